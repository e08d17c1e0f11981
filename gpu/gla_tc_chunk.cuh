// Shared pieces of the chunk-parallel tensor-core GLA kernels (gla_tc_states.cu, gla_fwd_tc.cu, gla_bwd_tc.cu):
// 16-bit inputs (bf16 / fp16), chunk 64 = 4 sub-chunks of 16, K and V multiples of 16 up to KM (64 or 128).
//
// Element mapping of a chunk tile (64 rows x W columns) in the elementwise phases: thread tid holds columns
// 8 cg .. 8 cg + 7 (cg = tid / 16) of rows qr + 16 I (qr = tid % 16, I = 0..3); the 16 lanes of a column group
// are one half-warp, so cumulative sums down the rows are half-warp shuffles (plus sub-chunk offsets).
// Decay factors are exp of non-positive numbers (taken relative to a sub-chunk boundary), except the diagonal
// sub-chunk operands whose factors are bounded by exp(span) with span <= span_limit (else those blocks are
// computed elementwise, exactly).
//
// Also here: warp shuffles and float atomics with their CPU emulation (cuda_emu.h has neither).
#pragma once
#include "gla_mma.cuh"

#define GT_FULL 0xffffffffu

#ifndef GLA_EMU
#define GT_DYN_SMEM(name, bytes) extern __shared__ __align__(16) unsigned char name[]
#else
// the launch's dynamic shared memory, which must be exactly the kernel's layout (cp.async checks need it there)
#define GT_DYN_SMEM(name, bytes)                 \
  unsigned char* const name = emu_dynamic_smem(); \
  emu_expect_dynamic_smem(bytes)
#endif

// ---- warp shuffles on N floats (MODE 0: from lane src of the width-group, 1: up, 2: down, 3: xor) ----------
#ifndef GLA_EMU
template <int MODE, int N>
GLA_DEVICE void gt_shfl(float* dst, const float* src, int arg, int width) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float v = src[i];
    if constexpr (MODE == 0)
      dst[i] = __shfl_sync(GT_FULL, v, arg, width);
    else if constexpr (MODE == 1)
      dst[i] = __shfl_up_sync(GT_FULL, v, arg, width);
    else if constexpr (MODE == 2)
      dst[i] = __shfl_down_sync(GT_FULL, v, arg, width);
    else
      dst[i] = __shfl_xor_sync(GT_FULL, v, arg, width);
  }
}
GLA_DEVICE void gt_atomic_add(float* p, float v) { atomicAdd(p, v); }
#else
inline float emu_gt_shfl_buf[32][32][32];
template <int MODE, int N>
inline void gt_shfl(float* dst, const float* src, int arg, int width) {
  static_assert(N <= 32, "emulated shuffle of at most 32 floats");
  const unsigned tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int w = (int)(tid / 32), lane = (int)(tid % 32);
  for (int i = 0; i < N; ++i) emu_gt_shfl_buf[w][lane][i] = src[i];
  __syncwarp();
  const int li = lane % width, base = lane - li;
  int s = lane;
  if constexpr (MODE == 0)
    s = base + arg % width;
  else if constexpr (MODE == 1)
    s = li >= arg ? lane - arg : lane;
  else if constexpr (MODE == 2)
    s = li + arg < width ? lane + arg : lane;
  else
    s = base + ((li ^ arg) % width);
  float tmp[32];
  for (int i = 0; i < N; ++i) tmp[i] = emu_gt_shfl_buf[w][s][i];
  __syncwarp();
  for (int i = 0; i < N; ++i) dst[i] = tmp[i];
}
inline void gt_atomic_add(float* p, float v) { std::atomic_ref<float>(*p).fetch_add(v); }
#endif

// ---- cp.async (sm_80+): 16-byte global -> shared copies that land without registers ---------------------------
// gt_cp16(dst, src, bytes): bytes = 16 or 0 (0 writes zeros and reads nothing: src only has to be a valid address).
// gt_cp_commit() closes a group, gt_cp_wait<N>() waits until at most N groups of this thread are in flight; other
// threads' copies are visible only after a barrier that follows their wait.
#ifndef GLA_EMU
GLA_DEVICE void gt_cp16(void* dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(bytes)
               : "memory");
}
GLA_DEVICE void gt_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
GLA_DEVICE void gt_cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#else
inline void gt_cp16(void* dst, const void* src, int bytes) { emu_cp_async16(dst, src, bytes); }
inline void gt_cp_commit() { emu_cp_async_commit(); }
template <int N>
inline void gt_cp_wait() {
  emu_cp_async_wait(N);
}
#endif

// ---- 16-byte vectors of 8 16-bit values <-> 8 floats --------------------------------------------------------
template <typename T>
GLA_DEVICE void gt_unpack(float* f, const V16& x) {
#pragma unroll
  for (int j = 0; j < 8; ++j) f[j] = bits_to_f<T>(half_of(x, j));
}
template <typename T>
GLA_DEVICE V16 gt_pack(const float* f) {
  V16 r;
#pragma unroll
  for (int j = 0; j < 4; ++j) r.w[j] = (u32)Mma<T>::cvt(f[2 * j]) | ((u32)Mma<T>::cvt(f[2 * j + 1]) << 16);
  return r;
}
GLA_DEVICE void gt_st16(void* p, const V16& x) { *reinterpret_cast<V16*>(p) = x; }
struct __align__(16) F4 {
  float x, y, z, w;
};
struct __align__(8) F2 {
  float x, y;
};
GLA_DEVICE void gt_ld8f(float* f, const float* p) {  // 8 floats, 16-byte aligned
  const F4 a = *reinterpret_cast<const F4*>(p), b = *reinterpret_cast<const F4*>(p + 4);
  f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}
GLA_DEVICE void gt_st8f(float* p, const float* f) {
  *reinterpret_cast<F4*>(p) = F4{f[0], f[1], f[2], f[3]};
  *reinterpret_cast<F4*>(p + 4) = F4{f[4], f[5], f[6], f[7]};
}

// rows qr + 16 I (I = 0..3), columns c0 .. c0 + 7 of a [B, T, H, W] array from token t0 on; zero where t >= len or
// !act (all loads issued before any use)
template <typename T>
GLA_DEVICE void gt_load_rows(V16* r, const T* __restrict__ x, int b, int h, int t0, int len, int Tlen, int H, int W,
                             int c0, bool act, int qr) {
  const V16 zero = {{0u, 0u, 0u, 0u}};
#pragma unroll
  for (int I = 0; I < 4; ++I) {
    const int t = qr + 16 * I;
    const bool ok = act && t < len;
    r[I] = ok ? ld16(x + ((i64)(b * Tlen + t0 + t) * H + h) * W + c0) : zero;
  }
}

// In: x[I][j] = g at row qr + 16 I (zero for rows >= len). Out: x = b, the inclusive cumulative sum down the
// chunk. Half-warp collective (every lane of the warp must call it).
GLA_DEVICE void gt_chunk_cumsum(float (*x)[8], int qr) {
  float y[4][8];
#pragma unroll
  for (int d = 1; d < 16; d *= 2) {
    gt_shfl<1, 32>(&y[0][0], &x[0][0], d, 16);
    if (qr >= d) {
#pragma unroll
      for (int I = 0; I < 4; ++I)
#pragma unroll
        for (int j = 0; j < 8; ++j) x[I][j] += y[I][j];
    }
  }
  gt_shfl<0, 32>(&y[0][0], &x[0][0], 15, 16);  // sub-chunk sums
  float off[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) off[j] = 0.f;
#pragma unroll
  for (int I = 0; I < 4; ++I)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      x[I][j] += off[j];
      off[j] += y[I][j];
    }
}

// Reverse (suffix) cumulative sum down the chunk of x[I][j] (row qr + 16 I), in place. Half-warp collective.
GLA_DEVICE void gt_chunk_revcumsum(float (*x)[8], int qr) {
  float y[4][8];
#pragma unroll
  for (int d = 1; d < 16; d *= 2) {
    gt_shfl<2, 32>(&y[0][0], &x[0][0], d, 16);
    if (qr + d < 16) {
#pragma unroll
      for (int I = 0; I < 4; ++I)
#pragma unroll
        for (int j = 0; j < 8; ++j) x[I][j] += y[I][j];
    }
  }
  gt_shfl<0, 32>(&y[0][0], &x[0][0], 0, 16);  // sub-chunk sums
  float off[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) off[j] = 0.f;
#pragma unroll
  for (int I = 3; I >= 0; --I)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      x[I][j] += off[j];
      off[j] += y[I][j];
    }
}

// store a warp tile (rows 16 RB.., column groups p0..p1-1) of fp32 accumulators times alpha as 16-bit pairs to
// x [B, T, H, W] (rows t < len)
template <typename T, int NPW>
GLA_DEVICE void gt_store_tile(T* __restrict__ x, const float (*acc)[4], int b, int h, int t0, int len, int Tlen, int H,
                              int W, int RB, int p0, int p1, int gid, int tig, float alpha = 1.f) {
#pragma unroll
  for (int pp = 0; pp < NPW; ++pp) {
    if (p0 + pp < p1) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int col = 16 * (p0 + pp) + 8 * hh + 2 * tig;
#pragma unroll
        for (int r2 = 0; r2 < 2; ++r2) {
          const int t = 16 * RB + gid + 8 * r2;
          if (t < len) {
            const u32 lo = Mma<T>::cvt(alpha * acc[2 * pp + hh][2 * r2]);
            const u32 hi = Mma<T>::cvt(alpha * acc[2 * pp + hh][2 * r2 + 1]);
            *reinterpret_cast<u32*>(x + ((i64)(b * Tlen + t0 + t) * H + h) * W + col) = lo | (hi << 16);
          }
        }
      }
    }
  }
}

// ---- shared-memory layouts of the chunk kernels (bytes), per KM (largest K, V: 64 or 128) -------------------
// gpu/gla_tc_states.py mirrors gt_bwd_smem / gt_fwd_smem.
template <int KM>
struct GtLayout {
  static constexpr int P = KM + 8;   // padded row (16-bit elements) of [.][KM] tiles
  static constexpr int BP = KM + 4;  // padded row (floats) of [64][KM] fp32 tiles
  static constexpr int AP = 72;      // padded row of [64][64] 16-bit score tiles
  static constexpr int T64 = 64 * P * 2;
  static constexpr int TK = KM * P * 2;
  static constexpr int F64 = 64 * BP * 4;
  static constexpr int A64 = 64 * AP * 2;
  static constexpr int SMALL = (10 * KM + 4) * 4;  // R[4][KM], E[4][KM], rs[KM], X2[KM], sp[4]
  // backward: regions (their later tenants in brackets)
  static constexpr int B_BS = 0;
  static constexpr int B_V = B_BS + F64;
  static constexpr int B_DO = B_V + T64;
  static constexpr int B_QR = B_DO + T64;  // raw q
  static constexpr int B_KR = B_QR + T64;  // raw k
  static constexpr int B_Z1 = 2 * TK + T64, B_Z2 = 224 * P * 2;
  static constexpr int B_ZSIZE = B_Z1 > B_Z2 ? (B_Z1 > F64 ? B_Z1 : F64) : (B_Z2 > F64 ? B_Z2 : F64);
  static constexpr int B_Z = B_KR + T64;  // h, dS, Kd  [Qh, Kh, Ko]  [dG fp32]
  static constexpr int B_AS = B_Z + B_ZSIZE;
  static constexpr int B_DAS = B_AS + A64;
  static constexpr int B_SMALL = B_DAS + A64;
  static constexpr int B_TOTAL = B_SMALL + SMALL;
  // forward output kernel
  static constexpr int F_BS = 0;
  static constexpr int F_V = F_BS + F64;
  static constexpr int F_H = F_V + T64;
  static constexpr int F_AS = F_H + TK;  // A (hi), A (lo)
  static constexpr int F_Q = F_AS + 2 * A64;  // Qh [Qe after the scores], Kh, Qh lo, Kh lo (64 rows each), Ko (96)
  static constexpr int F_SMALL = F_Q + 352 * P * 2;
  static constexpr int F_TOTAL = F_SMALL + (8 * KM + 4) * 4;  // R[4][KM], E[4][KM], sp[4]
  // lean forward output kernel (two CTAs per SM at KM 128): the scores summed over NH pieces of K of KH columns;
  // the zone holds one piece's operands, then (after the scores) Qe and the chunk state h; bs only for exact blocks
  static constexpr int NH = KM == 128 ? 2 : 1, KH = KM / NH, PH = KH + 8;
  static constexpr int O_ZOPS = 352 * PH * 2, O_ZQH = T64 + TK;
  static constexpr int O_ZSIZE = O_ZOPS > O_ZQH ? (O_ZOPS > F64 ? O_ZOPS : F64) : (O_ZQH > F64 ? O_ZQH : F64);
  static constexpr int O_V = 0;
  static constexpr int O_AS = O_V + T64;  // A (hi), A (lo)
  static constexpr int O_Z = O_AS + 2 * A64;  // Qh, Kh, Qh lo, Kh lo (64 rows each), Ko (96) [Qe, h] [bs]
  static constexpr int O_SMALL = O_Z + O_ZSIZE;
  static constexpr int O_TOTAL = O_SMALL + (8 * KM + 4) * 4;  // R[4][KM], E[4][KM], sp[4]
  // the V-tiled kernels of large heads (gla_tc_large.cu: glatc_fwd_vt, glatc_bwd_vt) use the lean layout O_*: the
  // tile of v (or do) at O_V, A at O_AS, the zone for one half-piece's score operands, then for a piece's left
  // operand [64][P] and state tile [KM][P]. The K-tiled backward glatc_bwd_kt (dq, dk, dg of KM columns of K, V in
  // pieces of KM columns):
  static constexpr int K_BS = 0;
  static constexpr int K_QR = K_BS + F64;  // raw q
  static constexpr int K_KR = K_QR + T64;  // raw k
  static constexpr int K_Z1 = 2 * T64 + 2 * TK, K_Z2 = 224 * P * 2;
  static constexpr int K_ZSIZE = K_Z1 > K_Z2 ? (K_Z1 > F64 ? K_Z1 : F64) : (K_Z2 > F64 ? K_Z2 : F64);
  static constexpr int K_Z = K_KR + T64;  // v, do, h, dS of a V piece  [Qh, Kh, Ko]  [dG fp32]
  static constexpr int K_DAS = K_Z + K_ZSIZE;  // dA' hi, lo
  static constexpr int K_SMALL = K_DAS + 2 * A64;
  static constexpr int K_TOTAL = K_SMALL + SMALL;
};

// the chunk's rows of q, k, g (raw, to registers: rows qr + 16 I, columns c0 ..) and of v (to Vs, row stride P),
// every load issued before any use
template <typename T, int KM>
GLA_DEVICE void gt_load_chunk(V16* qraw, V16* kraw, V16* gr, u16* Vs, const T* __restrict__ q, const T* __restrict__ k,
                              const T* __restrict__ v, const T* __restrict__ g, int b, int h, int t0, int len, int Tlen,
                              int H, int K, int V, int c0, bool actK, bool actV, int qr) {
  V16 vr[4];
  gt_load_rows<T>(vr, v, b, h, t0, len, Tlen, H, V, c0, actV, qr);
  gt_load_rows<T>(qraw, q, b, h, t0, len, Tlen, H, K, c0, actK, qr);
  gt_load_rows<T>(kraw, k, b, h, t0, len, Tlen, H, K, c0, actK, qr);
  gt_load_rows<T>(gr, g, b, h, t0, len, Tlen, H, K, c0, actK, qr);
  if (actV) {
#pragma unroll
    for (int I = 0; I < 4; ++I) gt_st16(Vs + (qr + 16 * I) * GtLayout<KM>::P + c0, vr[I]);
  }
}

// ---- chunk state operand: dst[k][v] (16-bit, row stride P) = Hc[k][v] + exp(p[k]) * Sf[k][v] ------------------
// Hc: the chunk's state inside its segment (16-bit bits of T, or fp32 if F32S), Sf: the segment's state (fp32,
// may be null), p: log decay from the segment boundary to the chunk (fp32 [K]). With D* given, the same for a
// second state and rs[k] += sum_v h[k][v] * d[k][v] (fp32 values before rounding). 256 threads.
template <typename T, bool F32S>
GLA_DEVICE void gt_load8_state(float* f, const void* Hc, i64 off) {
  if constexpr (F32S) {
    gt_ld8f(f, reinterpret_cast<const float*>(Hc) + off);
  } else {
    gt_unpack<T>(f, ld16(reinterpret_cast<const u16*>(Hc) + off));
  }
}
template <typename T, bool F32S>
GLA_DEVICE void gt_load8_state_or0(float* f, const void* Hc, i64 off, bool ok) {
  if (ok) {
    gt_load8_state<T, F32S>(f, Hc, off);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) f[j] = 0.f;
  }
}
GLA_DEVICE void gt_ld8f_or0(float* f, const float* p, bool ok) {
  if (ok) {
    gt_ld8f(f, p);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) f[j] = 0.f;
  }
}
// dst[kk][c] (16-bit, row stride ld) = Hc[kk][c] + exp(p[kk]) Sf[kk][c] for kk < rows, c < cols (multiple of 8) of
// global tiles with row stride ldg (the pointers already at the tile's first element; Sf may be null); with dstD the
// same for a second state (Dc, Df, pd) and rs[kk] += sum_c h[kk][c] dS[kk][c] (fp32 before rounding). 256 threads;
// the loads of NB pieces of 8 are issued together.
template <typename T, bool F32S, int MAXR, int MAXC, int NB>
GLA_DEVICE void gt_state_tile(u16* dstH, int ld, const void* Hc, const float* Sf, const float* p, u16* dstD,
                              const void* Dc, const float* Df, const float* pd, float* rs, int rows, int cols,
                              int ldg) {
  constexpr int NIT = MAXR * MAXC / 8 / 256;
  static_assert(NIT % NB == 0, "batches must divide the pieces");
  const int c8 = cols / 8, n = rows * c8;
#pragma unroll
  for (int i0 = 0; i0 < NIT; i0 += NB) {
    float hv[NB][8], sv[NB][8], ph[NB], dv[NB][8], dsv[NB][8], pdv[NB];
#pragma unroll
    for (int i = 0; i < NB; ++i) {  // loads
      const int e = threadIdx.x + 256 * (i0 + i);
      const bool ok = e < n;
      const int kk = ok ? e / c8 : 0;
      const i64 off = ok ? (i64)kk * ldg + (e % c8) * 8 : 0;
      gt_load8_state_or0<T, F32S>(hv[i], Hc, off, ok);
      gt_ld8f_or0(sv[i], Sf + off, ok && Sf != nullptr);
      ph[i] = (ok && Sf != nullptr) ? p[kk] : 0.f;
      if (dstD != nullptr) {
        gt_load8_state_or0<T, F32S>(dv[i], Dc, off, ok);
        gt_ld8f_or0(dsv[i], Df + off, ok && Df != nullptr);
        pdv[i] = (ok && Df != nullptr) ? pd[kk] : 0.f;
      }
    }
#pragma unroll
    for (int i = 0; i < NB; ++i) {
      const int e = threadIdx.x + 256 * (i0 + i);
      if (e < n) {
        const int kk = e / c8, c = (e % c8) * 8;
        const float f = dexp(ph[i]);
#pragma unroll
        for (int j = 0; j < 8; ++j) hv[i][j] += f * sv[i][j];
        gt_st16(dstH + kk * ld + c, gt_pack<T>(hv[i]));
        if (dstD != nullptr) {
          const float fd = dexp(pdv[i]);
          float acc = 0.f;
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            dv[i][j] += fd * dsv[i][j];
            acc += hv[i][j] * dv[i][j];
          }
          gt_st16(dstD + kk * ld + c, gt_pack<T>(dv[i]));
          gt_atomic_add(rs + kk, acc);
        }
      }
    }
  }
}

// the whole chunk state (K rows, V columns) into dstH (and dstD) at row stride P: gt_state_tile over all of it
template <typename T, bool F32S, int KM, int NB>
GLA_DEVICE void gt_state_operands(u16* dstH, const void* Hc, const float* Sf, const float* p, u16* dstD,
                                  const void* Dc, const float* Df, const float* pd, float* rs, int K, int V) {
  gt_state_tile<T, F32S, KM, KM, NB>(dstH, GtLayout<KM>::P, Hc, Sf, p, dstD, Dc, Df, pd, rs, K, V, V);
}

// ---- intra-chunk scores: one 16 x 16 block (I >= J) of alpha * A, A_ts = sum_k q_tk k_sk exp(b_tk - b_sk) --------
// for s <= t < len (zero elsewhere), into As[t][s] (16-bit, row stride AP; with Asl also the rounding remainder).
// Operands (gt_score_operands): Qh, Kh (diagonal; with Qhl, Khl the split diagonal Qh Kh^T + Qh Khl^T + Qhl Kh^T),
// Ko[pair] (pair = I(I-1)/2 + J), row stride PS. gt_score_mma adds the products over nks 16-column steps of the
// operands to acc (so a block can be summed over pieces of K), gt_score_store writes the block. Warp collectives.
template <typename T, int PS>
GLA_DEVICE void gt_score_mma(float (&acc)[2][4], const u16* Qh, const u16* Kh, const u16* Qhl, const u16* Khl,
                             const u16* Ko, int nks, int I, int J, int gid, int tig) {
  const bool split = I == J && Qhl != nullptr;
  const u16* Bop = (I == J) ? (Kh + 16 * I * PS) : (Ko + (I * (I - 1) / 2 + J) * 16 * PS);
  for (int ks = 0; ks < nks; ++ks) {
    u32 a[4], al[4];
    frag_a(a, Qh, PS, 16 * I, 16 * ks, gid, tig);
    if (split) frag_a(al, Qhl, PS, 16 * I, 16 * ks, gid, tig);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      u32 bb[2];
      frag_b(bb, Bop, PS, 8 * nt, 16 * ks, gid, tig);
      Mma<T>::mma(acc[nt], a, bb);
      if (split) {
        Mma<T>::mma(acc[nt], al, bb);
        frag_b(bb, Khl + 16 * I * PS, PS, 8 * nt, 16 * ks, gid, tig);
        Mma<T>::mma(acc[nt], a, bb);
      }
    }
  }
}
template <typename T, int KM>
GLA_DEVICE void gt_score_store(u16* As, u16* Asl, const float (&acc)[2][4], float alpha, int I, int J, int gid,
                               int tig) {
  using L = GtLayout<KM>;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int tl = gid + (i >= 2 ? 8 : 0), sl = 8 * nt + 2 * tig + (i & 1);
      const float val = (I == J && sl > tl) ? 0.f : alpha * acc[nt][i];
      const u16 hi = Mma<T>::cvt(val);
      As[(16 * I + tl) * L::AP + 16 * J + sl] = hi;
      if (Asl != nullptr) Asl[(16 * I + tl) * L::AP + 16 * J + sl] = Mma<T>::cvt(val - bits_to_f<T>(hi));
    }
}
// The whole block; diagonal blocks whose span exceeds span_limit are computed elementwise from the raw inputs (qg,
// kg: the chunk's first row in global memory, row stride rstride) and bs (the operands are then not read).
template <typename T, int KM>
GLA_DEVICE void gt_score_block(u16* As, u16* Asl, const u16* Qh, const u16* Kh, const u16* Qhl, const u16* Khl,
                               const u16* Ko, const float* bs, const float* span, float alpha, float span_limit,
                               const T* qg, const T* kg, i64 rstride, int K, int len, int I, int J, int lane) {
  using L = GtLayout<KM>;
  const int gid = lane >> 2, tig = lane & 3;
  if (I == J && span[I] > span_limit) {
    for (int pp = lane; pp < 256; pp += 32) {
      const int tl = pp / 16, sl = pp % 16, t = 16 * I + tl, s = 16 * I + sl;
      float a = 0.f;
      if (sl <= tl && t < len) {
        const T* qt = qg + t * rstride;
        const T* ks = kg + s * rstride;
        for (int kk = 0; kk < K; ++kk)
          a += to_f(qt[kk]) * to_f(ks[kk]) * dexp(bs[t * L::BP + kk] - bs[s * L::BP + kk]);
      }
      const u16 hi = Mma<T>::cvt(alpha * a);
      As[t * L::AP + s] = hi;
      if (Asl != nullptr) Asl[t * L::AP + s] = Mma<T>::cvt(alpha * a - bits_to_f<T>(hi));
    }
    return;
  }
  float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  gt_score_mma<T, L::P>(acc, Qh, Kh, Qhl, Khl, Ko, K / 16, I, J, gid, tig);
  gt_score_store<T, KM>(As, Asl, acc, alpha, I, J, gid, tig);
}

// block (I, J) of blocks in order (0,0) (1,0) (1,1) (2,0) (2,1) (2,2) (3,0) ...
GLA_DEVICE void gt_block_ij(int n, int& I, int& J) {
  I = 0;
  while (n > I) {
    n -= I + 1;
    ++I;
  }
  J = n;
}

// Stage-A operands of the thread's row t = qr + 16 I from raw q, k (16-bit), its cumulative gate bt (8 floats,
// columns c0 ..) and R (shared memory, [4][KM]): Qh = q exp(b - r_I), Kh = k exp(min(r_I - b, span_limit))
// (diagonal), Ko pairs k_J exp(r_I - b). With Qhl, Khl: the remainders of Qh, Kh after rounding (hi + lo carries
// ~16 bits), for the split diagonal blocks. Stored at column cd of tiles with row stride PS.
template <typename T, int KM, int PS>
GLA_DEVICE void gt_score_operand_row(u16* Qh, u16* Kh, u16* Qhl, u16* Khl, u16* Ko, const V16& qraw, const V16& kraw,
                                     const float* bt, const float* R, float span_limit, int c0, int cd, int qr,
                                     int I) {
  const int t = qr + 16 * I;
  float qv[8], kv[8], r[8], o1[8], o2[8];
  gt_unpack<T>(qv, qraw);
  gt_unpack<T>(kv, kraw);
  gt_ld8f(r, R + I * KM + c0);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    o1[j] = qv[j] * dexp(bt[j] - r[j]);
    o2[j] = kv[j] * expf(fminf(r[j] - bt[j], span_limit));
  }
  const V16 qh = gt_pack<T>(o1), kh = gt_pack<T>(o2);
  gt_st16(Qh + t * PS + cd, qh);
  gt_st16(Kh + t * PS + cd, kh);
  if (Qhl != nullptr) {
    float a1[8], a2[8];
    gt_unpack<T>(a1, qh);
    gt_unpack<T>(a2, kh);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      a1[j] = o1[j] - a1[j];
      a2[j] = o2[j] - a2[j];
    }
    gt_st16(Qhl + t * PS + cd, gt_pack<T>(a1));
    gt_st16(Khl + t * PS + cd, gt_pack<T>(a2));
  }
#pragma unroll
  for (int I2 = I + 1; I2 < 4; ++I2) {
    const int pair = I2 * (I2 - 1) / 2 + I;
    gt_ld8f(r, R + I2 * KM + c0);
#pragma unroll
    for (int j = 0; j < 8; ++j) o1[j] = kv[j] * dexp(r[j] - bt[j]);
    gt_st16(Ko + (pair * 16 + qr) * PS + cd, gt_pack<T>(o1));
  }
}
// the thread's four rows, their cumulative gate from bs (shared memory), full-width tiles (row stride P)
template <typename T, int KM>
GLA_DEVICE void gt_score_operands(u16* Qh, u16* Kh, u16* Qhl, u16* Khl, u16* Ko, const V16* qraw, const V16* kraw,
                                  const float* bs, const float* R, float span_limit, int c0, int qr) {
  using L = GtLayout<KM>;
#pragma unroll
  for (int I = 0; I < 4; ++I) {
    float bt[8];
    gt_ld8f(bt, bs + (qr + 16 * I) * L::BP + c0);
    gt_score_operand_row<T, KM, L::P>(Qh, Kh, Qhl, Khl, Ko, qraw[I], kraw[I], bt, R, span_limit, c0, c0, qr, I);
  }
}

// the chunk's cumulative gate to shared memory: bs[t][k] (row stride BP; not if bs is null), R[I][k] = b at row
// 16 I and E[I][k] = b at row 16 I + 15 (E[3]: the chunk's total, rows >= len holding g = 0)
template <int KM>
GLA_DEVICE void gt_store_decays(float* bs, float* R, float* E, const float (*x)[8], int c0, bool act, int qr) {
  using L = GtLayout<KM>;
  if (!act) return;
  if (bs != nullptr) {
#pragma unroll
    for (int I = 0; I < 4; ++I) gt_st8f(bs + (qr + 16 * I) * L::BP + c0, x[I]);
  }
  if (qr == 0) {
#pragma unroll
    for (int I = 0; I < 4; ++I) gt_st8f(R + I * KM + c0, x[I]);
  }
  if (qr == 15) {
#pragma unroll
    for (int I = 0; I < 4; ++I) gt_st8f(E + I * KM + c0, x[I]);
  }
}
// sp[I] = span of sub-chunk I = max over k of R[I][k] - E[I][k] (>= 0): warps 0..3, one sub-chunk each, after a
// barrier that follows gt_store_decays. Warp collective.
template <int KM>
GLA_DEVICE void gt_spans(float* sp, const float* R, const float* E, int K, int w, int lane) {
  if (w >= 4) return;
  float m = 0.f;
  for (int kk = lane; kk < K; kk += 32) m = fmaxf(m, R[w * KM + kk] - E[w * KM + kk]);
#pragma unroll
  for (int d = 16; d >= 1; d /= 2) {
    float y;
    gt_shfl<3, 1>(&y, &m, d, 32);
    m = fmaxf(m, y);
  }
  if (lane == 0) sp[w] = m;
}

// one 16 x 16 block (I >= J) of alpha * do v^T (masked s <= t) into dAs[t][s] (16-bit, row stride AP), and into
// lo[8] the rounding remainders of this lane's eight entries (hi + lo carries ~16 bits), for gt_dA_store_lo once
// the operands' memory may be overwritten. Warp collective.
template <typename T, int KM>
GLA_DEVICE void gt_dA_block(u16* dAs, u16* lo, const u16* DOs, const u16* Vs, float alpha, int V, int I, int J,
                            int lane) {
  using L = GtLayout<KM>;
  const int gid = lane >> 2, tig = lane & 3;
  float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  for (int ks = 0; ks < V / 16; ++ks) {
    u32 a[4];
    frag_a(a, DOs, L::P, 16 * I, 16 * ks, gid, tig);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      u32 bb[2];
      frag_b(bb, Vs, L::P, 16 * J + 8 * nt, 16 * ks, gid, tig);
      Mma<T>::mma(acc[nt], a, bb);
    }
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int tl = gid + (i >= 2 ? 8 : 0), sl = 8 * nt + 2 * tig + (i & 1);
      const float val = (I == J && sl > tl) ? 0.f : alpha * acc[nt][i];
      const u16 hi = Mma<T>::cvt(val);
      dAs[(16 * I + tl) * L::AP + 16 * J + sl] = hi;
      lo[4 * nt + i] = Mma<T>::cvt(val - bits_to_f<T>(hi));
    }
}
template <int KM>
GLA_DEVICE void gt_dA_store_lo(u16* dAsl, const u16* lo, int I, int J, int lane) {
  using L = GtLayout<KM>;
  const int gid = lane >> 2, tig = lane & 3;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int tl = gid + (i >= 2 ? 8 : 0), sl = 8 * nt + 2 * tig + (i & 1);
      dAsl[(16 * I + tl) * L::AP + 16 * J + sl] = lo[4 * nt + i];
    }
}

// ---- backward inter-chunk terms of one chunk (glatc_bwd, glatc_bwd_kt) ----------------------------------------------
// accq += do h^T, acck += v dS^T over n16 16-column steps of V (rows 16 RB.., column groups q0..q1-1 of the K tile):
// DOs, Vs [64, P] hold do and v, Hs and Ds [KM, P] the chunk's h and dS (K rows, V columns).
template <typename T, int KM>
GLA_DEVICE void gt_bwd_inter_products(float (&accq)[KM / 16][4], float (&acck)[KM / 16][4], const u16* DOs,
                                      const u16* Vs, const u16* Hs, const u16* Ds, int n16, int RB, int q0, int q1,
                                      int gid, int tig) {
  constexpr int P = GtLayout<KM>::P, NPW = KM / 32;
  for (int ks = 0; ks < n16; ++ks) {  // do h^T, v dS^T (rows RB, K columns q0..)
    u32 aq[4], ak[4];
    frag_a(aq, DOs, P, 16 * RB, 16 * ks, gid, tig);
    frag_a(ak, Vs, P, 16 * RB, 16 * ks, gid, tig);
#pragma unroll
    for (int pp = 0; pp < NPW; ++pp) {
      if (q0 + pp < q1) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          u32 bb[2];
          frag_b(bb, Hs, P, 16 * (q0 + pp) + 8 * hh, 16 * ks, gid, tig);
          Mma<T>::mma(accq[2 * pp + hh], aq, bb);
          frag_b(bb, Ds, P, 16 * (q0 + pp) + 8 * hh, 16 * ks, gid, tig);
          Mma<T>::mma(acck[2 * pp + hh], ak, bb);
        }
      }
    }
  }
}

// the inter parts as dq, dk: dq = scale exp(b) (do h^T), dk = exp(bL - b) (v dS^T); dG = q dq - k dk of them;
// X2[k] += sum_s k_s dk_s (the same fp32 values; per column of the tile, in shared memory)
template <typename T, int KM>
GLA_DEVICE void gt_bwd_inter_finish(float (&accq)[KM / 16][4], float (&acck)[KM / 16][4], float (&dG)[KM / 16][4],
                                    const float* bs, const float* E, const u16* Qr, const u16* Kr, float* X2,
                                    float scale, int RB, int q0, int q1, int gid, int tig) {
  using L = GtLayout<KM>;
  constexpr int P = L::P, BP = L::BP, NPW = KM / 32;
  float part[4 * NPW];
#pragma unroll
  for (int i = 0; i < 4 * NPW; ++i) part[i] = 0.f;
#pragma unroll
  for (int pp = 0; pp < NPW; ++pp) {
    if (q0 + pp < q1) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int r2 = 0; r2 < 2; ++r2)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int col = 16 * (q0 + pp) + 8 * hh + 2 * tig + j, t = 16 * RB + gid + 8 * r2;
            const float bt = bs[t * BP + col];
            const float dqi = scale * dexp(bt) * accq[2 * pp + hh][2 * r2 + j];
            const float dki = dexp(E[3 * KM + col] - bt) * acck[2 * pp + hh][2 * r2 + j];
            const float kv = bits_to_f<T>(Kr[t * P + col]);
            accq[2 * pp + hh][2 * r2 + j] = dqi;
            acck[2 * pp + hh][2 * r2 + j] = dki;
            dG[2 * pp + hh][2 * r2 + j] = bits_to_f<T>(Qr[t * P + col]) * dqi - kv * dki;
            part[4 * pp + 2 * hh + j] += kv * dki;
          }
    }
  }
  float y[4 * NPW];
#pragma unroll
  for (int m = 4; m < 32; m *= 2) {
    gt_shfl<3, 4 * NPW>(y, part, m, 32);
#pragma unroll
    for (int i = 0; i < 4 * NPW; ++i) part[i] += y[i];
  }
  if (gid == 0) {
#pragma unroll
    for (int pp = 0; pp < NPW; ++pp)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int j = 0; j < 2; ++j)
          if (q0 + pp < q1) gt_atomic_add(X2 + 16 * (q0 + pp) + 8 * hh + 2 * tig + j, part[4 * pp + 2 * hh + j]);
  }
}

// ---- backward stages C, D, E of one chunk (glatc_bwd over all of K, glatc_bwd_kt over one tile of K) ----------------
// Inputs: dA' (hi dAs + lo dAsl, [64, AP]), the score operands Qh, Kh, Ko, raw q, k (Qr, Kr), the cumulative gate bs
// and its block rows R, E (bL = E row 3), rowsum(h dS) rs and X2 in shared memory; the inter-chunk terms already in
// this warp's accq, acck, dG (rows 16 RB.., column groups q0..q1-1 of the tile). (C) dq, (D) dk, then dG through
// dGs (which aliases the zone of Qh, Kh, Ko: a barrier separates them) and (E) dg = its reverse cumulative sum in the
// chunk + exp(bL) rowsum(h dS) + X2. dq, dk, dg point at the tile's first column (rows of W = K elements).
struct GtBwdShared {
  const u16 *dAs, *dAsl, *Qh, *Kh, *Ko, *Qr, *Kr;
  const float *bs, *R, *E, *rs, *X2;
  float* dGs;
};
template <typename T, int KM>
GLA_DEVICE void gt_bwd_dq_dk_dg(const GtBwdShared& S, float (&accq)[KM / 16][4], float (&acck)[KM / 16][4],
                                float (&dG)[KM / 16][4], const float (&spn)[4], float span_limit, T* __restrict__ dq,
                                T* __restrict__ dk, T* __restrict__ dg, int b, int h, int t0, int len, int Tlen,
                                int H, int K, int RB, int npk, int q0, int q1, int gid, int tig, int lane, bool actK,
                                int c0, int qr) {
  using L = GtLayout<KM>;
  constexpr int P = L::P, AP = L::AP, BP = L::BP;
  constexpr int NPW = KM / 32;
  const u16 *dAs = S.dAs, *dAsl = S.dAsl, *Qh = S.Qh, *Kh = S.Kh, *Ko = S.Ko, *Qr = S.Qr, *Kr = S.Kr;
  const float *bs = S.bs, *R = S.R, *E = S.E, *rs = S.rs, *X2 = S.X2;
  float* dGs = S.dGs;
  // ---- (C) dq: rows I = RB -----------------------------------------------------------------------------------------
  if (q0 < npk) {
    const int I = RB;
    const bool tcdiag = spn[I] <= span_limit;
    float P_[2 * NPW][4];
#pragma unroll
    for (int n = 0; n < 2 * NPW; ++n) P_[n][0] = P_[n][1] = P_[n][2] = P_[n][3] = 0.f;
    for (int J = 0; J <= I; ++J) {
      if (J == I && !tcdiag) break;
      const u16* Bop = J == I ? Kh + 16 * I * P : Ko + (I * (I - 1) / 2 + J) * 16 * P;
      u32 a[4], al[4];
      frag_a(a, dAs, AP, 16 * I, 16 * J, gid, tig);
      frag_a(al, dAsl, AP, 16 * I, 16 * J, gid, tig);
#pragma unroll
      for (int pp = 0; pp < NPW; ++pp) {
        if (q0 + pp < q1) {
          u32 b0[2], b1[2];
          frag_b2_rowmajor(b0, b1, Bop, P, 0, 16 * (q0 + pp), lane);
          Mma<T>::mma(P_[2 * pp], a, b0);
          Mma<T>::mma(P_[2 * pp + 1], a, b1);
          Mma<T>::mma(P_[2 * pp], al, b0);
          Mma<T>::mma(P_[2 * pp + 1], al, b1);
        }
      }
    }
#pragma unroll
    for (int pp = 0; pp < NPW; ++pp) {
      if (q0 + pp < q1) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
          for (int r2 = 0; r2 < 2; ++r2)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              const int col = 16 * (q0 + pp) + 8 * hh + 2 * tig + j, t = 16 * I + gid + 8 * r2;
              const float bt = bs[t * BP + col], pv = P_[2 * pp + hh][2 * r2 + j];
              float dqv = accq[2 * pp + hh][2 * r2 + j] + dexp(bt - R[I * KM + col]) * pv;
              float dgv = dG[2 * pp + hh][2 * r2 + j] + bits_to_f<T>(Qh[t * P + col]) * pv;
              if (!tcdiag && t < len) {  // exact diagonal block (fp32)
                float e = 0.f;
                for (int s = 16 * I; s <= t; ++s)
                  e += (bits_to_f<T>(dAs[t * AP + s]) + bits_to_f<T>(dAsl[t * AP + s])) *
                       bits_to_f<T>(Kr[s * P + col]) * dexp(bt - bs[s * BP + col]);
                dqv += e;
                dgv += bits_to_f<T>(Qr[t * P + col]) * e;
              }
              accq[2 * pp + hh][2 * r2 + j] = dqv;
              dG[2 * pp + hh][2 * r2 + j] = dgv;
            }
      }
    }
    gt_store_tile<T, NPW>(dq, accq, b, h, t0, len, Tlen, H, K, RB, q0, q1, gid, tig);
  }

  // ---- (D) dk: rows J = RB -----------------------------------------------------------------------------------------
  if (q0 < npk) {
    const int J = RB;
    const bool tcdiag = spn[J] <= span_limit;
    for (int I = 3; I >= J; --I) {
      if (I == J && !tcdiag) break;
      float P_[2 * NPW][4];
#pragma unroll
      for (int n = 0; n < 2 * NPW; ++n) P_[n][0] = P_[n][1] = P_[n][2] = P_[n][3] = 0.f;
      u32 a[4], al[4];
      frag_a_trans(a, dAs, AP, 16 * I, 16 * J, lane);
      frag_a_trans(al, dAsl, AP, 16 * I, 16 * J, lane);
#pragma unroll
      for (int pp = 0; pp < NPW; ++pp) {
        if (q0 + pp < q1) {
          u32 b0[2], b1[2];
          frag_b2_rowmajor(b0, b1, Qh, P, 16 * I, 16 * (q0 + pp), lane);
          Mma<T>::mma(P_[2 * pp], a, b0);
          Mma<T>::mma(P_[2 * pp + 1], a, b1);
          Mma<T>::mma(P_[2 * pp], al, b0);
          Mma<T>::mma(P_[2 * pp + 1], al, b1);
        }
      }
      const u16* Kp = I == J ? Kh + 16 * J * P : Ko + (I * (I - 1) / 2 + J) * 16 * P;  // rows s - 16 J
#pragma unroll
      for (int pp = 0; pp < NPW; ++pp) {
        if (q0 + pp < q1) {
#pragma unroll
          for (int hh = 0; hh < 2; ++hh)
#pragma unroll
            for (int r2 = 0; r2 < 2; ++r2)
#pragma unroll
              for (int j = 0; j < 2; ++j) {
                const int col = 16 * (q0 + pp) + 8 * hh + 2 * tig + j, sl = gid + 8 * r2, s = 16 * J + sl;
                const float pv = P_[2 * pp + hh][2 * r2 + j];
                acck[2 * pp + hh][2 * r2 + j] += dexp(fminf(R[I * KM + col] - bs[s * BP + col], span_limit)) * pv;
                dG[2 * pp + hh][2 * r2 + j] -= bits_to_f<T>(Kp[sl * P + col]) * pv;
              }
        }
      }
    }
    if (!tcdiag) {  // exact diagonal block (fp32)
#pragma unroll
      for (int pp = 0; pp < NPW; ++pp) {
        if (q0 + pp < q1) {
#pragma unroll
          for (int hh = 0; hh < 2; ++hh)
#pragma unroll
            for (int r2 = 0; r2 < 2; ++r2)
#pragma unroll
              for (int j = 0; j < 2; ++j) {
                const int col = 16 * (q0 + pp) + 8 * hh + 2 * tig + j, s = 16 * J + gid + 8 * r2;
                if (s < len) {
                  const float bsv = bs[s * BP + col];
                  float e = 0.f;
                  for (int t = s; t < 16 * J + 16; ++t)
                    e += (bits_to_f<T>(dAs[t * AP + s]) + bits_to_f<T>(dAsl[t * AP + s])) *
                         bits_to_f<T>(Qr[t * P + col]) * dexp(bs[t * BP + col] - bsv);
                  acck[2 * pp + hh][2 * r2 + j] += e;
                  dG[2 * pp + hh][2 * r2 + j] -= bits_to_f<T>(Kr[s * P + col]) * e;
                }
              }
        }
      }
    }
    gt_store_tile<T, NPW>(dk, acck, b, h, t0, len, Tlen, H, K, RB, q0, q1, gid, tig);
  }
  __syncthreads();  // Qh, Kh, Ko are dead: Z <- dG (fp32)
  if (q0 < npk) {
#pragma unroll
    for (int pp = 0; pp < NPW; ++pp) {
      if (q0 + pp < q1) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int col = 16 * (q0 + pp) + 8 * hh + 2 * tig, t = 16 * RB + gid;
          *reinterpret_cast<F2*>(dGs + t * BP + col) = F2{dG[2 * pp + hh][0], dG[2 * pp + hh][1]};
          *reinterpret_cast<F2*>(dGs + (t + 8) * BP + col) = F2{dG[2 * pp + hh][2], dG[2 * pp + hh][3]};
        }
      }
    }
  }
  __syncthreads();

  // ---- (E) dg = reverse cumulative sum of dG in the chunk + exp(bL) rowsum(h * dS) + X2 -----------------------------
  {
    float x[4][8];
#pragma unroll
    for (int I = 0; I < 4; ++I) {
      if (actK) {
        gt_ld8f(x[I], dGs + (qr + 16 * I) * BP + c0);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) x[I][j] = 0.f;
      }
    }
    gt_chunk_revcumsum(x, qr);
    if (actK) {
      float xe[8], eL[8], rsv[8], x2[8];
      gt_ld8f(eL, E + 3 * KM + c0);
      gt_ld8f(rsv, rs + c0);
      gt_ld8f(x2, X2 + c0);
#pragma unroll
      for (int j = 0; j < 8; ++j) xe[j] = dexp(eL[j]) * rsv[j] + x2[j];
#pragma unroll
      for (int I = 0; I < 4; ++I) {
        const int t = qr + 16 * I;
        if (t < len) {
#pragma unroll
          for (int j = 0; j < 8; ++j) x[I][j] += xe[j];
          gt_st16(dg + ((i64)(b * Tlen + t0 + t) * H + h) * K + c0, gt_pack<T>(x[I]));
        }
      }
    }
  }
}
