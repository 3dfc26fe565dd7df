"""Fuzzing the loader with damaged headers (issue 31): seeded mutations of the header of the real
embedded GGUF and of a small safetensors checkpoint; and (issue 64) special files in place of a
checkpoint's (a FIFO, a folder, a symlink loop, an unreadable file), JSON nested too deeply and
token ids past the embedding. Every outcome must be a UserError or a model whose logits equal the
original's (and whose tokenizer has no id past its embedding): never another exception, never a
hang, never a model that computes something else. Mutations that make another valid model (a RoPE base rewritten to another positive float,
two same-shaped tensors swapped) are left out: no check can tell them from a real file."""
import json
import math
import os
import random
import shutil
import struct

import mlx.core as mx
import pytest
from conftest import TINY_LLAMA, make_checkpoint
from gguf_edit import fields
from special_files import KINDS, deep_json, replace, unprivileged, within

from mlx_flashnorm import load, loader
from mlx_flashnorm.errors import UserError

GGUF_CASES = 80
SAFETENSORS_CASES = 400
FILE_CASES = 60
TOKENS = mx.array([[1, 17, 4, 33, 9, 2]])  # ids inside both vocabularies


class Tally:
    """Counts the outcomes; a model that loads must compute the original's logits exactly."""

    def __init__(self, reference):
        self.reference, self.errors, self.matched = reference, 0, 0

    def run(self, path, what):
        try:
            with within(), unprivileged():  # a FIFO must not hang it; permissions bind root too
                model, tok = load(str(path), norm="rms", progress=False)  # as the references are
        except UserError as e:
            assert "\n" not in str(e), (what, str(e))
            self.errors += 1
            return
        except Exception as e:
            raise AssertionError(f"{what}: {type(e).__name__} instead of a UserError: {e}") from e
        assert mx.array_equal(model(TOKENS), self.reference), f"{what}: loaded, but computes other logits"
        vocab = tok._tokenizer.get_vocab()
        assert max(vocab.values()) < model.args.vocab_size, f"{what}: loaded a token id past the embedding"
        self.matched += 1


def int_values(fmt, old, rng):
    """Values for an integer field: edges, neighbours, scalings and a flipped bit, in its range."""
    size = struct.calcsize(fmt)
    bits, signed = 8 * size, fmt[-1].islower() and fmt[-1] != "?"
    values = [0, 1, 2, old - 1, old + 1, old * 2, old // 2, (1 << bits) - 1, old ^ (1 << rng.randrange(bits))]
    v = rng.choice(values) % (1 << bits)
    return v - (1 << bits) if signed and v >= 1 << (bits - 1) else v


def gguf_mutation(field, head, rng):
    """(format, value) for one field: floats (the RoPE base, the norm epsilon) only to values no
    model has; bools to any byte; integers as int_values."""
    old = struct.unpack_from(field.fmt, head, field.offset)[0]
    if field.fmt[-1] in "fd":
        return field.fmt, rng.choice([0.0, -old, math.nan, math.inf, -math.inf])
    if field.fmt[-1] == "?":
        return "<B", rng.choice([0, 1, 2, 255])
    return field.fmt, int_values(field.fmt, old, rng)


@pytest.fixture(scope="module")
def smollm2_copy(tmp_path_factory, smollm2):
    path = tmp_path_factory.mktemp("fuzz") / "smollm2.gguf"
    shutil.copyfile(loader.default_model_path(), path)
    return path, smollm2[0](TOKENS)


def test_fuzz_gguf_header(smollm2_copy, capsys):
    path, reference = smollm2_copy
    original = path.read_bytes()
    head = original[:4 << 20]
    all_fields, _ = fields(head)
    by_section = {s: [f for f in all_fields if f.section == s] for s in ("header", "metadata", "tensors")}
    rng, tally = random.Random(31), Tally(reference)
    for case in range(GGUF_CASES):
        section = rng.choices(["header", "metadata", "tensors"], [1, 6, 3])[0]
        field = rng.choice(by_section[section])
        fmt, value = gguf_mutation(field, head, rng)
        size = struct.calcsize(fmt)
        with open(path, "r+b") as f:
            f.seek(field.offset)
            f.write(struct.pack(fmt, value))
        tally.run(path, f"case {case}: {field.what} = {value!r}")
        with open(path, "r+b") as f:
            f.seek(field.offset)
            f.write(original[field.offset:field.offset + size])
    for cut in (100, len(head) // 2, len(head) + 1000, len(original) - 7):  # truncations
        os.truncate(path, cut)
        tally.run(path, f"truncated to {cut} bytes")
        with open(path, "ab") as f:
            f.write(original[cut:])
    tried = GGUF_CASES + 4
    with capsys.disabled():
        print(f"\nGGUF fuzz: {tried} mutations, {tally.errors} refused, {tally.matched} loaded and matched")
    assert tally.errors + tally.matched == tried and tally.errors > 0 and tally.matched > 0


# safetensors ---------------------------------------------------------------------------------------

TINY = dict(TINY_LLAMA, vocab_size=64, tie_word_embeddings=False)
DTYPES = ["BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "I64", "F64", "X9"]


def read_header(raw):
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def pack(header, data):
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data


def safetensors_mutation(raw, rng):
    """One damaged copy of a safetensors file's bytes, and what was done."""
    header, data = read_header(raw)
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    info = header[name]
    kind = rng.choice(["dtype", "shape", "offsets", "rename", "delete", "length", "byte", "truncate",
                       "metadata", "extra", "not an object"])
    if kind == "dtype":
        info["dtype"] = rng.choice(DTYPES)
    elif kind == "shape":
        shape, i = info["shape"], rng.randrange(len(info["shape"]))
        info["shape"] = rng.choice([shape[:i] + [shape[i] + rng.choice([-1, 1])] + shape[i + 1:],
                                    shape[::-1], shape + [1], [1] + shape, shape[:-1], [], [-shape[0]] + shape[1:],
                                    shape[:i] + [shape[i] * 2] + shape[i + 1:]])
    elif kind == "offsets":
        start, end = info["data_offsets"]
        other = header[rng.choice(names)]["data_offsets"]
        info["data_offsets"] = rng.choice([[start + 4, end + 4], [start - 4, end], [start, end + 4], [end, start],
                                           list(other), [start, len(data) + 4], [-4, end - start - 4], [start], None])
    elif kind == "rename":
        header[rng.choice(names)] = header.pop(name)  # replaces another tensor's entry, or keeps its own
    elif kind == "delete":
        del header[name]
    elif kind == "metadata":
        header["__metadata__"] = rng.choice([None, 5, [], {"format": 7}, "x"])
    elif kind == "extra":
        start = rng.choice([0, len(data) - 16, len(data)])
        header["model.extra.weight"] = {"dtype": "F32", "shape": [4] if start < len(data) else [0],
                                        "data_offsets": [start, start + 16 if start < len(data) else start]}
    elif kind == "not an object":
        header = rng.choice([[], None, 3, "header"])
    raw2 = pack(header, data)
    if kind == "length":
        raw2 = (int.from_bytes(raw2[:8], "little") + rng.choice([-9, -8, -1, 1, 8, 1 << 40])).to_bytes(8, "little", signed=True) + raw2[8:]
    elif kind == "byte":
        n = int.from_bytes(raw2[:8], "little")
        i = rng.randrange(8, 8 + n)
        raw2 = raw2[:i] + bytes([rng.choice(b'0123456789{}[]":,.-eFIU ')]) + raw2[i + 1:]
    elif kind == "truncate":
        raw2 = raw2[:rng.randrange(len(raw2))]
    return raw2, f"{kind} of {name}"


def test_fuzz_safetensors_header(tmp_path, spm_model, capsys):
    folder, _ = make_checkpoint(tmp_path / "tiny", TINY)
    shutil.copyfile(spm_model, folder / "tokenizer.model")
    reference = load(str(folder), norm="rms", progress=False)[0](TOKENS)
    file = folder / "model.safetensors"
    original = file.read_bytes()
    rng, tally = random.Random(31), Tally(reference)
    for case in range(SAFETENSORS_CASES):
        raw, what = safetensors_mutation(original, rng)
        file.write_bytes(raw)
        tally.run(folder, f"case {case}: {what}")
    with capsys.disabled():
        print(f"\nsafetensors fuzz: {SAFETENSORS_CASES} mutations, {tally.errors} refused, "
              f"{tally.matched} loaded and matched")
    assert tally.errors + tally.matched == SAFETENSORS_CASES and tally.errors > 0 and tally.matched > 0


# special files, deep nesting, token ids past the embedding (issue 64) -----------------------------

FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "model.safetensors.index.json"]
IDS = [5, 49151, 49152, 49153, 60_000, 1 << 31, 10**9, (1 << 32) - 1, 1 << 40, -1]  # 2 inside


def file_mutation(folder, rng):
    """Damage one file of a checkpoint folder in place; returns what was done."""
    kind = rng.choice(["special", "deep", "token id", "added token id"])
    name = rng.choice(FILES)
    if kind == "special":
        replace(folder / name, rng.choice(KINDS))
        return f"{name} made a special file"
    if kind == "deep":
        depth = rng.choice([900, 5000, 100_000])
        if name == "model.safetensors":  # the header
            raw = (folder / name).read_bytes()
            header = deep_json(depth).encode()
            (folder / name).write_bytes(len(header).to_bytes(8, "little") + header + raw[8:])
        else:
            (folder / name).write_text(deep_json(depth))
        return f"{name} nested {depth} deep"
    file = folder / "tokenizer.json"
    tokenizer = json.loads(file.read_text())
    new_id = rng.choice(IDS)
    if kind == "token id":
        token = rng.choice(list(tokenizer["model"]["vocab"]))
        tokenizer["model"]["vocab"][token] = new_id
    else:
        tokenizer["added_tokens"].append({"id": new_id, "content": "<fuzz>", "single_word": False,
                                          "lstrip": False, "rstrip": False, "normalized": False,
                                          "special": True})
    file.write_text(json.dumps(tokenizer))
    return f"tokenizer.json: a {kind} of {new_id}"


def test_fuzz_special_files_deep_json_and_token_ids(tmp_path, tiny_llama_dir, capsys):
    reference = load(str(tiny_llama_dir), norm="rms", progress=False)[0](TOKENS)
    rng, tally = random.Random(64), Tally(reference)
    for case in range(FILE_CASES):
        folder = shutil.copytree(tiny_llama_dir, tmp_path / f"case{case}")
        what = file_mutation(folder, rng)
        tally.run(folder, f"case {case}: {what}")
        for f in folder.iterdir():
            if not f.is_symlink():
                os.chmod(f, 0o755)
        shutil.rmtree(folder)
    with capsys.disabled():
        print(f"\nfile fuzz: {FILE_CASES} mutations, {tally.errors} refused, {tally.matched} loaded and "
              "matched")
    assert tally.errors + tally.matched == FILE_CASES and tally.errors > 0
