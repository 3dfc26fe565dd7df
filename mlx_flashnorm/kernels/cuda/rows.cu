// decode_rows (kernels/rows.py, which describes its design): decode_layers for a batch of rows,
// each at its own position, in one persistent launch of NW warps a block, its matvecs on the
// tensor cores. Two pieces (build.pieces; step.compose composes them):
//   device  its own device functions, after whole_step.cuh's in its header: a pass's input rows
//           loaded into shared memory with their norms, and the matvec tiles on the tensor cores
//           (fn_tile: 16 rows of a packed or full-precision matrix times 8, 16 or 32 input rows)
//   body    the kernel's body (build.cuda_source wraps it in the function of the inputs); its
//           marker lines are filled by step.compose: SIZES (the sizes and flags in `dims`,
//           rows.SIZES), TABLE (the pointer table, step.table) and whole_step.cuh's LAYER and
//           ATTEND pieces
// @piece device
template <typename A>
__device__ inline void fn_rows_in(const A* src, int n, int stride, int rows, float* xin, int xs,
                                  A* copy = nullptr) {
  // n values (16-byte aligned) of `rows` rows `stride` apart, written in this launch, into the
  // shared input rows (and copy where given): 16-byte loads, R in flight per thread before their
  // values are used; a load's row and chunk found by steps from the first's (a division each cost
  // more than the load)
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
        // 16-byte aligned: xs, N in 4s
        float4* o = reinterpret_cast<float4*>(xin + q[u] * xs + N * r[u]);
        #pragma unroll
        for (int k = 0; k < N / 4; ++k)
          o[k] = make_float4(f[4 * k], f[4 * k + 1], f[4 * k + 2], f[4 * k + 3]);
      }
    }
  }
}
template <typename A, int G>
__device__ inline void fn_post_rows(const A* v, const float* xsg, const A* res, A* rout,
                                    const float* gain, int b0, int rows, int K, float* xin, int xs,
                                    float (*red)[G], float eps, bool unrounded) {
  // post (Gemma 3): for `rows` rows (of G) from row b0, p = the post-norm of v (down_proj's
  // output times each row's deferred scale xsg, or o_proj's: xsg null; each value rounded to A as
  // the model rounds it) with gains `gain`, plus the residual res: into the shared input rows
  // (rounded to A, or unrounded: the rms mode's norm reads the sum as Gemma's norms do) and,
  // rounded, into rout (optional: one block writes it). fn_row_norms then takes xin as it is.
  fn_rows_in(v + long(b0) * K, K, K, rows, xin, xs);
  __syncthreads();
  float ss[G];
  #pragma unroll
  for (int g = 0; g < G; ++g) ss[g] = 0.0f;
  for (int i = threadIdx.x; i < K && threadIdx.x < 256; i += 256) {
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      if (g < rows) {
        const float u = fn_f(fn_cast<A>(xin[g * xs + i] * (xsg ? __ldcg(xsg + b0 + g) : 1.0f)));
        xin[g * xs + i] = u;
        ss[g] += u * u;
      }
    }
  }
  #pragma unroll
  for (int g = 0; g < G; ++g) ss[g] = fn_warp_sum(ss[g]);
  if (threadIdx.x % 32 == 0 && threadIdx.x < 256) {
    #pragma unroll
    for (int g = 0; g < G; ++g) red[threadIdx.x / 32][g] = ss[g];
  }
  __syncthreads();
  float r = 0.0f;
  if (threadIdx.x < rows) {
    for (int w = 0; w < 8; ++w) r += red[w][threadIdx.x];
    r = rsqrtf(r / K + eps);
  }
  __syncthreads();
  if (threadIdx.x < rows) red[0][threadIdx.x] = r;  // each row's 1/RMS
  __syncthreads();
  for (int i = threadIdx.x; i < K; i += blockDim.x) {
    const float w = __ldg(gain + i);
    for (int g = 0; g < rows; ++g) {
      const long at = long(b0 + g) * K + i;
      const float t = fn_norm_as<A>(xin[g * xs + i], red[0][g], w, true) + fn_f(__ldcg(res + at));
      const A tp = fn_cast<A>(t);
      if (rout) rout[at] = tp;
      xin[g * xs + i] = unrounded ? t : fn_f(tp);
    }
  }
  __syncthreads();
}
template <typename A, int G>
__device__ inline void fn_row_norms(const A* a, A* rout, const float* gain, long at0, int rows,
                                    int K, float* xin, int xs, float (*red)[G], float* srow,
                                    float* prow, float eps, bool prescale, int norm, bool post) {
  // for `rows` rows (of G) of p (a, from element at0; a null: the rows in xin already, from
  // fn_post_rows): p into rout (optional: one block writes it) and, times gain (optional), into
  // the shared input rows (row g at xin + g * xs); then each
  // row's 1/RSSe and its power of two P (half precision) into srow and prow. The rows are loaded
  // by fn_rows_in; the squares are then summed in the one-row kernel's order (value i by thread
  // i % 256, its 8 warps' sums in order): its norm alone. norm (NORM): 0 flash as above; 1 rms,
  // the input rows RMSNorm(p) with weights `gain` (fn_norm_as: post, as Gemma's), 1 into srow
  // and prow; 2 none, p alone, 1 into srow and prow.
  const float* wnorm = norm == 1 ? gain : nullptr;
  if (norm != 0) gain = nullptr;
  // passes of 8 rows: the gains of a thread's first GP values loaded before the rows, under their
  // latency (at 16 rows a pass it cost more than it saved: bench/RESULTS.md, "The batched step")
  constexpr int GP = G <= 8 ? 4 : 0;
  float gp[GP > 0 ? GP : 1];
  #pragma unroll
  for (int u = 0; u < GP; ++u)
    gp[u] = gain && threadIdx.x < 256 && threadIdx.x + 256 * u < K
        ? __ldg(gain + threadIdx.x + 256 * u) : 1.0f;
  if (a) fn_rows_in(a + at0, K, K, rows, xin, xs, rout ? rout + at0 : nullptr);
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
  for (int i = threadIdx.x + 256 * GP; i < K && threadIdx.x < 256; i += 256)
    add(i, gain ? __ldg(gain + i) : 1.0f);
  #pragma unroll
  for (int g = 0; g < G; ++g) ss[g] = fn_warp_sum(ss[g]);
  if (threadIdx.x % 32 == 0 && threadIdx.x < 256) {
    #pragma unroll
    for (int g = 0; g < G; ++g) red[threadIdx.x / 32][g] = ss[g];
  }
  __syncthreads();
  float r = 0.0f;  // rms: the row's 1/RMS
  if (threadIdx.x < rows) {
    float t = 0.0f;
    for (int w = 0; w < 8; ++w) t += red[w][threadIdx.x];
    const float s = norm == 0 ? rsqrtf(t + K * eps) : 1.0f;
    r = rsqrtf(t / K + eps);
    srow[threadIdx.x] = s;
    prow[threadIdx.x] = prescale ? __int_as_float(__float_as_int(s) & 0x7f800000) : 1.0f;
  }
  if (wnorm) {  // rms: the rows normalized and weighted in place, each row's 1/RMS through red
    __syncthreads();
    if (threadIdx.x < rows) red[0][threadIdx.x] = r;
    __syncthreads();
    for (int i = threadIdx.x; i < K; i += blockDim.x) {
      const float w = __ldg(wnorm + i);
      for (int g = 0; g < rows; ++g)
        xin[g * xs + i] = fn_norm_as<A>(xin[g * xs + i], red[0][g], w, post);
    }
    __syncthreads();
  }
}
template <typename U> __device__ inline float fn_from_bits(unsigned int h);
template <> __device__ inline float fn_from_bits<__half>(unsigned int h) {
  return __half2float(__ushort_as_half((unsigned short)h));
}
template <> __device__ inline float fn_from_bits<__nv_bfloat16>(unsigned int h) {
  return __uint_as_float(h << 16);
}
template <typename T, int BITS>
__device__ inline unsigned int fn_q_tf32(const unsigned int* q, int e) {
  // value e (0..7) of a thread's words, as a tf32 operand: a packed value (an exact float: 0 ..
  // 2^BITS - 1), a weight of T (BITS 16: float16 and bfloat16 values are exact in tf32), or a
  // float32 weight's high part (BITS 32: fn_tf32_lo is the rest)
  if constexpr (BITS == 32) {
    return q[e] & 0xffffe000u;
  } else if constexpr (BITS == 16) {
    return __float_as_uint(fn_from_bits<T>((q[e / 2] >> (16 * (e % 2))) & 0xffffu));
  } else {
    const unsigned int v = BITS == 4 ? (q[0] >> (4 * e)) & 15u : (q[e / 4] >> (8 * (e % 4))) & 255u;
    return __float_as_uint(__uint_as_float(0x4b000000u | v) - 8388608.0f);
  }
}
__device__ inline unsigned int fn_tf32_lo(unsigned int w) {
  // a float32's bits less its tf32 high part (fn_q_tf32), as a tf32 operand
  return __float_as_uint(__uint_as_float(w) - __uint_as_float(w & 0xffffe000u)) & 0xffffe000u;
}
__device__ inline void fn_mma_tf32(float* c, const unsigned int* a, unsigned int b0,
                                   unsigned int b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <typename T, int BITS>
struct fn_span {  // a lane's weights (rows gid and gid + 8), scales and biases of a tile's span
                  // (full precision: 8 weights of T a row, no scales or biases)
  unsigned int q0[BITS / 4], q1[BITS / 4];
  T s0, s1, c0, c1;
};
template <typename T, int BITS>
__device__ inline fn_span<T, BITS> fn_span_at(const unsigned int* w, const T* sc, const T* bi,
                                              long row0, int nrow, int sp, int gpr, float rspg) {
  // span sp of the tile at row0 (fn_tile's rows and lanes; rspg: 32 / the group size), loaded
  // ahead of its use
  constexpr int WORDS = BITS / 4;
  const int lane = threadIdx.x % 32, gid = lane / 4, tig = lane % 4;
  const long r0 = row0 + gid, r1 = r0 + 8;
  const int g = int((sp + 0.5f) * rspg);  // span sp's quantization group
  fn_span<T, BITS> f;
  if constexpr (BITS >= 16) {  // 16-byte loads (WORDS: 4 or 8)
    #pragma unroll
    for (int u = 0; u < WORDS; u += 4) {
      const uint4 a = __ldg(reinterpret_cast<const uint4*>(w + (r0 * nrow + sp) * BITS
                                                           + WORDS * tig + u));
      const uint4 b = __ldg(reinterpret_cast<const uint4*>(w + (r1 * nrow + sp) * BITS
                                                           + WORDS * tig + u));
      f.q0[u] = a.x; f.q0[u + 1] = a.y; f.q0[u + 2] = a.z; f.q0[u + 3] = a.w;
      f.q1[u] = b.x; f.q1[u + 1] = b.y; f.q1[u + 2] = b.z; f.q1[u + 3] = b.w;
    }
  } else {
    #pragma unroll
    for (int u = 0; u < WORDS; ++u) {
      f.q0[u] = __ldg(w + (r0 * nrow + sp) * BITS + WORDS * tig + u);
      f.q1[u] = __ldg(w + (r1 * nrow + sp) * BITS + WORDS * tig + u);
    }
    f.s0 = __ldg(sc + r0 * gpr + g); f.s1 = __ldg(sc + r1 * gpr + g);
    f.c0 = __ldg(bi + r0 * gpr + g); f.c1 = __ldg(bi + r1 * gpr + g);
  }
  return f;
}
__device__ inline int fn_tile_warp(int rot) {
  // the warp whose spans this warp takes in fn_tile (and whose first fn_tile_first loads): its
  // own turned by rot
  return (threadIdx.x / 32 + rot) % (blockDim.x / 32);
}
template <typename T, int BITS>
__device__ inline fn_span<T, BITS> fn_tile_first(const unsigned int* w, const T* sc, const T* bi,
                                                 long row0, int nrow, int sp0, int nsp, int gpr,
                                                 int gs, int rot = 0) {
  // the first span fn_tile's warp takes (rot as there), loaded before the tile's inputs are ready
  const int warp = fn_tile_warp(rot);
  fn_span<T, BITS> f = {};
  if (warp < nsp) f = fn_span_at<T, BITS>(w, sc, bi, row0, nrow, sp0 + warp, gpr, 32.0f / gs);
  return f;
}
template <typename T, int BITS, int NT>
__device__ inline void fn_tile(const unsigned int* w, const T* sc, const T* bi, long row0,
                               int nrow, int sp0, int nsp, int gpr, int gs, const float* xin,
                               int xs, float (*acc)[4], const fn_span<T, BITS>& first,
                               int rot = 0) {
  // rows row0 .. row0 + 15 of an affine BITS-bit matrix or a full-precision one (BITS those of
  // T: no scales or biases) (nrow spans of 32 values a row), spans
  // sp0 .. sp0 + nsp - 1, times the NT * 8 shared input rows, on the tensor cores (mma m16n8k8,
  // tf32): a warp's spans (v, v + NW, ..., v = fn_tile_warp(rot); its first, `first`, loaded by
  // the caller: fn_tile_first) added into acc, to be added over the warps (fn_tile_put/get).
  // Lane (gid, tig) holds weight rows gid and gid + 8 and input row gid of each group of 8; it
  // loads a span's values 8 tig .. 8 tig + 7 (a word of 4-bit values, two of 8-bit), and k-step
  // ks takes values 8 tig + 2 ks (the mma's column tig) and 8 tig + 2 ks + 1 (column tig + 4).
  // An input is split into two tf32 parts (hi + lo); the packed values are exact, and so are
  // float16 and bfloat16 weights (a float32 weight is split as an input is: its low part times
  // the input's high part is a third product). A span lies in one quantization group: sum(w x) =
  // scale (q . x) + bias sum(x), sum(x) from its lanes' values by shuffles.
  const int warp = fn_tile_warp(rot), lane = threadIdx.x % 32, gid = lane / 4, tig = lane % 4;
  const int step = blockDim.x / 32;  // spans a warp steps by
  const float rspg = 32.0f / gs;  // 1 / the spans in a group
  fn_span<T, BITS> nx = first;  // the next span, loaded a span ahead (the first by the caller)
  for (int j = warp; j < nsp; j += step) {
    const fn_span<T, BITS> cur = nx;
    if (j + step < nsp) nx = fn_span_at<T, BITS>(w, sc, bi, row0, nrow, sp0 + j + step, gpr, rspg);
    float xv[NT][8], ch[NT][4], cl[NT][4], xs_sum[NT][2];
    #pragma unroll
    for (int t = 0; t < NT; ++t) {
      const float4* xr =
          reinterpret_cast<const float4*>(xin + (t * 8 + gid) * xs + j * 32 + 8 * tig);
      const float4 xa = xr[0], xb = xr[1];
      xv[t][0] = xa.x; xv[t][1] = xa.y; xv[t][2] = xa.z; xv[t][3] = xa.w;
      xv[t][4] = xb.x; xv[t][5] = xb.y; xv[t][6] = xb.z; xv[t][7] = xb.w;
      if constexpr (BITS < 16) {
        float sum = ((xa.x + xa.y) + (xa.z + xa.w)) + ((xb.x + xb.y) + (xb.z + xb.w));
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);  // the span's sum of input row 8 t + gid
        // of input rows 8 t + 2 tig and 8 t + 2 tig + 1
        xs_sum[t][0] = __shfl_sync(0xffffffffu, sum, 8 * tig);
        xs_sum[t][1] = __shfl_sync(0xffffffffu, sum, 8 * tig + 4);
      }
      #pragma unroll
      for (int i = 0; i < 4; ++i) { ch[t][i] = 0.0f; cl[t][i] = 0.0f; }
    }
    #pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const unsigned int a[4] = {fn_q_tf32<T, BITS>(cur.q0, 2 * ks),
                                 fn_q_tf32<T, BITS>(cur.q1, 2 * ks),
                                 fn_q_tf32<T, BITS>(cur.q0, 2 * ks + 1),
                                 fn_q_tf32<T, BITS>(cur.q1, 2 * ks + 1)};
      unsigned int al[4] = {};  // float32 weights: their low parts
      if constexpr (BITS == 32) {
        al[0] = fn_tf32_lo(cur.q0[2 * ks]); al[1] = fn_tf32_lo(cur.q1[2 * ks]);
        al[2] = fn_tf32_lo(cur.q0[2 * ks + 1]); al[3] = fn_tf32_lo(cur.q1[2 * ks + 1]);
      }
      #pragma unroll
      for (int t = 0; t < NT; ++t) {
        const unsigned int h0 = __float_as_uint(xv[t][2 * ks]) & 0xffffe000u;
        const unsigned int h1 = __float_as_uint(xv[t][2 * ks + 1]) & 0xffffe000u;
        const unsigned int l0 = __float_as_uint(xv[t][2 * ks] - __uint_as_float(h0)) & 0xffffe000u;
        const unsigned int l1 =
            __float_as_uint(xv[t][2 * ks + 1] - __uint_as_float(h1)) & 0xffffe000u;
        fn_mma_tf32(ch[t], a, h0, h1);
        fn_mma_tf32(cl[t], a, l0, l1);
        if constexpr (BITS == 32) fn_mma_tf32(cl[t], al, h0, h1);
      }
    }
    #pragma unroll
    for (int t = 0; t < NT; ++t) {
      // element i: weight row gid + 8 (i / 2), input row 8 t + 2 tig + i % 2
      #pragma unroll
      for (int i = 0; i < 4; ++i) {
        if constexpr (BITS >= 16) {
          acc[t][i] += ch[t][i] + cl[t][i];
        } else {
          acc[t][i] += fn_f(i < 2 ? cur.s0 : cur.s1) * (ch[t][i] + cl[t][i])
                       + fn_f(i < 2 ? cur.c0 : cur.c1) * xs_sum[t][i & 1];
        }
      }
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
  // a tile's outputs, the warps' partial sums added: store(f, n, v) for its row f (0..15) and
  // input row n (0 .. rows - 1), between barriers (rb and any tile put before it are read once all
  // warps wrote them)
  fn_tile_put<NT>(acc, rb);
  __syncthreads();
  for (int o = threadIdx.x; o < 16 * rows; o += blockDim.x)
    store(o % 16, o / 16, fn_tile_get<NT>(rb, o % 16, o / 16));
  __syncthreads();
}
__device__ inline int fn_run(int items, int blocks) {
  // the first of this block's run of a phase's items: runs of ceil(items / blocks), in block order
  return min(items, int(blockIdx.x) * ((items + blocks - 1) / blocks));
}
__device__ inline int fn_run_end(int items, int blocks) {
  // one past the last of this block's run
  return min(items, int(blockIdx.x + 1) * ((items + blocks - 1) / blocks));
}
// @piece body
  // T, BITS, D, GQ, NL, SMAX, XA (below), G and GD (rows per matvec pass, 8 or 16 (rows.GMAX):
  // of the phases with inputs of K or HQ * D values, and of down_proj's I), GU (gate/up's: G, or
  // 16 where G is 8), IC (down_proj's input values held at once, a multiple of 32), NW (warps;
  // rows.WARPS): template constants
  constexpr int BMAX = 256, NT = G / 8, NTD = GD / 8, NTU = GU / 8;
  constexpr int EPL = 16 / sizeof(T), LPR = D / EPL, RPW = 32 / LPR;
  // the run-time sizes and flags (dims: rows.SIZES; XMAX unused here)
  {{SIZES}}
  // strides of an input row in shared memory (down_proj's: XSD, its input in chunks of IC values);
  // XA, max(K, HQM * D), a template constant: a binary's shared bytes follow from its template
  // alone (rows.launch_plan), as MLX fixes a binary's dynamic shared limit at its first launch
  const int XS = XA + 4, XSD = min(IC, IM) + 4;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  unsigned int* bar = const_cast<unsigned int*>(sync);
  unsigned int target = 0;
  // sized for the widest layer (HQM, HKVM, IM); a layer's rows B * NQKV, B * HQ * ... within them
  const long NQKVM = (HQM + 2 * HKVM) * D;
  float* raw = work;                                   // B * NQKV
  float* part = raw + long(B) * NQKVM;                 // B * HQ * SMAX * (D + 2)
  float* s1g = part + long(B) * HQM * SMAX * (D + 2);  // B each: per row 1/RSSe and its power
  float* p1g = s1g + B;                               // of two (phase 1, for attention),
  float* xsg = p1g + B;                               // down_proj's deferred scale (phase 5, for
                                                      // the next layer's add)
  // the rows between phases, in T (rounded where the one-row kernel rounds them), 16-byte aligned:
  T* res0 = reinterpret_cast<T*>(
      work + ((long(B) * (NQKVM + HQM * SMAX * (D + 2)) + 3 * B + 3) & ~3L));
  // res0, B * K: the stream after attention (p2, phase 4's); res1, B * K: before it (p, phase 6's
  // or x)
  T* res1 = res0 + long(B) * K;
  T* mbuf = res1 + long(B) * K;  // B * KO: attention's output, the splits merged
  T* abuf = mbuf + long(B) * HQM * D;  // B * I: down_proj's input
  extern __shared__ float smem[];
  float* xin = smem;  // GU * XS or GD * XSD: the running matvec's input rows
  // 2 * NW * NTU * 128: the warps' partial sums of a tile (two tiles)
  float* rb = xin + max(GU * XS, GD * XSD);
  float* rb2 = rb + NW * NTU * 128;
  __shared__ float red[8][G], redu[8][GU];
  // per row of the block's passes: 1/RSSe and its power of two
  __shared__ float srow[BMAX], prow[BMAX];
  __shared__ const void* tab[NA * NL];
  __shared__ float qsh[GQ][D], sm[NW][GQ], sl[NW][GQ];
  // the warps' attention values (NW * GQ * D floats) in the matvecs' space, unused between their
  // phases: static arrays are held to 48 KB, which they pass at D = 256 (rows.shared_bytes)
  float (*sacc)[GQ][D] = reinterpret_cast<float (*)[GQ][D]>(smem);
  __shared__ int first[BMAX + 1];  // phase 2's items: row b's are first[b] .. first[b + 1] - 1
  {{TABLE}}
  __syncthreads();
  // A matvec phase's items, (pass of G rows, tile of 16 weight rows) pass by pass, a run of
  // consecutive items a block (fn_run): a block loads a pass's input rows (and their norms) when
  // its item is of another pass than the last one, once a pass its run crosses
  const int NP = (B + G - 1) / G, NPD = (B + GD - 1) / GD, NPU = (B + GU - 1) / GU;
  for (int l = 0; l < NL; ++l) {
    {{LAYER}}
    // a row's attention splits (read from phase 2 on, after a grid barrier; the last layer's
    // readers passed barriers since): the one-row kernel's rule, capped so that the batch's items
    // about fill the grid once
    // (warp 0: each lane counts PL rows in turn, a scan over the lanes places them)
    if (warp == 0) {
      constexpr int PL = BMAX / 32;
      const int cap = max(1, NB / (B * HKV));
      int c[PL], own = 0;
      #pragma unroll
      for (int j = 0; j < PL; ++j) {
        const int b = lane * PL + j;
        const int m = b < B ? off[b] + 1 - fn_first_pos(off[b] + 1, W) : 0;  // positions attended
        c[j] = b < B ? HKV * max(1, min(min((m + 31) / 32, SMAX), cap)) : 0;
        own += c[j];
      }
      int upto = own;  // the items of lanes 0 .. lane
      #pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int t = __shfl_up_sync(0xffffffffu, upto, d);
        if (lane >= d) upto += t;
      }
      int t = upto - own;
      #pragma unroll
      for (int j = 0; j < PL; ++j) {
        if (lane * PL + j < B) first[lane * PL + j] = t;
        t += c[j];
      }
      if (lane == 31) first[B] = upto;
    }
    // 1. per row: p (x in the first layer, then res1; post: the last layer's post-feedforward
    // norm of its down_proj output y, plus res0, into res1 here), s = 1/RSSe(p); the q/k/v rows
    // of p * g (and their bias: fn_qkv_out)
    for (int item = fn_run(NP * (NQKV / 16), NB), end = fn_run_end(NP * (NQKV / 16), NB),
             have = -1; item < end; ++item) {
      const int b0 = item / (NQKV / 16) * G, tile = item % (NQKV / 16), rows = min(G, B - b0);
      const auto f1 =
          fn_tile_first<T, BITS>(wqkv, sqkv, bqkv, tile * 16, K / 32, 0, K / 32, K / GS, GS);
      if (b0 != have) {
        const bool from_y = post && l > 0;
        if (from_y)
          fn_post_rows<T, G>(y, xsg, res0, tile == 0 ? res1 : nullptr, g1 - K, b0, rows, K, xin,
                             XS, red, eps, NORM == 1);
        fn_row_norms<T, G>(from_y ? nullptr : l == 0 ? x : res1,
                           l == 0 && tile == 0 ? res1 : nullptr, has_g ? g1 : nullptr,
                           long(b0) * K, rows, K, xin, XS, red, srow + b0, prow + b0, eps,
                           prescale, NORM, post);
        if (tile == 0 && threadIdx.x < rows) {  // for attention, in every block: 1 where
          // the rows took s with their bias (fn_qkv_out)
          s1g[b0 + threadIdx.x] = qkv_bias ? 1.0f : srow[b0 + threadIdx.x];
          p1g[b0 + threadIdx.x] = qkv_bias ? 1.0f : prow[b0 + threadIdx.x];
        }
        have = b0;
      }
      float acc[NT][4] = {};
      fn_tile<T, BITS, NT>(wqkv, sqkv, bqkv, tile * 16, K / 32, 0, K / 32, K / GS, GS, xin, XS,
                           acc, f1);
      fn_tile_store<NT>(acc, rb, rows, [&](int f, int n, float v) {
        const int o = tile * 16 + f;
        raw[long(b0 + n) * NQKV + o] =
            fn_qkv_out<T, BITS>(v, cqkv, o, NORM, srow[b0 + n], prow[b0 + n]);
      });
    }
    fn_grid_sync(bar, target += NB);
    // 2. per (row, kv head, split): RoPE, the cache write, attention over the row's positions.
    // prefill (the rows one sequence's, in one cache): first every row's new k and v written (by
    // its first split, attending to nothing), then, past a grid barrier, the attention of each
    // row over the positions before it, the other rows' included
    for (int sweep = prefill ? 0 : 1; sweep < 2; ++sweep) {
      for (int item = blockIdx.x; item < first[B]; item += NB) {
        int b = 0;  // the row whose items hold this one (first[] only grows: each row has some)
        for (int hi = B - 1; b < hi;) {
          const int mid = (b + hi + 1) / 2;
          if (first[mid] <= item) b = mid;
          else hi = mid - 1;
        }
        const int S = (first[b + 1] - first[b]) / HKV;
        const int kvh = (item - first[b]) / S, split = (item - first[b]) % S;
        const int pos = off[b], n = pos + 1, lo0 = fn_first_pos(n, W);
        const int chunk = (n - lo0 + S - 1) / S;
        if (sweep == 0 && split > 0) continue;
        const int lo = lo0 + split * chunk, hi = sweep == 0 ? lo : min(n, lo + chunk);
        const bool mine = sweep == 0 || !prefill && lo <= pos && pos < hi;
        const float s = __ldcg(s1g + b), P = __ldcg(p1g + b);
        const float* rbase = raw + long(b) * NQKV;
        const long cbase = long((prefill ? 0 : b) * HKV + kvh) * C;
        const long head0 = long(b) * HQ + kvh * GQ;
        {{ATTEND}}
        // the row's one split: its output into mbuf here, as phase 3 would: v / sum, added over the
        // warps as just above
        for (int i = threadIdx.x; i < GQ * D && S == 1; i += blockDim.x) {
          const int h = i / D;
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
    }
    // 3. the splits of each row that has several merged, once (spread over the grid), into mbuf;
    // none if no row has
    const bool merge = first[B] > B * HKV;
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; merge && e < B * KO; e += NB * blockDim.x) {
      const int b = e / KO, k = e % KO, S = (first[b + 1] - first[b]) / HKV;
      if (S > 1)
        mbuf[e] = fn_cast<T>(
            fn_merged(part + (long(b) * HQ + k / D) * SMAX * (D + 2), S, D, k % D));
    }
    if (merge) fn_grid_sync(bar, target += NB);
    // 4. per row: o_proj, and p2 = o + p into res0 (post: o into p, for phase 5's post-norm)
    for (int item = fn_run(NP * (K / 16), NB), end = fn_run_end(NP * (K / 16), NB), have = -1;
         item < end; ++item) {
      const int b0 = item / (K / 16) * G, tile = item % (K / 16), rows = min(G, B - b0);
      const auto f1 =
          fn_tile_first<T, BITS>(wo, so, bo, tile * 16, KO / 32, 0, KO / 32, KO / GS, GS);
      if (b0 != have) {
        fn_rows_in(mbuf + long(b0) * KO, KO, KO, rows, xin, XS);
        __syncthreads();
        have = b0;
      }
      float acc[NT][4] = {};
      fn_tile<T, BITS, NT>(wo, so, bo, tile * 16, KO / 32, 0, KO / 32, KO / GS, GS, xin, XS, acc,
                           f1);
      fn_tile_store<NT>(acc, rb, rows, [&](int f, int n, float v) {
        const long at = long(b0 + n) * K + tile * 16 + f;
        if (post) p[at] = fn_cast<T>(v);
        else res0[at] = fn_cast<T>(fn_f(fn_cast<T>(v)) + fn_f(__ldcg(res1 + at)));
      });
    }
    fn_grid_sync(bar, target += NB);
    // 5. per row (post: p2 = the post-attention norm of o plus res1, into res0 here): s2 =
    // 1/RSSe(p2), gate/up rows of p2 * g2, a = silu(gate * s2) * up * P2 (GELU: gelu)
    for (int item = fn_run(NPU * (I / 16), NB), end = fn_run_end(NPU * (I / 16), NB), have = -1;
         item < end; ++item) {
      const int b0 = item / (I / 16) * GU, tile = item % (I / 16), rows = min(GU, B - b0);
      // up's spans go to the warps in turn from warp NW / 2: each warp takes about as many of both
      // tiles' spans
      const auto f1 =
          fn_tile_first<T, BITS>(wgu, sgu, bgu, tile * 16, K / 32, 0, K / 32, K / GS, GS);
      const auto f2 = fn_tile_first<T, BITS>(wgu, sgu, bgu, I + tile * 16, K / 32, 0, K / 32,
                                             K / GS, GS, NW / 2);
      if (b0 != have) {
        if (post)
          fn_post_rows<T, GU>(p, nullptr, res1, tile == 0 ? res0 : nullptr, g3, b0, rows, K, xin,
                              XS, redu, eps, NORM == 1);
        fn_row_norms<T, GU>(post ? nullptr : res0, nullptr, has_g ? g2 : nullptr, long(b0) * K,
                            rows, K, xin, XS, redu, srow + b0, prow + b0, eps, prescale, NORM,
                            post);
        if (tile == 0 && threadIdx.x < rows)  // down_proj's deferred scale, for the next layer
          xsg[b0 + threadIdx.x] = srow[b0 + threadIdx.x] / prow[b0 + threadIdx.x];
        have = b0;
      }
      {
        float acc[NTU][4] = {};
        fn_tile<T, BITS, NTU>(wgu, sgu, bgu, tile * 16, K / 32, 0, K / 32, K / GS, GS, xin, XS,
                              acc, f1);
        fn_tile_put<NTU>(acc, rb2);  // gate, read with up's outputs
      }
      float acc[NTU][4] = {};
      fn_tile<T, BITS, NTU>(wgu, sgu, bgu, I + tile * 16, K / 32, 0, K / 32, K / GS, GS, xin, XS,
                            acc, f2, NW / 2);
      fn_tile_store<NTU>(acc, rb, rows, [&](int f, int n, float v) {
        const float P = prow[b0 + n], up = fn_out<T, BITS>(v, NORM, P);
        const float gt = fn_out<T, BITS>(fn_tile_get<NTU>(rb2, f, n), NORM, P) * srow[b0 + n];
        abuf[long(b0 + n) * I + tile * 16 + f] =
            NORM == 0 ? fn_cast<T>(fn_act<GELU>(gt) * up * prow[b0 + n])
                      : fn_cast<T>(GELU ? fn_geglu<T>(gt, up) : fn_swiglu<T>(gt, up));
      });
    }
    fn_grid_sync(bar, target += NB);
    // 6. per row: down_proj, its scale xsg deferred to the next layer's add p = y * xs + p2 (into
    // res1; the last layer's y is the output; post: y, which the next layer's phase 1 reads); its
    // input in chunks of IC values where all I do not fit (loaded anew each)
    for (int item = fn_run(NPD * (K / 16), NB), end = fn_run_end(NPD * (K / 16), NB), have = -1;
         item < end; ++item) {
      const int b0 = item / (K / 16) * GD, tile = item % (K / 16), rows = min(GD, B - b0);
      float acc[NTD][4] = {};
      for (int c0 = 0; c0 < I; c0 += IC) {
        const int n = min(IC, I - c0);
        const auto f1 =
            fn_tile_first<T, BITS>(wd, sd, bd, tile * 16, I / 32, c0 / 32, n / 32, I / GS, GS);
        if (IC < I || b0 != have) {
          fn_rows_in(abuf + long(b0) * I + c0, n, I, rows, xin, XSD);
          __syncthreads();
          have = b0;
        }
        fn_tile<T, BITS, NTD>(wd, sd, bd, tile * 16, I / 32, c0 / 32, n / 32, I / GS, GS, xin,
                              XSD, acc, f1);
        if (IC < I) __syncthreads();  // the chunk read before the next is loaded
      }
      fn_tile_store<NTD>(acc, rb, rows, [&](int f, int n, float v) {
        const long at = long(b0 + n) * K + tile * 16 + f;
        if (l + 1 == NL || post) y[at] = fn_cast<T>(v);
        else
          res1[at] =
              fn_cast<T>(fn_f(fn_cast<T>(v)) * __ldcg(xsg + b0 + n) + fn_f(__ldcg(res0 + at)));
      });
    }
    if (l + 1 < NL) fn_grid_sync(bar, target += NB);
  }
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < B * K; i += blockDim.x) p[i] = __ldcg(res0 + i);
    for (int b = threadIdx.x; b < B; b += blockDim.x) ys[b] = __ldcg(xsg + b);
  }
  fn_grid_exit(bar, NB);
