// Chunk-parallel tensor-core GLA kernels for large heads (K, V multiples of 16; written for K up to 256 and V up to
// 512, nothing in them bounds the sizes): the output dimension is tiled over CTAs and the reductions over the other
// dimension are loops over pieces of KM = 128 columns inside a CTA, so every output element is written by one CTA
// and no partial sums cross CTAs. Same inputs and numerics as glatc_fwd_out / glatc_bwd (gla_fwd_tc.cu,
// gla_bwd_tc.cu); the chunk states come from the state walks (gla_tc_states.cu; glatc_walk2 tiles V by 128 there).
//
//   glatc_fwd_vt<T, KM, F32S>  one CTA per (V tile of KM columns, chunk, bh): o[:, tile] = scale (A V + Qe h).
//                              Pass 1 over K pieces sums the intra-chunk scores A (as glatc_fwd_out: halves of a
//                              piece's operands in shared memory, split diagonal blocks), pass 2 over K pieces adds
//                              Qe_p h_p (the piece's q exp(b) and its rows of the chunk's state tile).
//   glatc_bwd_vt<T, KM, F32S>  one CTA per (V tile, chunk, bh): dv[:, tile] = A'^T do + Kd dS, the same two passes
//                              (A' = scale A with single operands, as glatc_bwd; Kd = k exp(bL - b), dS the gradient
//                              into the chunk's end state).
//   glatc_bwd_kt<T, KM, F32S>  one CTA per (K tile of KM columns, chunk, bh): dq, dk, dg of the tile (glatc_bwd's
//                              stages with V in pieces of KM: dA' = scale do v^T, do h^T and v dS^T summed over the
//                              pieces; then the intra-chunk products and dg as there). KM 128: one CTA per SM;
//                              KM 64: two (more tiles, each recomputing dA' and reading v, do again).
// A CTA of glatc_fwd_vt / glatc_bwd_vt recomputes the scores of its chunk (ceil(V / KM) CTAs per chunk do); one of
// glatc_bwd_kt recomputes dA' (ceil(K / KM) per chunk). The sibling CTAs of a chunk are adjacent in the grid
// (blockIdx.x = tile + tiles * chunk), so their repeated reads of q, k, g (v, do) meet in L2.
// Exactness: a diagonal score block whose decay span over a piece's columns exceeds span_limit takes that piece's
// share elementwise in fp32 (from the raw inputs), the other pieces' on tensor cores; in glatc_bwd_kt the tile's span
// decides for its dq, dk and dG together (as glatc_bwd over all K).
#include "gla_tc_chunk.cuh"

// x unknown to the compiler from here on (no code motion of what depends on it; nothing in the emulation)
#ifndef CUDA_EMU
#define GL_OPAQUE(x) asm volatile("" : "+r"(x))
#else
#define GL_OPAQUE(x) ((void)0)
#endif

// gt_chunk_cumsum (the inclusive cumulative sum down the chunk of x[I][j], row qr + 16 I) one sub-chunk at a time:
// the same additions in the same order (the same bits), 8 floats of temporaries instead of 32. Half-warp collective.
GLA_DEVICE void gl_chunk_cumsum_seq(float (*x)[8], int qr) {
  float off[8], y[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) off[j] = 0.f;
#pragma unroll
  for (int I = 0; I < 4; ++I) {
#pragma unroll
    for (int d = 1; d < 16; d *= 2) {
      gt_shfl<1, 8>(y, x[I], d, 16);
      if (qr >= d) {
#pragma unroll
        for (int j = 0; j < 8; ++j) x[I][j] += y[j];
      }
    }
    gt_shfl<0, 8>(y, x[I], 15, 16);  // the sub-chunk's sum
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      x[I][j] += off[j];
      off[j] += y[j];
    }
  }
}

// acc (the warp's accumulator pair of diagonal block (I, I)) += the block's scores over one piece of kp columns,
// elementwise in fp32: sum_kk q_tk k_sk exp(b_tk - b_sk) for s <= t < len (bs: the piece's cumulative gate, row
// stride BP; qg, kg: the chunk's first row at the piece's first column, row stride rstride). Lanes hold the entries
// of the m16n8 fragments (rows gid, gid + 8; columns 2 tig, +1).
template <typename T, int KM>
GLA_DEVICE void gl_exact_diag(float (&acc)[2][4], const float* bs, const T* qg, const T* kg, i64 rstride, int kp,
                              int len, int I, int gid, int tig) {
  using L = GtLayout<KM>;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int tl = gid + (i >= 2 ? 8 : 0), sl = 8 * nt + 2 * tig + (i & 1), t = 16 * I + tl, s = 16 * I + sl;
      if (sl <= tl && t < len) {
        const T* qt = qg + t * rstride;
        const T* ks = kg + s * rstride;
        float a = 0.f;
        for (int kk = 0; kk < kp; ++kk)
          a += to_f(qt[kk]) * to_f(ks[kk]) * dexp(bs[t * L::BP + kk] - bs[s * L::BP + kk]);
        acc[nt][i] += a;
      }
    }
}

// ---- V-tiled chunk kernels: glatc_fwd_vt (BWD false: o) and glatc_bwd_vt (BWD true: dv) -------------------------
// One CTA per (group of vpc V tiles, chunk, bh): pass (1) the scores once, then per V tile passes (2) and (3).
// in: v (forward) or do (backward); the left operand of pass 2: Qe = q exp(b) (forward) or Kd = k exp(bL - b)
// (backward); the state tile: h = Hc + exp(pc) Sf (forward) or dS = Dc + exp(pc) Df (backward) at rows k0 ..,
// columns v0 ..
template <typename T, int KM, bool F32S, bool BWD>
GLA_DEVICE void gl_vtile(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ in,
                         const T* __restrict__ g, const void* __restrict__ Hc, const float* __restrict__ Sf,
                         const float* __restrict__ pc, T* __restrict__ out, float scale, int Tlen, int H, int K, int V,
                         int NC, int NT, float span_limit, int vpc, unsigned char* smem) {
  using L = GtLayout<KM>;
  constexpr int P = L::P, PH = L::PH, KH = L::KH, NPW = KM / 32;
  u16* Ws = reinterpret_cast<u16*>(smem + L::O_V);  // v / do tile [64][P] (pass 1: the piece's raw q)
  u16* As = reinterpret_cast<u16*>(smem + L::O_AS);  // A (pass 1: the piece's raw k, [64][P])
  u16* Qraw = Ws;
  u16* Kraw = As;
  u16* Asl = BWD ? nullptr : As + 64 * L::AP;
  u16* Qh = reinterpret_cast<u16*>(smem + L::O_Z);  // pass 1: one half-piece of the score operands, row stride PH
  u16* Kh = Qh + 64 * PH;
  u16* Qhl = BWD ? nullptr : Kh + 64 * PH;
  u16* Khl = BWD ? nullptr : Kh + 2 * 64 * PH;
  u16* Ko = Qh + 4 * 64 * PH;
  float* bs = reinterpret_cast<float*>(smem + L::O_Z);  // pass 1, exact blocks only: the piece's cumulative gate
  float* R = reinterpret_cast<float*>(smem + L::O_SMALL);
  float* E = R + 4 * KM;
  float* sp = E + 4 * KM;
  const int nvt = (V + KM - 1) / KM, ngrp = (nvt + vpc - 1) / vpc;  // V tiles; groups of vpc tiles, one per CTA
  const int tg = blockIdx.x % ngrp, c = blockIdx.x / ngrp, bh = blockIdx.y, b = bh / H, h = bh % H;
  const int tv0 = tg * vpc, tv1 = min(nvt, tv0 + vpc);
  const int t0 = 64 * c, len = min(64, Tlen - t0);
  const int tid = threadIdx.x, w = tid / 32, lane = tid % 32, gid = lane >> 2, tig = lane & 3;
  const int cg = tid >> 4, qr = tid & 15, c0 = 8 * cg;
  const i64 row0 = ((i64)(b * Tlen + t0) * H + h) * K;  // the chunk's first row of q, k, g

  // (1) the intra-chunk scores, blocks w and w + 8 of the 10 with I >= J, summed over the pieces of K. A thread's raw
  // q and k wait in shared memory (Qraw, Kraw: the regions of v and A, which are written after this pass) until its
  // half of the piece builds the operands: registers for two CTAs per SM
  int bI[2], bJ[2];
  bool on[2];
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    const int blk = w + 8 * n;
    gt_block_ij(blk < 10 ? blk : 0, bI[n], bJ[n]);
    on[n] = blk < 10;
  }
  float acc[2][2][4];
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) acc[n][nt][0] = acc[n][nt][1] = acc[n][nt][2] = acc[n][nt][3] = 0.f;
  for (int k0 = 0; k0 < K; k0 += KM) {
    const int kp = min(KM, K - k0);
    const bool actK = c0 < kp;
    float x[4][8];
    {
      V16 qraw[4], kraw[4], gr[4];
      gt_load_rows<T>(qraw, q, b, h, t0, len, Tlen, H, K, k0 + c0, actK, qr);
      gt_load_rows<T>(kraw, k, b, h, t0, len, Tlen, H, K, k0 + c0, actK, qr);
      gt_load_rows<T>(gr, g, b, h, t0, len, Tlen, H, K, k0 + c0, actK, qr);
#pragma unroll
      for (int I = 0; I < 4; ++I) gt_unpack<T>(x[I], gr[I]);
      if (actK) {  // the previous piece's readers of these rows are this thread itself
#pragma unroll
        for (int I = 0; I < 4; ++I) {
          gt_st16(Qraw + (qr + 16 * I) * P + c0, qraw[I]);
          gt_st16(Kraw + (qr + 16 * I) * P + c0, kraw[I]);
        }
      }
    }
    gt_chunk_cumsum(x, qr);
    gt_store_decays<KM>(nullptr, R, E, x, c0, actK, qr);  // R, E of this piece (the previous one's readers are done)
    __syncthreads();
    gt_spans<KM>(sp, R, E, kp, w, lane);
    __syncthreads();
    float spn[4];
#pragma unroll
    for (int I = 0; I < 4; ++I) spn[I] = sp[I];
    bool ex[2];  // (spn indexed by constants only: a run-time index would put it in local memory)
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const float si = bI[n] == 0 ? spn[0] : bI[n] == 1 ? spn[1] : bI[n] == 2 ? spn[2] : spn[3];
      ex[n] = on[n] && bI[n] == bJ[n] && si > span_limit;
    }
    if (spn[0] > span_limit || spn[1] > span_limit || spn[2] > span_limit || spn[3] > span_limit) {
      if (actK) {
#pragma unroll
        for (int I = 0; I < 4; ++I) gt_st8f(bs + (qr + 16 * I) * L::BP + c0, x[I]);
      }
      __syncthreads();
#pragma unroll
      for (int n = 0; n < 2; ++n)
        if (ex[n]) gl_exact_diag<T, KM>(acc[n], bs, q + row0 + k0, k + row0 + k0, (i64)H * K, kp, len, bI[n], gid, tig);
      __syncthreads();
    }
#pragma unroll
    for (int hf = 0; hf < L::NH; ++hf) {
      const int kh0 = hf * KH, nks = min(KH, kp - kh0) / 16;
      if (nks <= 0) break;
      if (actK && c0 >= kh0 && c0 < kh0 + KH) {
#pragma unroll
        for (int I = 0; I < 4; ++I)
          gt_score_operand_row<T, KM, PH>(Qh, Kh, Qhl, Khl, Ko, ld16(Qraw + (qr + 16 * I) * P + c0),
                                          ld16(Kraw + (qr + 16 * I) * P + c0), x[I], R, span_limit, c0, c0 - kh0, qr,
                                          I);
      }
      __syncthreads();
#pragma unroll
      for (int n = 0; n < 2; ++n)
        if (on[n] && !ex[n]) gt_score_mma<T, PH>(acc[n], Qh, Kh, Qhl, Khl, Ko, nks, bI[n], bJ[n], gid, tig);
      __syncthreads();
    }
  }
  __syncthreads();  // Qraw, Kraw are dead
#pragma unroll
  for (int n = 0; n < 2; ++n)
    if (on[n]) gt_score_store<T, KM>(As, Asl, acc[n], BWD ? scale : 1.f, bI[n], bJ[n], gid, tig);

  // (2), (3) for each of the CTA's V tiles (A stays in shared memory)
  const u16* Asl_ = As + 64 * L::AP;  // A lo (forward)
  u16* Ls = reinterpret_cast<u16*>(smem + L::O_Z);  // pass 2: the piece's left operand [64][P]
  u16* Ss = Ls + 64 * P;                            // pass 2: the piece's rows of the state tile [KM][P]
  const int NS = (NT + NC - 1) / NC, seg = c / NC;
  for (int tv = tv0; tv < tv1; ++tv) {
    if (tv > tv0) __syncthreads();  // the previous tile's last reads of Ws are done
    const int v0 = KM * tv, Vt = min(KM, V - v0);
    int t0v = t0;  // the rows' addresses recomputed per tile: hoisted out of the loop they would spill
    GL_OPAQUE(t0v);
    {  // the tile of v / do (read at the end; its loads overlap pass 2)
      V16 wr[4];
      gt_load_rows<T>(wr, in, b, h, t0v, len, Tlen, H, V, v0 + c0, c0 < Vt, qr);
      if (c0 < Vt) {
#pragma unroll
        for (int I = 0; I < 4; ++I) gt_st16(Ws + (qr + 16 * I) * P + c0, wr[I]);
      }
    }

    // (2) the state products over the pieces of K: out += L_p S_p (rows 16 RB, half of the tile's 16-column groups)
    const int RB = w & 3, half = w >> 2, np = Vt / 16, pw = (np + 1) / 2, p0 = half * pw, p1 = min(np, p0 + pw);
    const bool rows_on = p0 < np && 16 * RB < len;
    float acco[2 * NPW][4];
#pragma unroll
    for (int n = 0; n < 2 * NPW; ++n) acco[n][0] = acco[n][1] = acco[n][2] = acco[n][3] = 0.f;
    const i64 cKV = ((i64)bh * NT + c) * K * V, sKV = ((i64)bh * NS + seg) * K * V;
    for (int k0 = 0; k0 < K; k0 += KM) {
      const int kp = min(KM, K - k0);
      const bool actK = c0 < kp;
      {
        V16 lraw[4], gr[4];
        gt_load_rows<T>(lraw, BWD ? k : q, b, h, t0v, len, Tlen, H, K, k0 + c0, actK, qr);
        gt_load_rows<T>(gr, g, b, h, t0v, len, Tlen, H, K, k0 + c0, actK, qr);
        float x[4][8];
#pragma unroll
        for (int I = 0; I < 4; ++I) gt_unpack<T>(x[I], gr[I]);
        gl_chunk_cumsum_seq(x, qr);
        float eL[8];
        gt_shfl<0, 8>(eL, x[3], 15, 16);  // the chunk's total (row 63; rows past the end hold g = 0)
        if (actK) {
#pragma unroll
          for (int I = 0; I < 4; ++I) {
            float lv[8];
            gt_unpack<T>(lv, lraw[I]);
#pragma unroll
            for (int j = 0; j < 8; ++j) lv[j] *= BWD ? dexp(eL[j] - x[I][j]) : dexp(x[I][j]);
            gt_st16(Ls + (qr + 16 * I) * P + c0, gt_pack<T>(lv));
          }
        }
      }
      gt_state_tile<T, F32S, KM, KM, F32S ? 1 : 2>(
          Ss, P, reinterpret_cast<const unsigned char*>(Hc) + (cKV + (i64)k0 * V + v0) * (F32S ? 4 : 2),
          Sf != nullptr ? Sf + sKV + (i64)k0 * V + v0 : nullptr, pc + ((i64)bh * NT + c) * K + k0, nullptr, nullptr,
          nullptr, nullptr, nullptr, kp, Vt, V);
      __syncthreads();
      if (rows_on) {
        for (int ks = 0; ks < kp / 16; ++ks) {
          u32 a[4];
          frag_a(a, Ls, P, 16 * RB, 16 * ks, gid, tig);
#pragma unroll
          for (int pp = 0; pp < NPW; ++pp) {
            if (p0 + pp < p1) {
              u32 b0[2], b1[2];
              frag_b2_rowmajor(b0, b1, Ss, P, 16 * ks, 16 * (p0 + pp), lane);
              Mma<T>::mma(acco[2 * pp], a, b0);
              Mma<T>::mma(acco[2 * pp + 1], a, b1);
            }
          }
        }
      }
      __syncthreads();
    }
    // (3) forward: o = scale (Qe h + A V), A as hi + lo; backward: dv = Kd dS + A'^T do
    if (rows_on) {
      if constexpr (!BWD) {
        for (int J = 0; J <= RB; ++J) {
          u32 a[4], al[4];
          frag_a(a, As, L::AP, 16 * RB, 16 * J, gid, tig);
          frag_a(al, Asl_, L::AP, 16 * RB, 16 * J, gid, tig);
#pragma unroll
          for (int pp = 0; pp < NPW; ++pp) {
            if (p0 + pp < p1) {
              u32 b0[2], b1[2];
              frag_b2_rowmajor(b0, b1, Ws, P, 16 * J, 16 * (p0 + pp), lane);
              Mma<T>::mma(acco[2 * pp], a, b0);
              Mma<T>::mma(acco[2 * pp + 1], a, b1);
              Mma<T>::mma(acco[2 * pp], al, b0);
              Mma<T>::mma(acco[2 * pp + 1], al, b1);
            }
          }
        }
      } else {
        for (int I = RB; I < 4; ++I) {
          u32 a[4];
          frag_a_trans(a, As, L::AP, 16 * I, 16 * RB, lane);
#pragma unroll
          for (int pp = 0; pp < NPW; ++pp) {
            if (p0 + pp < p1) {
              u32 b0[2], b1[2];
              frag_b2_rowmajor(b0, b1, Ws, P, 16 * I, 16 * (p0 + pp), lane);
              Mma<T>::mma(acco[2 * pp], a, b0);
              Mma<T>::mma(acco[2 * pp + 1], a, b1);
            }
          }
        }
      }
      gt_store_tile<T, NPW>(out + v0, acco, b, h, t0v, len, Tlen, H, V, RB, p0, p1, gid, tig, BWD ? 1.f : scale);
    }
  }
}


template <typename T, int KM, bool F32S>
__global__ void __launch_bounds__(256, 2)
    glatc_fwd_vt(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ g,
                 const void* __restrict__ Hc, const float* __restrict__ Sf, const float* __restrict__ pc,
                 T* __restrict__ o, float scale, int B, int Tlen, int H, int K, int V, int NC, int NT,
                 float span_limit, int vpc) {
  GT_DYN_SMEM(smem, GtLayout<KM>::O_TOTAL);
  gl_vtile<T, KM, F32S, false>(q, k, v, g, Hc, Sf, pc, o, scale, Tlen, H, K, V, NC, NT, span_limit, vpc, smem);
}

template <typename T, int KM, bool F32S>
__global__ void __launch_bounds__(256, 2)
    glatc_bwd_vt(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ g, const T* __restrict__ dout,
                 const void* __restrict__ Dc, const float* __restrict__ Df, const float* __restrict__ pcr,
                 T* __restrict__ dv, float scale, int B, int Tlen, int H, int K, int V, int NC, int NT,
                 float span_limit, int vpc) {
  GT_DYN_SMEM(smem, GtLayout<KM>::O_TOTAL);
  gl_vtile<T, KM, F32S, true>(q, k, dout, g, Dc, Df, pcr, dv, scale, Tlen, H, K, V, NC, NT, span_limit, vpc, smem);
}

// ---- K-tiled backward: dq, dk, dg of KM columns of K ----------------------------------------------------------------
// glatc_bwd's stages (gla_bwd_tc.cu) restricted to the tile's columns: (0) q, k (raw), the cumulative gate, spans;
// (V) per piece of V: v, do, the tile's rows of h and dS (rowsum(h dS) accumulated), dA' += do v^T, do h^T and
// v dS^T summed; then the inter-chunk dq, dk, dG terms, the score operands Qh, Kh, Ko, dq (C), dk (D), dg (E).
template <typename T, int KM, bool F32S>
__global__ void __launch_bounds__(256, KM == 64 ? 2 : 1)
    glatc_bwd_kt(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ g,
                 const T* __restrict__ dout, const void* __restrict__ Hc, const float* __restrict__ Sf,
                 const float* __restrict__ pcf, const void* __restrict__ Dc, const float* __restrict__ Df,
                 const float* __restrict__ pcr, T* __restrict__ dq, T* __restrict__ dk, T* __restrict__ dg,
                 float scale, int B, int Tlen, int H, int K, int V, int NC, int NT, float span_limit) {
  using L = GtLayout<KM>;
  constexpr int P = L::P, AP = L::AP;
  constexpr int NPW = KM / 32;  // 16-column groups per warp in the matrix stages
  GT_DYN_SMEM(smem, L::K_TOTAL);
  float* bs = reinterpret_cast<float*>(smem + L::K_BS);
  u16* Qr = reinterpret_cast<u16*>(smem + L::K_QR);
  u16* Kr = reinterpret_cast<u16*>(smem + L::K_KR);
  u16* Vs = reinterpret_cast<u16*>(smem + L::K_Z);  // stage V
  u16* DOs = Vs + 64 * P;
  u16* Hs = DOs + 64 * P;
  u16* Ds = Hs + KM * P;
  u16* Qh = reinterpret_cast<u16*>(smem + L::K_Z);  // after stage V
  u16* Kh = Qh + 64 * P;
  u16* Ko = Kh + 64 * P;
  float* dGs = reinterpret_cast<float*>(smem + L::K_Z);  // after stage D
  u16* dAs = reinterpret_cast<u16*>(smem + L::K_DAS);
  u16* dAsl = dAs + 64 * AP;
  float* R = reinterpret_cast<float*>(smem + L::K_SMALL);
  float* E = R + 4 * KM;
  float* rs = E + 4 * KM;
  float* X2 = rs + KM;
  float* sp = X2 + KM;

  const int nkt = (K + KM - 1) / KM;
  const int tk = blockIdx.x % nkt, c = blockIdx.x / nkt, bh = blockIdx.y, b = bh / H, h = bh % H;
  const int k0 = KM * tk, Kt = min(KM, K - k0);
  const int t0 = 64 * c, len = min(64, Tlen - t0), NS = (NT + NC - 1) / NC, seg = c / NC;
  const int tid = threadIdx.x, w = tid / 32, lane = tid % 32, gid = lane >> 2, tig = lane & 3;
  const int cg = tid >> 4, qr = tid & 15, c0 = 8 * cg;
  const bool actK = c0 < Kt;
  const int RB = w & 3, half = w >> 2;  // row block and column half of this warp in the matrix stages
  const int npk = Kt / 16, pwk = (npk + 1) / 2, q0 = half * pwk, q1 = min(npk, q0 + pwk);  // the tile's column groups

  // ---- (0) q, k raw; cumulative gate of the tile ------------------------------------------------------------------
  {
    V16 gr[4], qraw[4], kraw[4];
    gt_load_rows<T>(qraw, q, b, h, t0, len, Tlen, H, K, k0 + c0, actK, qr);
    gt_load_rows<T>(kraw, k, b, h, t0, len, Tlen, H, K, k0 + c0, actK, qr);
    gt_load_rows<T>(gr, g, b, h, t0, len, Tlen, H, K, k0 + c0, actK, qr);
    if (actK) {
#pragma unroll
      for (int I = 0; I < 4; ++I) {
        gt_st16(Qr + (qr + 16 * I) * P + c0, qraw[I]);
        gt_st16(Kr + (qr + 16 * I) * P + c0, kraw[I]);
      }
    }
    for (int i = tid; i < 2 * KM; i += 256) rs[i] = 0.f;  // rs and X2
    float x[4][8];
#pragma unroll
    for (int I = 0; I < 4; ++I) gt_unpack<T>(x[I], gr[I]);
    gt_chunk_cumsum(x, qr);
    gt_store_decays<KM>(bs, R, E, x, c0, actK, qr);
  }
  __syncthreads();
  gt_spans<KM>(sp, R, E, Kt, w, lane);

  // ---- (V) over pieces of V: dA' blocks, do h^T, v dS^T, rowsum(h dS) -----------------------------------------------
  float accq[2 * NPW][4], acck[2 * NPW][4], dG[2 * NPW][4], dA[2][2][4];
#pragma unroll
  for (int n = 0; n < 2 * NPW; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) accq[n][i] = acck[n][i] = dG[n][i] = 0.f;
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) dA[n][nt][0] = dA[n][nt][1] = dA[n][nt][2] = dA[n][nt][3] = 0.f;
  const i64 cKV = ((i64)bh * NT + c) * K * V, sKV = ((i64)bh * NS + seg) * K * V;
  const int es = F32S ? 4 : 2;
  for (int vp0 = 0; vp0 < V; vp0 += KM) {
    const int vp = min(KM, V - vp0);
    const bool actV = c0 < vp;
    {
      V16 vr[4], dr[4];
      gt_load_rows<T>(vr, v, b, h, t0, len, Tlen, H, V, vp0 + c0, actV, qr);
      gt_load_rows<T>(dr, dout, b, h, t0, len, Tlen, H, V, vp0 + c0, actV, qr);
      if (actV) {
#pragma unroll
        for (int I = 0; I < 4; ++I) {
          gt_st16(Vs + (qr + 16 * I) * P + c0, vr[I]);
          gt_st16(DOs + (qr + 16 * I) * P + c0, dr[I]);
        }
      }
    }
    const i64 off = (i64)k0 * V + vp0;
    gt_state_tile<T, F32S, KM, KM, KM == 64 ? 1 : 2>(
        Hs, P, reinterpret_cast<const unsigned char*>(Hc) + (cKV + off) * es, Sf != nullptr ? Sf + sKV + off : nullptr,
        pcf + ((i64)bh * NT + c) * K + k0, Ds, reinterpret_cast<const unsigned char*>(Dc) + (cKV + off) * es,
        Df != nullptr ? Df + sKV + off : nullptr, pcr + ((i64)bh * NT + c) * K + k0, rs, Kt, vp, V);
    __syncthreads();
#pragma unroll
    for (int n = 0; n < 2; ++n) {  // dA' blocks w, w + 8 (of 10)
      const int blk = w + 8 * n;
      if (blk < 10) {
        int I, J;
        gt_block_ij(blk, I, J);
        for (int ks = 0; ks < vp / 16; ++ks) {
          u32 a[4];
          frag_a(a, DOs, P, 16 * I, 16 * ks, gid, tig);
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            u32 bb[2];
            frag_b(bb, Vs, P, 16 * J + 8 * nt, 16 * ks, gid, tig);
            Mma<T>::mma(dA[n][nt], a, bb);
          }
        }
      }
    }
    gt_bwd_inter_products<T, KM>(accq, acck, DOs, Vs, Hs, Ds, vp / 16, RB, q0, q1, gid, tig);
    __syncthreads();  // the piece's tiles are read
  }
#pragma unroll
  for (int n = 0; n < 2; ++n) {  // dA' as hi + lo
    const int blk = w + 8 * n;
    if (blk < 10) {
      int I, J;
      gt_block_ij(blk, I, J);
      gt_score_store<T, KM>(dAs, dAsl, dA[n], scale, I, J, gid, tig);
    }
  }
  gt_bwd_inter_finish<T, KM>(accq, acck, dG, bs, E, Qr, Kr, X2, scale, RB, q0, q1, gid, tig);
  if (actK) {  // Z <- Qh, Kh, Ko (the zone's last readers passed the barrier above)
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

  gt_bwd_dq_dk_dg<T, KM>(GtBwdShared{dAs, dAsl, Qh, Kh, Ko, Qr, Kr, bs, R, E, rs, X2, dGs}, accq, acck, dG, spn,
                         span_limit, dq + k0, dk + k0, dg + k0, b, h, t0, len, Tlen, H, K, RB, npk, q0, q1, gid, tig,
                         lane, actK, c0, qr);
}

#ifdef GLA_INSTANTIATE
#define GLATC_INST_LARGE(T, KM, F)                                                                                    \
  template __global__ void glatc_fwd_vt<T, KM, F>(const T*, const T*, const T*, const T*, const void*, const float*,  \
                                                  const float*, T*, float, int, int, int, int, int, int, int, float,  \
                                                  int);                                                               \
  template __global__ void glatc_bwd_vt<T, KM, F>(const T*, const T*, const T*, const T*, const void*, const float*,  \
                                                  const float*, T*, float, int, int, int, int, int, int, int, float,  \
                                                  int);                                                               \
  template __global__ void glatc_bwd_kt<T, KM, F>(const T*, const T*, const T*, const T*, const T*, const void*,      \
                                                  const float*, const float*, const void*, const float*,              \
                                                  const float*, T*, T*, T*, float, int, int, int, int, int, int, int, \
                                                  float);
GLATC_INST_LARGE(bf16, 128, false)
template __global__ void glatc_bwd_kt<bf16, 64, false>(const bf16*, const bf16*, const bf16*, const bf16*, const bf16*,
                                                       const void*, const float*, const float*, const void*,
                                                       const float*, const float*, bf16*, bf16*, bf16*, float, int, int,
                                                       int, int, int, int, int, float);
#ifndef GLA_INSTANTIATE_FAST
GLATC_INST_LARGE(bf16, 128, true)
GLATC_INST_LARGE(f16, 128, true)
#endif
#endif
