// decode_layers (kernels/step.py): every layer of a Llama-family stack for one decode row in one
// persistent launch, one block per SM, a grid barrier between the phases of a layer (post: the
// post-norms read o_proj's and down_proj's whole rows, obuf and y, at the next phase's start).
// One piece, the kernel's body (build.cuda_source wraps it in the function of the inputs); its
// header is whole_step.cuh's device piece. Its marker lines are filled by step.compose: SIZES
// (the sizes and flags in `dims`, step.SIZES), TABLE (the pointer table, step.table) and
// whole_step.cuh's LAYER and ATTEND pieces.
// @piece body
  // T, BITS, D (head size), GQ (query heads per kv head), NL (layers), SMAX, KRES, XIN:
  // template constants
  constexpr int NW = 8, PER = 32 / BITS, CW = 4 * PER;  // warps; values per word, per 16-byte chunk
  constexpr int EPL = 16 / sizeof(T), LPR = D / EPL, RPW = 32 / LPR;  // attention: a row's lanes
  // the run-time sizes and flags (dims: step.SIZES)
  {{SIZES}}
  const int NCK = K / CW;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gwarp = blockIdx.x * NW + warp, TW = NB * NW;
  const int pos = off[0], n = pos + 1;
  unsigned int* bar = const_cast<unsigned int*>(sync);
  unsigned int target = 0;
  // sized for the widest layer (HQM, HKVM, IM)
  float* raw = work;                          // NQKV: the q/k/v rows before RoPE
  float* part = raw + (HQM + 2 * HKVM) * D;   // HQ * SMAX * (D + 2): per split max, sum, values
  float* obuf = part + HQM * SMAX * (D + 2);  // K: o_proj's output
  float* abuf = obuf + K;                     // I: SwiGLU's output
  extern __shared__ float smem[];
  // laid out by KRES and XIN, template constants equal to K and XMAX: a binary's shared bytes
  // follow from its template (step.layout)
  float* pres = smem;         // K: this block's copy of the residual stream (T-rounded)
  float* xin = pres + KRES;   // XMAX: the running matvec's input row
  float* xsum = xin + XIN;    // XMAX / CW: its chunk sums
  __shared__ float red[NW];
  __shared__ const void* tab[NA * NL];
  __shared__ float qsh[GQ][D], sm[NW][GQ], sl[NW][GQ], sacc[NW][GQ][D];
  // the layers' arrays: one pointer table per block
  {{TABLE}}
  __syncthreads();
  float xs = 1.0f;  // the deferred scale of the layer's input (the previous down_proj's)
  for (int l = 0; l < NL; ++l) {
    {{LAYER}}
    const int NCO = KO / CW, NCI = I / CW;
    const int lo0 = fn_first_pos(n, W);  // the positions attended to: lo0 .. pos
    int S = (n - lo0 + 31) / 32;  // attention splits per kv head: about 32 positions or more each
    if (S > SMAX) S = SMAX;
    if (S > NB / HKV) S = NB / HKV;
    if (S < 1) S = 1;
    const int chunk = (n - lo0 + S - 1) / S;
    // 1. p = x * xs + r, s = 1/RSSe(p), the q/k/v rows of p * g (flash; rms: of RMSNorm(p),
    // rounded to T; none: of p, rounded to T), their bias added where they have one. post:
    // x * xs (rounded) through the last layer's post-feedforward norm first
    const float rpo = post && l > 0 ? fn_post_r<T>(y, xs, K, eps, red) : 0.0f;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < K; i += blockDim.x) {
      float t = l == 0 ? fn_f(x[i]) : fn_f(__ldcg(y + i)) * xs;
      if (l > 0 && post) t = fn_norm_as<T>(fn_f(fn_cast<T>(t)), rpo, g1[i - K], true);
      if (l > 0) t += pres[i];
      const float tp = fn_f(fn_cast<T>(t));
      // the norm's input: p, or (rms, post) Gemma's, the unrounded sum (kept in pres until the
      // norm has read it)
      const float u = NORM == 1 && post ? t : tp;
      pres[i] = u;
      ss += u * u;
      if (NORM != 1) fn_put(xin, i, has_g ? tp * g1[i] : tp, NCK, PER);
    }
    const float sum = fn_block_sum(ss, red);
    const float s1 = NORM == 0 ? rsqrtf(sum + K * eps) : 1.0f;
    const float P1 = prescale ? __int_as_float(__float_as_int(s1) & 0x7f800000) : 1.0f;
    // attention's: 1 where the rows took s1 with their bias (fn_qkv_out)
    const float s = qkv_bias ? 1.0f : s1, P = qkv_bias ? 1.0f : P1;
    if (NORM == 1) {  // the values this thread wrote into pres
      const float r = rsqrtf(sum / K + eps);
      for (int i = threadIdx.x; i < K; i += blockDim.x) {
        const float u = pres[i];
        pres[i] = fn_f(fn_cast<T>(u));
        fn_put(xin, i, fn_norm_as<T>(u, r, g1[i], post), NCK, PER);
      }
    }
    fn_chunk_sums(xin, xsum, NCK, CW);
    for (int row = gwarp; row < NQKV; row += TW) {
      const float a = fn_qrow<T, BITS>(wqkv, sqkv, bqkv, row, NCK, K / GS, GS, xin, xsum, lane);
      if (lane == 0) raw[row] = fn_qkv_out<T, BITS>(a, cqkv, row, NORM, s1, P1);
    }
    fn_grid_sync(bar, target += NB);
    // 2. RoPE, the cache write and attention: block (kv head, split of the positions)
    const int kvh = blockIdx.x / S, split = blockIdx.x % S;
    if (kvh < HKV) {
      const int lo = lo0 + split * chunk, hi = min(n, lo + chunk);
      const bool mine = lo <= pos && pos < hi;  // this block writes the new k and v
      const float* rbase = raw;
      const long cbase = long(kvh) * C, head0 = long(kvh) * GQ;
      {{ATTEND}}
    }
    fn_grid_sync(bar, target += NB);
    // 3. the splits merged (every block, into its input row), o_proj
    for (int e = threadIdx.x; e < KO; e += blockDim.x) {
      const float o = fn_merged(part + long(e / D) * SMAX * (D + 2), S, D, e % D);
      fn_put(xin, e, fn_f(fn_cast<T>(o)), NCO, PER);
    }
    fn_chunk_sums(xin, xsum, NCO, CW);
    for (int row = gwarp; row < K; row += TW) {
      const float a = fn_qrow<T, BITS>(wo, so, bo, row, NCO, KO / GS, GS, xin, xsum, lane);
      if (lane == 0) obuf[row] = fn_f(fn_cast<T>(a));
    }
    fn_grid_sync(bar, target += NB);
    // 4. p2 = o + p, s2 = 1/RSSe(p2), gate/up rows of p2 * g2, a = silu(gate * s2) * up * P2
    // (rms: of RMSNorm(p2), none: of p2, a = silu(gate) * up rounded as the layers round it;
    // GELU: gelu in place of silu); post: o through the post-attention norm first, and as phase 1
    const float rpa = post ? fn_post_r<T>(obuf, 1.0f, K, eps, red) : 0.0f;
    ss = 0.0f;
    for (int i = threadIdx.x; i < K; i += blockDim.x) {
      const float o = __ldcg(obuf + i);
      const float t = (post ? fn_norm_as<T>(o, rpa, g3[i], true) : o) + pres[i];
      const float tp = fn_f(fn_cast<T>(t));
      const float u = NORM == 1 && post ? t : tp;
      pres[i] = u;
      ss += u * u;
      if (NORM != 1) fn_put(xin, i, has_g ? tp * g2[i] : tp, NCK, PER);
    }
    const float sum2 = fn_block_sum(ss, red);
    const float s2 = NORM == 0 ? rsqrtf(sum2 + K * eps) : 1.0f;
    const float P2 = prescale ? __int_as_float(__float_as_int(s2) & 0x7f800000) : 1.0f;
    if (NORM == 1) {
      const float r = rsqrtf(sum2 / K + eps);
      for (int i = threadIdx.x; i < K; i += blockDim.x) {
        const float u = pres[i];
        pres[i] = fn_f(fn_cast<T>(u));
        fn_put(xin, i, fn_norm_as<T>(u, r, g2[i], post), NCK, PER);
      }
    }
    fn_chunk_sums(xin, xsum, NCK, CW);
    for (int i = gwarp; i < I; i += TW) {
      const float a0 = fn_qrow<T, BITS>(wgu, sgu, bgu, i, NCK, K / GS, GS, xin, xsum, lane);
      const float a1 = fn_qrow<T, BITS>(wgu, sgu, bgu, I + i, NCK, K / GS, GS, xin, xsum, lane);
      if (lane == 0) {
        const float g = fn_out<T, BITS>(a0, NORM, P2), u = fn_out<T, BITS>(a1, NORM, P2);
        abuf[i] = NORM == 0 ? fn_f(fn_cast<T>(fn_act<GELU>(g * s2) * u * P2))
                            : (GELU ? fn_geglu<T>(g, u) : fn_swiglu<T>(g, u));
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
