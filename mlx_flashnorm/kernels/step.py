"""decode_layers: every decoder layer of a Llama-family stack for one decode row in one CUDA launch.

A decode step of a small model is bound by launches, not by memory: SmolLM2-135M's 92 MiB of
weights take about 30 us to read on an H100, while the per-sublayer kernels (qkv_rope,
decode_attention, o_proj, gate_up, down_proj) cost about 8 launches a layer at ~13 us of host work
each (bench/RESULTS.md, "Against llama.cpp"). Here one persistent kernel runs all layers: its
blocks (one per SM, all resident) meet at a grid-wide barrier between the phases of a layer, and
FlashNorm makes each norm free inside the matvec after it (Sec. 5): every block recomputes the
residual add and 1/RSSe of the row it reads (a few KB) instead of waiting for another launch.

Per layer, between barriers:
  1. p = x * xs + r (the residual stream), s = 1/RSSe(p); the q/k/v rows of p * g (raw)
  2. RoPE with s (Sec. 3) or QK-norm's own 1/RSSe and gains (Sec. 4) on q and k, v * s, the new
     k and v written into the static cache in place, and attention over the filled positions,
     split over blocks (flash-decoding: partial max, sum and values per split)
  3. the splits merged, o_proj
  4. p2 = o + p, s2 = 1/RSSe(p2), gate/up rows of p2 * g2, SwiGLU with the up scale deferred
  5. down_proj; its deferred scale s2 (over the power of two P) goes to the next layer's add
CUDA only: the per-sublayer kernels stay the form Metal runs (no grid-wide barrier there).
Its plain-MLX reference (_reference) is the fallback and the self-check's yardstick (CHECK)."""
import ctypes
from functools import lru_cache

import mlx.core as mx

from .. import forms
from ..forms import gpu_backend
from .build import HEADERS, constant, float_bits, make_kernel, position_array, rand

THREADS = 256  # 8 warps a block
SMAX = 16  # attention splits per kv head, at most
MAX_LAYERS = 36  # 14 pointers a layer: the kernel's arguments stay within CUDA's 4 KB
MAX_ROWS = 64  # rows of the batched form (rows.py), at most
ARRAYS = ("wqkv", "sqkv", "bqkv", "wo", "so", "bo", "wgu", "sgu", "bgu", "wd", "sd", "bd", "kc", "vc")

_HEADER = """
__device__ inline void fn_grid_sync(unsigned int* bar, unsigned int target) {
  // every block of the grid arrives before any leaves (all blocks are resident: one per SM);
  // the count only grows within a launch, and the last block out resets it (fn_grid_exit)
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(bar, 1u);
    unsigned int seen;
    long long spins = 0;
    while (true) {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(bar) : "memory");
      if (seen >= target) break;
      if (++spins > (1LL << 31)) __trap();  // a block that never came: fail, never hang
    }
    __threadfence();
  }
  __syncthreads();
}
__device__ inline void fn_grid_exit(unsigned int* bar, unsigned int blocks) {
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(bar + 32, 1u) == blocks - 1) { atomicExch(bar, 0u); atomicExch(bar + 32, 0u); }
  }
}
__device__ inline void fn_put(float* xin, int i, float v, int nc, int per) {
  // element i of a matvec's input row into shared memory, chunk-major: lane c reads chunk c's
  // values at consecutive addresses (no bank conflicts); a chunk is 16 bytes of packed weights
  const int wd = i / per;
  xin[((wd & 3) * per + i % per) * nc + (wd >> 2)] = v;
}
__device__ inline void fn_chunk_sums(const float* xin, float* xsum, int nc, int cw) {
  __syncthreads();
  for (int c = threadIdx.x; c < nc; c += blockDim.x) {
    float t = 0.0f;
    for (int k = 0; k < cw; ++k) t += xin[k * nc + c];
    xsum[c] = t;
  }
  __syncthreads();
}
__device__ inline float fn_block_sum(float v, float* red) {
  v = fn_warp_sum(v);
  __syncthreads();
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float t = 0.0f;
  for (int w = 0; w < int(blockDim.x / 32); ++w) t += red[w];
  return t;
}
template <typename T, int BITS>
__device__ inline float fn_qrow(const unsigned int* w, const T* sc, const T* bi, long row, int nc, int gpr,
                                int gs, const float* xin, const float* xsum, int lane) {
  // one row of an affine BITS-bit matrix (nc 16-byte chunks, gpr groups of gs values) times the
  // shared input row: a group adds scale * (q . x) + bias * sum(x); lanes take the chunks in turn
  constexpr int PER = 32 / BITS, MASK = (1 << BITS) - 1;
  const uint4* wr = reinterpret_cast<const uint4*>(w) + row * nc;
  float a = 0.0f;
  for (int c = lane; c < nc; c += 32) {
    const uint4 q = __ldg(wr + c);
    const unsigned int qs[4] = {q.x, q.y, q.z, q.w};
    float d = 0.0f;
    #pragma unroll
    for (int u = 0; u < 4; ++u) {
      #pragma unroll
      for (int j = 0; j < PER; ++j) d += float((qs[u] >> (BITS * j)) & MASK) * xin[(u * PER + j) * nc + c];
    }
    const long g = row * gpr + c * 4 * PER / gs;
    a += fn_f(sc[g]) * d + fn_f(bi[g]) * xsum[c];
  }
  return fn_warp_sum(a);
}
"""

_STEP = """
  // T, BITS, D (head size), GQ (query heads per kv head), NL (layers), SMAX: template constants
  constexpr int NW = 8, PER = 32 / BITS, CW = 4 * PER;  // warps; values per word, per 16-byte chunk
  constexpr int EPL = 16 / sizeof(T), LPR = D / EPL, RPW = 32 / LPR;  // attention: a row's lanes
  const int K = dims[0], GS = dims[1], HQ = dims[2], HKV = dims[3], I = dims[4], C = dims[5], NB = dims[6];
  const int XMAX = dims[7];
  const bool has_g = dims[8] != 0, prescale = dims[9] != 0, qk_norm = dims[10] != 0;
  const float eps = __int_as_float(dims[11]), factor = __int_as_float(dims[12]), qk_eps = __int_as_float(dims[13]);
  const int KO = HQ * D, NQKV = (HQ + 2 * HKV) * D;
  const int NCK = K / CW, NCO = KO / CW, NCI = I / CW;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gwarp = blockIdx.x * NW + warp, TW = NB * NW;
  const int pos = off[0], n = pos + 1;
  int S = (n + 31) / 32;  // attention splits per kv head: about 32 positions or more each
  if (S > SMAX) S = SMAX;
  if (S > NB / HKV) S = NB / HKV;
  if (S < 1) S = 1;
  const int chunk = (n + S - 1) / S;
  unsigned int* bar = const_cast<unsigned int*>(sync);
  unsigned int target = 0;
  float* raw = work;                        // NQKV: the q/k/v rows before RoPE
  float* part = raw + NQKV;                 // HQ * SMAX * (D + 2): per split max, sum, values
  float* obuf = part + HQ * SMAX * (D + 2); // K: o_proj's output
  float* abuf = obuf + K;                   // I: SwiGLU's output
  extern __shared__ float smem[];
  float* pres = smem;        // K: this block's copy of the residual stream (T-rounded)
  float* xin = pres + K;     // XMAX: the running matvec's input row
  float* xsum = xin + XMAX;  // XMAX / CW: its chunk sums
  __shared__ float red[NW];
  __shared__ const void* tab[14 * NL];
  __shared__ float qsh[GQ][D], sm[NW][GQ], sl[NW][GQ], sacc[NW][GQ][D];
  // the layers' arrays: one pointer table per block
  TABLE
  __syncthreads();
  float xs = 1.0f;  // the deferred scale of the layer's input (the previous down_proj's)
  for (int l = 0; l < NL; ++l) {
    const unsigned int* wqkv = (const unsigned int*)tab[14 * l];
    const T* sqkv = (const T*)tab[14 * l + 1]; const T* bqkv = (const T*)tab[14 * l + 2];
    const unsigned int* wo = (const unsigned int*)tab[14 * l + 3];
    const T* so = (const T*)tab[14 * l + 4]; const T* bo = (const T*)tab[14 * l + 5];
    const unsigned int* wgu = (const unsigned int*)tab[14 * l + 6];
    const T* sgu = (const T*)tab[14 * l + 7]; const T* bgu = (const T*)tab[14 * l + 8];
    const unsigned int* wd = (const unsigned int*)tab[14 * l + 9];
    const T* sd = (const T*)tab[14 * l + 10]; const T* bd = (const T*)tab[14 * l + 11];
    T* kc = (T*)tab[14 * l + 12];
    T* vc = (T*)tab[14 * l + 13];
    const float* g1 = gains + long(l) * 2 * K;
    const float* g2 = g1 + K;
    // 1. p = x * xs + r, s = 1/RSSe(p), the q/k/v rows of p * g
    float ss = 0.0f;
    for (int i = threadIdx.x; i < K; i += blockDim.x) {
      const float t = l == 0 ? fn_f(x[i]) : fn_f(__ldcg(y + i)) * xs + pres[i];
      const float tp = fn_f(fn_cast<T>(t));
      pres[i] = tp;
      ss += tp * tp;
      fn_put(xin, i, has_g ? tp * g1[i] : tp, NCK, PER);
    }
    const float s = rsqrtf(fn_block_sum(ss, red) + K * eps);
    const float P = prescale ? __int_as_float(__float_as_int(s) & 0x7f800000) : 1.0f;
    fn_chunk_sums(xin, xsum, NCK, CW);
    for (int row = gwarp; row < NQKV; row += TW) {
      const float a = fn_qrow<T, BITS>(wqkv, sqkv, bqkv, row, NCK, K / GS, GS, xin, xsum, lane);
      if (lane == 0) raw[row] = a;
    }
    fn_grid_sync(bar, target += NB);
    // 2. RoPE, the cache write and attention: block (kv head, split of the positions)
    const int kvh = blockIdx.x / S, split = blockIdx.x % S;
    if (kvh < HKV) {
      const int lo = split * chunk, hi = min(n, lo + chunk);
      const bool mine = lo <= pos && pos < hi;  // this block writes the new k and v
      for (int vi = warp; vi < GQ + 2; vi += NW) {
        const bool is_q = vi < GQ, is_k = vi == GQ;
        if (!is_q && !mine) continue;
        const int head = is_q ? kvh * GQ + vi : (is_k ? HQ + kvh : HQ + HKV + kvh);
        const float* r = raw + head * D;
        const long at = (long(kvh) * C + pos) * D;
        if (!is_q && !is_k) {
          for (int d = lane; d < D; d += 32) vc[at + d] = fn_cast<T>(__ldcg(r + d) * s);
          continue;
        }
        float inv = factor * s;
        if (qk_norm) {
          float hss = 0.0f;
          for (int d = lane; d < D; d += 32) { const float v = __ldcg(r + d) * P; hss += v * v; }
          inv = rsqrtf(fn_warp_sum(hss) + D * qk_eps) * P;
        }
        const float* gq = qkg + (long(l) * 2 + (is_q ? 0 : 1)) * 2 * D;
        const float fpos = float(pos);
        for (int i = lane; i < D / 2; i += 32) {
          const int j = i + D / 2;
          const float ri = __ldcg(r + i), rj = __ldcg(r + j);
          const float sn = sinf(fpos * theta[i]), cs = cosf(fpos * theta[i]);
          const float gi = qk_norm ? gq[i] : 1.0f, gj = qk_norm ? gq[j] : 1.0f;
          const float pi = qk_norm ? gq[D + i] : 1.0f, pj = qk_norm ? gq[D + j] : 1.0f;
          const T yi = fn_cast<T>(inv * (ri * gi * cs - rj * pi * sn)), yj = fn_cast<T>(inv * (rj * gj * cs + ri * pj * sn));
          if (is_q) { qsh[vi][i] = fn_f(yi); qsh[vi][j] = fn_f(yj); }
          else { kc[at + i] = yi; kc[at + j] = yj; }
        }
      }
      __syncthreads();
      // softmax(q k) v over [lo, hi): the scale is in q and k already (Sec. 3); exp2 domain
      const int grp = lane / LPR, sub = lane % LPR;
      float qv[GQ][EPL], acc[GQ][EPL], m[GQ], lz[GQ];
      #pragma unroll
      for (int h = 0; h < GQ; ++h) {
        #pragma unroll
        for (int e = 0; e < EPL; ++e) { qv[h][e] = qsh[h][sub * EPL + e] * 1.4426950408889634f; acc[h][e] = 0.0f; }
        m[h] = -1e30f;
        lz[h] = 0.0f;
      }
      for (int j0 = lo + warp * RPW; j0 < hi; j0 += NW * RPW) {  // the same trip count for a warp
        const int j = j0 + grp;
        const bool ok = j < hi;
        const long row = (long(kvh) * C + (ok ? j : j0)) * D + sub * EPL;
        float kf[EPL], vf[EPL];
        fn_load<T, EPL>(kc + row, kf);
        fn_load<T, EPL>(vc + row, vf);
        #pragma unroll
        for (int h = 0; h < GQ; ++h) {
          float t = 0.0f;
          #pragma unroll
          for (int e = 0; e < EPL; ++e) t += qv[h][e] * kf[e];
          #pragma unroll
          for (int x2 = LPR / 2; x2 > 0; x2 >>= 1) t += fn_shfl_xor(t, x2);
          if (ok) {
            const float mn = fmaxf(m[h], t), corr = exp2f(m[h] - mn), w = exp2f(t - mn);
            lz[h] = lz[h] * corr + w;
            #pragma unroll
            for (int e = 0; e < EPL; ++e) acc[h][e] = acc[h][e] * corr + w * vf[e];
            m[h] = mn;
          }
        }
      }
      #pragma unroll 1
      for (int x2 = LPR; x2 < 32; x2 <<= 1) {  // the row groups of a warp
        #pragma unroll
        for (int h = 0; h < GQ; ++h) {
          const float m2 = fn_shfl_xor(m[h], x2), mn = fmaxf(m[h], m2);
          const float c1 = exp2f(m[h] - mn), c2 = exp2f(m2 - mn);
          lz[h] = lz[h] * c1 + fn_shfl_xor(lz[h], x2) * c2;
          #pragma unroll
          for (int e = 0; e < EPL; ++e) acc[h][e] = acc[h][e] * c1 + fn_shfl_xor(acc[h][e], x2) * c2;
          m[h] = mn;
        }
      }
      if (grp == 0) {
        #pragma unroll
        for (int h = 0; h < GQ; ++h) {
          if (sub == 0) { sm[warp][h] = m[h]; sl[warp][h] = lz[h]; }
          #pragma unroll
          for (int e = 0; e < EPL; ++e) sacc[warp][h][sub * EPL + e] = acc[h][e];
        }
      }
      __syncthreads();
      for (int i = threadIdx.x; i < GQ * (D + 2); i += blockDim.x) {  // the warps merged
        const int h = i / (D + 2), e = i % (D + 2);
        float M = -1e30f;
        for (int w = 0; w < NW; ++w) M = fmaxf(M, sm[w][h]);
        float v = 0.0f;
        for (int w = 0; w < NW; ++w) {
          const float c = exp2f(sm[w][h] - M);
          v += (e == 0 ? 0.0f : (e == 1 ? sl[w][h] : sacc[w][h][e - 2])) * c;
        }
        part[((long(kvh) * GQ + h) * SMAX + split) * (D + 2) + e] = e == 0 ? M : v;
      }
    }
    fn_grid_sync(bar, target += NB);
    // 3. the splits merged (every block, into its input row), o_proj
    for (int e = threadIdx.x; e < KO; e += blockDim.x) {
      const float* ph = part + long(e / D) * SMAX * (D + 2);
      float M = -1e30f;
      for (int t = 0; t < S; ++t) M = fmaxf(M, __ldcg(ph + t * (D + 2)));
      float lzs = 0.0f, o = 0.0f;
      for (int t = 0; t < S; ++t) {
        const float c = exp2f(__ldcg(ph + t * (D + 2)) - M);
        lzs += __ldcg(ph + t * (D + 2) + 1) * c;
        o += __ldcg(ph + t * (D + 2) + 2 + e % D) * c;
      }
      fn_put(xin, e, fn_f(fn_cast<T>(o / lzs)), NCO, PER);
    }
    fn_chunk_sums(xin, xsum, NCO, CW);
    for (int row = gwarp; row < K; row += TW) {
      const float a = fn_qrow<T, BITS>(wo, so, bo, row, NCO, KO / GS, GS, xin, xsum, lane);
      if (lane == 0) obuf[row] = fn_f(fn_cast<T>(a));
    }
    fn_grid_sync(bar, target += NB);
    // 4. p2 = o + p, s2 = 1/RSSe(p2), gate/up rows of p2 * g2, a = silu(gate * s2) * up * P2
    ss = 0.0f;
    for (int i = threadIdx.x; i < K; i += blockDim.x) {
      const float tp = fn_f(fn_cast<T>(__ldcg(obuf + i) + pres[i]));
      pres[i] = tp;
      ss += tp * tp;
      fn_put(xin, i, has_g ? tp * g2[i] : tp, NCK, PER);
    }
    const float s2 = rsqrtf(fn_block_sum(ss, red) + K * eps);
    const float P2 = prescale ? __int_as_float(__float_as_int(s2) & 0x7f800000) : 1.0f;
    fn_chunk_sums(xin, xsum, NCK, CW);
    for (int i = gwarp; i < I; i += TW) {
      const float a0 = fn_qrow<T, BITS>(wgu, sgu, bgu, i, NCK, K / GS, GS, xin, xsum, lane);
      const float a1 = fn_qrow<T, BITS>(wgu, sgu, bgu, I + i, NCK, K / GS, GS, xin, xsum, lane);
      if (lane == 0) {
        const float gt = a0 * s2;
        abuf[i] = fn_f(fn_cast<T>(gt / (1.0f + expf(-gt)) * a1 * P2));
      }
    }
    xs = s2 / P2;
    fn_grid_sync(bar, target += NB);
    // 5. down_proj (its scale xs deferred to the next layer's add)
    for (int e = threadIdx.x; e < I; e += blockDim.x) fn_put(xin, e, __ldcg(abuf + e), NCI, PER);
    fn_chunk_sums(xin, xsum, NCI, CW);
    for (int row = gwarp; row < K; row += TW) {
      const float a = fn_qrow<T, BITS>(wd, sd, bd, row, NCI, I / GS, GS, xin, xsum, lane);
      if (lane == 0) y[row] = fn_cast<T>(a);
    }
    if (l + 1 < NL) fn_grid_sync(bar, target += NB);
  }
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < K; i += blockDim.x) p[i] = fn_cast<T>(pres[i]);
    if (threadIdx.x == 0) ys[0] = xs;
  }
  fn_grid_exit(bar, NB);
"""


def _table(layers):
    """The body's pointer table: thread l of each block copies layer l's arrays into shared memory."""
    return "\n".join(f"  if (threadIdx.x == {l}) {{ " + " ".join(f"tab[{14 * l + k}] = {a}{l};" for k, a in
                                                               enumerate(ARRAYS)) + " }" for l in range(layers))


@lru_cache(maxsize=None)
def step_kernel(layers):
    names = [f"{a}{l}" for l in range(layers) for a in ARRAYS]
    return make_kernel("fn_decode_layers", ["x", "off", "dims", "theta", "gains", "qkg", "sync"] + names,
                       ["y", "p", "ys", "work"], _STEP.replace("TABLE", _table(layers)),
                       HEADERS["cuda"] + _HEADER)


def shared_bytes(K, xmax, bits, D, GQ, L):
    """The dynamic shared memory of a launch: the residual row and the matvec input with its chunk
    sums. Where it and the body's static arrays pass 48 KB, at least 48004 bytes are asked for:
    only then does MLX raise the kernel's limit (cuFuncSetAttribute), without which the launch
    is refused."""
    dynamic = 4 * (K + xmax + xmax // (4 * 32 // bits))
    static = 4 * 8 + 8 * 14 * L + 4 * GQ * D * (1 + 8) + 4 * 2 * 8 * GQ  # red, tab, qsh + sacc, sm + sl
    return max(dynamic, 48004) if dynamic + static > 48 * 1024 else dynamic


@lru_cache(maxsize=None)
def sm_count():
    """The GPU's multiprocessors (the grid: one resident block each), from the CUDA driver MLX
    loaded; 16 where it cannot be asked."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        value = ctypes.c_int()
        if lib.cuDeviceGetAttribute(ctypes.byref(value), 16, 0) == 0 and value.value > 0:
            return value.value
    except (OSError, AttributeError):
        pass
    return 16


@lru_cache(maxsize=None)
def sync_state():
    """The grid barrier's counters (64 uint32, in device memory): zero between launches."""
    a = mx.zeros((64,), mx.uint32)
    mx.eval(a)
    return a


def use_decode_layers(name="decode_layers"):
    """Whether the whole-step kernel (name: "decode_layers", one row, or "decode_rows", a batch)
    may run here (CUDA, our kernels on, its self-check passed)."""
    return forms.use_gpu(name) and gpu_backend() == "cuda"


def supported(x, layers, caches, n_heads, n_kv_heads, group_size, bits, name="decode_layers"):
    """Whether the kernel `name` takes this stack: CUDA with our kernels on, x one row ((1, 1, K);
    decode_rows: (B, 1, K), B <= MAX_ROWS), 4 or 8 bits, every layer's matrices alike, sizes in
    whole 16-byte chunks and groups, head size 64 or 128, at most 8 query heads per kv head."""
    B = x.shape[0]
    if not (use_decode_layers(name) and x.ndim == 3 and x.shape[1] == 1 and (B == 1 if name == "decode_layers" else
                                                                             B <= MAX_ROWS)
            and x.dtype in (mx.float16, mx.bfloat16, mx.float32) and bits in (4, 8) and 0 < len(layers) <= MAX_LAYERS):
        return False
    K, D = x.shape[-1], caches[0][0].shape[-1]
    I = layers[0][2][0].shape[0] // 2
    cw = 4 * 32 // bits
    if (D not in (64, 128) or n_heads % n_kv_heads or n_heads // n_kv_heads > 8 or group_size % cw
            or any(v % group_size or v % cw for v in (K, n_heads * D, I))):
        return False
    shapes = [(K * bits // 32, n_heads * D + 2 * n_kv_heads * D), (n_heads * D * bits // 32, K),
              (K * bits // 32, 2 * I), (I * bits // 32, K)]
    for mats, (k, v) in zip(layers, caches):
        for (w, s, b), (width, rows) in zip(mats, shapes):
            if w.dtype != mx.uint32 or w.shape != (rows, width) or s.dtype != x.dtype or b.dtype != x.dtype:
                return False
        if k.dtype != x.dtype or v.dtype != x.dtype or k.shape != v.shape or k.shape[:2] != (B, n_kv_heads):
            return False
    return True


def decode_layers(x, offset, layers, caches, gains, qk_gains, theta, eps, factor, qk_eps, n_heads, n_kv_heads,
                  group_size, bits):
    """Every layer of a Llama-family stack for one decode row x (the embedding, (1, 1, K)):
    (y, ys, p, caches) where y * ys is the last down_proj's output (its scale deferred), p the
    residual stream, and caches the (k, v) buffers with this position written.

    layers: per layer the (weight, scales, biases) of qkv_proj, o_proj, gate_up_proj (gate rows
    over up rows) and down_proj; caches: per layer (k, v), (1, kv heads, capacity, D); offset: the
    position (an int or the decode step's array); gains: (L, 2, K) float32, the two pre-norms'
    gains kept on the input, or None (folded); qk_gains: (L, 2, 2, D) float32, QK-norm's gains
    and their RoPE-permuted copy for q and k (Sec. 4), or None (Sec. 3: factor * s on q and k)."""
    if not supported(x, layers, caches, n_heads, n_kv_heads, group_size, bits):
        return _reference(x, offset, layers, caches, gains, qk_gains, theta, eps, factor, qk_eps, n_heads,
                          n_kv_heads, group_size, bits)
    K, L, D = x.shape[-1], len(layers), theta.shape[0] * 2
    I = layers[0][2][0].shape[0] // 2
    C = caches[0][0].shape[2]
    blocks = sm_count()
    xmax = max(K, n_heads * D, I)
    none = constant(mx.float32, 0.0)
    flags = (K, group_size, n_heads, n_kv_heads, I, C, blocks, xmax, gains is not None, x.dtype != mx.float32,
             qk_gains is not None, float_bits(eps), float_bits(factor), float_bits(qk_eps))
    arrays = [a for mats, kv in zip(layers, caches) for a in (*[t for m in mats for t in m], *kv)]
    work = (n_heads + 2 * n_kv_heads) * D + n_heads * SMAX * (D + 2) + K + I
    y, p, ys, _ = step_kernel(L)(
        inputs=[x, position_array(offset), constant(mx.int32, *flags), theta,
                none if gains is None else gains, none if qk_gains is None else qk_gains, sync_state()] + arrays,
        template=[("T", x.dtype), ("BITS", bits), ("D", D), ("GQ", n_heads // n_kv_heads), ("NL", L),
                  ("SMAX", SMAX)],
        grid=(blocks * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[x.shape, x.shape, x.shape[:-1] + (1,), (work,)],
        output_dtypes=[x.dtype, x.dtype, mx.float32, mx.float32],
        shared_memory=shared_bytes(K, xmax, bits, D, n_heads // n_kv_heads, L))
    # the caches were written in place: hand them out as depending on the launch, so that reading
    # them runs it first
    flat = mx.depends([a for kv in caches for a in kv], [y])
    return y, ys, p, list(zip(flat[0::2], flat[1::2]))


def _qmm(x, w, s, b, group_size, bits):
    f32 = mx.float32
    return mx.quantized_matmul(x[None], w, s.astype(f32), b.astype(f32), transpose=True, group_size=group_size,
                               bits=bits)[0]


def _reference(x, offset, layers, caches, gains, qk_gains, theta, eps, factor, qk_eps, n_heads, n_kv_heads,
               group_size, bits):
    """decode_layers in plain MLX (float32 arithmetic, rounded to x's dtype where the kernel rounds),
    over the whole cache with a mask, so that an array position (a compiled step) works: the
    fallback and the self-check's yardstick."""
    f32, T = mx.float32, x.dtype
    K, D = x.shape[-1], theta.shape[0] * 2
    HQ, HKV, GQ = n_heads, n_kv_heads, n_heads // n_kv_heads
    pos = offset if isinstance(offset, int) else position_array(offset)[:1].reshape(())
    pow2 = (lambda v: mx.power(2.0, mx.floor(mx.log2(v)))) if T != f32 else (lambda v: mx.array(1.0))
    rnd = lambda v: v.astype(T).astype(f32)
    cs, sn = mx.cos(pos * theta), mx.sin(pos * theta)
    h, xs, p, out = x.reshape(K).astype(f32), None, None, []
    for l, ((qkv, o, gu, down), (kc, vc)) in enumerate(zip(layers, caches)):
        p = rnd(h if xs is None else h * xs + p)
        s = mx.rsqrt((p * p).sum() + K * eps)
        P = pow2(s)
        raw = _qmm(p * gains[l, 0] if gains is not None else p, *qkv, group_size, bits).reshape(-1, D)
        q, k, v = raw[:HQ], raw[HQ:HQ + HKV], raw[HQ + HKV:]
        if qk_gains is None:
            inv_q = inv_k = factor * s
            gq = gk = mx.ones((2, D))
        else:
            inv = lambda r: mx.rsqrt(((r * P) ** 2).sum(-1, keepdims=True) + D * qk_eps) * P
            inv_q, inv_k = inv(q), inv(k)
            gq, gk = qk_gains[l, 0], qk_gains[l, 1]

        def rope(r, inv, g):
            a, b = r[:, :D // 2], r[:, D // 2:]
            ya = inv * (a * g[0, :D // 2] * cs - b * g[1, :D // 2] * sn)
            yb = inv * (b * g[0, D // 2:] * cs + a * g[1, D // 2:] * sn)
            return rnd(mx.concatenate([ya, yb], axis=-1))

        q, k, v = rope(q, inv_q, gq), rope(k, inv_k, gk), rnd(v * s)
        at = (mx.arange(kc.shape[2]) == pos)[None, None, :, None]  # the new position's row
        kc, vc = mx.where(at, k.astype(T)[None, :, None], kc), mx.where(at, v.astype(T)[None, :, None], vc)
        out.append((kc, vc))
        scores = q.reshape(HKV, GQ, D) @ kc[0].astype(f32).transpose(0, 2, 1)  # (HKV, GQ, capacity)
        scores = mx.where(mx.arange(kc.shape[2]) <= pos, scores, -mx.inf)
        att = rnd((mx.softmax(scores, axis=-1) @ vc[0].astype(f32)).reshape(-1))
        p = rnd(rnd(_qmm(att, *o, group_size, bits)) + p)
        s2 = mx.rsqrt((p * p).sum() + K * eps)
        P2 = pow2(s2)
        g = _qmm(p * gains[l, 1] if gains is not None else p, *gu, group_size, bits)
        gate, up = mx.split(g, 2)
        a = rnd(gate * s2 * mx.sigmoid(gate * s2) * up * P2)
        h = rnd(_qmm(a, *down, group_size, bits))
        xs = s2 / P2
    return h.astype(T).reshape(x.shape), xs.reshape(x.shape[:-1] + (1,)), p.astype(T).reshape(x.shape), out


def _random_stack(L, K, HQ, HKV, D, I, C, pos, seed):
    """A random quantized stack (4-bit, groups of 64) with caches filled up to pos."""
    def quantized(rows, cols, s):
        return mx.quantize(rand((rows, cols), s, scale=0.05), 64, 4)

    layers = [(quantized((HQ + 2 * HKV) * D, K, seed + 10 * l), quantized(K, HQ * D, seed + 10 * l + 1),
               quantized(2 * I, K, seed + 10 * l + 2), quantized(K, I, seed + 10 * l + 3)) for l in range(L)]
    mask = (mx.arange(C) < pos)[None, None, :, None]
    caches = [tuple(mx.where(mask, rand((1, HKV, C, D), seed + 10 * l + 4 + j), 0) for j in range(2))
              for l in range(L)]
    return layers, caches


def check_decode_layers():
    """Two layers, 41 positions (two splits a kv head), Sec. 3 with gains and Sec. 4 (QK-norm)."""
    L, K, HQ, HKV, D, I, C, pos = 2, 256, 4, 2, 64, 384, 64, 40
    layers, caches = _random_stack(L, K, HQ, HKV, D, I, C, pos, 40)
    theta = mx.exp(-mx.arange(D // 2, dtype=mx.float32) * 0.3)
    x = rand((1, 1, K), 41)
    gains = 16 * (1 + 0.3 * rand((L, 2, K), 42, mx.float32))
    qk = 1 + 0.3 * rand((L, 2, 2, D), 43, mx.float32)
    out = []
    for qk_gains, qk_eps in ((None, 0.0), (qk, 1e-6)):
        y, ys, p, kv = decode_layers(x, pos, layers, [tuple(mx.array(a) for a in c) for c in caches], gains,
                                     qk_gains, theta, 1e-5, D**-0.25, qk_eps, HQ, HKV, 64, 4)
        out += [y, ys, p] + [a[..., pos, :] for c in kv for a in c]
    return out


CHECK = (check_decode_layers, 2e-2)
