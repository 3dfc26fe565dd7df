"""Gemma 3 (text) on random weights in the HF layout: our reference = mlx-lm's gemma3_text,
FlashNorm = reference (pre-norms folded with the 1 + w gain, Sec. 4 attention, Sec. 2.2 GeGLU,
post-norms kept), weightless export in stock mlx-lm. float32; error max|a - b| / max|b|."""
import json

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model

from conftest import GEMMA3, load_folder as ours, random_weights, rel, write_checkpoint
from mlx_flashnorm import flashnorm, loader
from mlx_flashnorm.convert import export
from mlx_flashnorm.errors import UserError
from mlx_flashnorm.decoding import generate_step
from mlx_flashnorm.models import gemma3

TOL = 1e-4

@pytest.fixture(scope="module")
def tokens():
    mx.random.seed(3)
    return mx.random.randint(0, 512, (2, 12))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Norm weights (offsets from 1) around 0.2 +- 0.2: the norm gains 1 + w vary, none is 1."""
    arch, args = loader.model_args(GEMMA3)
    weights = random_weights(arch.Model(args), seed=11, scale=0.1)
    weights = {k: (v - 0.8 if "norm" in k else v) for k, v in weights.items()}
    return write_checkpoint(tmp_path_factory.mktemp("gemma3") / "gemma3", GEMMA3, weights)


def test_config_layers_and_errors():
    _, args = loader.model_args(GEMMA3)
    assert [args.is_sliding(i) for i in range(7)] == [True] * 5 + [False, True]
    _, args = loader.model_args({**GEMMA3, "layer_types": ["full_attention"] * 7})
    assert not any(args.is_sliding(i) for i in range(7))
    for bad, match in [({"hidden_activation": "relu"}, "hidden_activation"),
                       ({"final_logit_softcapping": 30.0}, "soft-capping"),
                       ({"layer_types": ["full_attention"]}, "layer_types")]:
        with pytest.raises(UserError, match=match):
            loader.model_args({**GEMMA3, **bad})


def test_reference_matches_mlx_lm(checkpoint, tokens):
    model = ours(checkpoint)
    ref = model(tokens)
    assert ref.shape == (2, 12, 512) and "lm_head" not in model  # tied
    assert rel(ref, load_model(checkpoint)[0](tokens)) < TOL


def test_reference_decode_matches_mlx_lm_past_the_window(checkpoint, tokens):
    """KV-cached greedy decoding beyond the sliding window (8) equals mlx-lm's (its rotating cache
    on the local layers): the window is applied in prefill and in the compiled decode step."""
    from mlx_lm.generate import generate_step as mlx_lm_step

    model, theirs = ours(checkpoint), load_model(checkpoint)[0]
    prompt = tokens[0, :5]
    a = [t for t, _ in generate_step(prompt, model, max_tokens=12)]
    b = [t for t, _ in generate_step(prompt, model, max_tokens=12, compiled=False)]
    c = [t for t, _ in mlx_lm_step(prompt, theirs, max_tokens=12)]
    assert a == b == c


@pytest.mark.parametrize("fold", [True, False])
def test_flash_matches_reference(checkpoint, tokens, fold):
    ref = ours(checkpoint)
    flash = flashnorm.apply(ours(checkpoint), fold=fold)
    layer = flash.layers[0]
    assert isinstance(layer.self_attn, flashnorm.FlashQKNormAttention)
    assert isinstance(layer.mlp, flashnorm.FlashGeGLU)
    for name in ("input_layernorm", "pre_feedforward_layernorm"):
        assert isinstance(layer[name], flashnorm.DeferredNorm)
    for name in ("post_attention_layernorm", "post_feedforward_layernorm"):  # kept
        assert isinstance(layer[name], gemma3.RMSNorm)
    assert rel(flash(tokens), ref(tokens)) < TOL
    prompt = tokens[1, :5]
    a = [t for t, _ in generate_step(prompt, ref, max_tokens=10)]
    assert a == [t for t, _ in generate_step(prompt, flash, max_tokens=10)]


def test_weightless_export_runs_in_stock_mlx_lm(checkpoint, tokens, tmp_path):
    model = ours(checkpoint)
    ref = model(tokens)
    mx.eval(ref)
    post = model.layers[2].post_feedforward_layernorm.weight
    flashnorm.make_weightless(model)
    out = export(model, None, tmp_path / "flash")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    weights = mx.load(str(out / "model.safetensors"))
    folded = [k for k in weights if k.endswith(("input_layernorm.weight", "pre_feedforward_layernorm.weight"))]
    folded.append("model.norm.weight")
    # the gain is 1 + w: a weightless norm stores w = 0
    assert len(folded) == 15 and all(mx.array_equal(weights[k], mx.zeros(64)) for k in folded)
    assert mx.array_equal(weights["model.layers.2.post_feedforward_layernorm.weight"], post)
    stock, _ = load_model(out)
    assert rel(stock(tokens), ref) < TOL


def test_verify_names_kept_norms_and_compares_layers(checkpoint, tokens):
    """verify's per-layer comparison runs Gemma as its model does (scaled embeddings, sliding
    masks: the 12-token prompt exceeds the window of 8), and names the norms FlashNorm keeps."""
    from mlx_flashnorm import verify

    ref, flash = ours(checkpoint), flashnorm.apply(ours(checkpoint))
    line = verify.norms_line(ref)
    assert line.startswith("FlashNorm removes input_layernorm, pre_feedforward_layernorm")
    assert "fuses q_norm/k_norm" in line and "keeps post_attention_layernorm" in line
    assert "post_feedforward_layernorm" in line
    states = verify.hidden_states(ref, tokens[:1])
    final = ref.model.norm(states[-1])
    assert rel(ref.model.embed_tokens.as_linear(final), ref(tokens[:1])) < 1e-6  # the model's own path
    rows, a, b = verify.compare(ref, flash, tokens[0], 4)
    assert len(rows) == 8 and all(r < TOL for _, _, r in rows) and a == b
