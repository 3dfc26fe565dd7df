"""FlashNorm in half precision (issue 10): float16 and bfloat16, on real and on stressed weights.

FlashNorm defers 1/RMS past the matmuls, so on trained weights (residual stream about 2e4 on
SmolLM2) x * sqrt(n) g and the unscaled matmul outputs left float16's range: NaN logits.
kernels.add_rss now carries an exact power of two in the deferred value (tests/test_kernels.py).
MLX emulates half precision on the CPU: one forward pass over a short prompt per model."""
import mlx.core as mx
import pytest

from mlx_flashnorm import flashnorm, load, loader

from conftest import QWEN2, QWEN3, random_weights
from test_flashnorm import tiny_llama, tiny_openelm

PROMPT = "The capital of France is Paris. The capital of Germany is"


CHAT = "Explain why the sky is blue in two sentences."


@pytest.fixture(scope="module")
def reference():
    """(tokens, float32 rms logits) for a plain and a chat-templated prompt."""
    model, tok = load(None, norm="rms", dtype="float32", progress=False)
    prompts = [tok.encode(PROMPT), tok.apply_chat_template([{"role": "user", "content": CHAT}],
                                                           add_generation_prompt=True)]
    return [(mx.array(t)[None], model(mx.array(t)[None])) for t in prompts]


TIE = 0.01  # a top-1 choice closer than this (relative to the largest logit) is a tie


def errors(logits, want):
    """(max |d| / max |want|, relative Frobenius error, decisive flips) over all positions. A
    decisive flip is a position whose top-1 token differs from want's although want ranks the
    two more than TIE apart: closer calls are ties that any rounding may break."""
    got = logits.astype(mx.float32)
    d = got - want
    top, ref = mx.argmax(got, -1)[..., None], mx.argmax(want, -1)[..., None]
    margin = mx.take_along_axis(want, ref, -1) - mx.take_along_axis(want, top, -1)
    return ((mx.abs(d).max() / mx.abs(want).max()).item(),
            (mx.sqrt(mx.sum(d * d)) / mx.sqrt(mx.sum(want * want))).item(),
            mx.sum(margin > TIE * mx.abs(want).max()).item())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_real_weights(reference, dtype):
    """SmolLM2 (the shipped Q4_1 GGUF; flash keeps the gain on the activations), a plain and a
    chat prompt: finite logits (a NaN fails every comparison), flash's max relative logit error
    against float32 rms at most 1.5x rms's own error in the same dtype + 5e-3, and no more decisive
    top-1 flips against float32 than rms has. Measured max errors: on the CPU (its quantized
    products accumulate in float32, kernels.quantized_matmul) float16 rms 0.0027-0.0054, flash
    0.0043-0.0056, bfloat16 rms 0.047-0.049, flash 0.033-0.039; on the H100 float16 rms 0.0038,
    flash 0.0044, where flash's greedy token differed from float32's at one of 40 positions of the
    chat prompt, a tie (bench/RESULTS.md, "Half precision")."""
    models = {n: load(None, norm=n, dtype=dtype, progress=False)[0] for n in ("rms", "flash")}
    for tokens, want in reference:
        e = {n: errors(m(tokens), want) for n, m in models.items()}
        assert e["flash"][0] <= 1.5 * e["rms"][0] + 5e-3, e
        assert e["flash"][2] <= e["rms"][2], e


def stressed(build, dtype, seed):
    """A random model whose first FFN writes a residual stream of max about 2e4 (trained models'
    range), in dtype."""
    model = build(seed)
    layer = model.layers[0]
    out = layer.mlp.down_proj if "mlp" in layer else layer.ffn.proj_2
    tokens = mx.array([[3, 14, 15, 92, 65, 35, 89, 79]])
    for _ in range(2):  # the residual grows about linearly in the output weights
        h, r = layer(model.embed_tokens(tokens), None)
        out.weight = out.weight * (2e4 / mx.abs(h + r).max())
    model.set_dtype(dtype)
    return model, tokens


def from_config(config):
    def build(seed):
        arch, args = loader.model_args(config)
        model = arch.Model(args)
        model.load_weights(list(random_weights(model, seed, scale=0.1).items()))
        model.config = config
        return model
    return build


@pytest.mark.parametrize("dtype,tol", [(mx.float16, 2e-2), (mx.bfloat16, 8e-2)])
@pytest.mark.parametrize("fold", [True, False])
@pytest.mark.parametrize("build", [lambda s: tiny_llama(s, tie_word_embeddings=True),
                                   lambda s: tiny_llama(s, tie_word_embeddings=False), tiny_openelm,
                                   from_config(QWEN3), from_config(QWEN2)],
                         ids=["llama-tied", "llama", "openelm", "qwen3", "qwen2"])
def test_stressed_residual_stream(build, fold, dtype, tol):
    """Every flash module behind DeferredNorm (Sec. 2.2 SwiGLU, Sec. 3 attention with and without
    biases, Sec. 4 QK-norm, both heads) with a residual stream of 1e4..3e4, folded and with the gain
    kept: finite and within tol of the rms model in the same dtype (relative to its largest logit).
    Gemma 3 is checked on its real weights (test_gemma3_gguf.py): its post-norms keep down_proj's
    output from growing the residual stream this way."""
    ref, tokens = stressed(build, dtype, 1)
    flash, _ = stressed(build, dtype, 1)
    flashnorm.apply(flash, fold=fold)
    want, got = ref(tokens).astype(mx.float32), flash(tokens).astype(mx.float32)
    assert mx.all(mx.isfinite(want)).item() and mx.all(mx.isfinite(got)).item()
    assert (mx.abs(got - want).max() / mx.abs(want).max()).item() < tol
