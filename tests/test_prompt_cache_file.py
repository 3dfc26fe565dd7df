"""--prompt-cache-file is not trusted (issue 64): a file that does not match the model and the run
(other weights at the same --model path, metadata that claims more than the arrays hold, NaN,
a `tokens` entry of the wrong type, arrays of other shapes or dtypes, other cache kinds) is never
used: a one-line note says why, the answer is that of a run without it, and the new save replaces
it. A file that is not a prompt cache of ours stays an error, and is not overwritten."""
import importlib
import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from conftest import TINY_LLAMA, in_process, make_checkpoint

generate = importlib.import_module("mlx_flashnorm.generate")  # the module (the package's is the function)

PROMPT = "one two three four five six"


def run(folder, *args, prompt=PROMPT):
    """generate --model folder as a user runs it (in this process): (exit code, text, stderr)."""
    r = in_process(generate.main, "--model", str(folder), "-m", "4", "--ignore-chat-template", "-p", prompt,
                   *args)
    return r.returncode, r.stdout.split("==========")[0], r.stderr


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_llama_dir):
    folder = tmp_path_factory.mktemp("pc") / "model"
    shutil.copytree(tiny_llama_dir, folder)
    return folder


@pytest.fixture(scope="module")
def saved(model_dir, tmp_path_factory):
    """A good prompt cache file of PROMPT, and the text a run without one answers."""
    file = tmp_path_factory.mktemp("saved") / "good.safetensors"
    code, text, err = run(model_dir, "--prompt-cache-file", str(file))
    assert code == 0 and "prompt cache: 0 of" in err, err
    return file, text


def doctored(saved, tmp_path, arrays=None, meta=None):
    """A copy of the good file with arrays or metadata changed: arrays(a) and meta(m) edit the
    dicts in place."""
    a, m = mx.load(str(saved[0]), return_metadata=True)
    (arrays or (lambda a: None))(a)
    (meta or (lambda m: None))(m)
    file = tmp_path / "cache.safetensors"
    mx.save_safetensors(str(file), a, m)
    return file


def ignored(folder, file, text, words=(), prompt=PROMPT):
    """A run with file answers as a run without it, with one note naming the file (and words);
    the file is replaced by a good one, which the next run reuses."""
    code, out, err = run(folder, "--prompt-cache-file", str(file), prompt=prompt)
    assert code == 0, err
    notes = [line for line in err.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and str(file) in notes[0] and "not used" in notes[0], err
    assert all(w in notes[0] for w in words), notes[0]
    assert "prompt cache: 0 of" in err and out == text, err
    code, again, err = run(folder, "--prompt-cache-file", str(file), prompt=prompt)
    assert code == 0 and "note: " not in err and "prompt cache: 0 of" not in err and again == text, err


def tokens_of(saved):
    return json.loads(mx.load(str(saved[0]), return_metadata=True)[1]["0.tokens"])


def test_positions_claimed_beyond_those_held(model_dir, saved, tmp_path):
    """Metadata claiming 4 more tokens than the arrays hold: a longer prompt sharing them used to
    get positions of zeros, silently."""
    longer = PROMPT + " seven eight nine ten"
    _, text, _ = run(model_dir, prompt=longer)
    tokens = in_process_tokens(model_dir, longer)
    file = doctored(saved, tmp_path, meta=lambda m: m.update({"0.tokens": json.dumps(tokens)}))
    assert len(tokens) > len(tokens_of(saved))
    ignored(model_dir, file, text, ["offset"], prompt=longer)


def in_process_tokens(folder, prompt):
    from mlx_flashnorm import load
    from mlx_flashnorm.decoding import encode_prompt

    _, tok = load(str(folder), progress=False)
    return encode_prompt(tok, prompt, chat_template=False)


def test_other_weights_at_the_same_path(tmp_path, tiny_llama_dir, saved):
    """The checkpoint at --model replaced by another (same shapes, other weights): the file made
    with the first is not used for the second."""
    folder = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    file = tmp_path / "cache.safetensors"
    code, _, err = run(folder, "--prompt-cache-file", str(file))
    assert code == 0 and file.exists(), err
    make_checkpoint(folder, TINY_LLAMA, seed=7)  # new weights, the tokenizer kept
    _, text, _ = run(folder)
    ignored(folder, file, text, ["other weights"])


def test_nan_in_the_cached_keys(model_dir, saved, tmp_path):
    def poison(a):
        k = np.array(a["0.0"])
        k[0, 1, 2, 3] = np.nan
        a["0.0"] = mx.array(k)
    ignored(model_dir, doctored(saved, tmp_path, arrays=poison), saved[1], ["NaN"])


@pytest.mark.parametrize("tokens", ['"one two"', '{"a": 1}', "[1.5, 2]", "[]", "[1, -4]", "[[1]]",
                                    "not json", "[" * 100_000 + "]" * 100_000])
def test_tokens_entry_of_the_wrong_type(model_dir, saved, tmp_path, tokens):
    ignored(model_dir, doctored(saved, tmp_path, meta=lambda m: m.update({"0.tokens": tokens})), saved[1],
            ["'tokens'"])


@pytest.mark.parametrize("name, change", [
    ("0.0", lambda k: k[:, :1]),  # a head fewer
    ("1.1", lambda v: v[..., :8]),  # a narrower head
    ("0.1", lambda v: v.astype(mx.float16)),
    ("1.0", lambda k: k[:, :, :3]),  # fewer positions than the offset
    ("0.2", lambda offset: mx.array(2.5)),
    ("1.2", lambda offset: offset + 40),
])
def test_arrays_of_other_shapes_or_dtypes(model_dir, saved, tmp_path, name, change):
    ignored(model_dir, doctored(saved, tmp_path, arrays=lambda a: a.update({name: change(a[name])})),
            saved[1])


def test_other_cache_kind_or_layer_count(model_dir, saved, tmp_path):
    ignored(model_dir, doctored(saved, tmp_path, meta=lambda m: m.update({"1.1": "RotatingKVCache"})),
            saved[1])

    def one_layer(a):
        for k in [k for k in a if k.startswith("1.")]:
            del a[k]
    ignored(model_dir, doctored(saved, tmp_path, arrays=one_layer, meta=lambda m: m.pop("1.1")), saved[1])


def test_a_file_that_is_not_a_prompt_cache_is_an_error_and_kept(model_dir, tmp_path):
    file = tmp_path / "weights.safetensors"
    shutil.copyfile(model_dir / "model.safetensors", file)
    before = file.read_bytes()
    code, _, err = run(model_dir, "--prompt-cache-file", str(file))
    assert code == 2 and "not a prompt cache file of ours" in err and len(err.strip().splitlines()) == 1, err
    assert file.read_bytes() == before
