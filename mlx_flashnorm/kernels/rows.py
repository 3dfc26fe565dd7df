"""decode_rows: kernels.decode_layers for a batch, B rows each at its own position (the batched server's step,
batch_cache.RowsKVCache), in one persistent CUDA launch of NW warps a block (WARPS).

The one-row kernel's phases (step.py) with every matvec on the tensor cores: a block takes a tile of 16 weight
rows, its warps split the input into spans of 32 values (mma m16n8k8 in tf32, G input rows at once), and their
partial sums are added in a fixed order. A packed 4- or 8-bit value is exact in tf32 and each input is split into
two tf32 parts, so a product keeps 21 bits or more; the sum's order is the mma's, not the one-row kernel's (the
batched step's tokens are the one-request tokens where no two logits are within float32 rounding: the GPU tests
check it). A row's output does not depend on the other rows (each mma column is its own row), so a request
decodes alike at any batch size. Rows go in passes (launch_plan); a matvec phase's items, (pass, tile), are spread
over the grid, item i of pass i % passes, so a block's next item (i + grid) keeps its input rows. The rows between
phases live in device memory as T (the one-row kernel rounds them there); o_proj's and down_proj's stores add their
outputs to the residual stream (down_proj's times its deferred scale) once; each row's 1/RSSe and deferred scale
are written by the block of its pass's first tile. A phase waits for its rows' loads: 16 bytes a load, several in
flight, and under them a tile's first span (weights, scales, biases: a load from device memory each phase waited
for after its rows) and, in passes of 8 rows, the norms' gains; gate/up's two tiles give their spans to the warps
from opposite ends, so that each warp takes about as many (rows_source.py). Attention is split over (row, kv head,
split of positions), capped so that the batch's items about fill the grid once; a row's splits are merged in a
phase of their own, which a batch of one split a row skips (its blocks write their outputs). Its plain-MLX
reference runs step._reference row by row.

On CUDA (sm_80 on) it runs only after its self-check (CHECK) passed; the GPU tests in tests/test_step_kernel.py
check it against the reference and against one-request decoding (bench/RESULTS.md, "GPU tests")."""
from functools import lru_cache

import mlx.core as mx

from .build import HEADERS, make_kernel, rand
from . import step
from .rows_source import HEADER as _HEADER
from .step_source import ATTEND, HEADER, LAYER, input_names, table

BMAX = step.MAX_ROWS
GMAX = 16  # rows per pass, at most: 32 was slower (H100, 2026-11-26: 3.88 ms a 32-row step against 3.45)
WARPS = 12  # NW, a block's warps (at most 168 registers a thread): a 32-row step 4-8% faster than with 8, 16 slower
SHARED_MAX = 160 * 1024  # dynamic shared bytes a launch asks for at most (and within step.shared_limit)

_ROWS_BODY = """
  // T, BITS, D, GQ, NL, SMAX, G and GD (rows per matvec pass, 8 or 16 (rows.GMAX): of the phases with
  // inputs of K or HQ * D values, and of down_proj's I), GU (gate/up's: G, or 16 where G is 8), IC
  // (down_proj's input values held at once, a multiple of 32), NW (warps; rows.WARPS): template constants
  constexpr int BMAX = 64, NT = G / 8, NTD = GD / 8, NTU = GU / 8;
  constexpr int EPL = 16 / sizeof(T), LPR = D / EPL, RPW = 32 / LPR;
  const int K = dims[0], GS = dims[1], HQ = dims[2], HKV = dims[3], I = dims[4], C = dims[5], NB = dims[6];
  const bool has_g = dims[8] != 0, prescale = dims[9] != 0, qk_norm = dims[10] != 0;
  const float eps = __int_as_float(dims[11]), factor = __int_as_float(dims[12]), qk_eps = __int_as_float(dims[13]);
  const int B = dims[14];
  const int KO = HQ * D, NQKV = (HQ + 2 * HKV) * D;
  // strides of an input row in shared memory (down_proj's: XSD, its input in chunks of IC values)
  const int XS = max(K, KO) + 4, XSD = min(IC, I) + 4;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  unsigned int* bar = const_cast<unsigned int*>(sync);
  unsigned int target = 0;
  float* raw = work;                                // B * NQKV
  float* part = raw + long(B) * NQKV;               // B * HQ * SMAX * (D + 2)
  float* s1g = part + long(B) * HQ * SMAX * (D + 2);  // B each: per row 1/RSSe and its power of two
  float* p1g = s1g + B;                             // (phase 1, for attention), down_proj's deferred
  float* xsg = p1g + B;                             // scale (phase 5, for the next layer's add)
  // the rows between phases, in T (rounded where the one-row kernel rounds them), 16-byte aligned:
  T* res0 = reinterpret_cast<T*>(work + ((long(B) * (NQKV + HQ * SMAX * (D + 2)) + 3 * B + 3) & ~3L));
  // res0, B * K: the stream after attention (p2, phase 4's); res1, B * K: before it (p, phase 6's or x)
  T* res1 = res0 + long(B) * K;
  T* mbuf = res1 + long(B) * K;  // B * KO: attention's output, the splits merged
  T* abuf = mbuf + long(B) * KO;  // B * I: down_proj's input
  extern __shared__ float smem[];
  float* xin = smem;                               // GU * XS or GD * XSD: the running matvec's input rows
  float* rb = xin + max(GU * XS, GD * XSD);       // 2 * NW * NTU * 128: the warps' partial sums of a tile (two tiles)
  float* rb2 = rb + NW * NTU * 128;
  __shared__ float red[8][G], redu[8][GU];
  __shared__ float srow[BMAX], prow[BMAX];  // per row of the block's passes: 1/RSSe and its power of two
  __shared__ const void* tab[14 * NL];
  __shared__ float qsh[GQ][D], sm[NW][GQ], sl[NW][GQ], sacc[NW][GQ][D];
  __shared__ int first[BMAX + 1];  // phase 2's items: row b's are first[b] .. first[b + 1] - 1
  TABLE
  if (threadIdx.x == 0) {  // a row's attention splits: the one-row kernel's rule, capped so that
    int t = 0;             // the batch's items about fill the grid once
    const int cap = max(1, NB / (B * HKV));
    for (int b = 0; b < B; ++b) {
      first[b] = t;
      t += HKV * max(1, min(min((off[b] + 32) / 32, SMAX), cap));
    }
    first[B] = t;
  }
  __syncthreads();
  // A matvec phase's items, (pass of G rows, tile of 16 weight rows), spread over the grid: a block
  // loads a pass's input rows (and their norms) when its item is of another pass than the last one
  const int NP = (B + G - 1) / G, NPD = (B + GD - 1) / GD, NPU = (B + GU - 1) / GU;
  for (int l = 0; l < NL; ++l) {
LAYER
    // 1. per row: p (x in the first layer, then res1), s = 1/RSSe(p); the q/k/v rows of p * g
    for (int item = blockIdx.x, have = -1; item < NP * (NQKV / 16); item += NB) {
      const int b0 = item % NP * G, tile = item / NP, rows = min(G, B - b0);
      const auto f1 = fn_tile_first<T, BITS>(wqkv, sqkv, bqkv, tile * 16, K / 32, 0, K / 32, K / GS, GS);
      if (b0 != have) {
        fn_row_norms<T, G>(l == 0 ? x : res1, l == 0 && tile == 0 ? res1 : nullptr, has_g ? g1 : nullptr, long(b0) * K,
                           rows, K, xin, XS, red, srow + b0, prow + b0, K * eps, prescale);
        if (tile == 0 && threadIdx.x < rows) {  // for attention, in every block
          s1g[b0 + threadIdx.x] = srow[b0 + threadIdx.x];
          p1g[b0 + threadIdx.x] = prow[b0 + threadIdx.x];
        }
        have = b0;
      }
      float acc[NT][4] = {};
      fn_tile<T, BITS, NT>(wqkv, sqkv, bqkv, tile * 16, K / 32, 0, K / 32, K / GS, GS, xin, XS, acc, f1);
      fn_tile_store<NT>(acc, rb, rows, [&](int f, int n, float v) { raw[long(b0 + n) * NQKV + tile * 16 + f] = v; });
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
      const float s = __ldcg(s1g + b), P = __ldcg(p1g + b);
      const float* rbase = raw + long(b) * NQKV;
      const long cbase = long(b * HKV + kvh) * C, head0 = long(b) * HQ + kvh * GQ;
ATTEND      for (int i = threadIdx.x; i < GQ * D && S == 1; i += blockDim.x) {  // the row's one split: its output
        const int h = i / D;  // into mbuf here, as phase 3 would: v / sum, added over the warps as just above
        float M = -1e30f, v = 0.0f, lz = 0.0f;
        for (int w = 0; w < NW; ++w) M = fmaxf(M, sm[w][h]);
        for (int w = 0; w < NW; ++w) {
          const float c = exp2f(sm[w][h] - M);
          v += sacc[w][h][i % D] * c;
          lz += sl[w][h] * c;
        }
        mbuf[(head0 + h) * D + i % D] = fn_cast<T>(v / lz);
      }
      __syncthreads();  // qsh and the warps' partials are rewritten by the block's next item
    }
    fn_grid_sync(bar, target += NB);
    // 3. the splits of each row that has several merged, once (spread over the grid), into mbuf; none if no row has
    const bool merge = first[B] > B * HKV;
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; merge && e < B * KO; e += NB * blockDim.x) {
      const int b = e / KO, k = e % KO, S = (first[b + 1] - first[b]) / HKV;
      if (S > 1) mbuf[e] = fn_cast<T>(fn_merged(part + (long(b) * HQ + k / D) * SMAX * (D + 2), S, D, k % D));
    }
    if (merge) fn_grid_sync(bar, target += NB);
    // 4. per row: o_proj, and p2 = o + p into res0
    for (int item = blockIdx.x, have = -1; item < NP * (K / 16); item += NB) {
      const int b0 = item % NP * G, tile = item / NP, rows = min(G, B - b0);
      const auto f1 = fn_tile_first<T, BITS>(wo, so, bo, tile * 16, KO / 32, 0, KO / 32, KO / GS, GS);
      if (b0 != have) {
        fn_rows_in(mbuf + long(b0) * KO, KO, KO, rows, xin, XS);
        __syncthreads();
        have = b0;
      }
      float acc[NT][4] = {};
      fn_tile<T, BITS, NT>(wo, so, bo, tile * 16, KO / 32, 0, KO / 32, KO / GS, GS, xin, XS, acc, f1);
      fn_tile_store<NT>(acc, rb, rows, [&](int f, int n, float v) {
        const long at = long(b0 + n) * K + tile * 16 + f;
        res0[at] = fn_cast<T>(fn_f(fn_cast<T>(v)) + fn_f(__ldcg(res1 + at)));
      });
    }
    fn_grid_sync(bar, target += NB);
    // 5. per row: s2 = 1/RSSe(p2), gate/up rows of p2 * g2, a = silu(gate * s2) * up * P2
    for (int item = blockIdx.x, have = -1; item < NPU * (I / 16); item += NB) {
      const int b0 = item % NPU * GU, tile = item / NPU, rows = min(GU, B - b0);
      // up's spans go to the warps in turn from warp NW / 2: each warp takes about as many of both tiles' spans
      const auto f1 = fn_tile_first<T, BITS>(wgu, sgu, bgu, tile * 16, K / 32, 0, K / 32, K / GS, GS);
      const auto f2 = fn_tile_first<T, BITS>(wgu, sgu, bgu, I + tile * 16, K / 32, 0, K / 32, K / GS, GS, NW / 2);
      if (b0 != have) {
        fn_row_norms<T, GU>(res0, nullptr, has_g ? g2 : nullptr, long(b0) * K, rows, K, xin, XS, redu, srow + b0,
                            prow + b0, K * eps, prescale);
        if (tile == 0 && threadIdx.x < rows)  // down_proj's deferred scale, for the next layer
          xsg[b0 + threadIdx.x] = srow[b0 + threadIdx.x] / prow[b0 + threadIdx.x];
        have = b0;
      }
      {
        float acc[NTU][4] = {};
        fn_tile<T, BITS, NTU>(wgu, sgu, bgu, tile * 16, K / 32, 0, K / 32, K / GS, GS, xin, XS, acc, f1);
        fn_tile_put<NTU>(acc, rb2);  // gate, read with up's outputs
      }
      float acc[NTU][4] = {};
      fn_tile<T, BITS, NTU>(wgu, sgu, bgu, I + tile * 16, K / 32, 0, K / 32, K / GS, GS, xin, XS, acc, f2, NW / 2);
      fn_tile_store<NTU>(acc, rb, rows, [&](int f, int n, float up) {
        const float gt = fn_tile_get<NTU>(rb2, f, n) * srow[b0 + n];
        abuf[long(b0 + n) * I + tile * 16 + f] = fn_cast<T>(gt / (1.0f + expf(-gt)) * up * prow[b0 + n]);
      });
    }
    fn_grid_sync(bar, target += NB);
    // 6. per row: down_proj, its scale xsg deferred to the next layer's add p = y * xs + p2 (into res1; the
    // last layer's y is the output); its input in chunks of IC values where all I do not fit (loaded anew each)
    for (int item = blockIdx.x, have = -1; item < NPD * (K / 16); item += NB) {
      const int b0 = item % NPD * GD, tile = item / NPD, rows = min(GD, B - b0);
      float acc[NTD][4] = {};
      for (int c0 = 0; c0 < I; c0 += IC) {
        const int n = min(IC, I - c0);
        const auto f1 = fn_tile_first<T, BITS>(wd, sd, bd, tile * 16, I / 32, c0 / 32, n / 32, I / GS, GS);
        if (IC < I || b0 != have) {
          fn_rows_in(abuf + long(b0) * I + c0, n, I, rows, xin, XSD);
          __syncthreads();
          have = b0;
        }
        fn_tile<T, BITS, NTD>(wd, sd, bd, tile * 16, I / 32, c0 / 32, n / 32, I / GS, GS, xin, XSD, acc, f1);
        if (IC < I) __syncthreads();  // the chunk read before the next is loaded
      }
      fn_tile_store<NTD>(acc, rb, rows, [&](int f, int n, float v) {
        const long at = long(b0 + n) * K + tile * 16 + f;
        if (l + 1 == NL) y[at] = fn_cast<T>(v);
        else res1[at] = fn_cast<T>(fn_f(fn_cast<T>(v)) * __ldcg(xsg + b0 + n) + fn_f(__ldcg(res0 + at)));
      });
    }
    if (l + 1 < NL) fn_grid_sync(bar, target += NB);
  }
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < B * K; i += blockDim.x) p[i] = __ldcg(res0 + i);
    for (int b = threadIdx.x; b < B; b += blockDim.x) ys[b] = __ldcg(xsg + b);
  }
  fn_grid_exit(bar, NB);
"""
_ROWS = _ROWS_BODY.replace("ATTEND", ATTEND).replace("LAYER\n", LAYER)


def rows_per_pass(B, xa, xi, limit=SHARED_MAX):
    """(G, GD, IC): the rows one matvec pass takes, 8 or 16 (GMAX; the tensor cores' groups of 8): 16 beyond 16
    rows where the dynamic shared memory (limit) holds it, else 8 (at 16 rows two passes of 8 fill more of the grid
    than one of 16: 1.7 against 2.0 ms a step, H100): G for the inputs of xa values (K or HQ * D), GD (at most G)
    for down_proj's xi (I), IC values at a time (all, or the fewest chunks of multiples of 32 that fit); or None."""
    if dynamic_bytes(8, 8, xa, 32) > limit:
        return None
    G = 8
    while G < GMAX and 2 * G < B and dynamic_bytes(2 * G, 8, xa, 32) <= limit:
        G *= 2
    GD = G
    while GD > 8 and dynamic_bytes(G, GD, xa, xi) > limit:
        GD //= 2
    chunks, IC = 1, xi
    while dynamic_bytes(G, GD, xa, IC) > limit:
        chunks += 1
        IC = 32 * -(-xi // (32 * chunks))
    return G, GD, IC


def gate_up_rows(B, G, GD, xa, IC, limit=SHARED_MAX):
    """GU, gate/up's rows per pass: 16 where G is 8, the batch has more and the shared memory holds them, else G
    (passes of 32 made a 64-row step slower: bench/RESULTS.md, "The batched step")."""
    return 16 if G == 8 and B > 8 and dynamic_bytes(16, GD, xa, IC) <= limit else G


def dynamic_bytes(G, GD, xa, xi):
    """Dynamic shared memory: G input rows of xa values (or GD of xi), padded by 4; two tiles' partial sums."""
    return 4 * (max(G * (xa + 4), GD * (xi + 4)) + 2 * WARPS * (G // 8) * 128)


def shared_bytes(G, GD, GU, xa, xi, D, GQ, L):
    """dynamic_bytes (GU rows: G or more), at least 48004 where it and static_bytes pass 48 KB (step.shared_bytes)."""
    dynamic = dynamic_bytes(GU, GD, xa, xi)
    return max(dynamic, 48004) if dynamic + static_bytes(G, GU, D, GQ, L) > 48 * 1024 else dynamic


def static_bytes(G, GU, D, GQ, L):
    """The body's static shared arrays."""
    return 4 * 8 * (G + GU) + 2 * 4 * BMAX + 4 * (BMAX + 1) + 8 * 14 * L + 4 * GQ * (D * (1 + WARPS) + 2 * WARPS)


@lru_cache(maxsize=None)
def rows_kernel(layers):
    return make_kernel("fn_decode_rows", input_names(layers), ["y", "p", "ys", "work"],
                       _ROWS.replace("TABLE", table(layers)), HEADERS["cuda"] + HEADER + _HEADER)


def decode_rows(x, positions, layers, caches, gains, qk_gains, theta, eps, factor, qk_eps, n_heads, n_kv_heads,
                group_size, bits):
    """step.decode_layers for B rows (x: (B, 1, K), positions: (B,) int32, caches (B, kv heads, capacity, D)
    per layer): one launch where step.supported says it runs and its plan fits the GPU, else the reference."""
    K, D, I, _ = step.sizes(x, layers, theta, n_heads)
    plan = (step.supported(x, layers, caches, n_heads, n_kv_heads, group_size, bits, name="decode_rows")
            and launch_plan(x.shape[0], K, I, D, n_heads, n_kv_heads, len(layers)))
    if not plan:
        return reference(x, positions, layers, caches, gains, qk_gains, theta, eps, factor, qk_eps, n_heads,
                         n_kv_heads, group_size, bits)
    template, work, shared = plan
    return step.launch(rows_kernel(len(layers)), x, positions.astype(mx.int32), layers, caches, gains, qk_gains, theta,
                       eps, factor, qk_eps, n_heads, n_kv_heads, group_size, bits, work=work, shared_memory=shared,
                       rows=(x.shape[0],), template=template)


def launch_plan(B, K, I, D, n_heads, n_kv_heads, L):
    """(template, work, shared) of a launch for B rows: its rows per pass (G, GD, IC: rows_per_pass; GU:
    gate_up_rows) within the shared memory the GPU gives a block (step.shared_limit), its work buffer's
    floats and its shared memory bytes; None where it cannot fit."""
    xa, GQ = max(K, n_heads * D), n_heads // n_kv_heads
    limit = min(SHARED_MAX, step.shared_limit() - static_bytes(GMAX, GMAX, D, GQ, L))
    if (plan := rows_per_pass(B, xa, I, limit)) is None:
        return None
    G, GD, IC = plan
    GU = gate_up_rows(B, G, GD, xa, IC, limit)
    shared = shared_bytes(G, GD, GU, xa, IC, D, GQ, L)
    if shared + static_bytes(G, GU, D, GQ, L) > step.shared_limit():
        return None
    floats = B * ((n_heads + 2 * n_kv_heads) * D + n_heads * step.SMAX * (D + 2) + 3)
    work = -(-floats // 4) * 4 + B * (2 * K + n_heads * D + I)  # the T rows after the floats, as if of 4 bytes
    return [("G", G), ("GD", GD), ("GU", GU), ("IC", IC), ("NW", WARPS)], work, shared


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
