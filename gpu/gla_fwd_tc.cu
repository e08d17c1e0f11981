// Chunk-parallel tensor-core GLA forward output, 16-bit inputs (bf16 / fp16), K and V multiples of 16 up to KM.
// One CTA (256 threads) per chunk of 64 tokens and bh; the chunk's incoming state comes from the state walk
// (gla_tc_states.cu): h = Hc[c] + exp(pc[c]) * Sf[c / NC], so no CTA waits on another.
//   o = scale * (A V + (q exp(b)) h),  A_ts = sum_k q_tk k_sk exp(b_tk - b_sk) for s <= t (gla_tc_chunk.cuh).
// Precision: the diagonal sub-chunk blocks of A (its largest entries) use split operands (hi + lo bf16, three
// products) and A enters A V as hi + lo (two products), so o's error is close to its own bf16 rounding.
// Two kernels compute the same:
//   glatc_fwd_out (the default at KM 128): ~90 KB of shared memory at KM 128, so two CTAs share an SM. The cumulative gate
//     stays in registers (in shared memory only when a diagonal block needs the exact elementwise path), the
//     scores are summed over two halves of K at KM 128 (one half's operands in shared memory at a time), and the
//     state h and q exp(b) are formed after the scores, in the zone the score operands used.
//   glatc_fwd_wide (the default at KM 64, where it fits two CTAs per SM too): every operand in shared memory at
//     once (200 KB at KM 128: one CTA per SM).
#include "gla_tc_chunk.cuh"

// o = scale * (A V + Qe h) for the chunk (As, Asl: A hi / lo; Vs, Qe: row stride P; Hs: [K][P]): warp w -> rows
// 16 (w % 4), half (w / 4) of the 16-column groups of V. After a barrier that follows the operands.
template <typename T, int KM>
GLA_DEVICE void gt_fwd_output(T* __restrict__ o, const u16* As, const u16* Asl, const u16* Vs, const u16* Qe,
                              const u16* Hs, float scale, int b, int Tlen, int H, int h, int t0, int K, int V,
                              int len, int w, int lane) {
  using L = GtLayout<KM>;
  constexpr int NPW = KM / 32;  // 16-column groups of V per warp
  const int gid = lane >> 2, tig = lane & 3;
  {
    const int I = w & 3, half = w >> 2, np = V / 16, pw = (np + 1) / 2, p0 = half * pw, p1 = min(np, p0 + pw);
    if (p0 < np && 16 * I < len) {
      float acc[2 * NPW][4];
#pragma unroll
      for (int n = 0; n < 2 * NPW; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
      for (int J = 0; J <= I; ++J) {
        u32 a[4], al[4];
        frag_a(a, As, L::AP, 16 * I, 16 * J, gid, tig);
        frag_a(al, Asl, L::AP, 16 * I, 16 * J, gid, tig);
#pragma unroll
        for (int pp = 0; pp < NPW; ++pp) {
          if (p0 + pp < p1) {
            u32 b0[2], b1[2];
            frag_b2_rowmajor(b0, b1, Vs, L::P, 16 * J, 16 * (p0 + pp), lane);
            Mma<T>::mma(acc[2 * pp], a, b0);
            Mma<T>::mma(acc[2 * pp + 1], a, b1);
            Mma<T>::mma(acc[2 * pp], al, b0);
            Mma<T>::mma(acc[2 * pp + 1], al, b1);
          }
        }
      }
      for (int ks = 0; ks < K / 16; ++ks) {
        u32 a[4];
        frag_a(a, Qe, L::P, 16 * I, 16 * ks, gid, tig);
#pragma unroll
        for (int pp = 0; pp < NPW; ++pp) {
          if (p0 + pp < p1) {
            u32 b0[2], b1[2];
            frag_b2_rowmajor(b0, b1, Hs, L::P, 16 * ks, 16 * (p0 + pp), lane);
            Mma<T>::mma(acc[2 * pp], a, b0);
            Mma<T>::mma(acc[2 * pp + 1], a, b1);
          }
        }
      }
      gt_store_tile<T, NPW>(o, acc, b, h, t0, len, Tlen, H, V, I, p0, p1, gid, tig, scale);
    }
  }
}

template <typename T, int KM, bool F32S>
__global__ void __launch_bounds__(256, 2)
    glatc_fwd_out(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ g,
                  const void* __restrict__ Hc, const float* __restrict__ Sf, const float* __restrict__ pc,
                  T* __restrict__ o, float scale, int B, int Tlen, int H, int K, int V, int NC, int NT,
                  float span_limit) {
  using L = GtLayout<KM>;
  constexpr int KH = L::KH, PH = L::PH;
  GT_DYN_SMEM(smem, L::O_TOTAL);
  u16* Vs = reinterpret_cast<u16*>(smem + L::O_V);
  u16* As = reinterpret_cast<u16*>(smem + L::O_AS);
  u16* Asl = As + 64 * L::AP;
  u16* Qh = reinterpret_cast<u16*>(smem + L::O_Z);  // one piece of K of the score operands, row stride PH
  u16* Kh = Qh + 64 * PH;
  u16* Qhl = Kh + 64 * PH;
  u16* Khl = Qhl + 64 * PH;
  u16* Ko = Khl + 64 * PH;
  float* bs = reinterpret_cast<float*>(smem + L::O_Z);  // exact blocks only, before the operands
  u16* Qe = Qh;                                         // after the scores, row stride P
  u16* Hs = Qe + 64 * L::P;
  float* R = reinterpret_cast<float*>(smem + L::O_SMALL);
  float* E = R + 4 * KM;
  float* sp = E + 4 * KM;
  const int c = blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;
  const int t0 = 64 * c, len = min(64, Tlen - t0), NS = (NT + NC - 1) / NC, seg = c / NC;
  const int tid = threadIdx.x, w = tid / 32, lane = tid % 32, gid = lane >> 2, tig = lane & 3;
  const int cg = tid >> 4, qr = tid & 15, c0 = 8 * cg;
  const bool actK = c0 < K, actV = c0 < V;
  const i64 row0 = ((i64)(b * Tlen + t0) * H + h) * K;

  // (0) loads, cumulative gate (x: rows qr + 16 I, columns c0 ..), sub-chunk boundaries and spans
  V16 qraw[4], kraw[4];
  float x[4][8];
  {
    V16 gr[4];
    gt_load_chunk<T, KM>(qraw, kraw, gr, Vs, q, k, v, g, b, h, t0, len, Tlen, H, K, V, c0, actK, actV, qr);
#pragma unroll
    for (int I = 0; I < 4; ++I) gt_unpack<T>(x[I], gr[I]);
    gt_chunk_cumsum(x, qr);
    gt_store_decays<KM>(nullptr, R, E, x, c0, actK, qr);
  }
  __syncthreads();
  gt_spans<KM>(sp, R, E, K, w, lane);
  __syncthreads();
  float spn[4];
#pragma unroll
  for (int I = 0; I < 4; ++I) spn[I] = sp[I];
  // diagonal blocks beyond the span limit: elementwise, exactly, from bs (the same decision in every thread)
  if (spn[0] > span_limit || spn[1] > span_limit || spn[2] > span_limit || spn[3] > span_limit) {
    if (actK) {
#pragma unroll
      for (int I = 0; I < 4; ++I) gt_st8f(bs + (qr + 16 * I) * L::BP + c0, x[I]);
    }
    __syncthreads();
    if (w < 4 && spn[w] > span_limit)
      gt_score_block<T, KM>(As, Asl, nullptr, nullptr, nullptr, nullptr, nullptr, bs, spn, 1.f, span_limit, q + row0,
                            k + row0, (i64)H * K, K, len, w, w, lane);
    __syncthreads();
  }
  // (1) intra-chunk scores on tensor cores: blocks w and w + 8 (of the 10 with I >= J), summed over the pieces
  int bI[2], bJ[2];
  bool on[2];
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    const int blk = w + 8 * n;
    gt_block_ij(blk < 10 ? blk : 0, bI[n], bJ[n]);
    on[n] = blk < 10 && !(bI[n] == bJ[n] && spn[bI[n]] > span_limit);
  }
  float acc[2][2][4];
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) acc[n][nt][0] = acc[n][nt][1] = acc[n][nt][2] = acc[n][nt][3] = 0.f;
#pragma unroll
  for (int hf = 0; hf < L::NH; ++hf) {
    const int k0 = hf * KH, nks = min(KH, K - k0) / 16;
    if (nks <= 0) break;
    if (actK && c0 >= k0 && c0 < k0 + KH) {
#pragma unroll
      for (int I = 0; I < 4; ++I)
        gt_score_operand_row<T, KM, PH>(Qh, Kh, Qhl, Khl, Ko, qraw[I], kraw[I], x[I], R, span_limit, c0, c0 - k0,
                                        qr, I);
    }
    __syncthreads();
#pragma unroll
    for (int n = 0; n < 2; ++n)
      if (on[n]) gt_score_mma<T, PH>(acc[n], Qh, Kh, Qhl, Khl, Ko, nks, bI[n], bJ[n], gid, tig);
    __syncthreads();
  }
#pragma unroll
  for (int n = 0; n < 2; ++n)
    if (on[n]) gt_score_store<T, KM>(As, Asl, acc[n], 1.f, bI[n], bJ[n], gid, tig);
  // (2) Qe = q exp(b) and the chunk's state h into the zone
  if (actK) {
#pragma unroll
    for (int I = 0; I < 4; ++I) {
      float qv[8];
      gt_unpack<T>(qv, qraw[I]);
#pragma unroll
      for (int j = 0; j < 8; ++j) qv[j] *= dexp(x[I][j]);
      gt_st16(Qe + (qr + 16 * I) * L::P + c0, gt_pack<T>(qv));
    }
  }
  {
    const i64 cKV = ((i64)bh * NT + c) * K * V;
    const void* Hcc = reinterpret_cast<const unsigned char*>(Hc) + cKV * (F32S ? 4 : 2);
    const float* Sfs = Sf != nullptr ? Sf + ((i64)bh * NS + seg) * K * V : nullptr;
    gt_state_operands<T, F32S, KM, KM * KM / 4096>(Hs, Hcc, Sfs, pc + ((i64)bh * NT + c) * K, nullptr, nullptr,
                                                   nullptr, nullptr, nullptr, K, V);
  }
  __syncthreads();
  // (3) o = scale * (A V + Qe h): warp w -> rows 16 (w % 4), half (w / 4) of the 16-column groups of V
  gt_fwd_output<T, KM>(o, As, Asl, Vs, Qe, Hs, scale, b, Tlen, H, h, t0, K, V, len, w, lane);
}

template <typename T, int KM, bool F32S>
__global__ void __launch_bounds__(256, KM == 64 ? 2 : 1)
    glatc_fwd_wide(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ g,
                  const void* __restrict__ Hc, const float* __restrict__ Sf, const float* __restrict__ pc,
                  T* __restrict__ o, float scale, int B, int Tlen, int H, int K, int V, int NC, int NT,
                  float span_limit) {
  using L = GtLayout<KM>;
  constexpr int NPW = KM / 32;  // 16-column groups of V per warp
  GT_DYN_SMEM(smem, L::F_TOTAL);
  float* bs = reinterpret_cast<float*>(smem + L::F_BS);
  u16* Vs = reinterpret_cast<u16*>(smem + L::F_V);
  u16* Hs = reinterpret_cast<u16*>(smem + L::F_H);
  u16* As = reinterpret_cast<u16*>(smem + L::F_AS);
  u16* Asl = As + 64 * L::AP;
  u16* Qh = reinterpret_cast<u16*>(smem + L::F_Q);
  u16* Qe = Qh;  // after the scores
  u16* Kh = Qh + 64 * L::P;
  u16* Qhl = Kh + 64 * L::P;
  u16* Khl = Qhl + 64 * L::P;
  u16* Ko = Khl + 64 * L::P;
  float* R = reinterpret_cast<float*>(smem + L::F_SMALL);
  float* E = R + 4 * KM;
  float* sp = E + 4 * KM;
  const int c = blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;
  const int t0 = 64 * c, len = min(64, Tlen - t0), NS = (NT + NC - 1) / NC, seg = c / NC;
  const int tid = threadIdx.x, w = tid / 32, lane = tid % 32, gid = lane >> 2, tig = lane & 3;
  const int cg = tid >> 4, qr = tid & 15, c0 = 8 * cg;
  const bool actK = c0 < K, actV = c0 < V;

  // (0) loads, incoming state, cumulative gate; after a barrier the stage-A operands and the sub-chunk spans
  V16 qraw[4], kraw[4];
  {
    V16 gr[4];
    gt_load_chunk<T, KM>(qraw, kraw, gr, Vs, q, k, v, g, b, h, t0, len, Tlen, H, K, V, c0, actK, actV, qr);
    const i64 cKV = ((i64)bh * NT + c) * K * V;
    const void* Hcc = reinterpret_cast<const unsigned char*>(Hc) + cKV * (F32S ? 4 : 2);
    const float* Sfs = Sf != nullptr ? Sf + ((i64)bh * NS + seg) * K * V : nullptr;
    gt_state_operands<T, F32S, KM, KM * KM / 2048>(Hs, Hcc, Sfs, pc + ((i64)bh * NT + c) * K, nullptr, nullptr, nullptr, nullptr,
                                     nullptr, K, V);
    float x[4][8];
#pragma unroll
    for (int I = 0; I < 4; ++I) gt_unpack<T>(x[I], gr[I]);
    gt_chunk_cumsum(x, qr);
    gt_store_decays<KM>(bs, R, E, x, c0, actK, qr);
  }
  __syncthreads();
  gt_spans<KM>(sp, R, E, K, w, lane);
  if (actK) gt_score_operands<T, KM>(Qh, Kh, Qhl, Khl, Ko, qraw, kraw, bs, R, span_limit, c0, qr);
  __syncthreads();
  float spn[4];
#pragma unroll
  for (int I = 0; I < 4; ++I) spn[I] = sp[I];
  // (1) intra-chunk scores: 10 blocks (I >= J) over 8 warps
  {
    const i64 row0 = ((i64)(b * Tlen + t0) * H + h) * K;
    for (int blk = w; blk < 10; blk += 8) {
      int I, J;
      gt_block_ij(blk, I, J);
      gt_score_block<T, KM>(As, Asl, Qh, Kh, Qhl, Khl, Ko, bs, spn, 1.f, span_limit, q + row0, k + row0,
                            (i64)H * K, K, len, I, J, lane);
    }
  }
  __syncthreads();
  if (actK) {  // Qe = q exp(b) over Qh
#pragma unroll
    for (int I = 0; I < 4; ++I) {
      const int t = qr + 16 * I;
      float qv[8], bt[8];
      gt_unpack<T>(qv, qraw[I]);
      gt_ld8f(bt, bs + t * L::BP + c0);
#pragma unroll
      for (int j = 0; j < 8; ++j) qv[j] *= dexp(bt[j]);
      gt_st16(Qe + t * L::P + c0, gt_pack<T>(qv));
    }
  }
  __syncthreads();
  // (2) o = scale * (A V + Qe h)
  gt_fwd_output<T, KM>(o, As, Asl, Vs, Qe, Hs, scale, b, Tlen, H, h, t0, K, V, len, w, lane);
}

#ifdef GLA_INSTANTIATE
#define GLATC_INST_FWD1(N, T, KM, F)                                                                                  \
  template __global__ void N<T, KM, F>(const T*, const T*, const T*, const T*, const void*, const float*, const float*, \
                                       T*, float, int, int, int, int, int, int, int, float);
#define GLATC_INST_FWD(T, KM, F) GLATC_INST_FWD1(glatc_fwd_out, T, KM, F) GLATC_INST_FWD1(glatc_fwd_wide, T, KM, F)
GLATC_INST_FWD(bf16, 128, false)
GLATC_INST_FWD(bf16, 64, false)
#ifndef GLA_INSTANTIATE_FAST
GLATC_INST_FWD(bf16, 128, true)
GLATC_INST_FWD(bf16, 64, true)
GLATC_INST_FWD(f16, 128, true)
GLATC_INST_FWD(f16, 64, true)
#endif
#endif
