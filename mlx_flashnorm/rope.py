"""RoPE's pieces as plain MLX ops, shared by FlashNorm's attention (Sec. 3/4: scales and gains
fused into the cos/sin tables) and the rope_after_qkv kernel's fallback."""
import math

import mlx.core as mx
import mlx.nn as nn

from .errors import UserError


def rope_frequencies(rope):
    """(position scale, per-pair frequencies theta_i in float32) of a reference RoPE module, with
    angle_i = (scale * pos) * theta_i computed as mx.fast.rope does. nn.RoPE: its scale and
    theta_i = exp(-2i ln(base) / dims); mlx-lm's Llama3RoPE: 1 and 1 / _freqs (mx.fast.rope's
    freqs are inverse frequencies). Other RoPE variants are refused."""
    if type(rope) is nn.RoPE:
        i = mx.arange(rope.dims // 2, dtype=mx.float32)
        return rope.scale, mx.exp(-i * (2 * math.log(rope.base) / rope.dims))
    if type(rope).__name__ == "Llama3RoPE":
        return 1.0, 1.0 / rope._freqs.astype(mx.float32)
    raise UserError("FlashNorm supports plain, linear-scaled and llama3 RoPE, "
                    f"not {type(rope).__name__}; use norm='rms' for this model")


def rope_tables(frequencies, offset, length, traditional):
    """cos and sin of shape (length, h) for positions offset .. offset+length-1 (offset an int or
    a scalar array; or one offset per row of a batch, (B,): tables (B, 1, length, h)), laid out
    for the rotation used: interleaved (x0,x1),(x2,x3).. (traditional) or rotate-half (i, i+h/2).
    frequencies: rope_frequencies(reference rope)."""
    scale, theta = frequencies
    if getattr(offset, "ndim", 0):
        offset = offset[:, None, None]
    pos = (offset + mx.arange(length)).astype(mx.float32)
    if scale != 1.0:  # x * 1 is x
        pos = pos * scale
    theta = mx.repeat(theta, 2) if traditional else mx.concatenate([theta, theta])  # per column
    angles = pos[..., None] * theta
    return mx.cos(angles), mx.sin(angles)


def rotate(x, traditional):
    """The signed pair swap of RoPE: y = x*cos + rotate(x)*sin. Interleaved: (-x1, x0, -x3, x2, ..);
    rotate-half: (-x[h/2:], x[:h/2])."""
    if traditional:
        pairs = x.reshape(*x.shape[:-1], -1, 2)
        return mx.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    a, b = mx.split(x, 2, axis=-1)
    return mx.concatenate([-b, a], axis=-1)


def permute_gain(g, traditional):
    """Sec. 4.2: the permutation with rotate(x * g) = rotate(x) * permute(g). Interleaved (as in
    the paper): swap each pair (g1, g0, g3, g2, ..). Rotate-half (OpenELM, Llama in MLX): rotate
    pairs element i with i+h/2, so permute swaps the two halves: (g[h/2:], g[:h/2])."""
    if traditional:
        return g.reshape(-1, 2)[:, ::-1].reshape(g.shape)
    a, b = mx.split(g, 2, axis=-1)
    return mx.concatenate([b, a], axis=-1)


def apply_rope(x, cos, sin, traditional, scale=None):
    """x * cos + rotate(x) * sin (times a per-row scale), computed in the tables' float32 and
    rounded once to x's dtype, as mx.fast.rope does."""
    y = x * cos + rotate(x, traditional) * sin
    return (y if scale is None else y * scale).astype(x.dtype)
