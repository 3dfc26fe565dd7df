"""rope_after_qkv: FlashNorm Sec. 3/4 after the q, k, v projections: RoPE with the deferred 1/RSS
(Sec. 3) or, with QK-norm (Sec. 4), each head's own 1/RSSe and the q/k norm weights fused into
cos/sin (rotate-half layout); v * s. Its source, launcher, plain-MLX fallback (rope.py's pieces)
and self-check (CHECK). Its switch and self-check keep the name "rope_qkv" (forms.use_gpu,
MLX_FLASHNORM_DISABLE, kernels.check.CHECKS), its CUDA function fn_rope_qkv."""
import math
from functools import lru_cache

import mlx.core as mx

from .. import forms
from ..rope import apply_rope, rope_tables
from .build import constant, float_bits, kernel, position_array, rand

_ROPE_AFTER_QKV = """
  // one warp per (token, head); heads: HQ queries, HKV keys, HKV values, read from q, k, v at
  // row strides QS, KS, VS and column offsets QO, KO, VO (one fused qkv array may be all three).
  // rotate-half RoPE: lane holds elements lane + 32 t, whose partners i +- D/2 are in the same
  // lane. Every size and flag is read at run time (dims; EPS and FACTOR as float bits): one compile
  // per dtype and head dim.
  constexpr int VPT = D / 32, HALF = VPT / 2;
  const int HQ = dims[0], HKV = dims[1], QS = dims[2], KS = dims[3], VS = dims[4];
  const int QO = dims[5], KO = dims[6], VO = dims[7];
  const bool QK_NORM = dims[8] != 0;
  const float EPS = __int_as_float(dims[9]), FACTOR = __int_as_float(dims[10]);
  const int H = HQ + 2 * HKV;
  const int L = q_shape[1], ROWS = q_shape[0] * L;
  const int gw = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (gw >= ROWS * H) return;
  const int row = gw / H, head = gw % H;      // row = b * L + l
  const int b = row / L, l = row % L;
  const bool is_q = head < HQ, is_k = !is_q && head < HQ + HKV;
  const long in = is_q ? long(row) * QS + QO + long(head) * D
      : is_k ? long(row) * KS + KO + long(head - HQ) * D
             : long(row) * VS + VO + long(head - HQ - HKV) * D;
  float x[VPT];
  #pragma unroll
  for (int t = 0; t < VPT; ++t) x[t] = fn_f((is_q ? q : (is_k ? k : v))[in + lane + 32 * t]);
  if (!is_q && !is_k) {
    const float sv = fn_f(s[row]);
    const long out = (long(b * HKV + head - HQ - HKV) * L + l) * D;
    #pragma unroll
    for (int t = 0; t < VPT; ++t) vo[out + lane + 32 * t] = fn_cast<T>(x[t] * sv);
    return;
  }
  // QK_NORM (Sec. 4): 1/RSSe of the head, gains g and permute(g) (sqrt(D), D^-1/4 folded in) on
  // cos and sin. Else (Sec. 3): the token's deferred s times D^-1/4 (FACTOR) on cos and sin.
  float ss = 0.0f;
  #pragma unroll
  for (int t = 0; t < VPT; ++t) ss += x[t] * x[t];
  ss = fn_warp_sum(ss);
  const float inv = QK_NORM ? rsqrtf(ss + D * EPS) : FACTOR * fn_f(s[row]);
  const float pos = float(off[0] + l);
  float y[VPT];
  #pragma unroll
  for (int t = 0; t < HALF; ++t) {
    const int i = lane + 32 * t, j = i + D / 2;   // a rotation pair
    float sn, cs;
    sn = sinf(pos * theta[i]);
    cs = cosf(pos * theta[i]);
    const float gi = QK_NORM ? (is_q ? qg : kg)[i] : 1.0f,
                gj = QK_NORM ? (is_q ? qg : kg)[j] : 1.0f;
    const float pi = QK_NORM ? (is_q ? qg : kg)[D + i] : 1.0f,
                pj = QK_NORM ? (is_q ? qg : kg)[D + j] : 1.0f;
    y[t] = inv * (x[t] * gi * cs - x[t + HALF] * pi * sn);
    y[t + HALF] = inv * (x[t + HALF] * gj * cs + x[t] * pj * sn);
  }
  const long out = is_q ? (long(b * HQ + head) * L + l) * D
                        : (long(b * HKV + head - HQ) * L + l) * D;
  #pragma unroll
  for (int t = 0; t < VPT; ++t) (is_q ? qo : ko)[out + lane + 32 * t] = fn_cast<T>(y[t]);
"""


@lru_cache(maxsize=None)
def rope_after_qkv_kernel():
    return kernel("fn_rope_qkv", ["q", "k", "v", "s", "off", "theta", "qg", "kg", "dims"],
                   ["qo", "ko", "vo"], _ROPE_AFTER_QKV)


def rope_after_qkv_supported(head_dim, traditional):
    return forms.use_gpu("rope_qkv") and not traditional and head_dim % 64 == 0 and head_dim <= 256


def rope_after_qkv(q, k, v, s, offset, theta, n_heads, n_kv_heads, gains=None, eps=0.0,
                   factor=1.0):
    """CUDA kernel preparing q, k, v for attention after a FlashNorm'd pre-norm (rotate-half layout
    only; see rope_after_qkv_supported). q, k, v (B, L, H * D) token-major projection outputs, or
    one fused (B, L, (Hq + 2 Hkv) * D) array passed as all three; s (B, L, 1) the deferred 1/RSSe
    of the block input; theta (D/2,) angles per position. v is returned times s. q and k get RoPE
    and: with gains ((2, D) tables for q and k, Sec. 4) their own per-head 1/RSSe and the gain
    tables on cos/sin; without (Sec. 3) s * factor. Returns q, k, v as (B, H, L, D). The kernel
    reads one position: per-row offsets (a batch, mlx_flashnorm.batch) take the MLX composition."""
    if not forms.use_gpu("rope_qkv") or getattr(offset, "size", 1) > 1:
        return rope_after_qkv_mlx(q, k, v, s, offset, theta, n_heads, n_kv_heads, gains, eps,
                                  factor)
    B, L, _ = q.shape
    D = theta.shape[0] * 2
    fused = q is k
    width = (n_heads + 2 * n_kv_heads) * D
    strides = (width,) * 3 if fused else (n_heads * D, n_kv_heads * D, n_kv_heads * D)
    offsets = (0, n_heads * D, (n_heads + n_kv_heads) * D) if fused else (0, 0, 0)
    rows, threads = B * L, 256
    warps = rows * (n_heads + 2 * n_kv_heads)
    off = position_array(offset)
    qg, kg = gains if gains is not None else (theta, theta)  # unused without QK-norm
    dims = constant(mx.int32, n_heads, n_kv_heads, *strides, *offsets, gains is not None,
                    float_bits(eps), float_bits(factor))
    return rope_after_qkv_kernel()(
        inputs=[q, k, v, s.astype(mx.float32), off, theta, qg, kg, dims],
        template=[("T", q.dtype), ("D", D)],
        grid=(math.ceil(warps * 32 / threads) * threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(B, n_heads, L, D), (B, n_kv_heads, L, D), (B, n_kv_heads, L, D)],
        output_dtypes=[q.dtype] * 3)


def rope_after_qkv_mlx(q, k, v, s, offset, theta, n_heads, n_kv_heads, gains, eps, factor):
    """rope_after_qkv in plain MLX ops (its fallback and self-check reference), through rope.py."""
    B, L, _ = q.shape
    D = theta.shape[0] * 2
    heads = lambda a, start, n: (a[..., start:start + n * D].reshape(B, L, n, D)
                                 .transpose(0, 2, 1, 3))
    if q is k:
        q, k, v = (heads(q, 0, n_heads), heads(q, n_heads * D, n_kv_heads),
                   heads(q, (n_heads + n_kv_heads) * D, n_kv_heads))
    else:
        q, k, v = heads(q, 0, n_heads), heads(k, 0, n_kv_heads), heads(v, 0, n_kv_heads)
    sf = s.astype(mx.float32)[:, None]
    cos, sin = rope_tables((1.0, theta.astype(mx.float32)), offset, L, traditional=False)

    def rope(x, gain):
        if gain is None:
            return apply_rope(x, cos, sin, False, factor * sf)
        xf = x.astype(mx.float32)
        inv = mx.rsqrt(mx.sum(xf * xf, axis=-1, keepdims=True) + D * eps)
        return apply_rope(x, cos * gain[0].astype(mx.float32), sin * gain[1].astype(mx.float32),
                          False, inv)

    qg, kg = gains if gains is not None else (None, None)
    return rope(q, qg), rope(k, kg), (v.astype(mx.float32) * sf).astype(v.dtype)


def check():
    qkv = rand((2, 3, 8 * 64), 7, scale=3.0)
    s = mx.abs(rand((2, 3, 1), 8, mx.float32))
    theta = mx.exp(-mx.arange(32, dtype=mx.float32) * (2 * math.log(10000.0) / 64))
    gains = (1 + 0.3 * rand((2, 64), 9, mx.float32), 1 + 0.3 * rand((2, 64), 10, mx.float32))
    return rope_after_qkv(qkv, qkv, qkv, s, 5, theta, 4, 2, gains, 1e-6, 0.35)


CHECK = (check, 1e-2)
