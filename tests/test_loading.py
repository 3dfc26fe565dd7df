"""Checkpoint sources: sharded folders, the hub cache (offline), GGUF, and each tokenizer kind."""
import json
import shutil

import mlx.core as mx
import pytest
from conftest import OPENELM_270M, TINY_LLAMA, make_checkpoint

from mlx_flashnorm import load
from mlx_flashnorm.errors import UserError
from mlx_flashnorm.loader import build_model, read_config, read_safetensors

def test_sharded_checkpoint_equals_single_file(tmp_path):
    config = {**TINY_LLAMA, "vocab_size": 60}
    single, weights = make_checkpoint(tmp_path / "single", config)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text(json.dumps(config))
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        mx.save_safetensors(str(sharded / file), {k: weights[k] for k in keys})
    weight_map = {k: f for f, keys in halves.items() for k in keys}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    tokens = mx.array([[1, 5, 7, 9]])
    a = build_model(read_config(single), read_safetensors(single), progress=False)(tokens)
    b = build_model(read_config(sharded), read_safetensors(sharded), progress=False)(tokens)
    assert mx.array_equal(a, b)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(UserError, match="shard model-00002-of-00002.safetensors"):
        read_safetensors(sharded)


def test_sentencepiece_tokenizer_model(tmp_path, spm_model):
    import sentencepiece as spm

    folder, _ = make_checkpoint(tmp_path / "m", {**TINY_LLAMA, "vocab_size": 60})
    shutil.copy(spm_model, folder / "tokenizer.model")
    _, tok = load(str(folder), norm="rms", progress=False)
    ref = spm.SentencePieceProcessor(model_file=str(spm_model))
    text = "the lazy zebras jump"
    assert tok.encode(text) == [1] + ref.encode(text)  # BOS, then sentencepiece's pieces
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
    assert 2 in tok.eos_token_ids


def test_openelm_needs_tokenizer_and_accepts_one(tmp_path, spm_model):
    config = {**OPENELM_270M, "model_dim": 64, "num_transformer_layers": 2, "head_dim": 16,
              "num_query_heads": [4, 4], "num_kv_heads": [1, 2], "ffn_multipliers": [0.5, 1.0],
              "ffn_dim_divisor": 16, "vocab_size": 60}
    folder, _ = make_checkpoint(tmp_path / "openelm", config)
    with pytest.raises(UserError, match="Llama-2 tokenizer"):
        load(str(folder), norm="rms", progress=False)
    model, tok = load(str(folder), tokenizer=str(spm_model), norm="rms", progress=False)
    assert model(mx.array([tok.encode("the quick fox")])).shape[-1] == 60


def hub_cache(root, repo, files):
    """Lay out a Hugging Face hub cache entry (refs/main -> snapshots/<commit>) holding files."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    entry = root / ("models--" + repo.replace("/", "--"))
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(commit)
    snapshot = entry / "snapshots" / commit
    shutil.copytree(files, snapshot)
    return snapshot


def test_hub_repo_id_from_cache_offline(tmp_path, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    hub_cache(tmp_path / "hub", "someone/tiny-llama", tiny_llama_dir)
    model, tok = load("someone/tiny-llama", norm="rms", progress=False)
    direct, _ = load(str(tiny_llama_dir), norm="rms", progress=False)
    tokens = mx.array([tok.encode("hello")])
    assert mx.array_equal(model(tokens), direct(tokens))
    with pytest.raises(UserError, match="HF_HUB_OFFLINE"):
        load("someone/not-cached", norm="rms", progress=False)


def test_batch_of_prompts_gives_logits_per_position(smollm2):
    model, tok = smollm2
    tokens = mx.array([tok.encode("one two three"), tok.encode("four five six")])
    logits = model(tokens)
    assert logits.shape == (2, tokens.shape[1], 49152)
    assert mx.allclose(logits[1:], model(tokens[1:]), atol=1e-4)


def test_gguf_tokenizer_chat_template_and_eos(smollm2):
    _, tok = smollm2
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok.encode("Hello, world! 123")) == "Hello, world! 123"
    assert tok.eos_token_ids == {2}
