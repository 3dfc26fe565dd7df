"""transformers 5 configs (RoPE under rope_parameters) and 4.x configs (top-level rope_theta and
rope_scaling) of the same weights give identical logits; a v5 config is not read as default RoPE."""
import json

import mlx.core as mx
import pytest
from conftest import OPENELM_270M, TINY_LLAMA, make_checkpoint

from mlx_flashnorm import load
from mlx_flashnorm.errors import UserError

LLAMA = {**TINY_LLAMA, "vocab_size": 60, "max_position_embeddings": 256}
SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}
TOKENS = mx.array([list(range(3, 50, 3))])


def as_v5(config, theta_key="rope_theta"):
    """The config as transformers 5 saves it: no top-level RoPE keys, all under rope_parameters."""
    v5 = {k: v for k, v in config.items() if k not in (theta_key, "rope_scaling")}
    v5["rope_parameters"] = {"rope_theta": config[theta_key], "rope_type": "default",
                             **(config.get("rope_scaling") or {})}
    return v5


def logits(folder, config, spm_model, norm="rms", **kwargs):
    (folder / "config.json").write_text(json.dumps(config))
    model, _ = load(str(folder), tokenizer=str(spm_model), norm=norm, progress=False, **kwargs)
    return model(TOKENS)


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_llama_v5_config_equals_v4(tmp_path, spm_model, kind):
    v4 = {**LLAMA, "rope_theta": 500000.0}
    if SCALINGS[kind]:
        v4["rope_scaling"] = SCALINGS[kind]
    folder, _ = make_checkpoint(tmp_path / "m", v4)
    a = logits(folder, v4, spm_model)
    b = logits(folder, as_v5(v4), spm_model)
    assert mx.array_equal(a, b)
    plain = {k: v for k, v in LLAMA.items() if k != "rope_theta"}  # what reading v5 as v4 used to give
    assert not mx.allclose(a, logits(folder, plain, spm_model), atol=1e-4)
    flash_v4 = logits(folder, v4, spm_model, norm="flash")
    flash_v5 = logits(folder, as_v5(v4), spm_model, norm="flash")
    assert mx.array_equal(flash_v4, flash_v5) and mx.allclose(flash_v4, a, atol=1e-4)


def test_openelm_v5_config_equals_v4(tmp_path, spm_model):
    v4 = {**OPENELM_270M, "model_dim": 64, "num_transformer_layers": 2, "head_dim": 16,
          "num_query_heads": [4, 4], "num_kv_heads": [1, 2], "ffn_multipliers": [0.5, 1.0],
          "ffn_dim_divisor": 16, "vocab_size": 60, "rope_freq_constant": 500000}
    folder, _ = make_checkpoint(tmp_path / "m", v4)
    a = logits(folder, v4, spm_model)
    assert mx.array_equal(a, logits(folder, as_v5(v4, "rope_freq_constant"), spm_model))
    plain = {k: v for k, v in v4.items() if k != "rope_freq_constant"}
    assert not mx.allclose(a, logits(folder, plain, spm_model), atol=1e-4)
    scaled = as_v5(v4, "rope_freq_constant")
    scaled["rope_parameters"].update(rope_type="linear", factor=2.0)
    with pytest.raises(UserError, match="'linear' RoPE scaling, which model_type 'openelm' does not have"):
        logits(folder, scaled, spm_model)
