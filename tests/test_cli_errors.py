"""Bad input to `python -m mlx_flashnorm.generate`: one line naming the problem, exit code 2."""
import json
import shutil

import pytest
from conftest import TINY_LLAMA, cli


def generate(*args, stdin=None):
    return cli("mlx_flashnorm.generate", *args, stdin=stdin)


def assert_user_error(result, *words):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    for w in words:
        assert w in lines[0], lines[0]


@pytest.fixture
def model_copy(tiny_llama_dir, tmp_path):
    return shutil.copytree(tiny_llama_dir, tmp_path / "model")


def test_runs_on_tiny_model(tiny_llama_dir):
    r = generate("--model", str(tiny_llama_dir), "--prompt", "hello", "--max-tokens", "5")
    assert r.returncode == 0, r.stderr
    assert "Generation: 5 tokens" in r.stdout and "Peak memory" in r.stdout


def test_missing_path(tmp_path):
    assert_user_error(generate("--model", str(tmp_path / "nope"), "--prompt", "hi"), "no such file")


def test_folder_that_is_not_a_model(tmp_path):
    assert_user_error(generate("--model", str(tmp_path), "--prompt", "hi"), "not a model folder")


def test_unknown_model_type(model_copy):
    config = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps({**config, "model_type": "gpt-martian"}))
    assert_user_error(generate("--model", str(model_copy), "--prompt", "hi"), "gpt-martian", "supported")


def test_config_missing_required_key(model_copy):
    config = {k: v for k, v in TINY_LLAMA.items() if k != "hidden_size"}
    (model_copy / "config.json").write_text(json.dumps(config))
    assert_user_error(generate("--model", str(model_copy), "--prompt", "hi"), "hidden_size")


def test_truncated_safetensors(model_copy):
    f = model_copy / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    assert_user_error(generate("--model", str(model_copy), "--prompt", "hi"), "model.safetensors")


def test_corrupt_safetensors(model_copy):
    (model_copy / "model.safetensors").write_bytes(b"\x13\x00\x00\x00\x00\x00\x00\x00{garbage" + bytes(100))
    assert_user_error(generate("--model", str(model_copy), "--prompt", "hi"), "model.safetensors")


def test_weights_do_not_match_config(model_copy):
    config = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    assert_user_error(generate("--model", str(model_copy), "--prompt", "hi"), "do not match")


def test_empty_prompt(tiny_llama_dir):
    assert_user_error(generate("--model", str(tiny_llama_dir), "--prompt", "  "), "prompt is empty")


def test_prompt_longer_than_context(tiny_llama_dir):
    # TINY_LLAMA has a 64-token context
    assert_user_error(generate("--model", str(tiny_llama_dir), "--prompt", "word " * 100), "context")


def test_missing_tokenizer(model_copy):
    for f in model_copy.glob("tokenizer*"):
        f.unlink()
    assert_user_error(generate("--model", str(model_copy), "--prompt", "hi"), "tokenizer", "--tokenizer")


def test_verbose_shows_traceback(tmp_path):
    r = generate("--model", str(tmp_path / "nope"), "--prompt", "hi", "--verbose")
    assert r.returncode != 0 and "Traceback" in r.stderr
