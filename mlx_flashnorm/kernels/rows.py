"""decode_rows: kernels.decode_layers for a batch, B rows each at its own position (the batched
server's step, batch_cache.RowsKVCache), in one persistent CUDA launch.

The one-row kernel's phases (step.py) with every matvec applied to G rows at once: a warp loads a
16-byte chunk of weights once and multiplies it into the G rows' inputs, so the weights are read
once per group of rows, and the launch count stays one per step whatever the batch. Rows go in
groups of G (G in 1, 2, 4, 8: as many as the shared memory holds); the residual stream lives in
device memory (two buffers, one read and one written per phase), each row's 1/RSSe and deferred
scale in shared memory. Attention is split over (row, kv head, split of positions), each row into
the splits the one-row kernel makes at its position; the splits are merged once, over the grid, in
a phase of their own (the one-row kernel merges in every block: one row's worth). Every block reads
every row's inputs, so the reads of what the launch wrote are batched (16-byte loads, several in
flight per thread): read one by one, their latency grew with the batch (2026-11-26, H200: 9.6 ms a
step at 32 rows, 18.4 at 64, slower than the layer loop there). For the same reason the chunk sums
of a group's input rows are one pass between one pair of barriers, not a pair per row (two
barriers and a chain of shared loads per row, four times a layer: about 2 ms a step at 32 rows by
that count); this last change and the eight loads in flight were made after the device time ran
out (2026-11-26) and have not run on a GPU: the self-check guards them. Every row is computed as the one-row kernel
computes it (the same roundings), so a batched greedy token is the one-request token. Its
plain-MLX reference runs step._reference row by row.

On CUDA it runs only after its self-check (CHECK) passed; the GPU tests in tests/test_step_kernel.py
check it against the reference and against one-request decoding (bench/RESULTS.md, "GPU tests")."""
from functools import lru_cache

import mlx.core as mx

from .build import HEADERS, make_kernel, rand
from . import step
from .step_source import ARRAYS, ATTEND, HEADER, LAYER, table

BMAX = step.MAX_ROWS
SHARED_MAX = 160 * 1024  # dynamic shared bytes a launch may ask for (227 KB per block on Hopper)

_HEADER = """
template <typename T, typename A, int G>
__device__ inline void fn_row_norms(const A* a, const float* as, const float* r, float* rout, const float* gain,
                                    long at0, int rows, int K, int nc, int per, float* xin, int xstride,
                                    float (*red)[G], float* srow, float* prow, float keps, bool prescale) {
  // for `rows` rows (of G) from element at0: p = a * as + r (as, one per row, and r optional)
  // rounded to T, into rout (block 0) and, times gain (optional), into the shared input rows; then
  // each row's 1/RSSe and its power of two P (half precision) into srow and prow
  float ss[G];
  #pragma unroll
  for (int g = 0; g < G; ++g) ss[g] = 0.0f;
  for (int i = threadIdx.x; i < K; i += blockDim.x) {
    float av[G], rv[G];  // the rows' loads issued together, then used
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      if (g < rows) {
        av[g] = fn_f(__ldcg(a + at0 + long(g) * K + i));
        rv[g] = r ? __ldcg(r + at0 + long(g) * K + i) : 0.0f;
      }
    }
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      if (g < rows) {
        const long at = at0 + long(g) * K + i;
        float t = av[g];
        if (as) t *= as[g];
        if (r) t += rv[g];
        const float tp = fn_f(fn_cast<T>(t));
        if (blockIdx.x == 0) rout[at] = tp;
        ss[g] += tp * tp;
        fn_put(xin + g * xstride, i, gain ? tp * gain[i] : tp, nc, per);
      }
    }
  }
  #pragma unroll
  for (int g = 0; g < G; ++g) ss[g] = fn_warp_sum(ss[g]);
  __syncthreads();
  if (threadIdx.x % 32 == 0) {
    #pragma unroll
    for (int g = 0; g < G; ++g) red[threadIdx.x / 32][g] = ss[g];
  }
  __syncthreads();
  if (threadIdx.x < rows) {
    float t = 0.0f;
    for (int w = 0; w < int(blockDim.x / 32); ++w) t += red[w][threadIdx.x];
    const float s = rsqrtf(t + keps);
    srow[threadIdx.x] = s;
    prow[threadIdx.x] = prescale ? __int_as_float(__float_as_int(s) & 0x7f800000) : 1.0f;
  }
}
__device__ inline void fn_rows_in(const float* src, int n, int rows, float* xin, int xstride, int nc, int per) {
  // `rows` rows of n floats (n a multiple of 4, src 16-byte aligned), written in this launch, into
  // the shared input rows: 16-byte loads, eight in flight per thread before their stores
  const float4* s4 = reinterpret_cast<const float4*>(src);
  const int total = rows * n / 4;
  for (int e0 = threadIdx.x; e0 < total; e0 += 8 * blockDim.x) {
    float4 v[8];
    #pragma unroll
    for (int u = 0; u < 8; ++u) if (e0 + u * int(blockDim.x) < total) v[u] = __ldcg(s4 + e0 + u * blockDim.x);
    #pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int e = e0 + u * blockDim.x;
      if (e < total) {
        float* x = xin + (4 * e / n) * xstride;
        const int k = 4 * e % n;
        fn_put(x, k, v[u].x, nc, per);
        fn_put(x, k + 1, v[u].y, nc, per);
        fn_put(x, k + 2, v[u].z, nc, per);
        fn_put(x, k + 3, v[u].w, nc, per);
      }
    }
  }
}
__device__ inline void fn_rows_chunk_sums(const float* xin, int xstride, float* xsum, int sstride, int rows, int nc,
                                          int cw) {
  // fn_chunk_sums for `rows` input rows at once: one pass over (row, chunk), each chunk's values
  // summed in the same order, between one pair of barriers (not one pair per row)
  __syncthreads();
  for (int e = threadIdx.x; e < rows * nc; e += blockDim.x) {
    const int g = e / nc, c = e % nc;
    float t = 0.0f;
    for (int k = 0; k < cw; ++k) t += xin[g * xstride + k * nc + c];
    xsum[g * sstride + c] = t;
  }
  __syncthreads();
}
template <typename T, int BITS, int G>
__device__ inline void fn_qrows(const unsigned int* w, const T* sc, const T* bi, long row, int nc, int gpr, int gs,
                                const float* xin, const float* xsum, int xstride, int sstride, int rows, int lane,
                                float* out) {
  // one row of an affine BITS-bit matrix times the G shared input rows (rows of them in use): the
  // weights of a chunk are loaded once for all of them
  constexpr int PER = 32 / BITS, MASK = (1 << BITS) - 1;
  const uint4* wr = reinterpret_cast<const uint4*>(w) + row * nc;
  float a[G];
  #pragma unroll
  for (int g = 0; g < G; ++g) a[g] = 0.0f;
  for (int c = lane; c < nc; c += 32) {
    const uint4 q = __ldg(wr + c);
    const unsigned int qs[4] = {q.x, q.y, q.z, q.w};
    const long grp = row * gpr + c * 4 * PER / gs;
    const float scale = fn_f(sc[grp]), bias = fn_f(bi[grp]);
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      if (g < rows) {
        const float* xg = xin + g * xstride;
        float d = 0.0f;
        #pragma unroll
        for (int u = 0; u < 4; ++u) {
          #pragma unroll
          for (int j = 0; j < PER; ++j) d += float((qs[u] >> (BITS * j)) & MASK) * xg[(u * PER + j) * nc + c];
        }
        a[g] += scale * d + bias * xsum[g * sstride + c];
      }
    }
  }
  #pragma unroll
  for (int g = 0; g < G; ++g) out[g] = fn_warp_sum(a[g]);
}
"""

_ROWS_BODY = """
  // T, BITS, D, GQ, NL, SMAX, G (rows per matvec group): template constants
  constexpr int NW = 8, PER = 32 / BITS, CW = 4 * PER, BMAX = 64;
  constexpr int EPL = 16 / sizeof(T), LPR = D / EPL, RPW = 32 / LPR;
  const int K = dims[0], GS = dims[1], HQ = dims[2], HKV = dims[3], I = dims[4], C = dims[5], NB = dims[6];
  const int XMAX = dims[7];
  const bool has_g = dims[8] != 0, prescale = dims[9] != 0, qk_norm = dims[10] != 0;
  const float eps = __int_as_float(dims[11]), factor = __int_as_float(dims[12]), qk_eps = __int_as_float(dims[13]);
  const int B = dims[14];
  const int KO = HQ * D, NQKV = (HQ + 2 * HKV) * D;
  const int NCK = K / CW, NCO = KO / CW, NCI = I / CW;
  const int XS = XMAX, SS = XMAX / CW;  // strides of a row's input and chunk sums in shared memory
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gwarp = blockIdx.x * NW + warp, TW = NB * NW;
  unsigned int* bar = const_cast<unsigned int*>(sync);
  unsigned int target = 0;
  float* raw = work;                                // B * NQKV
  float* part = raw + long(B) * NQKV;               // B * HQ * SMAX * (D + 2)
  float* obuf = part + long(B) * HQ * SMAX * (D + 2);  // B * K
  float* abuf = obuf + long(B) * K;                 // B * I
  float* res0 = abuf + long(B) * I;                 // B * K: the stream after a layer (read by phase 1)
  float* res1 = res0 + long(B) * K;                 // B * K: the stream after phase 1 (read by phase 4)
  float* mbuf = res1 + long(B) * K;                 // B * KO: attention's output, the splits merged
  extern __shared__ float smem[];
  float* xin = smem;                // G * XMAX: the running matvec's input rows
  float* xsum = xin + G * XMAX;     // G * XMAX / CW: their chunk sums
  __shared__ float red[NW][G];
  __shared__ float srow[BMAX], prow[BMAX], xsrow[BMAX];  // per row: 1/RSSe, its power of two, the deferred scale
  __shared__ const void* tab[14 * NL];
  __shared__ float qsh[GQ][D], sm[NW][GQ], sl[NW][GQ], sacc[NW][GQ][D];
  __shared__ int first[BMAX + 1];  // phase 2's items: row b's are first[b] .. first[b + 1] - 1
  TABLE
  for (int b = threadIdx.x; b < B; b += blockDim.x) xsrow[b] = 1.0f;
  if (threadIdx.x == 0) {  // a row's attention splits: the one-row kernel's rule (the same roundings)
    int t = 0;
    for (int b = 0; b < B; ++b) {
      first[b] = t;
      t += HKV * max(1, min(min((off[b] + 32) / 32, SMAX), NB / HKV));
    }
    first[B] = t;
  }
  __syncthreads();
  for (int l = 0; l < NL; ++l) {
LAYER
    // 1. per row: p = x * xs + r, s = 1/RSSe(p); the q/k/v rows of p * g, G rows at a time
    for (int b0 = 0; b0 < B; b0 += G) {
      const int rows = min(G, B - b0);
      fn_row_norms<T, T, G>(l == 0 ? x : y, l == 0 ? nullptr : xsrow + b0, l == 0 ? nullptr : res0, res1,
                            has_g ? g1 : nullptr, long(b0) * K, rows, K, NCK, PER, xin, XS, red, srow + b0,
                            prow + b0, K * eps, prescale);
      fn_rows_chunk_sums(xin, XS, xsum, SS, rows, NCK, CW);
      for (int row = gwarp; row < NQKV; row += TW) {
        float a[G];
        fn_qrows<T, BITS, G>(wqkv, sqkv, bqkv, row, NCK, K / GS, GS, xin, xsum, XS, SS, rows, lane, a);
        if (lane == 0) {
          #pragma unroll
          for (int g = 0; g < G; ++g) if (g < rows) raw[long(b0 + g) * NQKV + row] = a[g];
        }
      }
      __syncthreads();
    }
    fn_grid_sync(bar, target += NB);
    // 2. per (row, kv head, split): RoPE, the cache write, attention over the row's positions
    for (int item = blockIdx.x; item < first[B]; item += NB) {
      int b = 0;
      while (first[b + 1] <= item) ++b;
      const int S = (first[b + 1] - first[b]) / HKV, kvh = (item - first[b]) / S, split = (item - first[b]) % S;
      const int pos = off[b], n = pos + 1, chunk = (n + S - 1) / S;
      const int lo = split * chunk, hi = min(n, lo + chunk);
      const bool mine = lo <= pos && pos < hi;
      const float s = srow[b], P = prow[b];
      const float* rbase = raw + long(b) * NQKV;
      const long cbase = long(b * HKV + kvh) * C, head0 = long(b) * HQ + kvh * GQ;
ATTEND      __syncthreads();  // qsh and the warps' partials are rewritten by the block's next item
    }
    fn_grid_sync(bar, target += NB);
    // 3. each row's splits merged, once (spread over the grid), into mbuf
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < B * KO; e += NB * blockDim.x) {
      const int b = e / KO, k = e % KO, S = (first[b + 1] - first[b]) / HKV;
      mbuf[e] = fn_f(fn_cast<T>(fn_merged(part + (long(b) * HQ + k / D) * SMAX * (D + 2), S, D, k % D)));
    }
    fn_grid_sync(bar, target += NB);
    // 4. per row: o_proj
    for (int b0 = 0; b0 < B; b0 += G) {
      const int rows = min(G, B - b0);
      fn_rows_in(mbuf + long(b0) * KO, KO, rows, xin, XS, NCO, PER);
      fn_rows_chunk_sums(xin, XS, xsum, SS, rows, NCO, CW);
      for (int row = gwarp; row < K; row += TW) {
        float a[G];
        fn_qrows<T, BITS, G>(wo, so, bo, row, NCO, KO / GS, GS, xin, xsum, XS, SS, rows, lane, a);
        if (lane == 0) {
          #pragma unroll
          for (int g = 0; g < G; ++g) if (g < rows) obuf[long(b0 + g) * K + row] = fn_f(fn_cast<T>(a[g]));
        }
      }
      __syncthreads();
    }
    fn_grid_sync(bar, target += NB);
    // 5. per row: p2 = o + p, s2 = 1/RSSe(p2), gate/up rows of p2 * g2, a = silu(gate * s2) * up * P2
    for (int b0 = 0; b0 < B; b0 += G) {
      const int rows = min(G, B - b0);
      fn_row_norms<T, float, G>(obuf, nullptr, res1, res0, has_g ? g2 : nullptr, long(b0) * K, rows, K, NCK, PER,
                                xin, XS, red, srow + b0, prow + b0, K * eps, prescale);
      fn_rows_chunk_sums(xin, XS, xsum, SS, rows, NCK, CW);
      for (int i = gwarp; i < I; i += TW) {
        float a0[G], a1[G];
        fn_qrows<T, BITS, G>(wgu, sgu, bgu, i, NCK, K / GS, GS, xin, xsum, XS, SS, rows, lane, a0);
        fn_qrows<T, BITS, G>(wgu, sgu, bgu, I + i, NCK, K / GS, GS, xin, xsum, XS, SS, rows, lane, a1);
        if (lane == 0) {
          #pragma unroll
          for (int g = 0; g < G; ++g) {
            if (g >= rows) continue;
            const float gt = a0[g] * srow[b0 + g];
            abuf[long(b0 + g) * I + i] = fn_f(fn_cast<T>(gt / (1.0f + expf(-gt)) * a1[g] * prow[b0 + g]));
          }
        }
      }
      __syncthreads();
    }
    for (int b = threadIdx.x; b < B; b += blockDim.x) xsrow[b] = srow[b] / prow[b];
    fn_grid_sync(bar, target += NB);
    // 6. per row: down_proj (its scale xsrow deferred to the next layer's add)
    for (int b0 = 0; b0 < B; b0 += G) {
      const int rows = min(G, B - b0);
      fn_rows_in(abuf + long(b0) * I, I, rows, xin, XS, NCI, PER);
      fn_rows_chunk_sums(xin, XS, xsum, SS, rows, NCI, CW);
      for (int row = gwarp; row < K; row += TW) {
        float a[G];
        fn_qrows<T, BITS, G>(wd, sd, bd, row, NCI, I / GS, GS, xin, xsum, XS, SS, rows, lane, a);
        if (lane == 0) {
          #pragma unroll
          for (int g = 0; g < G; ++g) if (g < rows) y[long(b0 + g) * K + row] = fn_cast<T>(a[g]);
        }
      }
      __syncthreads();
    }
    if (l + 1 < NL) fn_grid_sync(bar, target += NB);
  }
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < B * K; i += blockDim.x) p[i] = fn_cast<T>(__ldcg(res0 + i));
    for (int b = threadIdx.x; b < B; b += blockDim.x) ys[b] = xsrow[b];
  }
  fn_grid_exit(bar, NB);
"""
_ROWS = _ROWS_BODY.replace("ATTEND", ATTEND).replace("LAYER\n", LAYER)


def rows_per_group(B, xmax, bits):
    """G: the rows one matvec pass takes, 1, 2, 4 or 8, as many as the batch has and the shared
    memory holds (SHARED_MAX)."""
    g = 1
    while g < 8 and g < B and 4 * 2 * g * (xmax + xmax // (4 * 32 // bits)) <= SHARED_MAX:
        g *= 2
    return g


def shared_bytes(G, xmax, bits, D, GQ, L):
    """Dynamic shared memory of a launch (G input rows and their chunk sums), at least 48004 bytes
    where it and the static arrays pass 48 KB (step.shared_bytes says why)."""
    dynamic = 4 * G * (xmax + xmax // (4 * 32 // bits))
    static = 4 * 8 * G + 3 * 4 * BMAX + 4 * (BMAX + 1) + 8 * 14 * L + 4 * GQ * D * (1 + 8) + 4 * 2 * 8 * GQ
    return max(dynamic, 48004) if dynamic + static > 48 * 1024 else dynamic


@lru_cache(maxsize=None)
def rows_kernel(layers):
    names = [f"{a}{l}" for l in range(layers) for a in ARRAYS]
    return make_kernel("fn_decode_rows", ["x", "off", "dims", "theta", "gains", "qkg", "sync"] + names,
                       ["y", "p", "ys", "work"], _ROWS.replace("TABLE", table(layers)),
                       HEADERS["cuda"] + HEADER + _HEADER)


def decode_rows(x, positions, layers, caches, gains, qk_gains, theta, eps, factor, qk_eps, n_heads, n_kv_heads,
                group_size, bits):
    """step.decode_layers for B rows (x: (B, 1, K), positions: (B,) int32, caches (B, kv heads,
    capacity, D) per layer): one launch where step.supported says it runs, else the reference."""
    if not step.supported(x, layers, caches, n_heads, n_kv_heads, group_size, bits, name="decode_rows"):
        return reference(x, positions, layers, caches, gains, qk_gains, theta, eps, factor, qk_eps, n_heads,
                         n_kv_heads, group_size, bits)
    B, L = x.shape[0], len(layers)
    K, D, I, xmax = step.sizes(x, layers, theta, n_heads)
    G = rows_per_group(B, xmax, bits)
    return step.launch(rows_kernel(L), x, positions.astype(mx.int32), layers, caches, gains, qk_gains, theta, eps,
                       factor, qk_eps, n_heads, n_kv_heads, group_size, bits,
                       work=B * ((n_heads + 2 * n_kv_heads) * D + n_heads * step.SMAX * (D + 2) + 3 * K + I
                                 + n_heads * D),
                       shared_memory=shared_bytes(G, xmax, bits, D, n_heads // n_kv_heads, L), rows=(B,),
                       template=[("G", G)])


def reference(x, positions, layers, caches, *args):
    """decode_rows in plain MLX: step._reference row by row (its caches' row b at positions[b])."""
    outs = [step._reference(x[b:b + 1], positions[b], layers, [(k[b:b + 1], v[b:b + 1]) for k, v in caches], *args)
            for b in range(x.shape[0])]
    y, ys, p = (mx.concatenate([o[i] for o in outs]) for i in range(3))
    kv = [tuple(mx.concatenate([o[3][l][j] for o in outs]) for j in range(2)) for l in range(len(layers))]
    return y, ys, p, kv


def check_decode_rows():
    """Three rows at positions 40, 5 and 17 of the one-row check's stack, Sec. 3 and Sec. 4."""
    L, K, HQ, HKV, D, I, C = 2, 256, 4, 2, 64, 384, 64
    layers, caches = step._random_stack(L, K, HQ, HKV, D, I, C, 41, 40)
    caches = [tuple(mx.concatenate([a, a[:, :, ::-1], a]) for a in c) for c in caches]  # 3 rows
    positions = mx.array([40, 5, 17], mx.int32)
    theta, gains, qk = step.check_tables(L, K, D)
    x = rand((3, 1, K), 44)
    out = []
    for qk_gains, qk_eps in ((None, 0.0), (qk, 1e-6)):
        y, ys, p, kv = decode_rows(x, positions, layers, [tuple(mx.array(a) + 0 for a in c) for c in caches],
                                gains, qk_gains, theta, 1e-5, D**-0.25, qk_eps, HQ, HKV, 64, 4)
        out += [y, ys, p] + [mx.take_along_axis(a, positions.reshape(3, 1, 1, 1), axis=2) for c in kv for a in c]
    return out


CHECK = (check_decode_rows, 2e-2)
