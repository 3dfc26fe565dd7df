"""Sec. 5: the norm beside the matmul. The decode step's two projections that read a pre-norm's
output, each one kernel with its norm: norm_qkv_rope (the residual add, 1/RSSe and gain, the
q/k/v matrix-vector product and rope_after_qkv's work) and gate_up (the same prologue, the gate/up
product and SwiGLU with the up scale deferred). Their sources, launchers, plain-MLX fallbacks
(add_rss, the linear, rope_after_qkv / gated) and self-checks (CHECKS). norm_qkv_rope's switch and
self-check keep the name "qkv_rope" (fused_supported, MLX_FLASHNORM_DISABLE, CHECKS), its CUDA
function fn_qkv_rope."""
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn

from .. import forms
from ..forms import gpu_backend
from .scale import add_rss, residual_inputs, scale_shape
from .build import constant, float_bits, kernel, position_array, rand
from .rope import rope_after_qkv

# The decode step's two projections that read a pre-norm's output, each one kernel with its
# norm: the residual add, 1/RSSe and the norm gain computed beside a 4- or 8-bit matrix-vector
# product (the paper's Sec. 5: FlashNorm needs the norm's reduction only at the matmul's output, so
# it runs inside the matmul kernel) and the consumer's first step in the epilogue: RoPE (Sec. 3/4)
# for qkv, the SwiGLU for gate/up. Where rms runs norm, matmul, split, RoPE (or activation) as
# separate launches, flash runs one. One row (a decode step), MLX's affine quantization.
_PROLOGUE = """
  // The block's input row, as add_rss computes it: p = x * xs + r in float32, rounded once to T
  // (block 0 writes it: the new residual stream), s = 1/RSSe(p), and p * g in float32 in shared
  // memory, word-major (element 8 w + j of the packed words at j * KW + w: lanes reading
  // consecutive words hit consecutive banks). P: add_rss's power of two (PRESCALE, half
  // precision), carried by outputs whose scale stays deferred. Sizes, flags and eps (dims[0-6], eps
  // as float bits) are read at run time: one compile per dtype and bit width.
  constexpr int PER = 32 / BITS, MASK = (1 << BITS) - 1;  // values per word
  const int NW = blockDim.x / 32, K = dims[0], GS = dims[1], KW = K / PER, G = K / GS;  // NW: warps
  const bool has_xs = dims[2] != 0, has_r = dims[3] != 0, has_g = dims[4] != 0,
             prescale = dims[5] != 0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __shared__ float hs[KMAX];
  __shared__ float red[32];
  float ss = 0.0f;
  for (int i = threadIdx.x; i < K; i += blockDim.x) {
    float t = fn_f(x[i]);
    if (has_xs) t *= xs[0];
    if (has_r) t += fn_f(r[i]);
    const T tp = fn_cast<T>(t);
    if (blockIdx.x == 0) h[i] = tp;
    const float pv = fn_f(tp);
    ss += pv * pv;
    hs[(i % PER) * KW + i / PER] = has_g ? pv * g[i] : pv;
  }
  ss = fn_warp_sum(ss);
  if (lane == 0) red[warp] = ss;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < NW; ++w) total += red[w];
  const float s = rsqrtf(total + K * __int_as_float(dims[6]));
  const float P = prescale ? __int_as_float(__float_as_int(s) & 0x7f800000) : 1.0f;
"""

_DOT = """
    // rows n0 and n1 of the packed weight times p * g (a warp; lanes take the words in turn):
    // w = scale * q + bias per group of GS values, so a group adds scale * (q . x) + bias * sum(x)
    float a0 = 0.0f, a1 = 0.0f;
    for (int wd = lane; wd < KW; wd += 32) {
      const int grp = wd * PER / GS;
      const uint32_t q0 = wq[long(n0) * KW + wd], q1 = wq[long(n1) * KW + wd];
      float sx = 0.0f, d0 = 0.0f, d1 = 0.0f;
      #pragma unroll
      for (int j = 0; j < PER; ++j) {
        const float xv = hs[j * KW + wd];
        sx += xv;
        d0 += float((q0 >> (BITS * j)) & MASK) * xv;
        d1 += float((q1 >> (BITS * j)) & MASK) * xv;
      }
      a0 += fn_f(scales[long(n0) * G + grp]) * d0 + fn_f(biases[long(n0) * G + grp]) * sx;
      a1 += fn_f(scales[long(n1) * G + grp]) * d1 + fn_f(biases[long(n1) * G + grp]) * sx;
    }
    a0 = fn_warp_sum(a0);
    a1 = fn_warp_sum(a1);
"""

_NORM_QKV_ROPE = _PROLOGUE + """
  // One block per head of the qkv rows (HQ query, HKV key, HKV value heads, D rows each); a warp
  // computes rows i and i + D/2, a rotation pair. Then as rope_after_qkv: v * s; q and k rotated
  // with factor * s (Sec. 3) or their own 1/RSSe and the gain tables on cos/sin (QK_NORM, Sec. 4;
  // the values carry P as in the composition, so epsilon weighs the same). Output: the heads in the
  // same order, one array (q, k and v are views of it: fewer arrays, less host work per launch).
  const int HQ = dims[7], HKV = dims[8], D = dims[9];
  const bool qk_norm = dims[10] != 0;
  const float factor = __int_as_float(dims[11]), qk_eps = __int_as_float(dims[12]);
  const int head = blockIdx.x;
  __shared__ float res[256];
  for (int i = warp; i < D / 2; i += NW) {
    const int n0 = head * D + i, n1 = n0 + D / 2;
""" + _DOT + """
    if (lane == 0) { res[i] = a0; res[i + D / 2] = a1; }
  }
  __syncthreads();
  const bool is_q = head < HQ, is_k = !is_q && head < HQ + HKV;
  const long out = long(head) * D;
  if (!is_q && !is_k) {
    for (int d = threadIdx.x; d < D; d += blockDim.x) qkv[out + d] = fn_cast<T>(res[d] * s);
    return;
  }
  float inv = factor * s;
  if (qk_norm) {
    float hss = 0.0f;
    for (int d = lane; d < D; d += 32) hss += (res[d] * P) * (res[d] * P);
    hss = fn_warp_sum(hss);
    inv = rsqrtf(hss + D * qk_eps) * P;
  }
  const float pos = float(off[0]);
  for (int i = threadIdx.x; i < D / 2; i += blockDim.x) {
    const int j = i + D / 2;
    const float sn = sinf(pos * theta[i]), cs = cosf(pos * theta[i]);
    const float gi = qk_norm ? (is_q ? qg : kg)[i] : 1.0f,
                gj = qk_norm ? (is_q ? qg : kg)[j] : 1.0f;
    const float pi = qk_norm ? (is_q ? qg : kg)[D + i] : 1.0f,
                pj = qk_norm ? (is_q ? qg : kg)[D + j] : 1.0f;
    const float yi = inv * (res[i] * gi * cs - res[j] * pi * sn),
                yj = inv * (res[j] * gj * cs + res[i] * pj * sn);
    qkv[out + i] = fn_cast<T>(yi);
    qkv[out + j] = fn_cast<T>(yj);
  }
"""

_GATE_UP = _PROLOGUE + """
  // A warp per (gate row i, up row I + i), blocks taking them in turn (BLOCKS of them):
  // a_i = silu(gate_i * s) * up_i * P, the up branch's scale deferred: so = s / P (Sec. 2.2).
  const int I = dims[7], BLOCKS = dims[8];
  if (blockIdx.x == 0 && threadIdx.x == 0) so[0] = s / P;
  for (int i = blockIdx.x * NW + warp; i < I; i += BLOCKS * NW) {
    const int n0 = i, n1 = I + i;
""" + _DOT + """
    if (lane == 0) {
      const float gt = a0 * s;
      a[i] = fn_cast<T>(gt / (1.0f + expf(-gt)) * a1 * P);
    }
  }
"""

KMAX = {"cuda": 8192, "metal": 4096}  # longest input row the shared memory holds (32 / 16 KiB)
FUSED_BLOCKS = 256  # the most blocks of _GATE_UP (each recomputes the input row)
# warps a block of _NORM_QKV_ROPE runs, at most: its grid is one block per head (15 for SmolLM2), so
# each warp computes one rotation pair where it can, not four in turn
QKV_WARPS = {"cuda": 32, "metal": 8}


@lru_cache(maxsize=None)
def fused_kernels():
    inputs = ["x", "xs", "r", "g", "wq", "scales", "biases"]
    return (kernel("fn_qkv_rope", inputs + ["theta", "qg", "kg", "off", "dims"], ["h", "qkv"],
                   _NORM_QKV_ROPE),
            kernel("fn_gate_up", inputs + ["dims"], ["h", "a", "so"], _GATE_UP))


def fused_supported(name, x, linear):
    """Whether the fused kernel `name` ("qkv_rope": norm_qkv_rope, or "gate_up") runs for one row
    x through linear: a bias-free, affine 4- or 8-bit QuantizedLinear whose input fits the shared
    memory."""
    return (forms.use_gpu(name) and x.size == x.shape[-1]
            and x.dtype in (mx.float32, mx.float16, mx.bfloat16)
            and isinstance(linear, nn.QuantizedLinear) and linear.bits in (4, 8)
            and linear.mode == "affine"
            and "bias" not in linear and "biases" in linear and linear["scales"].dtype == x.dtype
            and x.shape[-1] <= KMAX[gpu_backend()]
            and x.shape[-1] % linear.group_size == 0)


def _fused_inputs(x, eps, xs, r, g, linear):
    arrays, flags = residual_inputs(x, xs, r, g)
    return (arrays + [linear["weight"], linear["scales"], linear["biases"]],
            (x.shape[-1], linear.group_size, *flags, float_bits(eps)),  # _PROLOGUE's dims[0-6]
            [("T", x.dtype), ("BITS", linear.bits), ("KMAX", KMAX[gpu_backend()])])


@lru_cache(maxsize=None)
def gated(activation):
    """h = activation(gate * s) * up, rounded once to up's dtype (s is float32 in half precision,
    so all of it runs in float32), as one compiled element-wise kernel: run eagerly (prefill) it
    was four launches over float32 intermediates. shapeless: one trace serves every length. The
    gate_up kernel's fallback, and FlashNorm's FFNs where that kernel does not run."""
    return mx.compile(lambda gate, s, up: (activation(gate * s) * up).astype(up.dtype),
                      shapeless=True)


def norm_qkv_rope(x, eps, xs, r, g, linear, offset, theta, n_heads, n_kv_heads, gains=None,
                  qk_eps=0.0, factor=1.0):
    """(p, q, k, v) of one decode row: p, pg, s = add_rss(x, eps, xs, r, g), then linear (the
    concatenated q/k/v projection) on pg, and rope_after_qkv's RoPE (Sec. 3 with factor, or Sec. 4
    with gains and qk_eps) on its output; q, k, v as (B, H, 1, D). One kernel where fused_supported,
    else that composition."""
    if not fused_supported("qkv_rope", x, linear):
        p, pg, s = add_rss(x, eps, xs=xs, r=r, g=g)
        y = linear(p if pg is None else pg)
        return (p, *rope_after_qkv(y, y, y, s, offset, theta, n_heads, n_kv_heads, gains, qk_eps,
                                   factor))
    inputs, flags, template = _fused_inputs(x, eps, xs, r, g, linear)
    D = theta.shape[0] * 2
    off = position_array(offset)
    qg, kg = gains if gains is not None else (theta, theta)  # unused without QK-norm
    threads = 32 * min(D // 2, QKV_WARPS[gpu_backend()])
    heads = n_heads + 2 * n_kv_heads
    p, qkv = fused_kernels()[0](
        inputs=inputs + [theta, qg, kg, off,
                         constant(mx.int32, *flags, n_heads, n_kv_heads, D, gains is not None,
                                  float_bits(factor), float_bits(qk_eps))],
        template=template, grid=(heads * threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[x.shape, (1, heads, 1, D)], output_dtypes=[x.dtype] * 2)
    return p, qkv[:, :n_heads], qkv[:, n_heads:n_heads + n_kv_heads], qkv[:, n_heads + n_kv_heads:]


def gate_up(x, eps, xs, r, g, linear):
    """(p, a, s) of one decode row: p, pg, s = add_rss(x, eps, xs, r, g), then linear (gate rows
    over up rows) on pg and a = silu(gate * s) * up, its scale s still to apply (Sec. 2.2). One
    kernel where fused_supported, else that composition."""
    if not fused_supported("gate_up", x, linear):
        p, pg, s = add_rss(x, eps, xs=xs, r=r, g=g)
        gate, up = mx.split(linear(p if pg is None else pg), 2, axis=-1)
        return p, gated(nn.silu)(gate, s, up), s
    inputs, flags, template = _fused_inputs(x, eps, xs, r, g, linear)
    I = linear["weight"].shape[0] // 2
    blocks = min(FUSED_BLOCKS, -(-I // 8))
    p, a, so = fused_kernels()[1](
        inputs=inputs + [constant(mx.int32, *flags, I, blocks)],
        template=template, grid=(blocks * 256, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[x.shape, x.shape[:-1] + (I,), scale_shape(x)],
        output_dtypes=[x.dtype, x.dtype, mx.float32])
    return p, a, so[..., :1]


def _quantized(out_dims, in_dims, seed):
    linear = nn.Linear(in_dims, out_dims, bias=False)
    linear.weight = rand((out_dims, in_dims), seed, scale=0.05)
    return nn.QuantizedLinear.from_linear(linear, 64, 4)


def check_norm_qkv_rope():  # Sec. 4 (a residual add, gain and QK-norm), Sec. 3 (a deferred input)
    linear, theta = _quantized(8 * 64, 320, 16), mx.exp(-mx.arange(32, dtype=mx.float32) * 0.3)
    x, r = rand((1, 1, 320), 17, scale=300.0), rand((1, 1, 320), 18, scale=300.0)
    g = 1 + 0.3 * rand((320,), 19, mx.float32)
    gains = (1 + 0.3 * rand((2, 64), 20, mx.float32), 1 + 0.3 * rand((2, 64), 21, mx.float32))
    return (*norm_qkv_rope(x, 1e-6, None, r, g, linear, 5, theta, 4, 2, gains, 1e-6, 0.35),
            *norm_qkv_rope(x, 1e-6, mx.full((1, 1, 1), 0.01), r, None, linear, 9, theta, 4, 2,
                           factor=0.35))


def check_gate_up():
    linear = _quantized(2 * 200, 320, 22)
    x, r = rand((1, 1, 320), 23, scale=300.0), rand((1, 1, 320), 24, scale=300.0)
    return gate_up(x, 1e-6, mx.full((1, 1, 1), 0.01), r, 1 + 0.3 * rand((320,), 25, mx.float32),
                   linear)


CHECKS = {"qkv_rope": (check_norm_qkv_rope, 1e-2), "gate_up": (check_gate_up, 1e-2)}
