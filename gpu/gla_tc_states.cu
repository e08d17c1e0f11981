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
//   glatc_scan                in place over segments: Sseg[s] <- state entering segment s (reverse: gradient into
//                             its end) from a zero start; fin = the state after the last one.
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

// st[bh, s] (fp32 [K, V]): the segment's local state on entry, the state entering it on exit (reverse: the
// gradient into its end); fin[bh] the state after the last segment. S <- exp(gseg[s]) (rows) * S + local.
__global__ void __launch_bounds__(256) glatc_scan(float* __restrict__ st, const float* __restrict__ gseg,
                                                  float* __restrict__ fin, int NS, int K, int V, int reverse) {
  const int e = blockIdx.x * 256 + threadIdx.x;
  if (e >= K * V) return;
  const int i = e / V;
  const i64 bh = blockIdx.y, KV = (i64)K * V;
  float S = 0.f;
  int s = reverse ? NS - 1 : 0;
  const int step = reverse ? -1 : 1;
  float loc = st[(bh * NS + s) * KV + e];
  float gt = gseg[(bh * NS + s) * K + i];
  for (int n = 0; n < NS; ++n) {
    const int sn = s + step;
    float loc_n = 0.f, gt_n = 0.f;
    if (n + 1 < NS) {  // the next segment's values load before the dependent update
      loc_n = st[(bh * NS + sn) * KV + e];
      gt_n = gseg[(bh * NS + sn) * K + i];
    }
    st[(bh * NS + s) * KV + e] = S;
    S = dexp(gt) * S + loc;
    loc = loc_n;
    gt = gt_n;
    s = sn;
  }
  fin[bh * KV + e] = S;
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
GLATC_INST_WALK(bf16, false, false)
GLATC_INST_WALK(bf16, true, false)
#ifndef GLA_INSTANTIATE_FAST
GLATC_INST_WALK(bf16, false, true)
GLATC_INST_WALK(bf16, true, true)
GLATC_INST_WALK(f16, false, true)
GLATC_INST_WALK(f16, true, true)
#endif
#endif
