"""The portable path (a GPU where our kernels do not run: Metal today, MLX_FLASHNORM_KERNELS=0):
FlashNorm takes its weightless form (Sec. 1, Fig. 1(b)) on MLX's own primitives, and decoding runs
eagerly over the filled cache, as mlx-lm does. Here forms.portable() is forced on the CPU.
float32; error measure max|a - b| / max|b| over the logits."""
import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from conftest import OPENELM_270M, TINY_LLAMA, f32_tol, random_weights, rel
from mlx_flashnorm import flashnorm, forms, loader
from mlx_flashnorm.bench.step_graph import step_ops
from mlx_flashnorm.decoding import generate_step

TINY_OPENELM = dict(OPENELM_270M, model_dim=128, num_transformer_layers=2, num_query_heads=[4, 4],
                    num_kv_heads=[2, 1], ffn_multipliers=[0.5, 1.0], vocab_size=512)
GEMMA3 = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
          "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 512,
          "query_pre_attn_scalar": 32, "sliding_window": 8, "sliding_window_pattern": 2,
          "max_position_embeddings": 256}
CONFIGS = {"llama": dict(TINY_LLAMA, vocab_size=512, max_position_embeddings=256),
           "llama-untied": dict(TINY_LLAMA, vocab_size=512, tie_word_embeddings=False),
           "openelm": TINY_OPENELM, "gemma3": GEMMA3}


@pytest.fixture
def portable(monkeypatch):
    monkeypatch.setattr(forms, "portable", lambda: True)


def build(config, norm, bits=None):
    arch, args = loader.model_args(config)
    model = loader.build_model(config, random_weights(arch.Model(args), seed=1, scale=0.1), progress=False)
    return loader.prepare(model, norm=norm, bits=bits)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_weightless_form_equals_rms(name, portable):
    """Full precision: the norm weights are folded into the linears, the blocks keep the
    reference structure (no deferred modules), and the logits are rms's."""
    tokens = mx.array([[5, 9, 2, 7, 11, 3]])
    rms, flash = build(CONFIGS[name], "rms"), build(CONFIGS[name], "flash")
    kinds = {type(m).__name__ for _, m in flash.named_modules()}
    assert not kinds & {"DeferredNorm", "DeferredLinear", "FlashAttention", "FlashQKNormAttention",
                        "FlashSwiGLU", "FlashFusedSwiGLU", "FlashGeGLU", "TiedFlashHead"}
    assert rel(flash(tokens), rms(tokens)) < f32_tol(1e-5)
    # pre-norm weights moved into the linears: their effective gain is now 1
    norm = flash.layers[0][flashnorm.mapping(flash).pairs[0].norm]
    assert mx.allclose(flashnorm.norm_weight(norm), mx.ones(norm.weight.shape)).item()


def test_quantized_model_is_the_rms_model(portable):
    """Quantized: the gain stays on the norm (as fold=False does everywhere), so flash is the rms
    model itself, quantized weights included."""
    rms, flash = (build(CONFIGS["llama"], norm, bits=4) for norm in ("rms", "flash"))
    a, b = dict(tree_flatten(rms.parameters())), dict(tree_flatten(flash.parameters()))
    assert a.keys() == b.keys()
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)


def test_step_has_no_more_operations_than_rms(portable):
    for name in ("llama", "openelm"):
        rms, flash = (build(CONFIGS[name], norm, bits=4) for norm in ("rms", "flash"))
        assert len(step_ops(flash)) <= len(step_ops(rms))


def test_decoding_is_eager_and_matches_compiled(portable):
    model = build(CONFIGS["llama"], "flash")
    prompt = mx.array([5, 9, 2, 7, 11, 3, 8, 1])
    eager = [t for t, _ in generate_step(prompt, model, max_tokens=12)]
    assert getattr(model, "_compiled_decode", None) is None  # the compiled step was never made
    compiled = [t for t, _ in generate_step(prompt, model, max_tokens=12, compiled=True)]
    assert eager == compiled


def test_deferred_form_stays_the_default_here():
    """On the CPU (no GPU at all) FlashNorm keeps its deferred form: the tests' reference."""
    assert not forms.portable()
    model = build(CONFIGS["llama"], "flash")
    assert isinstance(model.layers[0].input_layernorm, flashnorm.DeferredNorm)
    assert isinstance(model.layers[0].self_attn, flashnorm.FlashAttention)


def eager_step_ops(model, cache):
    """Operation names, views left out, of one eager 1-token step after an 8-token prefill."""
    from mlx_flashnorm.bench.step_graph import VIEWS, graph_ops

    model(mx.arange(8)[None], cache=cache)
    mx.eval([c.state for c in cache])
    ops = graph_ops(model(mx.array([[3]]), cache=cache), *[a for c in cache for a in c.state])
    return [op for op in ops if op not in VIEWS]


@pytest.mark.parametrize("name", ["llama", "openelm"])
def test_step_has_no_more_operations_than_mlx_lm(name, portable, monkeypatch, tmp_path):
    """Issue 11: on the portable path our eager decode step (rms, and so flash, its weightless
    form) builds no more operations than mlx-lm's own model on the same 4-bit weights (Llama: one
    concatenated q/k/v and gate/up matmul each instead of five), so what is left between the two
    there is Python (bench/RESULTS.md, "Portable path"). forms.ENABLED is off, so no CPU
    row-parallel split adds operations; float32, so no CPU-only half-precision casts."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model, quantize_model

    from conftest import make_checkpoint
    from mlx_flashnorm.cache import make_cache

    monkeypatch.setattr(forms, "ENABLED", False)
    folder, _ = make_checkpoint(tmp_path / name, CONFIGS[name])
    ours = loader.prepare(loader.build_model(loader.read_config(folder), loader.read_safetensors(folder),
                                             progress=False), norm="rms", bits=4)
    peer, config = load_model(folder)
    peer, _ = quantize_model(peer, config, 64, 4)
    mine, theirs = eager_step_ops(ours, make_cache(ours)), eager_step_ops(peer, make_prompt_cache(peer))
    assert len(mine) <= len(theirs), (sorted(mine), sorted(theirs))
    assert mine.count("QuantizedMatmul") <= theirs.count("QuantizedMatmul")
