// decode_chunk (kernels/chunk.py): `steps` greedy decode steps of one row in one persistent launch.
// Its body is step.cu's, with this file's open and close pieces on step.cu's STEPS_OPEN and
// STEPS_CLOSE lines (chunk.source): a loop over the steps around decode_layers' layers, each step
// ending in the final norm, the LM head's matvec, a grid-wide argmax and the token's embedding row,
// which the next step's first layer reads. Three pieces:
//   device  the header's functions: an embedding row (fn_embed), the argmax's order (fn_better)
//   open    the chunk's sizes (FIELDS: chunk.FIELDS, in `cdims`), its buffers, the first step's
//           input row (the embedding of prev[0]); the loop opened, each step's position and input
//           row: `pos`, `n` and `x`, which step.cu's layers read (pos and n shadow the launch's,
//           off[0]: the first step's)
//   close   after the last layer: the final norm in the mode NORM (as the model's modules round
//           it: flash, the final DeferredNorm's add_rss and the head's deferred scale; rms,
//           RMSNorm as the layers'; none, the residual add), the head's rows (4- or 8-bit: HBITS,
//           run-time) rounded to T, each block's largest and, after a grid barrier, every
//           block's; block 0 writes the token; the next input row; the loop closed
// @piece device
template <typename T>
__device__ inline void fn_embed(const unsigned int* w, const T* sc, const T* bi, long token, int K,
                                int gs, int bits, float* row) {
  // row `token` of an affine `bits`-bit embedding (K values in groups of gs) into `row`, each value
  // scale * q + bias rounded to T, as mx.dequantize gives it
  const int per = 32 / bits, mask = (1 << bits) - 1;
  const unsigned int* wr = w + token * (K / per);
  const T* s = sc + token * (K / gs);
  const T* b = bi + token * (K / gs);
  for (int i = threadIdx.x; i < K; i += blockDim.x) {
    const float q = float((wr[i / per] >> (bits * (i % per))) & mask);
    row[i] = fn_f(fn_cast<T>(fn_f(s[i / gs]) * q + fn_f(b[i / gs])));
  }
}
__device__ inline bool fn_better(float v, int id, float best, int best_id) {
  // the argmax's order: a larger value, or the same value at a lower id (mx.argmax's first
  // maximum); a NaN is never better
  return v > best || (v == best && id < best_id);
}
// @piece open
  // the chunk's sizes (cdims: chunk.FIELDS)
  {{FIELDS}}
  const int PERH = 32 / HBITS, CWH = 4 * PERH, NCH = K / CWH;  // the head's words and chunks
  float* erow = xsum + XMAX / 16;  // K: the step's input row (xsum is sized for 8-bit chunks)
  float* amax = work + WORK;       // NB: each block's largest logit (after decode_layers' work)
  int* aid = reinterpret_cast<int*>(amax + NB);  // NB: its token
  __shared__ float wmax[NW];
  __shared__ int wid[NW], token;
  fn_embed<T>(ew, es, eb, long(prev[0]), K, EGS, EBITS, erow);
  for (int it = 0; it < steps[0]; ++it) {
    const int pos = off[0] + it, n = pos + 1;  // this step's position, the positions it attends
    const float* x = erow;  // this step's input row
    __syncthreads();        // (erow written)
// @piece close
    fn_grid_sync(bar, target += NB);  // every block's rows of the last down_proj in y
    // the final norm: p = y * xs + r (T), the head's input row: flash p * g * P (T; s / P on the
    // head's output), rms RMSNorm(p) with the final norm's weights (hg), none p
    float fss = 0.0f;
    for (int i = threadIdx.x; i < K; i += blockDim.x) {
      const float tp = fn_f(fn_cast<T>(fn_f(__ldcg(y + i)) * xs + pres[i]));
      pres[i] = tp;
      fss += tp * tp;
    }
    const float fsum = fn_block_sum(fss, red);
    const float fs = rsqrtf(fsum + K * heps), fr = rsqrtf(fsum / K + heps);
    const float FP = prescale ? __int_as_float(__float_as_int(fs) & 0x7f800000) : 1.0f;
    for (int i = threadIdx.x; i < K; i += blockDim.x) {
      const float v = NORM == 0 ? fn_f(fn_cast<T>(pres[i] * (has_hg ? hg[i] : 1.0f) * FP))
                    : (NORM == 1 ? fn_normed<T>(pres[i], fr, hg[i]) : pres[i]);
      fn_put(xin, i, v, NCH, PERH);
    }
    fn_chunk_sums(xin, xsum, NCH, CWH);
    // the head's rows: each logit rounded to T (flash: times s / P, rounded again), a warp's
    // largest kept (its rows ascend: the first of equal ones), then the block's
    const float fscale = NORM == 0 ? fs / FP : 1.0f;
    float best = -__int_as_float(0x7f800000);  // -inf
    int bid = V;                              // none yet
    for (int row = gwarp; row < V; row += TW) {
      const float a = HBITS == 8
          ? fn_qrow<T, 8>(hw, hsc, hbi, row, NCH, K / HGS, HGS, xin, xsum, lane)
          : fn_qrow<T, 4>(hw, hsc, hbi, row, NCH, K / HGS, HGS, xin, xsum, lane);
      float v = fn_f(fn_cast<T>(a));
      if (NORM == 0) v = fn_f(fn_cast<T>(v * fscale));
      if (fn_better(v, row, best, bid)) { best = v; bid = row; }
    }
    if (lane == 0) { wmax[warp] = best; wid[warp] = bid; }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < NW; ++w)
        if (fn_better(wmax[w], wid[w], best, bid)) { best = wmax[w]; bid = wid[w]; }
      amax[blockIdx.x] = best;
      aid[blockIdx.x] = bid;
    }
    fn_grid_sync(bar, target += NB);  // every block's largest
    if (threadIdx.x == 0) {  // the same token in every block (one order over the same values)
      best = -__int_as_float(0x7f800000);
      bid = V;
      for (int b = 0; b < NB; ++b) {
        const float v = __ldcg(amax + b);
        const int id = __ldcg(aid + b);
        if (fn_better(v, id, best, bid)) { best = v; bid = id; }
      }
      token = bid < V ? bid : 0;  // every logit NaN: token 0, never a row past the embedding
      if (blockIdx.x == 0) tokens[it] = token;
    }
    __syncthreads();
    if (it + 1 < steps[0]) fn_embed<T>(ew, es, eb, long(token), K, EGS, EBITS, erow);
  }
