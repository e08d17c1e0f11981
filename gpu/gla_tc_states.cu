// Tensor-core state passes of the chunk-parallel GLA kernels (16-bit inputs, fp32 accumulation and states).
// Layout: q, k, g [B, T, H, K]; v, do [B, T, H, V]; chunk c = tokens 64c .. 64c + 63; segment s = chunks
// s NC .. s NC + NC - 1 (NS segments, NT chunks per sequence b, h; bh = b H + h).
//
//   glatc_walk<T, REV, F32S>  one CTA per (64 x 64 state tile, segment, bh), chunk after chunk inside the segment
//                             from a zero state, writing every chunk's state (16-bit bits of T, or fp32):
//     REV = false (forward):  Hc[c] = state before chunk c,     S <- diag(exp(bL)) S + (k exp(bL - b))^T v
//     REV = true  (reverse):  Hc[c] = gradient into c's end,    S <- diag(exp(bL)) S + scale (q exp(b))^T do
//                             (b: inclusive cumulative gate inside the chunk, bL its last row) and at the end
//                             Sseg[s] = S (fp32); gseg[s] = the segment's log decay; pc[c] = log decay between the
//                             segment boundary and chunk c (forward: before c; reverse: after c).
//   glatc_walk2<T, REV, F32S, VM>  the same outputs, one CTA per (64 rows of K, VM columns of V, segment, bh),
//                             inputs by cp.async in two stages, no shuffles (the default; glatc_walk: walk=1)
//   glatc_scan                in place over segments: Sseg[s] <- state entering segment s (reverse: gradient into
//                             its end) from a zero start; fin = the state after the last one; dec = exp of the
//                             gate summed over the sequence.
//   glatc_combine             out[s] = base[s] + exp(log decay from the sequence boundary to s) * S0 (initial state
//                             or final-state gradient), so consumers need no S0 / dht of their own.
// A consumer's state of chunk c is then Hc[c] + exp(pc[c]) * out[c / NC] (gla_tc_chunk.cuh: gt_state_operands).
#include "gla_tc_chunk.cuh"

#define GW_THREADS 128
#define GW_P 72  // padded row of [64][64] 16-bit tiles
#define GW_FP 68  // padded row of [64][64] fp32 tiles
#ifndef GW_MIN_CTAS
#define GW_MIN_CTAS 3  // CTAs per SM the register allocation aims at (168 registers; 4: 128 with spills)
#endif

template <typename T, bool REV, bool F32S>
__global__ void __launch_bounds__(GW_THREADS, GW_MIN_CTAS) glatc_walk(const T* __restrict__ left, const T* __restrict__ right,
                                                         const T* __restrict__ g, void* __restrict__ Hout,
                                                         float* __restrict__ Sseg, float* __restrict__ gseg,
                                                         float* __restrict__ pc, float scale, int B, int Tlen, int H,
                                                         int K, int V, int NC, int NS, int NT) {
  __shared__ __align__(16) u16 Ls[64 * GW_P];  // left * decay, [t][k]
  __shared__ __align__(16) u16 Rs[64 * GW_P];  // right, [t][v]
  __shared__ __align__(16) unsigned char Sb[F32S ? 64 * GW_FP * 4 : 64 * GW_P * 2];  // staged state tile
  __shared__ float bLs[64];
  const int nkt = (K + 63) / 64;
  const int tk = blockIdx.x % nkt, tv = blockIdx.x / nkt, seg = blockIdx.y, bh = blockIdx.z, b = bh / H, h = bh % H;
  const int k0 = 64 * tk, v0 = 64 * tv, Kt = min(64, K - k0), Vt = min(64, V - v0);
  const int tid = threadIdx.x, w = tid / 32, lane = tid % 32, gid = lane >> 2, tig = lane & 3;
  const int cg = tid >> 4, qr = tid & 15;
  const bool actL = 8 * cg < Kt, actR = 8 * cg < Vt;
  const bool writer = tv == 0 && qr == 0 && actL;  // writes pc / gseg for its 8 columns
  const int cb = seg * NC, ce = min(NT, cb + NC), nch = ce - cb;

  float sacc[8][4];
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) sacc[nt][0] = sacc[nt][1] = sacc[nt][2] = sacc[nt][3] = 0.f;
  float run[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) run[j] = 0.f;

  V16 lr[4], gr[4], rr[4];
  auto fetch = [&](int c) {
    const int t0 = 64 * c, len = min(64, Tlen - t0);
    gt_load_rows<T>(lr, left, b, h, t0, len, Tlen, H, K, k0 + 8 * cg, actL, qr);
    gt_load_rows<T>(gr, g, b, h, t0, len, Tlen, H, K, k0 + 8 * cg, actL, qr);
    gt_load_rows<T>(rr, right, b, h, t0, len, Tlen, H, V, v0 + 8 * cg, actR, qr);
  };
  if (nch > 0) fetch(REV ? ce - 1 : cb);

  for (int n = 0; n < nch; ++n) {
    const int c = REV ? ce - 1 - n : cb + n;
    // (a) stage the state entering this step (16-bit or fp32)
    if (16 * w < Kt) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int col = 8 * nt + 2 * tig, r = 16 * w + gid;
        if (col < Vt) {
          if constexpr (F32S) {
            float* St = reinterpret_cast<float*>(Sb);
            St[r * GW_FP + col] = sacc[nt][0];
            St[r * GW_FP + col + 1] = sacc[nt][1];
            St[(r + 8) * GW_FP + col] = sacc[nt][2];
            St[(r + 8) * GW_FP + col + 1] = sacc[nt][3];
          } else {
            u16* St = reinterpret_cast<u16*>(Sb);
            *reinterpret_cast<u32*>(St + r * GW_P + col) =
                (u32)Mma<T>::cvt(sacc[nt][0]) | ((u32)Mma<T>::cvt(sacc[nt][1]) << 16);
            *reinterpret_cast<u32*>(St + (r + 8) * GW_P + col) =
                (u32)Mma<T>::cvt(sacc[nt][2]) | ((u32)Mma<T>::cvt(sacc[nt][3]) << 16);
          }
        }
      }
    }
    // (b) cumulative gate and the decayed left operand of this chunk
    if (actR) {
#pragma unroll
      for (int I = 0; I < 4; ++I) gt_st16(Rs + (qr + 16 * I) * GW_P + 8 * cg, rr[I]);
    }
    float eL[8];  // the chunk's total log decay per column: the thread's 4 rows, then the half-warp
    {
      float y[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) eL[j] = 0.f;
#pragma unroll
      for (int I = 0; I < 4; ++I) {
        gt_unpack<T>(y, gr[I]);
#pragma unroll
        for (int j = 0; j < 8; ++j) eL[j] += y[j];
      }
#pragma unroll
      for (int m = 1; m < 16; m *= 2) {
        gt_shfl<3, 8>(y, eL, m, 16);
#pragma unroll
        for (int j = 0; j < 8; ++j) eL[j] += y[j];
      }
    }
    float off[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) off[j] = 0.f;
#pragma unroll
    for (int I = 0; I < 4; ++I) {  // sub-chunk by sub-chunk: b = cumulative gate, then the decayed left rows
      float x[8], y[8];
      gt_unpack<T>(x, gr[I]);
#pragma unroll
      for (int d = 1; d < 16; d *= 2) {
        gt_shfl<1, 8>(y, x, d, 16);
        if (qr >= d) {
#pragma unroll
          for (int j = 0; j < 8; ++j) x[j] += y[j];
        }
      }
      gt_shfl<0, 8>(y, x, 15, 16);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        x[j] += off[j];
        off[j] += y[j];
      }
      if (actL) {
        float lv[8];
        gt_unpack<T>(lv, lr[I]);
#pragma unroll
        for (int j = 0; j < 8; ++j) lv[j] *= REV ? scale * dexp(x[j]) : dexp(fminf(eL[j] - x[j], 0.f));
        gt_st16(Ls + (qr + 16 * I) * GW_P + 8 * cg, gt_pack<T>(lv));
      }
    }
    if (qr == 0 && actL) {
#pragma unroll
      for (int j = 0; j < 8; ++j) bLs[8 * cg + j] = eL[j];
    }
    if (writer) {
      float* pcc = pc + ((i64)bh * NT + c) * K + k0 + 8 * cg;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        pcc[j] = run[j];
        run[j] += eL[j];
      }
    }
    if (n + 1 < nch) fetch(REV ? c - 1 : c + 1);  // next chunk's loads overlap this chunk's matrix work
    __syncthreads();
    // (c) the staged state to global memory
    {
      const i64 base = ((i64)bh * NT + c) * K * V;
      if constexpr (F32S) {
        const float* St = reinterpret_cast<const float*>(Sb);
        for (int e = tid; e < 64 * 16; e += GW_THREADS) {
          const int r = e / 16, cc = (e % 16) * 4;
          if (r < Kt && cc < Vt)
            *reinterpret_cast<F4*>(reinterpret_cast<float*>(Hout) + base + (i64)(k0 + r) * V + v0 + cc) =
                *reinterpret_cast<const F4*>(St + r * GW_FP + cc);
        }
      } else {
        const u16* St = reinterpret_cast<const u16*>(Sb);
        for (int e = tid; e < 64 * 8; e += GW_THREADS) {
          const int r = e / 8, cc = (e % 8) * 8;
          if (r < Kt && cc < Vt)
            gt_st16(reinterpret_cast<u16*>(Hout) + base + (i64)(k0 + r) * V + v0 + cc, ld16(St + r * GW_P + cc));
        }
      }
    }
    // (d) S <- diag(exp(bL)) S + Ls^T Rs
    if (16 * w < Kt) {
      const float e0 = dexp(bLs[16 * w + gid]), e1 = dexp(bLs[16 * w + gid + 8]);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        sacc[nt][0] *= e0;
        sacc[nt][1] *= e0;
        sacc[nt][2] *= e1;
        sacc[nt][3] *= e1;
      }
#pragma unroll 1
      for (int ks = 0; ks < 4; ++ks) {  // not unrolled: fewer fragments in flight, more CTAs per SM
        u32 a[4];
        frag_a_trans(a, Ls, GW_P, 16 * ks, 16 * w, lane);
#pragma unroll
        for (int p = 0; p < 4; ++p) {
          if (16 * p < Vt) {
            u32 b0[2], b1[2];
            frag_b2_rowmajor(b0, b1, Rs, GW_P, 16 * ks, 16 * p, lane);
            Mma<T>::mma(sacc[2 * p], a, b0);
            Mma<T>::mma(sacc[2 * p + 1], a, b1);
          }
        }
      }
    }
    __syncthreads();
  }
  if (16 * w < Kt) {
    float* out = Sseg + ((i64)bh * NS + seg) * K * V;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int col = 8 * nt + 2 * tig, r = k0 + 16 * w + gid;
      if (col < Vt) {
        out[(i64)r * V + v0 + col] = sacc[nt][0];
        out[(i64)r * V + v0 + col + 1] = sacc[nt][1];
        out[(i64)(r + 8) * V + v0 + col] = sacc[nt][2];
        out[(i64)(r + 8) * V + v0 + col + 1] = sacc[nt][3];
      }
    }
  }
  if (writer && gseg != nullptr) {
#pragma unroll
    for (int j = 0; j < 8; ++j) gseg[((i64)bh * NS + seg) * K + k0 + 8 * cg + j] = run[j];
  }
}

// ---- glatc_walk2: the same walk, one CTA per (64 rows of K, tile of VM columns of V, segment, bh), 256 threads ----
// Inputs land in shared memory by cp.async, two stages (the next chunk's tiles load during this chunk's work), so
// no thread holds prefetched data in registers. The cumulative gate is sequential per thread (rows 8 w .. 8 w + 7 of
// columns 2 lane, 2 lane + 1; warp totals exchanged through shared memory), no shuffles; the decayed left operand
// is computed once per tile of VM columns (all of V up to VM; glatc_walk: once per 64-column tile of V). blockIdx.x
// = K tile + (K tiles) * V tile; the CTAs of the first V tile write pc and gseg. Outputs as glatc_walk.
#define GW2_THREADS 256

template <int VM>
struct Gw2Layout {
  static constexpr int LP = 72;                   // padded row (16-bit) of [64][64] tiles (left, g, Ls)
  static constexpr int RP = VM + 8;               // padded row of [64][VM] tiles (right, staged state)
  static constexpr int LT = 64 * LP * 2;          // one [64][64] tile (bytes)
  static constexpr int RT = 64 * RP * 2;          // one [64][VM] tile
  static constexpr int STAGE = 2 * LT + RT;       // left, g, right of one chunk
  static constexpr int IN = 0;                    // two stages
  static constexpr int LS = IN + 2 * STAGE;       // left * decay [t][k]
  static constexpr int SB = LS + LT;              // staged 16-bit state [k][v]
  static constexpr int TOT = SB + RT;             // per warp: gate sums of its 8 rows [8][64] fp32
  static constexpr int BL = TOT + 8 * 64 * 4;     // the chunk's total log decay per k [64] fp32
  static constexpr int TOTAL = BL + 64 * 4;
};

// cp.async of rows 0..63 (zero from row len on) and the first Wt (multiple of 8) of W columns from column c0 of
// x [B, T, H, W] at token t0 into a [64][ncol] tile (row stride ld); 256 threads
template <typename T, int NCOL>
GLA_DEVICE void gw2_load_tile(u16* dst, int ld, const T* __restrict__ x, int b, int h, int t0, int len, int Tlen, int H,
                              int W, int c0, int Wt) {
  constexpr int CPR = NCOL / 8, N = 64 * CPR / GW2_THREADS;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int e = threadIdx.x + GW2_THREADS * i, t = e / CPR, cc = 8 * (e % CPR);
    const bool ok = t < len && cc < Wt;
    const T* src = ok ? x + ((i64)(b * Tlen + t0 + t) * H + h) * W + c0 + cc : x;
    gt_cp16(dst + t * ld + cc, src, ok ? 16 : 0);
  }
}

template <typename T, bool REV, bool F32S, int VM>
__global__ void __launch_bounds__(GW2_THREADS, VM == 64 ? 3 : 2)
    glatc_walk2(const T* __restrict__ left, const T* __restrict__ right, const T* __restrict__ g,
                void* __restrict__ Hout, float* __restrict__ Sseg, float* __restrict__ gseg, float* __restrict__ pc,
                float scale, int B, int Tlen, int H, int K, int V, int NC, int NS, int NT) {
  using L = Gw2Layout<VM>;
  constexpr int NTL = VM / 16;  // n8 tiles per warp (a warp holds 16 rows of K and VM / 2 columns of V)
  GT_DYN_SMEM(smem, L::TOTAL);
  u16* Ls = reinterpret_cast<u16*>(smem + L::LS);
  u16* Sb = reinterpret_cast<u16*>(smem + L::SB);
  float* tot = reinterpret_cast<float*>(smem + L::TOT);
  float* bLs = reinterpret_cast<float*>(smem + L::BL);
  const int nkt = (K + 63) / 64;  // VM 64 serves V <= 64 only: one V tile
  const int tk = VM == 64 ? blockIdx.x : blockIdx.x % nkt, tv = VM == 64 ? 0 : blockIdx.x / nkt;
  const int seg = blockIdx.y, bh = blockIdx.z, b = bh / H, h = bh % H;
  const int k0 = 64 * tk, Kt = min(64, K - k0), v0 = VM * tv, Vt = VM == 64 ? V : min(VM, V - v0);
  const int tid = threadIdx.x, w = tid / 32, lane = tid % 32, gid = lane >> 2, tig = lane & 3;
  const int mr = 16 * (w & 3), nc0 = (VM / 2) * (w >> 2);  // the warp's state rows and first column (in the tile)
  const bool first_v = tv == 0;  // writes pc and gseg
  const bool mma_rows = mr < Kt;
  const int kc = 2 * lane;  // elementwise: rows 8 w .. 8 w + 7, columns kc, kc + 1 of the tile
  const int cb = seg * NC, ce = min(NT, cb + NC), nch = ce - cb;

  float sacc[NTL][4];
#pragma unroll
  for (int nt = 0; nt < NTL; ++nt) sacc[nt][0] = sacc[nt][1] = sacc[nt][2] = sacc[nt][3] = 0.f;
  float run[2] = {0.f, 0.f};

  auto issue = [&](int c, int stage) {
    u16* base = reinterpret_cast<u16*>(smem + L::IN + stage * L::STAGE);
    const int t0 = 64 * c, len = min(64, Tlen - t0);
    gw2_load_tile<T, 64>(base, L::LP, left, b, h, t0, len, Tlen, H, K, k0, Kt);
    gw2_load_tile<T, 64>(base + 64 * L::LP, L::LP, g, b, h, t0, len, Tlen, H, K, k0, Kt);
    gw2_load_tile<T, VM>(base + 2 * 64 * L::LP, L::RP, right, b, h, t0, len, Tlen, H, V, v0, Vt);
    gt_cp_commit();
  };
  if (nch > 0) issue(REV ? ce - 1 : cb, 0);

  for (int n = 0; n < nch; ++n) {
    const int c = REV ? ce - 1 - n : cb + n, stage = n & 1;
    const u16* Lin = reinterpret_cast<const u16*>(smem + L::IN + stage * L::STAGE);
    const u16* Gin = Lin + 64 * L::LP;
    const u16* Rin = Lin + 2 * 64 * L::LP;
    gt_cp_wait<0>();
    __syncthreads();  // this chunk's tiles are in; every thread is done with the previous chunk
    if (n + 1 < nch) issue(REV ? c - 1 : c + 1, stage ^ 1);
    // (a) the state entering this step: 16-bit to Sb (written out below), fp32 straight to global memory
    const i64 hbase = ((i64)bh * NT + c) * K * V;
    if (mma_rows) {
#pragma unroll
      for (int nt = 0; nt < NTL; ++nt) {
        const int col = nc0 + 8 * nt + 2 * tig, r = mr + gid;
        if (col < Vt) {
          if constexpr (F32S) {
            float* Ho = reinterpret_cast<float*>(Hout) + hbase + (i64)(k0 + r) * V + v0 + col;
            if (r < Kt) *reinterpret_cast<F2*>(Ho) = F2{sacc[nt][0], sacc[nt][1]};
            if (r + 8 < Kt) *reinterpret_cast<F2*>(Ho + 8 * V) = F2{sacc[nt][2], sacc[nt][3]};
          } else {
            *reinterpret_cast<u32*>(Sb + r * L::RP + col) =
                (u32)Mma<T>::cvt(sacc[nt][0]) | ((u32)Mma<T>::cvt(sacc[nt][1]) << 16);
            *reinterpret_cast<u32*>(Sb + (r + 8) * L::RP + col) =
                (u32)Mma<T>::cvt(sacc[nt][2]) | ((u32)Mma<T>::cvt(sacc[nt][3]) << 16);
          }
        }
      }
    }
    // (b) cumulative gate of the thread's 8 rows (rows past the end hold g = 0), the warp's sums to shared memory
    float x[8][2];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const u32 u = ld32(Gin + (8 * w + i) * L::LP + kc);
      x[i][0] = bits_to_f<T>((u16)(u & 0xffffu));
      x[i][1] = bits_to_f<T>((u16)(u >> 16));
      if (i > 0) {
        x[i][0] += x[i - 1][0];
        x[i][1] += x[i - 1][1];
      }
    }
    *reinterpret_cast<F2*>(tot + w * 64 + kc) = F2{x[7][0], x[7][1]};
    __syncthreads();
    // (c) offsets from the rows above, the chunk's total, the decayed left operand; chunk log decays
    float off[2] = {0.f, 0.f}, bL[2] = {0.f, 0.f};
#pragma unroll
    for (int w2 = 0; w2 < 8; ++w2) {
      const F2 t2 = *reinterpret_cast<const F2*>(tot + w2 * 64 + kc);
      if (w2 < w) {
        off[0] += t2.x;
        off[1] += t2.y;
      }
      bL[0] += t2.x;
      bL[1] += t2.y;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int t = 8 * w + i;
      const u32 u = ld32(Lin + t * L::LP + kc);
      float lv[2] = {bits_to_f<T>((u16)(u & 0xffffu)), bits_to_f<T>((u16)(u >> 16))};
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float bt = x[i][j] + off[j];
        lv[j] *= REV ? scale * dexp(bt) : dexp(fminf(bL[j] - bt, 0.f));
      }
      *reinterpret_cast<u32*>(Ls + t * L::LP + kc) = (u32)Mma<T>::cvt(lv[0]) | ((u32)Mma<T>::cvt(lv[1]) << 16);
    }
    if (w == 0) {
      *reinterpret_cast<F2*>(bLs + kc) = F2{bL[0], bL[1]};
      float* pcc = pc + ((i64)bh * NT + c) * K + k0 + kc;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        if (first_v && kc + j < Kt) pcc[j] = run[j];
        run[j] += bL[j];
      }
    }
    // (d) the staged 16-bit state to global memory (Sb complete after the barrier above)
    if constexpr (!F32S) {
      constexpr int CPR = VM / 8;
#pragma unroll
      for (int i = 0; i < 64 * CPR / GW2_THREADS; ++i) {
        const int e = tid + GW2_THREADS * i, r = e / CPR, cc = 8 * (e % CPR);
        if (r < Kt && cc < Vt)
          gt_st16(reinterpret_cast<u16*>(Hout) + hbase + (i64)(k0 + r) * V + v0 + cc, ld16(Sb + r * L::RP + cc));
      }
    }
    __syncthreads();  // Ls, bLs complete
    // (e) S <- diag(exp(bL)) S + Ls^T R
    if (mma_rows) {
      const float e0 = dexp(bLs[mr + gid]), e1 = dexp(bLs[mr + gid + 8]);
#pragma unroll
      for (int nt = 0; nt < NTL; ++nt) {
        sacc[nt][0] *= e0;
        sacc[nt][1] *= e0;
        sacc[nt][2] *= e1;
        sacc[nt][3] *= e1;
      }
#pragma unroll 1
      for (int ks = 0; ks < 4; ++ks) {
        u32 a[4];
        frag_a_trans(a, Ls, L::LP, 16 * ks, mr, lane);
#pragma unroll
        for (int p = 0; p < NTL / 2; ++p) {
          if (nc0 + 16 * p < Vt) {
            u32 b0[2], b1[2];
            frag_b2_rowmajor(b0, b1, Rin, L::RP, 16 * ks, nc0 + 16 * p, lane);
            Mma<T>::mma(sacc[2 * p], a, b0);
            Mma<T>::mma(sacc[2 * p + 1], a, b1);
          }
        }
      }
    }
  }
  if (mma_rows) {
    float* out = Sseg + ((i64)bh * NS + seg) * K * V;
#pragma unroll
    for (int nt = 0; nt < NTL; ++nt) {
      const int col = nc0 + 8 * nt + 2 * tig, r = mr + gid;
      if (col < Vt) {
        if (r < Kt) *reinterpret_cast<F2*>(out + (i64)(k0 + r) * V + v0 + col) = F2{sacc[nt][0], sacc[nt][1]};
        if (r + 8 < Kt)
          *reinterpret_cast<F2*>(out + (i64)(k0 + r + 8) * V + v0 + col) = F2{sacc[nt][2], sacc[nt][3]};
      }
    }
  }
  if (w == 0 && first_v && gseg != nullptr) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
      if (kc + j < Kt) gseg[((i64)bh * NS + seg) * K + k0 + kc + j] = run[j];
  }
}

// st[bh, s] (fp32 [K, V]): the segment's local state on entry, the state entering it on exit (reverse: the
// gradient into its end); fin[bh] the state after the last segment. S <- exp(gseg[s]) (rows) * S + local.
// dec (may be null): dec[bh, i] = exp(sum_s gseg[bh, s, i]), the decay over the whole sequence (one thread per row).
// Segments are read GS at a time (their loads in flight together), then updated in order.
#define GS_GROUP 8
__global__ void __launch_bounds__(256) glatc_scan(float* __restrict__ st, const float* __restrict__ gseg,
                                                  float* __restrict__ fin, float* __restrict__ dec, int NS, int K,
                                                  int V, int reverse) {
  const int e = blockIdx.x * 256 + threadIdx.x;
  if (e >= K * V) return;
  const int i = e / V;
  const i64 bh = blockIdx.y, KV = (i64)K * V;
  float S = 0.f, Lsum = 0.f;
  for (int n0 = 0; n0 < NS; n0 += GS_GROUP) {
    float loc[GS_GROUP], gt[GS_GROUP];
#pragma unroll
    for (int j = 0; j < GS_GROUP; ++j) {
      const int n = n0 + j, s = reverse ? NS - 1 - n : n;
      loc[j] = n < NS ? st[(bh * NS + s) * KV + e] : 0.f;
      gt[j] = n < NS ? gseg[(bh * NS + s) * K + i] : 0.f;
    }
#pragma unroll
    for (int j = 0; j < GS_GROUP; ++j) {
      const int n = n0 + j, s = reverse ? NS - 1 - n : n;
      if (n < NS) {
        st[(bh * NS + s) * KV + e] = S;
        S = dexp(gt[j]) * S + loc[j];
        Lsum += gt[j];
      }
    }
  }
  fin[bh * KV + e] = S;
  if (dec != nullptr && e % V == 0) dec[bh * K + i] = dexp(Lsum);
}

// out[bh, s] = base[bh, s] + exp(L[bh, s]) * S0[bh] with L the log decay of the segments before s (reverse: after s)
__global__ void __launch_bounds__(256) glatc_combine(float* __restrict__ out, const float* __restrict__ base,
                                                     const float* __restrict__ S0, const float* __restrict__ gseg,
                                                     int NS, int K, int V, int reverse) {
  const int e = blockIdx.x * 256 + threadIdx.x;
  if (e >= K * V) return;
  const int i = e / V;
  const i64 bh = blockIdx.y, KV = (i64)K * V;
  const float s0 = S0[bh * KV + e];
  float L = 0.f;
  for (int n = 0; n < NS; ++n) {
    const int s = reverse ? NS - 1 - n : n;
    out[(bh * NS + s) * KV + e] = base[(bh * NS + s) * KV + e] + dexp(L) * s0;
    L += gseg[(bh * NS + s) * K + i];
  }
}

#ifdef GLA_INSTANTIATE
#define GLATC_INST_WALK(T, R, F)                                                                                 \
  template __global__ void glatc_walk<T, R, F>(const T*, const T*, const T*, void*, float*, float*, float*, float, \
                                               int, int, int, int, int, int, int, int);
#define GLATC_INST_WALK2(T, R, F, VM)                                                                            \
  template __global__ void glatc_walk2<T, R, F, VM>(const T*, const T*, const T*, void*, float*, float*, float*,  \
                                                    float, int, int, int, int, int, int, int, int);
GLATC_INST_WALK(bf16, false, false)
GLATC_INST_WALK(bf16, true, false)
GLATC_INST_WALK2(bf16, false, false, 128)
GLATC_INST_WALK2(bf16, true, false, 128)
GLATC_INST_WALK2(bf16, false, false, 64)
#ifndef GLA_INSTANTIATE_FAST
GLATC_INST_WALK(bf16, false, true)
GLATC_INST_WALK(bf16, true, true)
GLATC_INST_WALK(f16, false, true)
GLATC_INST_WALK(f16, true, true)
GLATC_INST_WALK2(bf16, true, false, 64)
GLATC_INST_WALK2(bf16, false, true, 128)
GLATC_INST_WALK2(bf16, true, true, 128)
GLATC_INST_WALK2(f16, false, true, 128)
GLATC_INST_WALK2(f16, true, true, 64)
#endif
#endif
