"""Qwen 2 and Qwen 3 GGUF files (written here from tiny random checkpoints) load: metadata -> config,
llama.cpp tensor names -> HF names, and their logits equal those of the safetensors checkpoint."""
import mlx.core as mx
import pytest
from conftest import QWEN2, QWEN3, f32_tol, make_checkpoint, rel
from gguf_files import smollm2_meta, write_qwen_gguf

from mlx_flashnorm import load

TOKENS = mx.array([[1, 7, 42, 300, 5, 99, 511, 64]])


@pytest.mark.parametrize("arch, config", [("qwen2", QWEN2), ("qwen3", QWEN3)])
def test_qwen_gguf_equals_its_safetensors(tmp_path, spm_model, arch, config):
    folder, weights = make_checkpoint(tmp_path / arch, config)
    if not config["tie_word_embeddings"]:
        assert "lm_head.weight" in weights  # Qwen 2's untied head travels as GGUF 'output'
    path = write_qwen_gguf(tmp_path / f"{arch}.gguf", arch, config, weights)
    for norm in ("rms", "flash"):
        ref, _ = load(str(folder), norm=norm, tokenizer=str(spm_model), progress=False)
        model, _ = load(str(path), norm=norm, tokenizer=str(spm_model), progress=False)
        assert model.config["model_type"] == arch
        for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                    "num_key_value_heads", "rope_theta", "tie_word_embeddings", "vocab_size"):
            assert model.config[key] == config[key], key
        assert rel(model(TOKENS), ref(TOKENS)) < f32_tol(1e-6), norm


def test_qwen_gguf_brings_its_tokenizer_with_qwen2_pre_tokenizer(tmp_path):
    """A GGUF's own byte-level BPE vocabulary (here SmolLM2's) with tokenizer.ggml.pre 'qwen2' loads
    as its tokenizer, with Qwen 2's rule: case-insensitive contractions, one digit a piece."""
    meta = smollm2_meta()
    config = dict(QWEN2, vocab_size=len(meta["tokenizer.ggml.tokens"]))
    _, weights = make_checkpoint(tmp_path / "q", config)
    path = write_qwen_gguf(tmp_path / "qwen2-tok.gguf", "qwen2", config, weights, tokenizer_meta=meta)
    _, tok = load(str(path), progress=False)
    pre = tok._tokenizer.backend_tokenizer.pre_tokenizer
    assert [p for p, _ in pre.pre_tokenize_str("THEY'LL pay 42")] == ["THEY", "'LL", "Ġpay", "Ġ", "4", "2"]
    assert tok.decode(tok.encode("THEY'LL pay 42", add_special_tokens=False)) == "THEY'LL pay 42"
