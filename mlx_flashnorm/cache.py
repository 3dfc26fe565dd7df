"""KV caches and the attention over them.

mlx-lm's growing KVCache serves prefill and uncompiled decoding. StaticKVCache preallocates its
buffers so that every compiled 1-token step sees arrays of the same shapes; its attention then
covers the filled positions through kernels.decode_attention, with no mask (a masked attention
takes a slow path on some backends), except on sliding-window layers, which get a window mask."""
import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention as mlx_lm_attention
from mlx_lm.models.cache import KVCache, create_attention_mask

from . import forms
from .kernels import decode_attention


# attention scores (rows x heads x queries x keys) up to which CUDA composes a prefill's
COMPOSED_MAX = 2**24


def scaled_dot_product_attention(q, k, v, cache, scale, mask):
    """The attention every model calls: a static cache's own for a decode step; a short prefill on
    CUDA composed from matmuls (composed_attention says why); else mlx-lm's."""
    if isinstance(cache, StaticKVCache) and q.shape[2] == 1:
        return cache.attention(q, k, v, scale, mask)
    if (q.shape[2] > 1 and not hasattr(cache, "bits") and mx.default_device() == mx.gpu
            and forms.gpu_backend() == "cuda"
            and q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] <= COMPOSED_MAX):
        return composed_attention(q, k, v, scale, mask)
    return mlx_lm_attention(q, k, v, cache=cache, scale=scale, mask=mask)


def composed_attention(q, k, v, scale, mask):
    """softmax(q k^T scale + mask) v from two matmuls, the softmax in float32; q (B, heads, L, D)
    the last L of the S positions of k and v (B, kv heads, S, D); mask None, "causal", a boolean
    (True: seen) or an additive array. On CUDA, MLX's fused attention builds a cuDNN graph for each
    new shape (rows, queries, keys), which costs far more each time than this form does
    (bench/RESULTS.md, "Prefill attention on CUDA"), and a server's prompts come in ever new
    lengths."""
    B, H, L, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    s = (q * scale).reshape(B, Hk, H // Hk, L, D) @ mx.expand_dims(k, 2).swapaxes(-1, -2)
    if isinstance(mask, str):
        mask = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
    elif mask is not None and mask.ndim == 4:  # per row, and one for all heads or one per head
        mask = (mx.expand_dims(mask, 2) if mask.shape[1] == 1
                else mask.reshape(B, Hk, H // Hk, L, S))
    if mask is not None:
        s = mx.where(mask, s, mx.finfo(s.dtype).min) if mask.dtype == mx.bool_ else s + mask
    return (mx.softmax(s, axis=-1, precise=True) @ mx.expand_dims(v, 2)).reshape(B, H, L, D)


class StaticKVCache:
    """Keys and values in buffers preallocated to `capacity` positions and written in place.

    While `offset` is a Python int (prefill) the cache behaves like mlx-lm's KVCache and hands out
    only the filled part. Once `offset` is an mx.array (decoding, and a compiled prefill after a
    prefix), every call sees buffers of the same shapes, so a step compiles once and is replayed;
    N > 1 tokens then attend over the whole buffer through a causal mask (make_mask)."""

    static_rows = True  # buffers of every position and an array offset (flashnorm.decode_stack)

    def __init__(self, capacity, offset=0):
        self.capacity = capacity
        self.keys = self.values = None
        self.offset = offset

    def update_and_fetch(self, keys, values):
        B, H, N, _ = keys.shape
        if self.keys is None:
            self.keys = mx.zeros((B, H, self.capacity, keys.shape[3]), keys.dtype)
            self.values = mx.zeros((B, H, self.capacity, values.shape[3]), values.dtype)
        if isinstance(self.offset, int):
            end = self.offset + N
            if end > self.capacity:
                raise ValueError(f"StaticKVCache holds {self.capacity} positions, "
                                 f"{end} were asked for")
            self.keys[..., self.offset:end, :] = keys
            self.values[..., self.offset:end, :] = values
            self.offset = end
            return self.keys[..., :end, :], self.values[..., :end, :]
        # one scatter along the positions (put_along_axis), not mx.slice_update: MLX 0.32's CUDA
        # backend runs a dynamic slice update over the whole buffer (its copy kernel is sized by
        # the destination), a large share of a decode step's GPU time
        # (bench/RESULTS.md, "GPU time per kernel")
        self.start = self.offset  # the attention's: a view of the step's offset (decode_attention)
        at = (self.offset + mx.arange(N) if N > 1 else self.offset).reshape(1, 1, N, 1)
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(at, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(at, values.shape), values,
                                        axis=2)
        self.offset = self.offset + N
        return self.keys, self.values

    def make_mask(self, N, return_array=False, window_size=None):
        if isinstance(self.offset, int):
            return create_attention_mask(N, offset=self.offset, return_array=return_array,
                                         window_size=window_size)
        if N == 1 and window_size is None:
            return None  # decoding: attention() covers exactly the filled positions
        # a compiled prefill's N tokens (decoding.prefill) or a sliding-window layer's step (Gemma
        # 3): token i sees the positions up to offset + i (the last window_size of them)
        i, j = self.offset + mx.arange(N)[:, None], mx.arange(self.capacity)
        return (j <= i) if window_size is None else (j <= i) & (j > i - window_size)

    def attention(self, q, k, v, scale, mask):
        if isinstance(self.offset, int) or mask is not None:  # prefill, or a windowed decode step
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        return decode_attention(q, k, v, self.start, scale)

    @property
    def state(self):
        return self.keys, self.values


def make_cache(model, capacity=None):
    """One cache per layer: mlx-lm's growing KVCache, or a StaticKVCache of `capacity` positions."""
    if capacity is None:
        return [KVCache() for _ in model.layers]
    return [StaticKVCache(capacity) for _ in model.layers]
