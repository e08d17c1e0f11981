// Fused chunk-parallel tensor-core GLA backward, 16-bit inputs (bf16 / fp16), K and V multiples of 16 up to KM.
// One CTA (256 threads) per chunk of 64 tokens and bh. Inputs besides q, k, v, g, do: the chunk's incoming state
// h = Hc[c] + exp(pcf[c]) * Sf[c / NC] and the gradient into its end state dS = Dc[c] + exp(pcr[c]) * Df[c / NC]
// (state walks of gla_tc_states.cu; Sf, Df include the initial state and dht). With A' = scale A, dA' = scale dA
// (dA_ts = do_t . v_s), both masked to s <= t, b the cumulative gate inside the chunk and bL its last row:
//   dv_s = sum_{t >= s} A'_ts do_t + (k_s exp(bL - b_s)) dS
//   dq_t = scale exp(b_t) (do_t h^T) + sum_{s <= t} dA'_ts k_s exp(b_t - b_s)
//   dk_s = exp(bL - b_s) (v_s dS^T) + sum_{t >= s} dA'_ts q_t exp(b_t - b_s)
//   dg_t = sum_{t' >= t in the chunk} (q dq - k dk)_t' + exp(bL) rowsum(h * dS) + sum_s k_s exp(bL - b_s) (v_s dS^T)
// so dg needs no pass over the whole sequence. In the in-chunk sum the products of every pair (t, s) both after t'
// cancel exactly; with 16-bit operands they cancel only if q dq and k dk use the same rounded operands. So the
// intra-chunk parts use one pair of operands per sub-chunk pair (I >= J) for dq, dk and dG alike:
//   Qh_I = q_I exp(b - r_I) <= 1,  Ko_IJ = k_J exp(r_I - b) <= 1 (I > J),  Kh_I = k_I exp(r_I - b) (diagonal, <=
//   exp(span_I); blocks with span_I > span_limit are done elementwise in fp32),  r_I = b at row 16 I:
//   dq_I  += exp(b - r_I) sum_J dA'_IJ Ko_IJ        (q dq)_I += Qh_I * sum_J dA'_IJ Ko_IJ
//   dk_J  += sum_I exp(r_I - b) dA'_IJ^T Qh_I       (k dk)_J += sum_I Ko_IJ * (dA'_IJ^T Qh_I)
// and the inter-chunk parts enter dG and the last term of dg with the same fp32 values (the model in
// docs/benchmarks/gla_tc_design.md: dg error 1.6e-2 with independent roundings, 3e-3 with these).
//
// Stages and shared memory (GtLayout<KM>; region Z is reused twice):
//   0 loads (raw q, k, v, do kept), state operands h, dS (16-bit) and rowsum(h * dS), cumulative gate, Kd
//   I inter-chunk products: do h^T, v dS^T, Kd dS (registers until the end), their dG terms
//   - Z <- Qh, Kh, Ko;   A A' (10 blocks) and dA' (10 blocks, hi in dAs, the rounding remainder lo in v's memory
//     after a barrier: dq and dk take dA' as hi + lo, two products, so its rounding leaves their error)
//   B dv;   C dq and its dG terms;   D dk and its dG terms;   - Z <- dG (fp32)
//   E reverse cumulative sum of dG in the chunk, dg
#include "gla_tc_chunk.cuh"

template <typename T, int KM, bool F32S>
__global__ void __launch_bounds__(256, KM == 64 ? 2 : 1)
    glatc_bwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ g,
              const T* __restrict__ dout, const void* __restrict__ Hc, const float* __restrict__ Sf,
              const float* __restrict__ pcf, const void* __restrict__ Dc, const float* __restrict__ Df,
              const float* __restrict__ pcr, T* __restrict__ dq, T* __restrict__ dk, T* __restrict__ dv,
              T* __restrict__ dg, float scale, int B, int Tlen, int H, int K, int V, int NC, int NT,
              float span_limit) {
  using L = GtLayout<KM>;
  constexpr int P = L::P, AP = L::AP;
  constexpr int NPW = KM / 32;  // 16-column groups per warp in the matrix stages
  GT_DYN_SMEM(smem, L::B_TOTAL);
  float* bs = reinterpret_cast<float*>(smem + L::B_BS);
  u16* Vs = reinterpret_cast<u16*>(smem + L::B_V);
  u16* DOs = reinterpret_cast<u16*>(smem + L::B_DO);
  u16* Qr = reinterpret_cast<u16*>(smem + L::B_QR);
  u16* Kr = reinterpret_cast<u16*>(smem + L::B_KR);
  u16* Hs = reinterpret_cast<u16*>(smem + L::B_Z);  // stage 0 .. I
  u16* Ds = Hs + KM * P;
  u16* Kd = Ds + KM * P;
  u16* Qh = reinterpret_cast<u16*>(smem + L::B_Z);  // after stage I
  u16* Kh = Qh + 64 * P;
  u16* Ko = Kh + 64 * P;
  float* dGs = reinterpret_cast<float*>(smem + L::B_Z);  // after stage D
  u16* As = reinterpret_cast<u16*>(smem + L::B_AS);
  u16* dAs = reinterpret_cast<u16*>(smem + L::B_DAS);
  u16* dAsl = Vs;  // dA' lo, after stage A (v is read there for the last time)
  float* R = reinterpret_cast<float*>(smem + L::B_SMALL);
  float* E = R + 4 * KM;
  float* rs = E + 4 * KM;
  float* X2 = rs + KM;
  float* sp = X2 + KM;

  const int c = blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;
  const int t0 = 64 * c, len = min(64, Tlen - t0), NS = (NT + NC - 1) / NC, seg = c / NC;
  const int tid = threadIdx.x, w = tid / 32, lane = tid % 32, gid = lane >> 2, tig = lane & 3;
  const int cg = tid >> 4, qr = tid & 15, c0 = 8 * cg;
  const bool actK = c0 < K, actV = c0 < V;
  const int RB = w & 3, half = w >> 2;  // row block and column half of this warp in the matrix stages
  const int npk = K / 16, pwk = (npk + 1) / 2, q0 = half * pwk, q1 = min(npk, q0 + pwk);  // K column groups
  const int npv = V / 16, pwv = (npv + 1) / 2, v0 = half * pwv, v1 = min(npv, v0 + pwv);  // V column groups

  // ---- (0) ---------------------------------------------------------------------------------------------------
  {
    V16 gr[4], kraw[4];
    {
      V16 vr[4], dr[4], qraw[4];
      gt_load_rows<T>(vr, v, b, h, t0, len, Tlen, H, V, c0, actV, qr);
      gt_load_rows<T>(dr, dout, b, h, t0, len, Tlen, H, V, c0, actV, qr);
      gt_load_rows<T>(qraw, q, b, h, t0, len, Tlen, H, K, c0, actK, qr);
      gt_load_rows<T>(kraw, k, b, h, t0, len, Tlen, H, K, c0, actK, qr);
      gt_load_rows<T>(gr, g, b, h, t0, len, Tlen, H, K, c0, actK, qr);
#pragma unroll
      for (int I = 0; I < 4; ++I) {
        const int t = qr + 16 * I;
        if (actV) {
          gt_st16(Vs + t * P + c0, vr[I]);
          gt_st16(DOs + t * P + c0, dr[I]);
        }
        if (actK) {
          gt_st16(Qr + t * P + c0, qraw[I]);
          gt_st16(Kr + t * P + c0, kraw[I]);
        }
      }
    }
    for (int i = tid; i < 2 * KM; i += 256) rs[i] = 0.f;  // rs and X2
    __syncthreads();
    const i64 cKV = ((i64)bh * NT + c) * K * V, sKV = ((i64)bh * NS + seg) * K * V;
    const int es = F32S ? 4 : 2;
    gt_state_operands<T, F32S, KM, KM == 64 ? 2 : 4>(Hs, reinterpret_cast<const unsigned char*>(Hc) + cKV * es,
                                  Sf != nullptr ? Sf + sKV : nullptr, pcf + ((i64)bh * NT + c) * K, Ds,
                                  reinterpret_cast<const unsigned char*>(Dc) + cKV * es,
                                  Df != nullptr ? Df + sKV : nullptr, pcr + ((i64)bh * NT + c) * K, rs, K, V);
    float x[4][8], eL[8];
#pragma unroll
    for (int I = 0; I < 4; ++I) gt_unpack<T>(x[I], gr[I]);
    gt_chunk_cumsum(x, qr);
    gt_shfl<0, 8>(eL, x[3], 15, 16);
    gt_store_decays<KM>(bs, R, E, x, c0, actK, qr);
    if (actK) {  // Kd = k exp(bL - b)
#pragma unroll
      for (int I = 0; I < 4; ++I) {
        float kv[8];
        gt_unpack<T>(kv, kraw[I]);
#pragma unroll
        for (int j = 0; j < 8; ++j) kv[j] *= dexp(eL[j] - x[I][j]);
        gt_st16(Kd + (qr + 16 * I) * P + c0, gt_pack<T>(kv));
      }
    }
  }
  __syncthreads();
  gt_spans<KM>(sp, R, E, K, w, lane);

  // ---- (I) inter-chunk products --------------------------------------------------------------------------------
  float accq[2 * NPW][4], acck[2 * NPW][4], accv[2 * NPW][4], dG[2 * NPW][4];
#pragma unroll
  for (int n = 0; n < 2 * NPW; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) accq[n][i] = acck[n][i] = accv[n][i] = dG[n][i] = 0.f;
  gt_bwd_inter_products<T, KM>(accq, acck, DOs, Vs, Hs, Ds, V / 16, RB, q0, q1, gid, tig);
  for (int ks = 0; ks < K / 16; ++ks) {  // Kd dS (rows RB, V columns v0..)
    u32 a[4];
    frag_a(a, Kd, P, 16 * RB, 16 * ks, gid, tig);
#pragma unroll
    for (int pp = 0; pp < NPW; ++pp) {
      if (v0 + pp < v1) {
        u32 b0[2], b1[2];
        frag_b2_rowmajor(b0, b1, Ds, P, 16 * ks, 16 * (v0 + pp), lane);
        Mma<T>::mma(accv[2 * pp], a, b0);
        Mma<T>::mma(accv[2 * pp + 1], a, b1);
      }
    }
  }
  gt_bwd_inter_finish<T, KM>(accq, acck, dG, bs, E, Qr, Kr, X2, scale, RB, q0, q1, gid, tig);
  __syncthreads();  // h, dS, Kd are dead: Z <- Qh, Kh, Ko
  if (actK) {
    V16 qv[4], kv[4];
#pragma unroll
    for (int I = 0; I < 4; ++I) {
      qv[I] = ld16(Qr + (qr + 16 * I) * P + c0);
      kv[I] = ld16(Kr + (qr + 16 * I) * P + c0);
    }
    gt_score_operands<T, KM>(Qh, Kh, nullptr, nullptr, Ko, qv, kv, bs, R, span_limit, c0, qr);
  }
  __syncthreads();
  float spn[4];
#pragma unroll
  for (int I = 0; I < 4; ++I) spn[I] = sp[I];

  // ---- (A) A' and dA' -----------------------------------------------------------------------------------------
  {
    const i64 rstride = (i64)H * K;
    const T* qg = q + ((i64)(b * Tlen + t0) * H + h) * K;
    const T* kg = k + ((i64)(b * Tlen + t0) * H + h) * K;
    u16 lo[2][8];  // this warp's dA' blocks (at most two: tasks w + 8, w + 16 >= 10), their remainders
#pragma unroll
    for (int n = 0; n < 3; ++n) {
      const int task = w + 8 * n;
      if (task >= 20) break;
      int I, J;
      gt_block_ij(task % 10, I, J);
      if (task < 10)
        gt_score_block<T, KM>(As, nullptr, Qh, Kh, nullptr, nullptr, Ko, bs, spn, scale, span_limit, qg, kg, rstride,
                              K, len, I, J, lane);
      else
        gt_dA_block<T, KM>(dAs, lo[n > 0 ? n - 1 : 0], DOs, Vs, scale, V, I, J, lane);
    }
    __syncthreads();  // v is dead: its memory <- dA' lo
#pragma unroll
    for (int n = 1; n < 3; ++n) {
      const int task = w + 8 * n;
      if (task >= 10 && task < 20) {
        int I, J;
        gt_block_ij(task % 10, I, J);
        gt_dA_store_lo<KM>(dAsl, lo[n - 1], I, J, lane);
      }
    }
  }
  __syncthreads();

  // ---- (B) dv = A'^T do + (Kd dS) ------------------------------------------------------------------------------
  if (v0 < npv) {
    for (int I = RB; I < 4; ++I) {
      u32 a[4];
      frag_a_trans(a, As, AP, 16 * I, 16 * RB, lane);
#pragma unroll
      for (int pp = 0; pp < NPW; ++pp) {
        if (v0 + pp < v1) {
          u32 b0[2], b1[2];
          frag_b2_rowmajor(b0, b1, DOs, P, 16 * I, 16 * (v0 + pp), lane);
          Mma<T>::mma(accv[2 * pp], a, b0);
          Mma<T>::mma(accv[2 * pp + 1], a, b1);
        }
      }
    }
    gt_store_tile<T, NPW>(dv, accv, b, h, t0, len, Tlen, H, V, RB, v0, v1, gid, tig);
  }

  gt_bwd_dq_dk_dg<T, KM>(GtBwdShared{dAs, dAsl, Qh, Kh, Ko, Qr, Kr, bs, R, E, rs, X2, dGs}, accq, acck, dG, spn,
                         span_limit, dq, dk, dg, b, h, t0, len, Tlen, H, K, RB, npk, q0, q1, gid, tig, lane, actK, c0,
                         qr);
}

#ifdef GLA_INSTANTIATE
#define GLATC_INST_BWD(T, KM, F)                                                                                    \
  template __global__ void glatc_bwd<T, KM, F>(const T*, const T*, const T*, const T*, const T*, const void*,       \
                                               const float*, const float*, const void*, const float*, const float*, \
                                               T*, T*, T*, T*, float, int, int, int, int, int, int, int, float);
GLATC_INST_BWD(bf16, 128, false)
GLATC_INST_BWD(bf16, 64, false)
#ifndef GLA_INSTANTIATE_FAST
GLATC_INST_BWD(bf16, 128, true)
GLATC_INST_BWD(bf16, 64, true)
GLATC_INST_BWD(f16, 128, true)
GLATC_INST_BWD(f16, 64, true)
#endif
#endif
