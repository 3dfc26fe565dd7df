"""cache.composed_attention (a short prefill's attention on CUDA) against MLX's fused attention,
the unoptimized computation's stand-in here (on the CPU mx.fast.scaled_dot_product_attention is
MLX's own composition; on a GPU its fused kernel), in float32 and half precision, with every mask
the models pass."""
import mlx.core as mx
import pytest

from mlx_flashnorm.cache import composed_attention, scaled_dot_product_attention

TOL = {mx.float32: 1e-5, mx.float16: 4e-3, mx.bfloat16: 3e-2}  # the largest absolute error allowed


def inputs(dtype, B=3, H=6, Hk=2, L=5, S=9, D=32):
    key = mx.random.key(7)
    q, k, v = (mx.random.normal(shape, key=kk).astype(dtype)
               for shape, kk in zip([(B, H, L, D), (B, Hk, S, D), (B, Hk, S, D)], mx.random.split(key, 3)))
    return q, k, v


def masks(L, S, B, H):
    seen = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
    window = seen & (mx.arange(S - L, S)[:, None] - mx.arange(S)[None] < 4)  # a sliding window of 4
    return {"none": None, "causal": "causal", "window": window,
            "additive": mx.where(window, 0.0, -1e9).astype(mx.float32),
            "per row": mx.broadcast_to(window, (B, 1, L, S)), "per head": mx.broadcast_to(window, (B, H, L, S))}


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("name", ["none", "causal", "window", "additive", "per row", "per head"])
def test_composed_attention_is_the_fused_one(dtype, name):
    q, k, v = inputs(dtype)
    mask = masks(5, 9, 3, 6)[name]
    if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
        mask = mask.astype(dtype)
    got = composed_attention(q, k, v, 0.125, mask)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item() <= TOL[dtype]


def test_a_causal_prefill_from_an_empty_cache_sees_only_the_past():
    """L == S: query i sees keys 0..i; changing a later key changes no earlier row."""
    q, k, v = inputs(mx.float32, L=6, S=6)
    a = composed_attention(q, k, v, 0.125, "causal")
    b = composed_attention(q, k, v.at[:, :, 5].add(10.0), 0.125, "causal")
    assert mx.array_equal(a[:, :, :5], b[:, :, :5]).item() and not mx.allclose(a[:, :, 5], b[:, :, 5]).item()


def test_the_models_attention_on_this_device():
    """scaled_dot_product_attention for a prefill over mlx-lm's cache: the fused attention's result
    (composed on CUDA, mlx-lm's elsewhere)."""
    from mlx_lm.models.cache import KVCache

    q, k, v = inputs(mx.float32)
    got = scaled_dot_product_attention(q, k, v, KVCache(), 0.125, "causal")
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    assert mx.abs(got - want).max().item() <= TOL[mx.float32]
