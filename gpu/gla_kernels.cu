// Chunked gated linear attention: the general kernels (any K, V; fp32/fp16/bf16 inputs; fp32
// arithmetic and states). Layout: q, k, g [B, T, H, K]; v, o [B, T, H, V]; per-chunk states
// [B*H, NT, K, V] fp32; chunk decay totals gtot [B*H, NT, K] fp32 (log space).
// Every exp() argument is <= 0: decays are taken relative to a later position of the same chunk.
//
//   gla_chunk_outer   per chunk: mode 0  sum_t (k_t * exp(bL - b_t))^T v_t   (local state)
//                                mode 1  scale * sum_t (q_t * exp(b_t))^T do_t (local d-state)
//   gla_state_scan    sequential over chunks, parallel over K*V: incoming state of every chunk
//   gla_chunk_output  per chunk: o = scale * ((q*exp(b)) S_in + tril(A) v)
//   (states come from zero-start scans; an initial state S0 / final-state gradient D enters on the fly as
//    exp(pre_c) * S0 and exp(suf_c) * D with pre/suf the log decay before / after chunk c, both <= 0)
//   gla_bwd_scores    per chunk: A (decayed q k^T, masked) and dA = do v^T (masked)
//   gla_bwd_dqdk      per chunk and K tile: dq, dk and dG = q*dq - k*dk
//   gla_bwd_dv        per chunk and V tile: dv
//   seg_chunk_sum / seg_carry / seg_finish: cumulative sums along T (decay cumsum, dg)
//   gla_state_correction: o += scale * (q * exp(G)) S_in   (ZeCO correction)
#include "gla_common.cuh"

#define GLA_NT 256  // threads per block of every kernel here

// g, q, k of one chunk (rows t < len of 64, from token t0) in K columns k0..k0+31, as fp32 (zero outside)
template <typename T>
GLA_DEVICE void load_gqk_tile(float (*gs)[33], float (*qs)[33], float (*ks)[33], const T* __restrict__ g,
                              const T* __restrict__ q, const T* __restrict__ k, int b, int h, int t0, int len,
                              int Tlen, int H, int K, int k0) {
  for (int e = threadIdx.x; e < 64 * 32; e += GLA_NT) {
    const int t = e / 32, kk = e % 32;
    float gv = 0.f, qv = 0.f, kv = 0.f;
    if (t < len && k0 + kk < K) {
      const i64 idx = ((i64)(b * Tlen + t0 + t) * H + h) * K + k0 + kk;
      gv = to_f(g[idx]);
      qv = to_f(q[idx]);
      kv = to_f(k[idx]);
    }
    gs[t][kk] = gv;
    qs[t][kk] = qv;
    ks[t][kk] = kv;
  }
}

// inclusive cumulative sum down the 64 rows of the 32 columns of bs (threads 0..31, one column each)
GLA_DEVICE void cumsum_rows64(float (*bs)[33]) {
  const int col = threadIdx.x;
  if (col < 32) {
    float run = 0.f;
    for (int t = 0; t < 64; ++t) {
      run += bs[t][col];
      bs[t][col] = run;
    }
  }
}

// row t of the decayed scores over one K tile: A[cc] += sum_kk q_t k_s exp(b_t - b_s), s = tx + 16 cc <= t < len
GLA_DEVICE void decayed_scores_row(float (&A)[4], const float (*qs)[33], const float (*ks)[33],
                                   const float (*bs)[33], int t, int tx, int len) {
#pragma unroll
  for (int cc = 0; cc < 4; ++cc) {
    const int s = tx + 16 * cc;
    if (s <= t && t < len) {
      float a = 0.f;
      for (int kk = 0; kk < 32; ++kk) a += qs[t][kk] * ks[s][kk] * dexp(bs[t][kk] - bs[s][kk]);
      A[cc] += a;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(GLA_NT) gla_chunk_outer(const T* __restrict__ left, const T* __restrict__ right,
                                                          const T* __restrict__ g, float* __restrict__ out,
                                                          float* __restrict__ gtot, int B, int Tlen, int H, int K,
                                                          int V, int C, int NT, int mode, float scale) {
  __shared__ float gs[64][33];
  __shared__ float ls[64][33];
  __shared__ float rs[64][33];
  const int c = blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;
  const int nVt = (V + 31) / 32;
  const int k0 = (blockIdx.z / nVt) * 32, v0 = (blockIdx.z % nVt) * 32;
  const int t0 = c * C, len = min(C, Tlen - t0);
  const int tid = threadIdx.x;
  for (int e = tid; e < 64 * 32; e += GLA_NT) {
    const int t = e / 32, kk = e % 32;
    float gv = 0.f, lv = 0.f, rv = 0.f;
    if (t < len && k0 + kk < K) {
      const i64 idx = ((i64)(b * Tlen + t0 + t) * H + h) * K + k0 + kk;
      gv = to_f(g[idx]);
      lv = to_f(left[idx]);
    }
    if (t < len && v0 + kk < V) rv = to_f(right[((i64)(b * Tlen + t0 + t) * H + h) * V + v0 + kk]);
    gs[t][kk] = gv;
    ls[t][kk] = lv;
    rs[t][kk] = rv;
  }
  __syncthreads();
  if (tid < 32) {
    float acc = 0.f;
    for (int t = 0; t < len; ++t) {
      acc += gs[t][tid];
      gs[t][tid] = acc;
    }
  }
  __syncthreads();
  for (int e = tid; e < 64 * 32; e += GLA_NT) {
    const int t = e / 32, kk = e % 32;
    if (t < len) {
      const float bt = gs[t][kk];
      ls[t][kk] *= (mode == 0) ? dexp(gs[len - 1][kk] - bt) : scale * dexp(bt);
    }
  }
  __syncthreads();
  const int tx = tid % 32, ty = tid / 32;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int t = 0; t < len; ++t) {
    const float r = rs[t][tx];
#pragma unroll
    for (int rr = 0; rr < 4; ++rr) acc[rr] += ls[t][ty + 8 * rr] * r;
  }
#pragma unroll
  for (int rr = 0; rr < 4; ++rr) {
    const int i = k0 + ty + 8 * rr, j = v0 + tx;
    if (i < K && j < V) out[(((i64)bh * NT + c) * K + i) * V + j] = acc[rr];
  }
  if (gtot != nullptr && blockIdx.z % nVt == 0 && tid < 32 && k0 + tid < K)
    gtot[((i64)bh * NT + c) * K + k0 + tid] = gs[len - 1][tid];
}

// st[bh, c] holds the chunk's local state on entry and its incoming state on exit (reverse: the
// gradient into the chunk's end state). S <- exp(gtot[c]) (rows) * S + local.
__global__ void __launch_bounds__(GLA_NT) gla_state_scan(float* __restrict__ st, const float* __restrict__ gtot,
                                                         const float* __restrict__ init,
                                                         float* __restrict__ final_state, int NT, int K, int V,
                                                         int reverse) {
  const int e = blockIdx.x * GLA_NT + threadIdx.x;
  if (e >= K * V) return;
  const int i = e / V;
  const i64 bh = blockIdx.y;
  const i64 KV = (i64)K * V;
  float S = init != nullptr ? init[bh * KV + e] : 0.f;
  int c = reverse ? NT - 1 : 0;
  const int step = reverse ? -1 : 1;
  float loc = st[(bh * NT + c) * KV + e];
  float gt = gtot[(bh * NT + c) * K + i];
  for (int n = 0; n < NT; ++n) {
    const int cn = c + step;
    float loc_next = 0.f, gt_next = 0.f;
    if (n + 1 < NT) {  // prefetch the next chunk before the dependent update
      loc_next = st[(bh * NT + cn) * KV + e];
      gt_next = gtot[(bh * NT + cn) * K + i];
    }
    st[(bh * NT + c) * KV + e] = S;
    S = dexp(gt) * S + loc;
    loc = loc_next;
    gt = gt_next;
    c = cn;
  }
  if (final_state != nullptr) final_state[bh * KV + e] = S;
}

// o[t, v0:v0+64] for one chunk: scale * ((q * exp(b)) S_in + tril(A) v), A_ts = sum_k q_tk k_sk exp(b_tk - b_sk)
template <typename T>
__global__ void __launch_bounds__(GLA_NT) gla_chunk_output(const T* __restrict__ q, const T* __restrict__ k,
                                                           const T* __restrict__ v, const T* __restrict__ g,
                                                           const float* __restrict__ S_in, T* __restrict__ o,
                                                           float scale, int B, int Tlen, int H, int K, int V,
                                                           int C, int NT, const float* __restrict__ S0,
                                                           const float* __restrict__ pre) {
  __shared__ float sm[3 * 64 * 33 + 32 * 65];
  float(*bs)[33] = reinterpret_cast<float(*)[33]>(sm);
  float(*qs)[33] = reinterpret_cast<float(*)[33]>(sm + 64 * 33);
  float(*ks)[33] = reinterpret_cast<float(*)[33]>(sm + 2 * 64 * 33);
  float(*Ss)[65] = reinterpret_cast<float(*)[65]>(sm + 3 * 64 * 33);
  float(*As)[65] = reinterpret_cast<float(*)[65]>(sm);            // after the K loop
  float(*vs)[65] = reinterpret_cast<float(*)[65]>(sm + 64 * 65);  // after the K loop
  const int c = blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H, v0 = blockIdx.z * 64;
  const int t0 = c * C, len = min(C, Tlen - t0);
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const float* Sc = S_in + ((i64)bh * NT + c) * K * V;
  const float* S0b = S0 != nullptr ? S0 + (i64)bh * K * V : nullptr;
  const float* prec = S0 != nullptr ? pre + ((i64)bh * NT + c) * K : nullptr;
  float acc[4][4], A[4][4];
  set_zero(acc);
  set_zero(A);

  for (int k0 = 0; k0 < K; k0 += 32) {
    load_gqk_tile<T>(bs, qs, ks, g, q, k, b, h, t0, len, Tlen, H, K, k0);
    for (int e = tid; e < 32 * 64; e += GLA_NT) {  // incoming state: zero-start scan + decayed S0
      const int kk = e / 64, j = e % 64;
      float sv = 0.f;
      if (k0 + kk < K && v0 + j < V) {
        sv = Sc[(i64)(k0 + kk) * V + v0 + j];
        if (S0b != nullptr) sv += dexp(prec[k0 + kk]) * S0b[(i64)(k0 + kk) * V + v0 + j];
      }
      Ss[kk][j] = sv;
    }
    __syncthreads();
    cumsum_rows64(bs);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int t = ty + 16 * r;
      decayed_scores_row(A[r], qs, ks, bs, t, tx, len);
      for (int kk = 0; kk < 32; ++kk) {
        const float qe = qs[t][kk] * dexp(bs[t][kk]);
#pragma unroll
        for (int cc = 0; cc < 4; ++cc) acc[r][cc] += qe * Ss[kk][tx + 16 * cc];
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int r = 0; r < 4; ++r)
#pragma unroll
    for (int cc = 0; cc < 4; ++cc) As[ty + 16 * r][tx + 16 * cc] = A[r][cc];
  for (int e = tid; e < 64 * 64; e += GLA_NT) {
    const int s = e / 64, j = e % 64;
    vs[s][j] = (s < len && v0 + j < V) ? to_f(v[((i64)(b * Tlen + t0 + s) * H + h) * V + v0 + j]) : 0.f;
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int t = ty + 16 * r;
    for (int s = 0; s <= t; ++s) {
      const float a = As[t][s];
#pragma unroll
      for (int cc = 0; cc < 4; ++cc) acc[r][cc] += a * vs[s][tx + 16 * cc];
    }
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int t = ty + 16 * r;
#pragma unroll
    for (int cc = 0; cc < 4; ++cc) {
      const int j = v0 + tx + 16 * cc;
      if (t < len && j < V) o[((i64)(b * Tlen + t0 + t) * H + h) * V + j] = from_f<T>(scale * acc[r][cc]);
    }
  }
}

// A[t, s] = sum_k q_tk k_sk exp(b_tk - b_sk) and dA[t, s] = sum_j do_tj v_sj for s <= t < len, else 0.
// Stored as [B*H, NT, 64, 64] fp32.
template <typename T>
__global__ void __launch_bounds__(GLA_NT) gla_bwd_scores(const T* __restrict__ q, const T* __restrict__ k,
                                                         const T* __restrict__ v, const T* __restrict__ g,
                                                         const T* __restrict__ dout, float* __restrict__ Aout,
                                                         float* __restrict__ dAout, int B, int Tlen, int H, int K,
                                                         int V, int C, int NT) {
  __shared__ float bs[64][33];
  __shared__ float qs[64][33];
  __shared__ float ks[64][33];
  const int c = blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;
  const int t0 = c * C, len = min(C, Tlen - t0);
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  float A[4][4], dA[4][4];
  set_zero(A);
  set_zero(dA);
  for (int k0 = 0; k0 < K; k0 += 32) {
    load_gqk_tile<T>(bs, qs, ks, g, q, k, b, h, t0, len, Tlen, H, K, k0);
    __syncthreads();
    cumsum_rows64(bs);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 4; ++r) decayed_scores_row(A[r], qs, ks, bs, ty + 16 * r, tx, len);
    __syncthreads();
  }
  for (int v0 = 0; v0 < V; v0 += 32) {  // qs <- do tile, ks <- v tile
    for (int e = tid; e < 64 * 32; e += GLA_NT) {
      const int t = e / 32, jj = e % 32;
      float dv = 0.f, vv = 0.f;
      if (t < len && v0 + jj < V) {
        const i64 idx = ((i64)(b * Tlen + t0 + t) * H + h) * V + v0 + jj;
        dv = to_f(dout[idx]);
        vv = to_f(v[idx]);
      }
      qs[t][jj] = dv;
      ks[t][jj] = vv;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int t = ty + 16 * r;
#pragma unroll
      for (int cc = 0; cc < 4; ++cc) {
        const int s = tx + 16 * cc;
        if (s <= t && t < len) {
          float a = 0.f;
          for (int jj = 0; jj < 32; ++jj) a += qs[t][jj] * ks[s][jj];
          dA[r][cc] += a;
        }
      }
    }
    __syncthreads();
  }
  const i64 base = ((i64)bh * NT + c) * 64 * 64;
#pragma unroll
  for (int r = 0; r < 4; ++r)
#pragma unroll
    for (int cc = 0; cc < 4; ++cc) {
      const int t = ty + 16 * r, s = tx + 16 * cc;
      Aout[base + t * 64 + s] = A[r][cc];
      dAout[base + t * 64 + s] = dA[r][cc];
    }
}

// dq, dk for one chunk and one K tile of 32; dG = q*dq - k*dk (fp32, [B, T, H, K]).
//   dq_tk = scale (exp(b_tk) sum_j do_tj S_in[k, j] + sum_{s<=t} dA_ts k_sk exp(b_tk - b_sk))
//   dk_sk = scale sum_{t>=s} dA_ts q_tk exp(b_tk - b_sk) + exp(bL_k - b_sk) sum_j v_sj dS[k, j]
template <typename T>
__global__ void __launch_bounds__(GLA_NT) gla_bwd_dqdk(const T* __restrict__ q, const T* __restrict__ k,
                                                       const T* __restrict__ v, const T* __restrict__ g,
                                                       const T* __restrict__ dout, const float* __restrict__ S_in,
                                                       const float* __restrict__ dS, const float* __restrict__ dAin,
                                                       T* __restrict__ dq, T* __restrict__ dk,
                                                       float* __restrict__ dG, float scale, int B, int Tlen, int H,
                                                       int K, int V, int C, int NT, const float* __restrict__ S0,
                                                       const float* __restrict__ pre, const float* __restrict__ D,
                                                       const float* __restrict__ suf) {
  __shared__ float sm[3 * 64 * 33 + 64 * 65];
  // phase 1 (V loop)
  float(*dos)[33] = reinterpret_cast<float(*)[33]>(sm);
  float(*vs)[33] = reinterpret_cast<float(*)[33]>(sm + 64 * 33);
  float(*Ss)[33] = reinterpret_cast<float(*)[33]>(sm + 2 * 64 * 33);
  float(*dSs)[33] = reinterpret_cast<float(*)[33]>(sm + 2 * 64 * 33 + 32 * 33);
  // phase 2
  float(*bs)[33] = reinterpret_cast<float(*)[33]>(sm);
  float(*qs)[33] = reinterpret_cast<float(*)[33]>(sm + 64 * 33);
  float(*ks)[33] = reinterpret_cast<float(*)[33]>(sm + 2 * 64 * 33);
  float(*dAs)[65] = reinterpret_cast<float(*)[65]>(sm + 3 * 64 * 33);

  const int c = blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H, k0 = blockIdx.z * 32;
  const int t0 = c * C, len = min(C, Tlen - t0);
  const int tid = threadIdx.x, kk = tid % 32, ty = tid / 32;  // rows t = ty + 8 r
  const float* Sc = S_in + ((i64)bh * NT + c) * K * V;
  const float* dSc = dS + ((i64)bh * NT + c) * K * V;
  const float* S0b = S0 != nullptr ? S0 + (i64)bh * K * V : nullptr;
  const float* Db = D != nullptr ? D + (i64)bh * K * V : nullptr;
  float P[8], R[8];
#pragma unroll
  for (int r = 0; r < 8; ++r) P[r] = R[r] = 0.f;
  for (int v0 = 0; v0 < V; v0 += 32) {
    for (int e = tid; e < 64 * 32; e += GLA_NT) {
      const int t = e / 32, jj = e % 32;
      float a = 0.f, bb = 0.f;
      if (t < len && v0 + jj < V) {
        const i64 idx = ((i64)(b * Tlen + t0 + t) * H + h) * V + v0 + jj;
        a = to_f(dout[idx]);
        bb = to_f(v[idx]);
      }
      dos[t][jj] = a;
      vs[t][jj] = bb;
    }
    for (int e = tid; e < 32 * 32; e += GLA_NT) {  // zero-start states + decayed S0 / D
      const int i = e / 32, jj = e % 32;
      float sv = 0.f, dv = 0.f;
      if (k0 + i < K && v0 + jj < V) {
        const i64 ij = (i64)(k0 + i) * V + v0 + jj;
        sv = Sc[ij];
        dv = dSc[ij];
        if (S0b != nullptr) sv += dexp(pre[((i64)bh * NT + c) * K + k0 + i]) * S0b[ij];
        if (Db != nullptr) dv += dexp(suf[((i64)bh * NT + c) * K + k0 + i]) * Db[ij];
      }
      Ss[i][jj] = sv;
      dSs[i][jj] = dv;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      const int t = ty + 8 * r;
      float p = 0.f, rr = 0.f;
      for (int jj = 0; jj < 32; ++jj) {
        p += dos[t][jj] * Ss[kk][jj];
        rr += vs[t][jj] * dSs[kk][jj];
      }
      P[r] += p;
      R[r] += rr;
    }
    __syncthreads();
  }
  load_gqk_tile<T>(bs, qs, ks, g, q, k, b, h, t0, len, Tlen, H, K, k0);
  const float* dAc = dAin + ((i64)bh * NT + c) * 64 * 64;
  for (int e = tid; e < 64 * 64; e += GLA_NT) dAs[e / 64][e % 64] = dAc[e];
  __syncthreads();
  cumsum_rows64(bs);
  __syncthreads();
  const float bL = bs[len - 1][kk];
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    const int t = ty + 8 * r;
    if (t >= len || k0 + kk >= K) continue;
    const float bt = bs[t][kk];
    float dqa = dexp(bt) * P[r];
    for (int s = 0; s <= t; ++s) dqa += dAs[t][s] * ks[s][kk] * dexp(bt - bs[s][kk]);
    float dka = 0.f;
    for (int u = t; u < len; ++u) dka += dAs[u][t] * qs[u][kk] * dexp(bs[u][kk] - bt);
    const float dqv = scale * dqa;
    const float dkv = scale * dka + dexp(bL - bt) * R[r];
    const i64 idx = ((i64)(b * Tlen + t0 + t) * H + h) * K + k0 + kk;
    dq[idx] = from_f<T>(dqv);
    dk[idx] = from_f<T>(dkv);
    dG[idx] = qs[t][kk] * dqv - ks[t][kk] * dkv;
  }
}

// dv[s, j] = scale sum_{t>=s} A_ts do_tj + sum_k k_sk exp(bL_k - b_sk) dS[k, j]; one chunk, V tile of 64.
template <typename T>
__global__ void __launch_bounds__(GLA_NT) gla_bwd_dv(const T* __restrict__ k, const T* __restrict__ g,
                                                     const T* __restrict__ dout, const float* __restrict__ Ain,
                                                     const float* __restrict__ dS, T* __restrict__ dv, float scale,
                                                     int B, int Tlen, int H, int K, int V, int C, int NT,
                                                     const float* __restrict__ D, const float* __restrict__ suf) {
  __shared__ float sm[2 * 64 * 65];
  float(*bs)[33] = reinterpret_cast<float(*)[33]>(sm);
  float(*ks)[33] = reinterpret_cast<float(*)[33]>(sm + 64 * 33);
  float(*dSs)[65] = reinterpret_cast<float(*)[65]>(sm + 2 * 64 * 33);
  float(*As)[65] = reinterpret_cast<float(*)[65]>(sm);
  float(*dos)[65] = reinterpret_cast<float(*)[65]>(sm + 64 * 65);
  const int c = blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H, v0 = blockIdx.z * 64;
  const int t0 = c * C, len = min(C, Tlen - t0);
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const float* dSc = dS + ((i64)bh * NT + c) * K * V;
  const float* Db = D != nullptr ? D + (i64)bh * K * V : nullptr;
  float acc[4][4], acc2[4][4];
  set_zero(acc);
  set_zero(acc2);
  for (int k0 = 0; k0 < K; k0 += 32) {
    for (int e = tid; e < 64 * 32; e += GLA_NT) {
      const int t = e / 32, i = e % 32;
      float gv = 0.f, kv = 0.f;
      if (t < len && k0 + i < K) {
        const i64 idx = ((i64)(b * Tlen + t0 + t) * H + h) * K + k0 + i;
        gv = to_f(g[idx]);
        kv = to_f(k[idx]);
      }
      bs[t][i] = gv;
      ks[t][i] = kv;
    }
    for (int e = tid; e < 32 * 64; e += GLA_NT) {  // zero-start d-state + decayed D
      const int i = e / 64, j = e % 64;
      float dv = 0.f;
      if (k0 + i < K && v0 + j < V) {
        dv = dSc[(i64)(k0 + i) * V + v0 + j];
        if (Db != nullptr) dv += dexp(suf[((i64)bh * NT + c) * K + k0 + i]) * Db[(i64)(k0 + i) * V + v0 + j];
      }
      dSs[i][j] = dv;
    }
    __syncthreads();
    cumsum_rows64(bs);
    __syncthreads();
    for (int e = tid; e < 64 * 32; e += GLA_NT) {
      const int t = e / 32, i = e % 32;
      if (t < len) ks[t][i] *= dexp(bs[len - 1][i] - bs[t][i]);
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int s = ty + 16 * r;
      for (int i = 0; i < 32; ++i) {
        const float kv = ks[s][i];
#pragma unroll
        for (int cc = 0; cc < 4; ++cc) acc[r][cc] += kv * dSs[i][tx + 16 * cc];
      }
    }
    __syncthreads();
  }
  const float* Ac = Ain + ((i64)bh * NT + c) * 64 * 64;
  for (int e = tid; e < 64 * 64; e += GLA_NT) {
    const int t = e / 64, j = e % 64;
    As[t][j] = Ac[e];
    dos[t][j] = (t < len && v0 + j < V) ? to_f(dout[((i64)(b * Tlen + t0 + t) * H + h) * V + v0 + j]) : 0.f;
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int s = ty + 16 * r;
    for (int t = s; t < 64; ++t) {
      const float a = As[t][s];
#pragma unroll
      for (int cc = 0; cc < 4; ++cc) acc2[r][cc] += a * dos[t][tx + 16 * cc];
    }
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int s = ty + 16 * r;
#pragma unroll
    for (int cc = 0; cc < 4; ++cc) {
      const int j = v0 + tx + 16 * cc;
      if (s < len && j < V) dv[((i64)(b * Tlen + t0 + s) * H + h) * V + j] = from_f<T>(scale * acc2[r][cc] + acc[r][cc]);
    }
  }
}

// ---- cumulative sums along T of an [B, T, H, K] array, in chunks of C ---------------------------
// ctot[bh, c, i] = sum over the chunk of x
template <typename Tin>
__global__ void __launch_bounds__(GLA_NT) seg_chunk_sum(const Tin* __restrict__ x, float* __restrict__ ctot, int B,
                                                        int Tlen, int H, int K, int C, int NT) {
  const int c = blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;
  const int t0 = c * C, len = min(C, Tlen - t0);
  for (int i = threadIdx.x; i < K; i += GLA_NT) {
    float acc = 0.f;
    for (int t = 0; t < len; ++t) acc += to_f(x[((i64)(b * Tlen + t0 + t) * H + h) * K + i]);
    ctot[((i64)bh * NT + c) * K + i] = acc;
  }
}

// exclusive scan of ctot over chunks (forward or reverse), starting from base[bh, i] (or 0); in place
__global__ void __launch_bounds__(GLA_NT) seg_carry(float* __restrict__ ctot, const float* __restrict__ base, int BH,
                                                    int K, int NT, int reverse) {
  const int e = blockIdx.x * GLA_NT + threadIdx.x;
  if (e >= BH * K) return;
  const int bh = e / K, i = e % K;
  float run = base != nullptr ? base[e] : 0.f;
  for (int n = 0; n < NT; ++n) {
    const int c = reverse ? NT - 1 - n : n;
    const i64 idx = ((i64)bh * NT + c) * K + i;
    const float x = ctot[idx];
    ctot[idx] = run;
    run += x;
  }
}

// out[t] = carry + inclusive (reverse: suffix) sum of x within the chunk
template <typename Tin, typename Tout>
__global__ void __launch_bounds__(GLA_NT) seg_finish(const Tin* __restrict__ x, const float* __restrict__ carry,
                                                     Tout* __restrict__ out, int B, int Tlen, int H, int K, int C,
                                                     int NT, int reverse) {
  const int c = blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;
  const int t0 = c * C, len = min(C, Tlen - t0);
  for (int i = threadIdx.x; i < K; i += GLA_NT) {
    float acc = carry[((i64)bh * NT + c) * K + i];
    for (int n = 0; n < len; ++n) {
      const int t = reverse ? len - 1 - n : n;
      const i64 idx = ((i64)(b * Tlen + t0 + t) * H + h) * K + i;
      acc += to_f(x[idx]);
      out[idx] = from_f<Tout>(acc);
    }
  }
}

// ZeCO correction: o[t, v0:v0+64] += scale * sum_k q_tk exp(G_tk) S_in[k, j]; 64 tokens per block.
// G is the inclusive cumulative log decay from the slice start (fp32, [B, T, H, K]); S_in [B*H, K, V].
template <typename T>
__global__ void __launch_bounds__(GLA_NT) gla_state_correction(T* __restrict__ o, const T* __restrict__ q,
                                                               const float* __restrict__ G,
                                                               const float* __restrict__ S_in, float scale, int B,
                                                               int Tlen, int H, int K, int V) {
  __shared__ float qe[64][33];
  __shared__ float Ss[32][65];
  const int bh = blockIdx.y, b = bh / H, h = bh % H, v0 = blockIdx.z * 64, t0 = blockIdx.x * 64;
  const int len = min(64, Tlen - t0);
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const float* Sb = S_in + (i64)bh * K * V;
  float acc[4][4];
  set_zero(acc);
  for (int k0 = 0; k0 < K; k0 += 32) {
    for (int e = tid; e < 64 * 32; e += GLA_NT) {
      const int t = e / 32, i = e % 32;
      float val = 0.f;
      if (t < len && k0 + i < K) {
        const i64 idx = ((i64)(b * Tlen + t0 + t) * H + h) * K + k0 + i;
        val = to_f(q[idx]) * dexp(G[idx]);
      }
      qe[t][i] = val;
    }
    for (int e = tid; e < 32 * 64; e += GLA_NT) {
      const int i = e / 64, j = e % 64;
      Ss[i][j] = (k0 + i < K && v0 + j < V) ? Sb[(i64)(k0 + i) * V + v0 + j] : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int t = ty + 16 * r;
      for (int i = 0; i < 32; ++i) {
        const float a = qe[t][i];
#pragma unroll
        for (int cc = 0; cc < 4; ++cc) acc[r][cc] += a * Ss[i][tx + 16 * cc];
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int t = ty + 16 * r;
#pragma unroll
    for (int cc = 0; cc < 4; ++cc) {
      const int j = v0 + tx + 16 * cc;
      if (t < len && j < V) {
        const i64 idx = ((i64)(b * Tlen + t0 + t) * H + h) * V + j;
        o[idx] = from_f<T>(to_f(o[idx]) + scale * acc[r][cc]);
      }
    }
  }
}

#ifdef GLA_INSTANTIATE  // explicit instantiations for the offline nvcc build check (NVRTC uses name expressions)
#define GLA_INST_T(T)                                                                                                \
  template __global__ void gla_chunk_outer<T>(const T*, const T*, const T*, float*, float*, int, int, int, int, int, \
                                              int, int, int, float);                                                 \
  template __global__ void gla_chunk_output<T>(const T*, const T*, const T*, const T*, const float*, T*, float, int,  \
                                               int, int, int, int, int, int, const float*, const float*);            \
  template __global__ void gla_bwd_scores<T>(const T*, const T*, const T*, const T*, const T*, float*, float*, int,  \
                                             int, int, int, int, int, int);                                          \
  template __global__ void gla_bwd_dqdk<T>(const T*, const T*, const T*, const T*, const T*, const float*,           \
                                           const float*, const float*, T*, T*, float*, float, int, int, int, int,    \
                                           int, int, int, const float*, const float*, const float*, const float*);   \
  template __global__ void gla_bwd_dv<T>(const T*, const T*, const T*, const float*, const float*, T*, float, int,   \
                                         int, int, int, int, int, int, const float*, const float*);                  \
  template __global__ void seg_chunk_sum<T>(const T*, float*, int, int, int, int, int, int);                         \
  template __global__ void gla_state_correction<T>(T*, const T*, const float*, const float*, float, int, int, int,   \
                                                   int, int);
#define GLA_INST_SEG(A, B) \
  template __global__ void seg_finish<A, B>(const A*, const float*, B*, int, int, int, int, int, int, int);
GLA_INST_T(f16)  // the 16-bit types carry the inline PTX conversions
GLA_INST_SEG(f16, float)
GLA_INST_SEG(float, bf16)
#ifndef GLA_INSTANTIATE_FAST  // every instantiation the Python wrappers name
GLA_INST_T(float)
GLA_INST_T(bf16)
GLA_INST_SEG(float, float)
GLA_INST_SEG(bf16, float)
GLA_INST_SEG(float, f16)
#endif
#endif
