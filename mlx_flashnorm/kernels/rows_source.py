"""decode_rows' device functions (rows.py's body runs them): a pass's input rows loaded into shared memory and their
norms, and the matvec tiles on the tensor cores (fn_tile: 16 rows of a packed matrix times 8, 16 or 32 input rows)."""

HEADER = r"""
template <typename A>
__device__ inline void fn_rows_in(const A* src, int n, int stride, int rows, float* xin, int xs, A* copy = nullptr) {
  // n values (16-byte aligned) of `rows` rows `stride` apart, written in this launch, into the shared input rows
  // (and copy where given): 16-byte loads, R in flight per thread before their values are used; a load's row and
  // chunk found by steps from the first's (a division each cost more than the load)
  constexpr int N = 16 / sizeof(A), R = 4;
  const int per = n / N, total = rows * per, qs = blockDim.x / per, rs = blockDim.x % per;
  for (int e0 = threadIdx.x; e0 < total; e0 += R * blockDim.x) {
    uint4 v[R];
    int q[R], r[R];  // element e0 + u * blockDim.x: row q[u], its chunk r[u]
    q[0] = e0 / per;
    r[0] = e0 - q[0] * per;
    #pragma unroll
    for (int u = 1; u < R; ++u) {
      q[u] = q[u - 1] + qs;
      r[u] = r[u - 1] + rs;
      if (r[u] >= per) { r[u] -= per; ++q[u]; }
    }
    #pragma unroll
    for (int u = 0; u < R; ++u) {
      if (e0 + u * blockDim.x < total)
        v[u] = __ldcg(reinterpret_cast<const uint4*>(src + long(q[u]) * stride + N * r[u]));
    }
    #pragma unroll
    for (int u = 0; u < R; ++u) {
      if (e0 + u * blockDim.x < total) {
        if (copy) *reinterpret_cast<uint4*>(copy + long(q[u]) * stride + N * r[u]) = v[u];
        float f[N];
        fn_unpack<A, N>(v[u], f);
        float4* o = reinterpret_cast<float4*>(xin + q[u] * xs + N * r[u]);  // 16-byte aligned: xs, N in 4s
        #pragma unroll
        for (int k = 0; k < N / 4; ++k) o[k] = make_float4(f[4 * k], f[4 * k + 1], f[4 * k + 2], f[4 * k + 3]);
      }
    }
  }
}
template <typename A, int G>
__device__ inline void fn_row_norms(const A* a, A* rout, const float* gain, long at0, int rows, int K, float* xin,
                                    int xs, float (*red)[G], float* srow, float* prow, float keps, bool prescale) {
  // for `rows` rows (of G) of p (a, from element at0): p into rout (optional: one block writes it) and, times
  // gain (optional), into the shared input rows (row g at xin + g * xs); then each row's 1/RSSe and its power
  // of two P (half precision) into srow and prow. The rows are loaded by fn_rows_in; the squares are then summed
  // in the one-row kernel's order (value i by thread i % 256, its 8 warps' sums in order): its norm alone.
  // passes of 8 rows: the gains of a thread's first GP values loaded before the rows, under their latency (a 16-row
  // step's qkv phase 8.9 -> 4.9 us; at 16 rows a pass it cost more than it saved: bench/RESULTS.md, "The batched step")
  constexpr int GP = G <= 8 ? 4 : 0;
  float gp[GP > 0 ? GP : 1];
  #pragma unroll
  for (int u = 0; u < GP; ++u)
    gp[u] = gain && threadIdx.x < 256 && threadIdx.x + 256 * u < K ? __ldg(gain + threadIdx.x + 256 * u) : 1.0f;
  fn_rows_in(a + at0, K, K, rows, xin, xs, rout ? rout + at0 : nullptr);
  __syncthreads();
  float ss[G];
  #pragma unroll
  for (int g = 0; g < G; ++g) ss[g] = 0.0f;
  auto add = [&](int i, float gv) {
    float p[G];  // loaded before any store (which the compiler would otherwise keep between them)
    #pragma unroll
    for (int g = 0; g < G; ++g) p[g] = g < rows ? xin[g * xs + i] : 0.0f;
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      ss[g] += p[g] * p[g];
      if (gain && g < rows) xin[g * xs + i] = p[g] * gv;
    }
  };
  #pragma unroll
  for (int u = 0; u < GP; ++u)
    if (threadIdx.x < 256 && threadIdx.x + 256 * u < K) add(threadIdx.x + 256 * u, gp[u]);
  for (int i = threadIdx.x + 256 * GP; i < K && threadIdx.x < 256; i += 256) add(i, gain ? __ldg(gain + i) : 1.0f);
  #pragma unroll
  for (int g = 0; g < G; ++g) ss[g] = fn_warp_sum(ss[g]);
  if (threadIdx.x % 32 == 0 && threadIdx.x < 256) {
    #pragma unroll
    for (int g = 0; g < G; ++g) red[threadIdx.x / 32][g] = ss[g];
  }
  __syncthreads();
  if (threadIdx.x < rows) {
    float t = 0.0f;
    for (int w = 0; w < 8; ++w) t += red[w][threadIdx.x];
    const float s = rsqrtf(t + keps);
    srow[threadIdx.x] = s;
    prow[threadIdx.x] = prescale ? __int_as_float(__float_as_int(s) & 0x7f800000) : 1.0f;
  }
}
template <int BITS>
__device__ inline unsigned int fn_q_tf32(const unsigned int* q, int e) {
  // packed value e (0..7) of a thread's words, as a tf32 operand (an exact float: 0 .. 2^BITS - 1)
  const unsigned int v = BITS == 4 ? (q[0] >> (4 * e)) & 15u : (q[e / 4] >> (8 * (e % 4))) & 255u;
  return __float_as_uint(__uint_as_float(0x4b000000u | v) - 8388608.0f);
}
__device__ inline void fn_mma_tf32(float* c, const unsigned int* a, unsigned int b0, unsigned int b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <typename T, int BITS>
struct fn_span {  // a lane's weights (rows gid and gid + 8), scales and biases of one span of a tile
  unsigned int q0[BITS / 4], q1[BITS / 4];
  T s0, s1, c0, c1;
};
template <typename T, int BITS>
__device__ inline fn_span<T, BITS> fn_span_at(const unsigned int* w, const T* sc, const T* bi, long row0, int nrow,
                                              int sp, int gpr, float rspg) {
  // span sp of the tile at row0 (fn_tile's rows and lanes; rspg: 32 / the group size), loaded ahead of its use
  constexpr int WORDS = BITS / 4;
  const int lane = threadIdx.x % 32, gid = lane / 4, tig = lane % 4;
  const long r0 = row0 + gid, r1 = r0 + 8;
  const int g = int((sp + 0.5f) * rspg);  // span sp's quantization group
  fn_span<T, BITS> f;
  #pragma unroll
  for (int u = 0; u < WORDS; ++u) {
    f.q0[u] = __ldg(w + (r0 * nrow + sp) * BITS + WORDS * tig + u);
    f.q1[u] = __ldg(w + (r1 * nrow + sp) * BITS + WORDS * tig + u);
  }
  f.s0 = __ldg(sc + r0 * gpr + g); f.s1 = __ldg(sc + r1 * gpr + g);
  f.c0 = __ldg(bi + r0 * gpr + g); f.c1 = __ldg(bi + r1 * gpr + g);
  return f;
}
__device__ inline int fn_tile_warp(int rot) {
  // the warp whose spans this warp takes in fn_tile (and whose first fn_tile_first loads): its own turned by rot
  return (threadIdx.x / 32 + rot) % (blockDim.x / 32);
}
template <typename T, int BITS>
__device__ inline fn_span<T, BITS> fn_tile_first(const unsigned int* w, const T* sc, const T* bi, long row0, int nrow,
                                                 int sp0, int nsp, int gpr, int gs, int rot = 0) {
  // the first span fn_tile's warp takes (rot as there), loaded before the tile's inputs are ready
  const int warp = fn_tile_warp(rot);
  fn_span<T, BITS> f = {};
  if (warp < nsp) f = fn_span_at<T, BITS>(w, sc, bi, row0, nrow, sp0 + warp, gpr, 32.0f / gs);
  return f;
}
template <typename T, int BITS, int NT>
__device__ inline void fn_tile(const unsigned int* w, const T* sc, const T* bi, long row0, int nrow, int sp0, int nsp,
                               int gpr, int gs, const float* xin, int xs, float (*acc)[4],
                               const fn_span<T, BITS>& first, int rot = 0) {
  // rows row0 .. row0 + 15 of an affine BITS-bit matrix (nrow spans of 32 values a row), spans sp0 .. sp0 + nsp - 1,
  // times the NT * 8 shared input rows, on the tensor cores (mma m16n8k8, tf32): a warp's spans (v, v + NW, ...,
  // v = fn_tile_warp(rot); its first, `first`, loaded by the caller: fn_tile_first) added into acc, to be added
  // over the warps (fn_tile_put/get). Lane (gid, tig) holds weight rows gid and gid + 8 and input row gid of each
  // group of 8; it loads a span's values 8 tig .. 8 tig + 7 (a word of 4-bit values, two of 8-bit), and k-step ks
  // takes values 8 tig + 2 ks (the mma's column tig) and 8 tig + 2 ks + 1 (column tig + 4). An input is split into
  // two tf32 parts (hi + lo); the packed values are exact. A span lies in one quantization group:
  // sum(w x) = scale (q . x) + bias sum(x), sum(x) from its lanes' values by shuffles.
  const int warp = fn_tile_warp(rot), lane = threadIdx.x % 32, gid = lane / 4, tig = lane % 4;
  const int step = blockDim.x / 32;  // spans a warp steps by
  const float rspg = 32.0f / gs;  // 1 / the spans in a group
  fn_span<T, BITS> nx = first;  // the next span, loaded a span ahead (the first by the caller)
  for (int j = warp; j < nsp; j += step) {
    const fn_span<T, BITS> cur = nx;
    const float s0 = fn_f(cur.s0), s1 = fn_f(cur.s1), c0 = fn_f(cur.c0), c1 = fn_f(cur.c1);
    if (j + step < nsp) nx = fn_span_at<T, BITS>(w, sc, bi, row0, nrow, sp0 + j + step, gpr, rspg);
    float xv[NT][8], ch[NT][4], cl[NT][4], xs_sum[NT][2];
    #pragma unroll
    for (int t = 0; t < NT; ++t) {
      const float4* xr = reinterpret_cast<const float4*>(xin + (t * 8 + gid) * xs + j * 32 + 8 * tig);
      const float4 xa = xr[0], xb = xr[1];
      xv[t][0] = xa.x; xv[t][1] = xa.y; xv[t][2] = xa.z; xv[t][3] = xa.w;
      xv[t][4] = xb.x; xv[t][5] = xb.y; xv[t][6] = xb.z; xv[t][7] = xb.w;
      float sum = ((xa.x + xa.y) + (xa.z + xa.w)) + ((xb.x + xb.y) + (xb.z + xb.w));
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);  // the span's sum of input row 8 t + gid
      xs_sum[t][0] = __shfl_sync(0xffffffffu, sum, 8 * tig);  // of input rows 8 t + 2 tig and 8 t + 2 tig + 1
      xs_sum[t][1] = __shfl_sync(0xffffffffu, sum, 8 * tig + 4);
      #pragma unroll
      for (int i = 0; i < 4; ++i) { ch[t][i] = 0.0f; cl[t][i] = 0.0f; }
    }
    #pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const unsigned int a[4] = {fn_q_tf32<BITS>(cur.q0, 2 * ks), fn_q_tf32<BITS>(cur.q1, 2 * ks),
                                 fn_q_tf32<BITS>(cur.q0, 2 * ks + 1), fn_q_tf32<BITS>(cur.q1, 2 * ks + 1)};
      #pragma unroll
      for (int t = 0; t < NT; ++t) {
        const unsigned int h0 = __float_as_uint(xv[t][2 * ks]) & 0xffffe000u;
        const unsigned int h1 = __float_as_uint(xv[t][2 * ks + 1]) & 0xffffe000u;
        const unsigned int l0 = __float_as_uint(xv[t][2 * ks] - __uint_as_float(h0)) & 0xffffe000u;
        const unsigned int l1 = __float_as_uint(xv[t][2 * ks + 1] - __uint_as_float(h1)) & 0xffffe000u;
        fn_mma_tf32(ch[t], a, h0, h1);
        fn_mma_tf32(cl[t], a, l0, l1);
      }
    }
    #pragma unroll
    for (int t = 0; t < NT; ++t) {
      #pragma unroll
      for (int i = 0; i < 4; ++i)  // element i: weight row gid + 8 (i / 2), input row 8 t + 2 tig + i % 2
        acc[t][i] += (i < 2 ? s0 : s1) * (ch[t][i] + cl[t][i]) + (i < 2 ? c0 : c1) * xs_sum[t][i & 1];
    }
  }
}
template <int NT>
__device__ inline void fn_tile_put(float (*acc)[4], float* rb) {
  // a warp's partial sums of a tile into rb (NW warps x NT x 4 x 32 floats)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  #pragma unroll
  for (int t = 0; t < NT; ++t) {
    #pragma unroll
    for (int i = 0; i < 4; ++i) rb[((warp * NT + t) * 4 + i) * 32 + lane] = acc[t][i];
  }
}
template <int NT>
__device__ inline float fn_tile_get(const float* rb, int f, int n) {
  // the tile's output f (its row row0 + f) for input row n: the warps' partial sums, in order
  const int t = n / 8, m = n % 8, lane = (f % 8) * 4 + m / 2, i = (f / 8) * 2 + m % 2;
  float v = 0.0f;
  for (int w = 0; w < int(blockDim.x / 32); ++w) v += rb[((w * NT + t) * 4 + i) * 32 + lane];
  return v;
}
template <int NT, typename Store>
__device__ inline void fn_tile_store(float (*acc)[4], float* rb, int rows, Store store) {
  // a tile's outputs, the warps' partial sums added: store(f, n, v) for its row f (0..15) and input row n
  // (0 .. rows - 1), between barriers (rb and any tile put before it are read once all warps wrote them)
  fn_tile_put<NT>(acc, rb);
  __syncthreads();
  for (int o = threadIdx.x; o < 16 * rows; o += blockDim.x) store(o % 16, o / 16, fn_tile_get<NT>(rb, o % 16, o / 16));
  __syncthreads();
}
"""
