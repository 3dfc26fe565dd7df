"""Qwen 2 and Qwen 3 GGUF files (written here from tiny random checkpoints) load: metadata -> config,
llama.cpp tensor names -> HF names, and their logits equal those of the safetensors checkpoint."""
import mlx.core as mx
import pytest
from conftest import QWEN2, QWEN3, f32_tol, make_checkpoint, rel
from gguf_files import write_qwen_gguf

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
