"""Malformed model files, one test per class of damage (issue 31): each is refused with a one-line
UserError naming the file and the field, where it used to raise a traceback or load silently.
Damaged GGUF files are the real embedded SmolLM2 GGUF with one header field rewritten in place;
damaged checkpoints are copies of a tiny random Llama with SmolLM2's tokenizer."""
import json
import math
import os
import shutil
import signal
import struct
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from conftest import TINY_LLAMA, cli, write_checkpoint
from gguf_edit import fields, find, write
from special_files import KINDS, deep_json, replace, unprivileged, within

from mlx_flashnorm import load, loader
from mlx_flashnorm.errors import UserError
from mlx_flashnorm.gguf import read_tensors


@pytest.fixture(scope="module")
def original():
    """The embedded GGUF's path and its header fields."""
    path = loader.default_model_path()
    with open(path, "rb") as f:
        head = f.read(4 << 20)
    return path, head


@pytest.fixture
def damaged(original, tmp_path):
    """damaged(*(field name, value)) -> a copy of the embedded GGUF with those fields rewritten."""
    path, head = original

    def make(*edits):
        copy = tmp_path / "damaged.gguf"
        shutil.copyfile(path, copy)
        for what, value in edits:
            write(copy, find(head, what), value)
        return copy
    return make


def refused(path, *words, **kwargs):
    """load(path) raises a one-line UserError that names each of words (the file among them)."""
    with pytest.raises(UserError) as e:
        load(str(path), progress=False, **kwargs)
    message = str(e.value)
    assert "\n" not in message, message
    for w in words:
        assert w in message, message
    return message


def refused_gguf(path, *words):
    return refused(path, "damaged.gguf", *words)


# GGUF: what used to raise a traceback ------------------------------------------------------------

def test_gguf_alignment_of_zero(damaged):
    # general.file_type has general.alignment's length: renamed, its value 0 is the alignment
    path = damaged(("value general.file_type", 0))
    with open(path, "r+b") as f:
        head = f.read(4 << 20)
        key = find(head, "value general.file_type").offset - 4 - len("general.file_type")
        f.seek(key)
        f.write(b"general.alignment")
    refused(path, "damaged.gguf", "general.alignment", "power of two")


def test_gguf_head_count_of_zero(damaged):
    refused_gguf(damaged(("value llama.attention.head_count", 0)), "llama.attention.head_count", "positive")


def test_gguf_tensor_dimension_of_zero(damaged):
    # rows of no values (GGUF's first dimension): the quantized weight gets 0 scales a row
    refused_gguf(damaged(("dim 0 of blk.3.ffn_up.weight", 0)), "blk.3.ffn_up.weight", "shape")


def test_gguf_deeply_nested_metadata_arrays(tmp_path):
    path = tmp_path / "nested.gguf"
    key = b"general.nested"
    body = struct.pack("<Q", len(key)) + key + struct.pack("<I", 9)
    body += struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 4, 0)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + body + bytes(32))
    with pytest.raises(UserError, match="'general.nested' nests arrays"):
        read_tensors(path)


def test_gguf_head_count_that_does_not_divide_the_weights(damaged):
    refused_gguf(damaged(("value llama.attention.head_count", 7), ("value llama.attention.head_count_kv", 7)),
            "llama.attention.head_count", "does not divide")


def test_gguf_embedding_length_that_does_not_match(damaged):
    refused_gguf(damaged(("value llama.embedding_length", 500)), "llama.embedding_length", "token_embd.weight")


def test_gguf_broken_chat_template(original, damaged):
    path = damaged()
    length = find(original[1], "length of value tokenizer.chat_template")
    start = length.offset + 8
    template = original[1][start:start + struct.unpack_from("<Q", original[1], length.offset)[0]]
    with open(path, "r+b") as f:  # the last "%}" loses its "}": a Jinja syntax error
        f.seek(start + template.rindex(b"%}") + 1)
        f.write(b" ")
    refused_gguf(path, "tokenizer.chat_template", "chat template is broken")


# GGUF: what used to load silently ----------------------------------------------------------------

def test_gguf_tensor_type_that_does_not_fit_its_neighbours(damaged):
    # Q4_1 (type 3) rewritten as Q4_0 (type 2): 18 bytes a block instead of 20
    refused_gguf(damaged(("type of blk.0.ffn_down.weight", 2)), "blk.0.ffn_down.weight", "leaves a gap")
    # and the norm's float32 as float16: half its size
    refused_gguf(damaged(("type of blk.0.attn_norm.weight", 1)), "blk.0.attn_norm.weight", "F16")


def test_gguf_unaligned_tensor_offset(original, damaged):
    field = find(original[1], "offset of blk.9.attn_q.weight")
    offset = struct.unpack_from("<Q", original[1], field.offset)[0]
    refused_gguf(damaged(("offset of blk.9.attn_q.weight", offset + 2)), "blk.9.attn_q.weight", "alignment")


def test_gguf_version_beyond_the_format(damaged):
    refused_gguf(damaged(("version", 4)), "GGUF version 4")


@pytest.mark.parametrize("key, value, words", [
    ("llama.context_length", 4_000_000_000, ["llama.context_length", "4000000000"]),
    ("tokenizer.ggml.eos_token_id", 60000, ["tokenizer.ggml.eos_token_id", "outside the vocabulary"]),
    ("llama.rope.dimension_count", 0, ["llama.rope.dimension_count", "positive"]),
])
def test_gguf_implausible_metadata(damaged, key, value, words):
    refused_gguf(damaged((f"value {key}", value)), *words)


def test_gguf_nan_weights(original, damaged):
    path = damaged()
    head = original[1]
    data_start = -(-fields(head)[1] // 32) * 32
    offset = struct.unpack_from("<Q", head, find(head, "offset of output_norm.weight").offset)[0]
    with open(path, "r+b") as f:
        f.seek(data_start + offset + 4 * 17)
        f.write(struct.pack("<f", math.nan))
    refused_gguf(path, "model.norm.weight", "NaN")


def test_gguf_errors_reach_the_command_line_as_one_line(damaged):
    r = cli("mlx_flashnorm.generate", "--model", str(damaged(("version", 4))), "--prompt", "hi")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "damaged.gguf" in r.stderr and "Traceback" not in r.stderr


# Hugging Face checkpoints ------------------------------------------------------------------------

@pytest.fixture
def folder(tiny_llama_dir, tmp_path):
    return shutil.copytree(tiny_llama_dir, tmp_path / "model")


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def test_config_that_is_null(folder):
    (folder / "config.json").write_text("null")
    refused(folder, "config.json", "JSON object")


def test_rope_scaling_that_is_a_string(folder):
    edit_config(folder, rope_scaling="linear")
    refused(folder, "config.json", "'rope_scaling'")


def test_negative_rope_theta(folder):
    edit_config(folder, rope_theta=-10000.0)
    refused(folder, "config.json", "'rope_theta' must be positive")


@pytest.mark.parametrize("change, words", [
    ({"rope_scaling": {"rope_type": "llama3"}}, ["'factor'"]),
    ({"rope_theta": float("nan")}, ["'rope_theta' must be positive"]),
    ({"rms_norm_eps": "small"}, ["'rms_norm_eps' must be a number"]),
    ({"hidden_size": 64.5}, ["'hidden_size' must be a whole number"]),
    ({"rope_parameters": "x"}, ["'rope_parameters' must be an object"]),
])
def test_config_values_of_the_wrong_type_or_range(tiny_llama_dir, change, words):
    config = dict(json.loads((tiny_llama_dir / "config.json").read_text()), **change)
    with pytest.raises(UserError) as e:
        loader.build_model(config, loader.read_safetensors(tiny_llama_dir), progress=False)
    assert all(w in str(e.value) for w in ["config.json", *words]), str(e.value)


def test_implausible_context_and_eos_in_config(folder):
    edit_config(folder, max_position_embeddings=4_000_000_000)
    refused(folder, "config.json", "'max_position_embeddings'")
    edit_config(folder, max_position_embeddings=64, eos_token_id=[2, 60000])
    refused(folder, "config.json", "'eos_token_id'", "outside the vocabulary")


def test_quantization_block_that_does_not_match_the_weights(folder):
    edit_config(folder, quantization={"group_size": 64, "bits": 4})  # the weights are float32
    refused(folder, "config.json", "'quantization'")


def test_index_that_is_not_json_or_has_no_weight_map(folder):
    index = folder / "model.safetensors.index.json"
    index.write_text("{not json")
    refused(folder, "model.safetensors.index.json", "not a valid index")
    index.write_text(json.dumps({"metadata": {}}))
    refused(folder, "model.safetensors.index.json", "'weight_map'")


def test_index_pointing_outside_the_model_folder(folder, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(folder / "model.safetensors", outside / "model.safetensors")
    weights = mx.load(str(outside / "model.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "../elsewhere/model.safetensors" for k in weights}}))
    refused(folder, "model.safetensors.index.json", "../elsewhere/model.safetensors", "model folder")


def rewrite_header(file, edit):
    """Rewrite a safetensors file's JSON header through edit(header), the data unchanged."""
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


def test_safetensors_with_two_tensors_over_the_same_bytes(folder):
    def alias(header):
        a, b = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"
        header[b]["data_offsets"] = header[a]["data_offsets"]
    rewrite_header(folder / "model.safetensors", alias)
    refused(folder, "model.safetensors", "share bytes", "q_proj.weight")


def test_safetensors_with_integer_dtype_for_float_weights(folder):
    weights = mx.load(str(folder / "model.safetensors"))
    weights["model.layers.1.mlp.up_proj.weight"] = (weights["model.layers.1.mlp.up_proj.weight"] * 100).astype(mx.int32)
    write_checkpoint(folder, json.loads((folder / "config.json").read_text()), weights)
    refused(folder, str(folder), "model.layers.1.mlp.up_proj.weight", "int32")


def test_safetensors_with_nan_weights(folder):
    weights = mx.load(str(folder / "model.safetensors"))
    w = np.array(weights["model.layers.0.post_attention_layernorm.weight"])
    w[5] = np.inf
    weights["model.layers.0.post_attention_layernorm.weight"] = mx.array(w)
    write_checkpoint(folder, json.loads((folder / "config.json").read_text()), weights)
    refused(folder, str(folder), "model.layers.0.post_attention_layernorm.weight", "NaN or infinite")


def test_broken_chat_template_in_tokenizer_config(folder):
    file = folder / "tokenizer_config.json"
    config = json.loads(file.read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }"
    file.write_text(json.dumps(config))
    for jinja in folder.glob("chat_template.jinja"):
        jinja.unlink()
    refused(folder, "tokenizer_config.json", "'chat_template'")
    r = cli("mlx_flashnorm.generate", "--model", str(folder), "--prompt", "hi")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("error: ") and "chat template" in r.stderr, r.stderr


# token ids past the embedding -------------------------------------------------------------------

def edit_tokenizer(folder, edit):
    file = folder / "tokenizer.json"
    tokenizer = json.loads(file.read_text())
    edit(tokenizer)
    file.write_text(json.dumps(tokenizer))


@pytest.mark.parametrize("token_id", [60_000, 10**9])
def test_tokenizer_id_past_the_embedding(folder, token_id):
    """A tokenizer.json mapping a token (" t") to an id past the embedding's 49,152 rows is refused
    at load, where it used to load and then read beyond the embedding (10^9: a segfault)."""
    edit_tokenizer(folder, lambda t: t["model"]["vocab"].update({"\u0120t": token_id}))
    refused(folder, "tokenizer.json", str(token_id), "49152")
    r = cli("mlx_flashnorm.generate", "--model", str(folder), "--prompt", "a t b t c t",
            "--ignore-chat-template", "-m", "2")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "tokenizer.json" in r.stderr, r.stderr


def test_added_token_id_past_the_embedding(folder):
    edit_tokenizer(folder, lambda t: t["added_tokens"].append(
        {"id": 50_000, "content": "<extra>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}))
    refused(folder, "tokenizer.json", "<extra>", "beyond the model's vocabulary")


def test_tokenizer_smaller_than_the_embedding_loads(tiny_llama_dir, tmp_path):
    """Padding rows (an embedding larger than the tokenizer) are normal."""
    from conftest import make_checkpoint

    config = dict(TINY_LLAMA, vocab_size=TINY_LLAMA["vocab_size"] + 64)
    folder, _ = make_checkpoint(tmp_path / "padded", config)
    for f in tiny_llama_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, folder)
    model, tok = load(str(folder), progress=False)
    assert model.args.vocab_size == config["vocab_size"] > len(tok.get_vocab())


def test_prompt_ids_past_the_vocabulary_never_reach_the_model(folder):
    """The second line of defence: ids of a prompt, as text or as a list, are checked against the
    model's vocabulary before the model runs (encode_prompt, stream_generate, the server's
    parse_call)."""
    from mlx_flashnorm import stream_generate
    from mlx_flashnorm.decoding import encode_prompt
    from mlx_flashnorm.serve.openai_api import HTTPError, parse_call

    model, tok = load(str(folder), progress=False)
    vocab = model.args.vocab_size
    with pytest.raises(UserError, match="outside the model's vocabulary of 5"):
        encode_prompt(tok, "hello world", chat_template=False, vocab=5)
    for ids in ([1, vocab], [1, -1]):
        with pytest.raises(UserError, match="vocabulary"):
            next(stream_generate(model, tok, ids, max_tokens=1))
    defaults = {"max_tokens": 4, "temp": 0.0, "top_p": 1.0, "top_k": 0}
    for chat, body in ((False, {"prompt": "hello world"}),
                       (True, {"messages": [{"role": "user", "content": "hello"}]})):
        with pytest.raises(HTTPError, match="vocabulary"):
            parse_call(body, chat, tok, 64, 5, defaults)


# special files in place of a model's, a tokenizer's or a cache's file -----------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
def test_special_file_in_a_model_folder(folder, name, kind):
    """A FIFO (it used to hang), a folder, a symlink loop or an unreadable file in place of one of
    a checkpoint's files: a one-line error naming it."""
    replace(folder / name, kind)
    with within(), unprivileged():
        refused(folder, name)


@pytest.mark.parametrize("kind", KINDS)
def test_special_file_as_the_gguf_model(original, tmp_path, kind):
    path = tmp_path / "model.gguf"
    shutil.copyfile(original[0], path)
    replace(path, kind)
    with within(), unprivileged():
        refused(path, "model.gguf")


def test_unreadable_model_folder(folder):
    os.chmod(folder, 0)
    try:
        with within(), unprivileged():
            refused(folder, str(folder))
    finally:
        os.chmod(folder, 0o755)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_json_nested_too_deeply(folder, name):
    (folder / name).write_text(deep_json())
    refused(folder, name, "nested")


def test_safetensors_header_nested_too_deeply(folder):
    file = folder / "model.safetensors"
    header = deep_json().encode()
    header += b" " * (-len(header) % 8)
    file.write_bytes(len(header).to_bytes(8, "little") + header + bytes(64))
    refused(folder, "model.safetensors", "nested")


def test_gguf_that_cannot_be_mapped(original, monkeypatch):
    """An mmap that runs out of address space (ENOMEM) names the file."""
    import errno

    from mlx_flashnorm import gguf

    def no_room(*args, **kwargs):
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(gguf.mmap, "mmap", no_room)
    refused(original[0], original[0].name, "address space")


@pytest.mark.parametrize("kind", KINDS)
def test_special_file_as_the_prompt_cache_file(tmp_path, kind):
    """--prompt-cache-file naming a FIFO (it used to hang), a folder, a symlink loop or an
    unreadable file: a one-line error before the model loads, and nothing written through it."""
    from mlx_flashnorm.serve import prompt_cache

    path = tmp_path / "cache.safetensors"
    replace(path, kind)
    with within(), unprivileged():
        with pytest.raises(UserError, match="cache.safetensors") as e:
            prompt_cache.check_path(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", KINDS)
def test_special_file_in_the_kernel_cache(tmp_path, kind):
    """A special file in place of a kernel cache's file (a cubin, the self-checks' record) is a
    cache miss, and a write replaces it rather than writing through it."""
    from mlx_flashnorm.kernels import check, nvrtc

    path = tmp_path / "self-check.json"
    replace(path, kind)
    with within(), unprivileged():
        assert nvrtc.read_cached(path) is None
        assert check._read_passed(path) == set()
    check._write_passed(path, {"add_rss"})
    if kind == "folder":  # left as it is: a cache is not worth a folder
        assert path.is_dir() and check._read_passed(path) == set()
        return
    assert not path.is_symlink() and check._read_passed(path) == {"add_rss"}
    nvrtc.write_cached(path, b"cubin")
    assert nvrtc.read_cached(path) == b"cubin" and [p.name for p in tmp_path.iterdir()] == [path.name]


def test_valid_files_still_load(folder):
    """The checks refuse no healthy checkpoint: the tiny one and the embedded GGUF load."""
    model, tok = load(str(folder), progress=False)
    assert model(mx.array([tok.encode("hello")])).shape[-1] == TINY_LLAMA["vocab_size"]


# converter partial outputs -----------------------------------------------------------------------

KILLED = """
import sys, time
from mlx_flashnorm import convert
import mlx.core as mx
def stuck(*a, **k):
    print("writing", flush=True)
    time.sleep(600)
mx.save_safetensors = stuck
convert.main(sys.argv[1:])
"""


def test_converter_killed_leaves_no_partial_folder_behind(tiny_llama_dir, tmp_path):
    out = tmp_path / "flash"
    child = subprocess.Popen([sys.executable, "-c", KILLED, "--model", str(tiny_llama_dir), "--flashnorm",
                              "--out", str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "writing"
        partial = tmp_path / f".flash.partial-{child.pid}"
        assert partial.is_dir()
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert partial.is_dir()  # SIGKILL runs no cleanup
    alive = tmp_path / f".other.partial-{os.getpid()}"  # a live converter's partial output stays
    alive.mkdir()
    r = cli("mlx_flashnorm.convert", "--model", str(tiny_llama_dir), "--flashnorm", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert not partial.exists() and alive.is_dir() and (out / "model.safetensors").exists()
