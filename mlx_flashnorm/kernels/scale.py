"""add_rss: p = x * xs + r, p * g, and 1/RSSe(p) = rsqrt(sum(p^2) + d*eps) per row, the residual
add and FlashNorm's deferred scale in one pass (Appendix A/B). Its source, launcher, plain-MLX
fallback and self-check (CHECK); residual_inputs and scale_shape also serve the matvec kernels."""
import math
from functools import lru_cache

import mlx.core as mx

from .. import forms
from .build import constant, float_bits, kernel, rand

_ADD_RSS = """
  // one block per row: p = x * xs + r (in float32, rounded once to T), s = rsqrt(sum(p^2) + d*eps)
  // and pg = p * g * P, s / P. The flags (HAS_XS, HAS_R, HAS_G, PRESCALE) and eps (its bits) are
  // read at run time: one compile per dtype. PRESCALE (half precision): P = 2^floor(log2(s)), an
  // exact power of two that brings pg to the scale of a normalized row (in range), s / P in [1, 2).
  const int row = blockIdx.x;
  const int D = x_shape[x_ndim - 1];
  const bool has_xs = flags[0] != 0, has_r = flags[1] != 0, has_g = flags[2] != 0,
             prescale = flags[3] != 0;
  const long base = long(row) * D;
  const float xsv = has_xs ? xs[row] : 1.0f;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    float t = fn_f(x[base + i]) * xsv;
    if (has_r) t += fn_f(r[base + i]);
    const T tp = fn_cast<T>(t);
    p[base + i] = tp;
    ss += fn_f(tp) * fn_f(tp);
  }
  __shared__ float buf[32];
  __shared__ float total;
  ss = fn_warp_sum(ss);
  if (threadIdx.x % 32 == 0) buf[threadIdx.x / 32] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.0f;
    for (int w = 0; w < int(blockDim.x / 32); ++w) t += buf[w];
    total = t;
  }
  __syncthreads();
  const float sc = rsqrtf(total + D * __int_as_float(flags[4]));
  const float P = prescale ? __int_as_float(__float_as_int(sc) & 0x7f800000) : 1.0f;
  if (threadIdx.x == 0) s[row] = sc / P;
  for (int i = threadIdx.x; i < D; i += blockDim.x)
    pg[base + i] = fn_cast<T>(fn_f(p[base + i]) * (has_g ? g[i] : 1.0f) * P);
"""


@lru_cache(maxsize=None)
def add_rss_kernel():
    return kernel("fn_add_rss", ["x", "xs", "r", "g", "flags"], ["p", "pg", "s"], _ADD_RSS)


def residual_inputs(x, xs, r, g):
    """The kernel inputs x, xs, r, g of a residual add with an optional scale and gain (add_rss and
    the Sec. 5 kernels), absent ones stood in for, and their flags: has xs, r, g; half precision."""
    none = constant(mx.float32, 0.0)  # stands in for an absent input (its flag is 0)
    return ([x, none if xs is None else xs.astype(mx.float32),
             x if r is None else r.astype(x.dtype), none if g is None else g.astype(mx.float32)],
            (xs is not None, r is not None, g is not None, x.dtype != mx.float32))


def scale_shape(x):
    """The shape of a kernel's float32 scale output for rows x: (.., 1), but 4 values for a single
    row (a decode step), so that the array is 16 bytes and out of MLX's managed small-array pool,
    which the next kernel would read slowly (see constant); the caller keeps [..., :1] of a single
    row's, a view."""
    return x.shape[:-1] + ((4,) if x.size == x.shape[-1] else (1,))


def power_of_two_below(s):
    """2^floor(log2(s)) of a positive float32 array, exactly (the exponent bits of s)."""
    return mx.view(mx.bitwise_and(mx.view(s, mx.int32), 0x7F800000), mx.float32)


def add_rss(x, eps, xs=None, r=None, g=None):
    """(p, pg, s) over the last axis: p = x * xs + r (xs (.., 1) and r optional), the new residual
    stream in x's dtype; s = 1/RSSe(p) = rsqrt(sum(p^2) + d * eps) with shape (.., 1), in float32;
    pg = p * g (g optional; None when there is no g, in float32). Appendix A/B of the paper: with
    sqrt(d) * g as the gain, pg * s is RMSNorm(p) * g.

    Half precision: p * sqrt(d) * g leaves float16's range on trained models, whose residual
    stream grows large (bench/RESULTS.md, "Half precision"), and so would every matmul output after
    it. There pg carries an exact power of two P = 2^floor(log2 s) (pg = p * g * P, also without g)
    and s is returned as s / P, in [1, 2): pg is then on the scale of a normalized row and pg * s is
    unchanged, since a power-of-two factor adds no rounding. x * xs + r is computed in float32 and
    rounded once."""
    half = x.dtype != mx.float32
    if forms.use_gpu("add_rss") and x.dtype in (mx.float32, mx.float16, mx.bfloat16):
        d, rows = x.shape[-1], x.size // x.shape[-1]
        threads = min(1024, max(32, 32 * math.ceil(d / 4 / 32)))
        arrays, flags = residual_inputs(x, xs, r, g)
        p, pg, s = add_rss_kernel()(
            inputs=arrays + [constant(mx.int32, *flags, float_bits(eps))],
            template=[("T", x.dtype)],
            grid=(rows * threads, 1, 1), threadgroup=(threads, 1, 1),
            output_shapes=[x.shape, x.shape, scale_shape(x)],
            output_dtypes=[x.dtype, x.dtype, mx.float32])
        return ((p if (r is not None or xs is not None) else x),
                (pg if (g is not None or half) else None), s if rows > 1 else s[..., :1])
    if not half:
        p = x if xs is None else x * xs
        p = p if r is None else p + r
        s = mx.rsqrt(mx.sum(p * p, axis=-1, keepdims=True) + x.shape[-1] * eps)
        return p, (None if g is None else p * g), s
    if xs is None:
        p = x if r is None else x + r
    else:
        pf = x.astype(mx.float32) * xs
        p = (pf if r is None else pf + r.astype(mx.float32)).astype(x.dtype)
    pf = p.astype(mx.float32)
    s = mx.rsqrt(mx.sum(pf * pf, axis=-1, keepdims=True) + x.shape[-1] * eps)
    P = power_of_two_below(s)
    pg = (pf * P if g is None else pf * (g.astype(mx.float32) * P)).astype(x.dtype)
    return p, pg, s / P


def check():
    x, r = rand((3, 320), 1, scale=300.0), rand((3, 320), 2, scale=300.0)
    g = 1 + 0.3 * rand((320,), 3, mx.float32)
    return add_rss(x, 1e-6, xs=mx.full((3, 1), 0.7), r=r, g=g)


CHECK = (check, 1e-2)
