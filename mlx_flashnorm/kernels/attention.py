"""decode_attention: softmax(q k^T * scale) v over the first n cached positions (n an array), so a
compiled decode step attends over a fixed-size cache without a mask. Its source (the CUDA body,
respelled for Metal), launcher, plain-MLX fallback (mx.fast.scaled_dot_product_attention with a
mask) and self-check (CHECK)."""
from functools import lru_cache

import mlx.core as mx

from .. import forms
from ..forms import gpu_backend
from .build import float_bits, kernel, position_array, rand

_ATTENTION = """
  // one block per (batch * kv head, split of the cache): the GQ query heads of a kv head share
  // each K/V row it loads. A row (D values) is loaded by LPR lanes, EPL values (16 bytes) each, so
  // a warp holds G rows at a time and takes U of them per row group (all loads in flight before a
  // sum waits); the block's NW warps take ROWS = NW * G * U consecutive positions per step.
  // A long cache (C > SPLIT_ABOVE) is split in chunks of CHUNK positions over S blocks
  // per kv head (flash-decoding): each writes its partial softmax state (max, sum; weighted values)
  // per query head and fn_decode_combine merges them. A short one is one block per kv head, which
  // writes o itself. GQ, D, SPLIT_ABOVE, CHUNK, SCALE_BITS (the scale's float bits): template
  // constants; the other sizes run-time.
  constexpr int EPL = 16 / sizeof(T), LPR = D / EPL, G = 32 / LPR, U = G >= 8 ? 1 : 2;
  constexpr int NW = 8, ROWS = NW * G * U;
  const int HQ = q_shape[1], HKV = k_shape[1], C = k_shape[2];
  const int S = C > SPLIT_ABOVE ? (C + CHUNK - 1) / CHUNK : 1;
  const int kvh = blockIdx.x / S, split = blockIdx.x % S;  // kvh = b * HKV + kv head
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, grp = lane / LPR, sub = lane % LPR;
  const int len = start[0] + 1;  // positions filled: those before the query, and its own
  const int lo = split * (S > 1 ? CHUNK : C);
  const int end = S > 1 ? lo + CHUNK : C;
  const int hi = end < len ? end : len;
  const float sc = __int_as_float(SCALE_BITS) * 1.4426950408889634f;  // exp2 domain
  const long head0 = long(kvh / HKV) * HQ + (kvh % HKV) * GQ;  // the first of its query heads
  float qv[GQ][EPL], acc[GQ][EPL], m[GQ], l[GQ];
  #pragma unroll
  for (int h = 0; h < GQ; ++h) {
    fn_load<T, EPL>(q + (head0 + h) * D + sub * EPL, qv[h]);
    #pragma unroll
    for (int e = 0; e < EPL; ++e) { qv[h][e] *= sc; acc[h][e] = 0.0f; }
    m[h] = -1e30f;
    l[h] = 0.0f;
  }
  const long base = long(kvh) * C * D + sub * EPL;
  for (int w0 = lo + warp * G * U; w0 < hi; w0 += ROWS) {  // the same trip count for a whole warp
    const int j0 = w0 + grp * U;
    float kf[U][EPL], vf[U][EPL], d[U][GQ];
    long r[U];
    #pragma unroll
    for (int u = 0; u < U; ++u) {  // a position past hi reads row w0 again and gets no weight
      r[u] = base + long(j0 + u < hi ? j0 + u : w0) * D;
      fn_load<T, EPL>(k + r[u], kf[u]);
    }
    #pragma unroll
    for (int u = 0; u < U; ++u) fn_load<T, EPL>(v + r[u], vf[u]);
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      #pragma unroll
      for (int h = 0; h < GQ; ++h) {
        float t = 0.0f;
        #pragma unroll
        for (int e = 0; e < EPL; ++e) t += qv[h][e] * kf[u][e];
        #pragma unroll
        for (int x = LPR / 2; x > 0; x >>= 1) t += fn_shfl_xor(t, x);  // over the row's lanes
        d[u][h] = t;
      }
    }
    #pragma unroll
    for (int h = 0; h < GQ; ++h) {
      float mn = m[h];
      #pragma unroll
      for (int u = 0; u < U; ++u) if (j0 + u < hi) mn = fmaxf(mn, d[u][h]);
      const float corr = exp2f(m[h] - mn);
      l[h] *= corr;
      #pragma unroll
      for (int e = 0; e < EPL; ++e) acc[h][e] *= corr;
      #pragma unroll
      for (int u = 0; u < U; ++u) {
        const float w = j0 + u < hi ? exp2f(d[u][h] - mn) : 0.0f;
        l[h] += w;
        #pragma unroll
        for (int e = 0; e < EPL; ++e) acc[h][e] += w * vf[u][e];
      }
      m[h] = mn;
    }
  }
  // merge the row groups of a warp (lanes LPR apart hold the same dims), then the warps; these
  // loops run once per block and stay rolled: MLX hashes a kernel's whole binary at every launch
  // (host time per KB), and unrolled they made it larger
  // (bench/LOG.md, "What a launch costs on the host")
  #pragma unroll 1
  for (int x = LPR; x < 32; x <<= 1) {
    #pragma unroll
    for (int h = 0; h < GQ; ++h) {
      const float m2 = fn_shfl_xor(m[h], x), mn = fmaxf(m[h], m2);
      const float c1 = exp2f(m[h] - mn), c2 = exp2f(m2 - mn);
      l[h] = l[h] * c1 + fn_shfl_xor(l[h], x) * c2;
      #pragma unroll
      for (int e = 0; e < EPL; ++e) acc[h][e] = acc[h][e] * c1 + fn_shfl_xor(acc[h][e], x) * c2;
      m[h] = mn;
    }
  }
  __shared__ float sm[NW][GQ], sl[NW][GQ], sacc[NW][GQ][D];
  if (grp == 0) {
    #pragma unroll
    for (int h = 0; h < GQ; ++h) {
      if (sub == 0) { sm[warp][h] = m[h]; sl[warp][h] = l[h]; }
      #pragma unroll
      for (int e = 0; e < EPL; ++e) sacc[warp][h][sub * EPL + e] = acc[h][e];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < GQ * D; i += blockDim.x) {
    const int h = i / D, dd = i % D;
    float M = -1e30f;
    #pragma unroll 1
    for (int w = 0; w < NW; ++w) M = fmaxf(M, sm[w][h]);
    float L = 0.0f, O = 0.0f;
    #pragma unroll 1
    for (int w = 0; w < NW; ++w) {
      const float c = exp2f(sm[w][h] - M);
      L += sl[w][h] * c;
      O += sacc[w][h][dd] * c;
    }
    const long head = head0 + h;
    if (S == 1) o[head * D + dd] = fn_cast<T>(O / L);
    else {
      const long row = (head * S + split) * (D + 2);  // a split's partial state: O, then M and L
      part[row + dd] = O;
      if (dd == 0) { part[row + D] = M; part[row + D + 1] = L; }
    }
  }
"""

_COMBINE = """
  // one block of NW warps per (batch * query head): merge the S partial states fn_decode_attention
  // wrote (per split D weighted values, the max, the sum). Lanes take splits in turn for the max
  // and the sum, then warps take splits and lanes dims for the values: no load waits on another.
  constexpr int NW = 8, W = D + 2;
  const int S = part_shape[1];
  const long head = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long ps = head * S * W;  // this head's splits
  float M = -1e30f;
  for (int s = lane; s < S; s += 32) M = fmaxf(M, part[ps + s * W + D]);
  M = fn_warp_max(M);
  float L = 0.0f;
  for (int s = lane; s < S; s += 32)
    L += part[ps + s * W + D + 1] * exp2f(part[ps + s * W + D] - M);
  L = fn_warp_sum(L);
  __shared__ float so[NW][D];
  for (int d = lane; d < D; d += 32) {
    float O = 0.0f;
    #pragma unroll 4
    for (int s = warp; s < S; s += NW)
      O += part[ps + s * W + d] * exp2f(part[ps + s * W + D] - M);
    so[warp][d] = O;
  }
  __syncthreads();
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float O = 0.0f;
    for (int w = 0; w < NW; ++w) O += so[w][d];
    o[head * D + d] = fn_cast<T>(O / L);
  }
"""

SPLIT_ABOVE, CHUNK = 1024, 64  # caches longer than SPLIT_ABOVE are split in CHUNKs (_ATTENTION)
# query heads per kv head x head dim its shared memory holds
GROUP_MAX = {"cuda": 1024, "metal": 512}


@lru_cache(maxsize=None)
def _attention_kernels():
    return (kernel("fn_decode_attention", ["q", "k", "v", "start"], ["o", "part"], _ATTENTION),
            kernel("fn_decode_combine", ["part"], ["o"], _COMBINE))


def decode_attention(q, k, v, start, scale):
    """Attention of queries q (B, Hq, L, D) over the filled positions of k, v (B, Hkv, C, D):
    start, an int32 array of one element, is the first query's position (the positions filled
    before these queries), and query i sees positions up to start + i. The decode step passes a
    view of its 16-byte offset (generate.position): a computed one-element array (such as the
    count after the write) would sit in MLX's managed small-array pool (see constant). The CUDA
    kernel takes L = 1 (a decode step), one block per kv head and its query heads; a cache longer
    than SPLIT_ABOVE positions is split over blocks of CHUNK positions and merged by a second
    kernel (flash-decoding), so that a long context keeps the GPU busy."""
    B, Hq, L, D = q.shape
    Hkv, C = k.shape[1], k.shape[2]
    lanes = D * q.dtype.size // 16  # per row: 16-byte loads, a power of two <= 32 lanes
    if (forms.use_gpu("decode_attention") and L == 1 and D * q.dtype.size % 16 == 0
            and lanes & (lanes - 1) == 0 and lanes <= 32 and Hq % Hkv == 0
            and Hq // Hkv * D <= GROUP_MAX[gpu_backend()]
            and q.dtype == k.dtype == v.dtype):
        S = -(-C // CHUNK) if C > SPLIT_ABOVE else 1
        attend, combine = _attention_kernels()
        o, part = attend(
            # 1-D: Metal takes a 0-d input by reference, not as start[0]
            inputs=[q, k, v, position_array(start)],
            # one scale per model: a constant, not an array
            template=[("T", q.dtype), ("D", D), ("GQ", Hq // Hkv), ("SPLIT_ABOVE", SPLIT_ABOVE),
                      ("CHUNK", CHUNK), ("SCALE_BITS", float_bits(scale))],
            grid=(B * Hkv * S * 256, 1, 1), threadgroup=(256, 1, 1),  # NW = 8 warps (_ATTENTION)
            output_shapes=[q.shape, (B * Hq, S, D + 2)], output_dtypes=[q.dtype, mx.float32])
        if S == 1:
            return o
        return combine(inputs=[part], template=[("T", q.dtype), ("D", D)],
                       grid=(B * Hq * 256, 1, 1), threadgroup=(256, 1, 1),  # NW = 8 (_COMBINE)
                       output_shapes=[q.shape], output_dtypes=[q.dtype])[0]
    mask = mx.arange(C)[None] <= (start.reshape(-1)[0] + mx.arange(L))[:, None]
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def check():  # a short cache (one block per head) and a split long one
    q, k, v = rand((2, 6, 1, 64), 4), rand((2, 2, 40, 64), 5), rand((2, 2, 40, 64), 6)
    long_k, long_v = rand((1, 2, SPLIT_ABOVE + 76, 64), 14), rand((1, 2, SPLIT_ABOVE + 76, 64), 15)
    return (decode_attention(q, k, v, mx.array(28), 0.125),
            decode_attention(q[:1], long_k, long_v, mx.array(SPLIT_ABOVE + 49), 0.125))


CHECK = (check, 1e-2)  # a call on small float16 inputs, the largest relative error
