"""The fused residual add + RMSNorm/LayerNorm kernel (the norm modules' kernel, mlx_flashnorm.nn):
o = c/sqrt(d) * (p or p - mean(p)) / sigma * w + b with p = x + residual, in one launch, rounded
to the input's dtype where the fallback rounds it (so that a model's one-row step and its batched
rows, which take the fallback, round alike); its source (one body in CUDA spelling, respelled for
Metal), launcher, plain-MLX fallback (compose, on mx.fast.rms_norm / layer_norm) and self-check
(CHECK)."""
import math
from functools import lru_cache

import mlx.core as mx

from .. import forms
from .build import CUDA_DTYPES, float_bits, make_kernel, rand

KERNEL_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
MAX_KERNEL_DIM = 65536


# ----------------------------------------------------------------------------------
# Plain MLX composition: the fallback forward and the reference for the tests.

def compose(x, residual, weight, bias, scale, center, eps):
    """(o, p) from mx ops; ``scale`` is c / sqrt(d)."""
    p = x if residual is None else x + residual
    w = weight
    if scale != 1.0 and w is not None:
        w = w * scale
    if center:
        o = mx.fast.layer_norm(p, w, bias, eps)
    else:
        o = mx.fast.rms_norm(p, w, eps)
        if bias is not None:
            o = o + bias
    if scale != 1.0 and weight is None:
        o = o * scale if bias is None else (o - bias) * scale + bias
    return o, p


# ----------------------------------------------------------------------------------
# Fused add+norm kernel: one threadgroup (block) per row, each thread keeps its (at
# most PER) values of p in registers, so memory is read once; the mean (center) and
# the sum of squares are two exact passes over the registers.  D and the block size
# are read at run time, so one compiled kernel serves every width up to PER * block.

HEADERS = {"cuda": CUDA_DTYPES + """
__device__ inline float fnorm_block_sum(float v, float* buf, int tid, int nwarps) {
  for (int k = 16; k > 0; k >>= 1) v += __shfl_xor_sync(0xffffffff, v, k);
  __syncthreads();  // buf may still be read by the previous block sum
  if ((tid & 31) == 0) buf[tid >> 5] = v;
  __syncthreads();
  float s = 0.0f;
  for (int i = 0; i < nwarps; ++i) s += buf[i];
  return s;
}
""", "metal": """
template <typename U> inline float fn_f(U v) { return static_cast<float>(v); }
template <typename U> inline U fn_cast(float v) { return static_cast<U>(v); }

inline float fnorm_block_sum(float v, threadgroup float* buf, int tid, int nwarps) {
  v = simd_sum(v);  // Apple GPUs: 32-wide SIMD groups
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if ((tid & 31) == 0) buf[tid >> 5] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float s = 0.0f;
  for (int i = 0; i < nwarps; ++i) s += buf[i];
  return s;
}
"""}

_BODY = """
  const int row = blockIdx.x;
  const int tid = threadIdx.x;
  const int block = blockDim.x;
  const int D = x_shape[x_ndim - 1];
  __shared__ float buf[32];
  const long base = long(row) * D;
  float v[PER];
  float s = 0.0f;
  #pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int i = tid + k * block;
    float t = 0.0f;
    if (i < D) {
      {load_p}
    }
    v[k] = t;
    s += t;
  }
  {center}
  float ss = 0.0f;
  #pragma unroll
  for (int k = 0; k < PER; ++k) ss += v[k] * v[k];
  const float inv =
      rsqrtf(fnorm_block_sum(ss, buf, tid, block / 32) / D + __int_as_float(EPS_BITS));
  const float scale = __int_as_float(SCALE_BITS);
  #pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int i = tid + k * block;
    if (i < D) {
      // rounded as the composition rounds it (mx.fast.rms_norm / layer_norm, then the weight and
      // the bias as values of T): the normalized value in T, times the weight (times scale) in T,
      // plus the bias in T
      float t = fn_f(fn_cast<T>(v[k] * inv));
      {mul_w}
      {add_b}
      o[base + i] = fn_cast<T>(t);
    }
  }
"""

# p is rounded to T before the statistics, as the composition does (x + residual in T).
_LOAD_P = "t = fn_f(x[base + i]);"
_LOAD_P_RES = """const T tp = fn_cast<T>(fn_f(x[base + i]) + fn_f(res[base + i]));
      p[base + i] = tp;
      t = fn_f(tp);"""
# The weight times scale rounded to T (the composition's w * scale; w itself at scale 1), or without
# a weight the scale as a value of T (the composition's o * scale); nothing at scale 1.
_MUL_W = "t = fn_f(fn_cast<T>(t * fn_f(fn_cast<T>(fn_f(w[i]) * scale))));"
_MUL_SCALE = "if (scale != 1.0f) t = fn_f(fn_cast<T>(t * fn_f(fn_cast<T>(scale))));"
_CENTER = """const float mean = fnorm_block_sum(s, buf, tid, block / 32) / D;
  #pragma unroll
  for (int k = 0; k < PER; ++k) v[k] = (tid + k * block < D) ? v[k] - mean : 0.0f;"""


@lru_cache(maxsize=None)
def kernel(backend, has_res, has_w, has_b, center):
    """The launcher of one variant (which inputs it has, centered or not) for backend's header."""
    source = (_BODY.replace("{load_p}", _LOAD_P_RES if has_res else _LOAD_P)
              .replace("{center}", _CENTER if center else "")
              .replace("{mul_w}", _MUL_W if has_w else _MUL_SCALE)
              .replace("{add_b}", "t = fn_f(fn_cast<T>(t + fn_f(b[i])));" if has_b else ""))
    inputs = ["x"] + ["res"] * has_res + ["w"] * has_w + ["b"] * has_b
    outputs = ["o"] + ["p"] * has_res
    flags = "".join(f for f, on in zip("rwbc", (has_res, has_w, has_b, center)) if on)
    return make_kernel("flashnorm_" + flags, inputs, outputs, source, HEADERS[backend])


def _pow2_at_least(n):
    return 1 << max(0, n - 1).bit_length()


def _block_size(d):
    """About 8 values a thread: 32..1024 threads, a power of two, and the registers
    each thread keeps (a power of two >= 8, so few kernels are compiled)."""
    block = min(1024, max(32, _pow2_at_least(math.ceil(d / 8))))
    return block, max(8, _pow2_at_least(math.ceil(d / block)))


def kernel_ok(x, residual, weight, bias):
    arrays = [a for a in (x, residual, weight, bias) if a is not None]
    return (x.dtype in KERNEL_DTYPES and all(a.dtype == x.dtype for a in arrays)
            and 0 < x.shape[-1] <= MAX_KERNEL_DIM and x.size > 0)


def fused(backend, x, residual, weight, bias, scale, center, eps):
    """(o, p) from one kernel launch; the caller checked ``kernel_ok``."""
    d = x.shape[-1]
    block, per = _block_size(d)
    rows = x.size // d
    launch = kernel(backend, residual is not None, weight is not None, bias is not None, center)
    inputs = [x] + [mx.broadcast_to(a, x.shape) for a in (residual,) if a is not None]
    inputs += [a for a in (weight, bias) if a is not None]
    n_out = 1 + (residual is not None)
    outs = launch(inputs=inputs,
                  template=[("T", x.dtype), ("PER", per),
                            ("EPS_BITS", float_bits(eps)),
                            ("SCALE_BITS", float_bits(scale))],
                  grid=(rows * block, 1, 1), threadgroup=(block, 1, 1),
                  output_shapes=[x.shape] * n_out, output_dtypes=[x.dtype] * n_out)
    return outs[0], (outs[1] if residual is not None else x)


def check():
    x, r, w = rand((3, 320), 11), rand((3, 320), 12), 1 + 0.3 * rand((320,), 13)
    path = forms.gpu_backend() if forms.use_gpu("normalize") else "fallback"
    run = compose if path == "fallback" else lambda *a: fused(path, *a)
    return run(x, r, w, None, 1.0, False, 1e-6)


CHECK = (check, 1e-2)
