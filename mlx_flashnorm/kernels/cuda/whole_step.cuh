// The whole-step kernels' shared CUDA: what step.cu (decode_layers, one row) and rows.cu
// (decode_rows, a batch) both take, in three pieces (build.pieces; step.compose composes them):
//   device  the device functions both kernels' headers hold: the grid barrier (fn_grid_sync,
//           fn_grid_exit), a matrix fetched into L2 ahead (fn_prefetch_matrix), an attention
//           head's splits merged (fn_merged), the one-row matvec's input row (fn_put,
//           fn_chunk_sums), block sum (fn_block_sum) and matrix row
//           (fn_qrow: packed, or full precision), RMSNorm's value and SwiGLU and GeGLU as the rms
//           mode's layers round them (fn_normed, fn_norm_as, fn_sigmoid, fn_swiglu, fn_geglu),
//           the flash mode's activations (fn_act), a post-norm's 1/RMS (fn_post_r), a sliding
//           window's first position (fn_first_pos), a matvec's output as the model's linear
//           leaves it (fn_out) and a q/k/v output with its bias (fn_qkv_out)
//   layer   layer l's arrays read from the block's pointer table (NA a layer, each at its place
//           A_<array>: step.table, step.places), and its sizes (query and kv heads, FFN width:
//           HQ, HKV, I, KO, NQKV), sliding window (W) and RoPE angles (th) from the layer table
//           `lt` (LT ints a layer, each size at its place L_<size>: step.layer_table) (the
//           bodies' {{LAYER}} line), and the next layer's matrices fetched into L2 as it starts;
//           HQM, HKVM and IM (the sizes table) are the widest layer's, which size the work buffer
//   attend  phase 2 of one (row, kv head, split of the positions), the bodies' {{ATTEND}} line:
//           RoPE on the row's q and k, the new k and v written into the cache by the split that
//           holds the position, attention over the split's positions, its partial state (max,
//           sum, values) into `part`. The body around it names the row: rbase (its raw q/k/v),
//           cbase (its kv head's first cache row), head0 (its first query head among all rows'
//           heads), pos, lo, hi, mine (this block writes the new k and v), s and P.
// The norm mode NORM (step.NORMS; the sizes table): 0 flash (1/RSSe deferred past the matvecs,
// the gains on their inputs, QK-norm's gains in RoPE's tables), 1 rms (RMSNorm before each
// matvec, weights multiplied into its input, as the model's own layers round it: the q/k/v and
// gate/up outputs in T, QK-norm on them, the softmax scale (factor) on the rounded q, SwiGLU's
// sigmoid in T as MLX computes it: fn_swiglu), 2 none (no norm: the residual add alone). In rms
// and none s and P are 1. GELU (a template constant): GeGLU with tanh GELU in place of SwiGLU.
// post (Gemma 3, step.POST): the post-attention and post-feedforward norms on o_proj's and
// down_proj's outputs before the residual add, the model's own in flash and rms (gains g3 and the
// previous layer's g4), every model norm computed as Gemma's: in float32, rounded once
// (fn_norm_as), the rms pre-norms on the residual add's unrounded sum.
// The matrices are BITS-bit affine quantized (4 or 8: words of packed values, scales and biases
// per group) or full precision (BITS 16 or 32, those of T: rows of T, no scales or biases). Where
// q/k/v have a bias (qkv_bias, Qwen 2's) phase 1 adds it as the model's linears do (fn_qkv_out):
// in flash after the deferred scale, so that attention's s and P are 1 then as well. The q/k/v and
// gate/up outputs are rounded to T as the model's linears round them (fn_out).
// @piece device
__device__ inline void fn_grid_sync(unsigned int* bar, unsigned int target) {
  // every block of the grid arrives before any leaves (all blocks are resident: one per SM);
  // the count only grows within a launch, and the last block out resets it (fn_grid_exit). The
  // arrival is a release (the block's writes, ordered before it by __syncthreads, are seen by
  // whoever acquires the count after it) and the wait an acquire, no full fences around them
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" : : "l"(bar) : "memory");
    unsigned int seen;
    unsigned long long t0, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    for (unsigned int k = 1;; ++k) {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(bar) : "memory");
      if (seen >= target) break;
      if (k % 256) continue;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      // a block that never came within the time limit (in ns): fail, never hang
      if (now - t0 > 2000000000ull) __trap();
    }
  }
  __syncthreads();
}
__device__ inline void fn_prefetch(const void* p, long bytes, int blocks) {
  // bytes from p into L2, a 128-byte line a thread in turn over the grid (a hint: nothing waits)
  const char* c = static_cast<const char*>(p);
  const long step = long(blocks) * blockDim.x * 128;
  for (long o = (long(blockIdx.x) * blockDim.x + threadIdx.x) * 128; o < bytes; o += step)
    asm volatile("prefetch.global.L2 [%0];" : : "l"(c + o));
}
template <typename T, int BITS>
__device__ inline void fn_prefetch_matrix(const void* const* t, long rows, long cols, int gs,
                                          int blocks) {
  // a matrix of a layer's pointer table into L2: its weight (t[0]), and where quantized its
  // scales and biases (t[1], t[2]: a value of T a group)
  fn_prefetch(t[0], rows * cols * BITS / 8, blocks);
  if (BITS < 16) {
    fn_prefetch(t[1], rows * (cols / gs) * long(sizeof(T)), blocks);
    fn_prefetch(t[2], rows * (cols / gs) * long(sizeof(T)), blocks);
  }
}
__device__ inline void fn_grid_exit(unsigned int* bar, unsigned int blocks) {
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(bar + 32, 1u) == blocks - 1) { atomicExch(bar, 0u); atomicExch(bar + 32, 0u); }
  }
}
__device__ inline float fn_merged(const float* ph, int S, int D, int d) {
  // value d of a head's attention output from the partial states of its S splits (each D + 2
  // floats at ph: max, sum, values; written in this launch, so read past L1)
  float M = -1e30f;
  for (int t = 0; t < S; ++t) M = fmaxf(M, __ldcg(ph + t * (D + 2)));
  float lzs = 0.0f, o = 0.0f;
  for (int t = 0; t < S; ++t) {
    const float c = exp2f(__ldcg(ph + t * (D + 2)) - M);
    lzs += __ldcg(ph + t * (D + 2) + 1) * c;
    o += __ldcg(ph + t * (D + 2) + 2 + d) * c;
  }
  return o / lzs;
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
template <typename T>
__device__ inline float fn_normed(float v, float r, float w) {
  // RMSNorm's value as MLX computes it (mx.fast.rms_norm, and the norm modules' fused kernel,
  // kernels/normalize.py): v times its 1/RMS rounded to T, times the weight w (a value of T)
  // rounded to T
  return fn_f(fn_cast<T>(fn_f(fn_cast<T>(v * r)) * w));
}
template <typename T>
__device__ inline float fn_norm_as(float v, float r, float w, bool post) {
  // the model's RMSNorm value: fn_normed, or with post-norms Gemma 3's (in float32: v times its
  // 1/RMS r times the gain w, 1 + weight, rounded once to T)
  return post ? fn_f(fn_cast<T>(v * r * w)) : fn_normed<T>(v, r, w);
}
template <typename T, typename A>
__device__ inline float fn_post_r(const A* v, float xs, int K, float eps, float* red) {
  // a post-norm's 1/RMS over the K values v[i] * xs (written in this launch), each rounded to T
  // as the model's layers round them, summed by the whole block
  float ss = 0.0f;
  for (int i = threadIdx.x; i < K; i += blockDim.x) {
    const float u = fn_f(fn_cast<T>(fn_f(__ldcg(v + i)) * xs));
    ss += u * u;
  }
  return rsqrtf(fn_block_sum(ss, red) / K + eps);
}
__device__ inline int fn_first_pos(int n, int W) {
  // the first of n positions a sliding window of W (0: none) attends to
  return W > 0 && n > W ? n - W : 0;
}
template <typename T> __device__ inline float fn_exp_in(float v) { return expf(v); }
template <> __device__ inline float fn_exp_in<__half>(float v) {
  return __half2float(hexp(__float2half(v)));
}
template <> __device__ inline float fn_exp_in<__nv_bfloat16>(float v) {
  return __bfloat162float(hexp(__float2bfloat16(v)));
}
template <typename T>
__device__ inline float fn_sigmoid(float g) {
  // sigmoid(g) (g a value of T) as MLX's CUDA Sigmoid computes it in T: e = exp(|g|) (hexp, as
  // cuda::std::exp takes a half type), y = 1 / (1 + e), g < 0 ? y : 1 - y, each step rounded to T
  const float e = fn_exp_in<T>(fabsf(g));
  const float y = fn_f(fn_cast<T>(1.0f / fn_f(fn_cast<T>(1.0f + e))));
  return g < 0.0f ? y : fn_f(fn_cast<T>(1.0f - y));
}
template <typename T>
__device__ inline float fn_swiglu(float gate, float up) {
  // silu(gate) * up as the rms and none modes' layers round it (mlx_lm's swiglu, gate * sigmoid
  // then times up, each a T value): gate and up in T (the matvec's outputs), the sigmoid
  // (fn_sigmoid), its product with gate, and that times up, each rounded to T
  const float g = fn_f(fn_cast<T>(gate)), u = fn_f(fn_cast<T>(up));
  return fn_f(fn_cast<T>(fn_f(fn_cast<T>(g * fn_sigmoid<T>(g))) * u));
}
template <typename T>
__device__ inline float fn_geglu(float gate, float up) {
  // gelu(gate) * up as the rms and none modes' layers round it (mlx.nn.gelu_approx, compiled:
  // 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), each step and constant a T value, the cube
  // and tanh in float as MLX's CUDA takes a half type; then times up): each step rounded to T
  const auto r = [](float v) { return fn_f(fn_cast<T>(v)); };
  const float x = r(gate), u = r(up), c1 = r(0.044715f), c2 = r(0.7978845608028654f);
  const float t = r(c2 * r(x + r(c1 * r(powf(x, 3.0f)))));
  return r(r(r(0.5f * x) * r(1.0f + r(tanhf(t)))) * u);
}
template <bool GELU>
__device__ inline float fn_act(float g) {
  // the flash mode's activation of the scaled gate, in float32: tanh GELU or SiLU
  return GELU ? 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * powf(g, 3.0f))))
              : g / (1.0f + expf(-g));
}
template <typename T, int BITS>
__device__ inline float fn_qrow(const unsigned int* w, const T* sc, const T* bi, long row, int nc,
                                int gpr, int gs, const float* xin, const float* xsum, int lane) {
  // one row of an affine BITS-bit matrix (nc 16-byte chunks, gpr groups of gs values) times the
  // shared input row: a group adds scale * (q . x) + bias * sum(x); lanes take the chunks in turn.
  // Full precision (BITS those of T): a chunk is 16 / sizeof(T) values of T, no groups
  constexpr int PER = 32 / BITS;
  const uint4* wr = reinterpret_cast<const uint4*>(w) + row * nc;
  float a = 0.0f;
  if constexpr (BITS >= 16) {
    static_assert(BITS == 8 * sizeof(T), "full-precision weights are of T");
    for (int c = lane; c < nc; c += 32) {
      float v[4 * PER];
      fn_unpack<T, 4 * PER>(__ldg(wr + c), v);
      #pragma unroll
      for (int e = 0; e < 4 * PER; ++e) a += v[e] * xin[e * nc + c];
    }
  } else {
    constexpr int MASK = (1 << BITS) - 1;
    for (int c = lane; c < nc; c += 32) {
      const uint4 q = __ldg(wr + c);
      const unsigned int qs[4] = {q.x, q.y, q.z, q.w};
      float d = 0.0f;
      #pragma unroll
      for (int u = 0; u < 4; ++u) {
        #pragma unroll
        for (int j = 0; j < PER; ++j)
          d += float((qs[u] >> (BITS * j)) & MASK) * xin[(u * PER + j) * nc + c];
      }
      const long g = row * gpr + c * 4 * PER / gs;
      a += fn_f(sc[g]) * d + fn_f(bi[g]) * xsum[c];
    }
  }
  return fn_warp_sum(a);
}
template <typename T, int BITS>
__device__ inline float fn_out(float a, int norm, float P) {
  // a matvec's output a as the model's linear leaves it: in T (flash: as its input took the power
  // of two P of its 1/RSSe, add_rss, so that it stays in T's range; 1 in rms and none), but for
  // flash's 4- and 8-bit matvecs, which keep it as Sec. 5's fused kernels do (norm_qkv_rope,
  // gate_up); no fused kernel takes a full-precision linear
  return norm == 0 && BITS < 16 ? a : fn_f(fn_cast<T>(a * P)) / P;
}
template <typename T, int BITS>
__device__ inline float fn_qkv_out(float a, const T* c, int o, int norm, float s, float P) {
  // q/k/v output o (a, as summed) as phase 2 reads it: without a bias (c null), fn_out's; with
  // its linear's bias c[o] as the model's layers add it, the sum in T: flash, to the output in T
  // (a P) times s / P in T (DeferredLinear: the scale before the bias); rms and none, to a in T
  // (nn.QuantizedLinear), or to a (full precision: nn.Linear's addmm rounds once)
  if (!c) return fn_out<T, BITS>(a, norm, P);
  const float b = fn_f(c[o]), r = fn_f(fn_cast<T>(a * P));
  if (norm == 0) return fn_f(fn_cast<T>(fn_f(fn_cast<T>(r * (s / P))) + b));
  return fn_f(fn_cast<T>((BITS >= 16 ? a : r) + b));
}
// @piece layer
    const void* const* ta = tab + NA * l;  // its pointers (step.ARRAYS)
    const int* ls = lt + LT * l;  // its row of the layer table (offsets, then step.LAYER_SIZES)
    const unsigned int* wqkv = (const unsigned int*)ta[A_WQKV];
    const T* sqkv = (const T*)ta[A_SQKV]; const T* bqkv = (const T*)ta[A_BQKV];
    const unsigned int* wo = (const unsigned int*)ta[A_WO];
    const T* so = (const T*)ta[A_SO]; const T* bo = (const T*)ta[A_BO];
    const unsigned int* wgu = (const unsigned int*)ta[A_WGU];
    const T* sgu = (const T*)ta[A_SGU]; const T* bgu = (const T*)ta[A_BGU];
    const unsigned int* wd = (const unsigned int*)ta[A_WD];
    const T* sd = (const T*)ta[A_SD]; const T* bd = (const T*)ta[A_BD];
    const T* cqkv = qkv_bias ? (const T*)ta[A_CQKV] : nullptr;  // q/k/v's bias (Qwen 2)
    T* kc = (T*)ta[A_KC];
    T* vc = (T*)ta[A_VC];
    const int HQ = ls[L_HQ], HKV = ls[L_HKV], I = ls[L_I];
    const int KO = HQ * D, NQKV = (HQ + 2 * HKV) * D;
    const int W = ls[L_W];  // its sliding window (0: every position)
    const float* th = theta + ls[L_TH];  // its RoPE angles
    // the pre-norms' gains; post: the post-attention norm's (g3), the previous layer's
    // post-feedforward norm's at g1 - K
    const float* g1 = gains + long(l) * (post ? 4 : 2) * K;
    const float* g2 = g1 + K;
    const float* g3 = g2 + K;
    // the matrices of the next layer (at the first, of the first too) into L2 while this one
    // runs: the step's weights do not all stay in L2, and a matvec would wait on memory
    for (int m = l == 0 ? 0 : l + 1; m <= l + 1 && m < NL; ++m) {
      const void* const* tm = tab + NA * m;
      const int* lm = lt + LT * m;
      const long hq = lm[L_HQ], hkv = lm[L_HKV], im = lm[L_I];
      fn_prefetch_matrix<T, BITS>(tm + A_WQKV, (hq + 2 * hkv) * D, K, GS, NB);
      fn_prefetch_matrix<T, BITS>(tm + A_WO, K, hq * D, GS, NB);
      fn_prefetch_matrix<T, BITS>(tm + A_WGU, 2 * im, K, GS, NB);
      fn_prefetch_matrix<T, BITS>(tm + A_WD, K, im, GS, NB);
    }
// @piece attend
      // rounds of a warp's positions loaded and scored at once, as many as the registers allow
      // (fewer where a block of more warps leaves each thread fewer)
      constexpr int UA = GQ <= 4 && NW <= 8 ? 4 : (GQ * D < 512 ? 2 : 1);
      for (int vi = warp; vi < GQ + 2; vi += NW) {
        const bool is_q = vi < GQ, is_k = vi == GQ;
        if (!is_q && !mine) continue;
        const int head = is_q ? kvh * GQ + vi : (is_k ? HQ + kvh : HQ + HKV + kvh);
        const float* r = rbase + head * D;
        const long at = (cbase + pos) * D;
        if (!is_q && !is_k) {
          for (int d = lane; d < D; d += 32) vc[at + d] = fn_cast<T>(__ldcg(r + d) * s);
          continue;
        }
        // flash: s (Sec. 3) or QK-norm's 1/RSSe (Sec. 4) times RoPE with the gains in its
        // tables; rms: QK-norm's RMSNorm on the rounded row, then RoPE; none: RoPE alone
        float inv = NORM == 0 ? factor * s : 1.0f;
        if (qk_norm) {
          float hss = 0.0f;
          for (int d = lane; d < D; d += 32) { const float v = __ldcg(r + d) * P; hss += v * v; }
          inv = NORM == 0 ? rsqrtf(fn_warp_sum(hss) + D * qk_eps) * P
                          : rsqrtf(fn_warp_sum(hss) / D + qk_eps);
        }
        const bool in_tables = NORM == 0 && qk_norm, normed = NORM != 0 && qk_norm;
        const float* gq = qkg + (long(l) * 2 + (is_q ? 0 : 1)) * 2 * D;
        const float fpos = float(pos), mul = NORM == 0 ? inv : 1.0f;
        for (int i = lane; i < D / 2; i += 32) {
          const int j = i + D / 2;
          float ri = __ldcg(r + i), rj = __ldcg(r + j);
          if (normed) {
            ri = fn_norm_as<T>(ri, inv, gq[i], post);
            rj = fn_norm_as<T>(rj, inv, gq[j], post);
          }
          const float sn = sinf(fpos * th[i]), cs = cosf(fpos * th[i]);
          const float gi = in_tables ? gq[i] : 1.0f, gj = in_tables ? gq[j] : 1.0f;
          const float pi = in_tables ? gq[D + i] : 1.0f, pj = in_tables ? gq[D + j] : 1.0f;
          const T yi = fn_cast<T>(mul * (ri * gi * cs - rj * pi * sn)),
                  yj = fn_cast<T>(mul * (rj * gj * cs + ri * pj * sn));
          if (is_q) { qsh[vi][i] = fn_f(yi); qsh[vi][j] = fn_f(yj); }
          else { kc[at + i] = yi; kc[at + j] = yj; }
        }
      }
      __syncthreads();
      // softmax(q k) v over [lo, hi), exp2 domain: flash, the scale in q and k already (Sec. 3);
      // rms, none: the rounded q times the softmax scale's product with log2(e), as the layers'
      // decode attention (kernels/attention.py) scales it
      const int grp = lane / LPR, sub = lane % LPR;
      const float qmul = NORM == 0 ? 1.4426950408889634f : factor * 1.4426950408889634f;
      float qv[GQ][EPL], acc[GQ][EPL], m[GQ], lz[GQ];
      #pragma unroll
      for (int h = 0; h < GQ; ++h) {
        #pragma unroll
        for (int e = 0; e < EPL; ++e) {
          qv[h][e] = qsh[h][sub * EPL + e] * qmul;
          acc[h][e] = 0.0f;
        }
        m[h] = -1e30f;
        lz[h] = 0.0f;
      }
      // a warp's positions UA rounds at a time, their loads issued before any is used (a
      // conversion next to its load would wait for it), their scores before one max and one
      // rescale a head (a rescale after each position made a serial chain that the warps could
      // not hide: bench/RESULTS.md, "The batched step"); the same trip count for a warp
      for (int j00 = lo + warp * RPW; j00 < hi; j00 += UA * NW * RPW) {
        uint4 kw[UA], vw[UA];
        #pragma unroll
        for (int u = 0; u < UA; ++u) {
          const int j0 = j00 + u * NW * RPW, j = j0 + grp;
          if (j0 < hi) {
            const long row = (cbase + (j < hi ? j : j0)) * D + sub * EPL;
            kw[u] = *reinterpret_cast<const uint4*>(kc + row);
            vw[u] = *reinterpret_cast<const uint4*>(vc + row);
          }
        }
        // the trip's scores first, then one max and one rescale a head
        float t[UA][GQ], vf[UA][EPL];
        bool ok[UA];
        #pragma unroll
        for (int u = 0; u < UA; ++u) {
          const int j0 = j00 + u * NW * RPW, j = j0 + grp;
          ok[u] = j < hi;  // (j0 <= j)
          #pragma unroll
          for (int h = 0; h < GQ; ++h) t[u][h] = 0.0f;
          #pragma unroll
          // a round past the end: times a zero weight
          for (int e = 0; e < EPL; ++e) vf[u][e] = 0.0f;
          if (j0 < hi) {  // the same for the whole warp (its shuffles); kw[u], vw[u] loaded
            float kf[EPL];
            fn_unpack<T, EPL>(kw[u], kf);
            fn_unpack<T, EPL>(vw[u], vf[u]);
            #pragma unroll
            for (int h = 0; h < GQ; ++h) {
              float s = 0.0f;
              #pragma unroll
              for (int e = 0; e < EPL; ++e) s += qv[h][e] * kf[e];
              #pragma unroll
              for (int x2 = LPR / 2; x2 > 0; x2 >>= 1) s += fn_shfl_xor(s, x2);
              t[u][h] = s;
            }
          }
        }
        #pragma unroll
        for (int h = 0; h < GQ; ++h) {
          float mn = m[h];
          #pragma unroll
          for (int u = 0; u < UA; ++u) if (ok[u]) mn = fmaxf(mn, t[u][h]);
          const float corr = exp2f(m[h] - mn);
          float w[UA], ws = 0.0f;
          #pragma unroll
          for (int u = 0; u < UA; ++u) { w[u] = ok[u] ? exp2f(t[u][h] - mn) : 0.0f; ws += w[u]; }
          lz[h] = lz[h] * corr + ws;
          #pragma unroll
          for (int e = 0; e < EPL; ++e) {
            float a = acc[h][e] * corr;
            #pragma unroll
            for (int u = 0; u < UA; ++u) a += w[u] * vf[u][e];
            acc[h][e] = a;
          }
          m[h] = mn;
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
          for (int e = 0; e < EPL; ++e)
            acc[h][e] = acc[h][e] * c1 + fn_shfl_xor(acc[h][e], x2) * c2;
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
        part[((head0 + h) * SMAX + split) * (D + 2) + e] = e == 0 ? M : v;
      }
