// Shared pieces of the tensor-core GLA kernels (gla_tc_chunk.cuh and its files, gla_zeco.cu): mma.sync m16n8k16
// on 16-bit operands with fp32 accumulation, fragment loads (32-bit pairs and ldmatrix.trans), 16-byte vector
// loads, and the loops over fragments the kernels share. Compiled by NVRTC (inlined by gpu/runtime.py), nvcc and
// the CPU emulation (gpu/emu/cuda_emu.h: ldmatrix and mma.sync emulated).
#pragma once
#include "gla_common.cuh"

#define TC_THREADS 256
#define TC_KP 136  // padded row of 16-bit [.][K] tiles (K <= 128)

#ifndef CUDA_EMU
#define TC_DYN_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#else
#define TC_DYN_SMEM(name) unsigned char* const name = emu_dynamic_smem()
#endif

typedef unsigned short u16;
typedef unsigned int u32;

// mma.sync.aligned.m16n8k16.row.col.f32.TY.TY.f32: d[16x8] += a[16x16] b[16x8] (16-bit operands, fp32 accumulation)
#define GLA_MMA_SYNC(TY, d, a, b)                                                                          \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, " \
               "{%0,%1,%2,%3};\n"                                                                          \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                            \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]))

template <bool BF>
struct MmaSync {
  static GLA_DEVICE void mma(float* d, const u32* a, const u32* b) {
#ifndef CUDA_EMU
    if constexpr (BF)
      GLA_MMA_SYNC("bf16", d, a, b);
    else
      GLA_MMA_SYNC("f16", d, a, b);
#else
    emu_mma_m16n8k16<BF>(d, a, b[0], b[1]);
#endif
  }
};

// per 16-bit type: the operand rounding (cvt) and its way back to fp32, and the mma on it
template <typename T>
struct Mma;
template <>
struct Mma<bf16> : MmaSync<true> {
  static GLA_DEVICE u16 cvt(float f) {
#ifndef CUDA_EMU
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
#else
    return emu_f32_to_bf16(f);
#endif
  }
  static GLA_DEVICE float back(u32 u) { return bits_to_float(u << 16); }
};
template <>
struct Mma<f16> : MmaSync<false> {
  static GLA_DEVICE u16 cvt(float f) { return f2h_bits(f); }
  static GLA_DEVICE float back(u32 u) { return to_f(from_bits<f16>((u16)u)); }
};

GLA_DEVICE u32 ld32(const u16* p) { return *reinterpret_cast<const u32*>(p); }

// A fragment (16 x 16, row-major tile with row stride ld, 16-bit), rows r0.., cols c0..
GLA_DEVICE void frag_a(u32* a, const u16* base, int ld, int r0, int c0, int gid, int tig) {
  a[0] = ld32(base + (r0 + gid) * ld + c0 + 2 * tig);
  a[1] = ld32(base + (r0 + gid + 8) * ld + c0 + 2 * tig);
  a[2] = ld32(base + (r0 + gid) * ld + c0 + 2 * tig + 8);
  a[3] = ld32(base + (r0 + gid + 8) * ld + c0 + 2 * tig + 8);
}
// B fragment (16 x 8) from its transpose stored row-major: BT[n][k], n0.. (8 rows), k0.. (16 cols)
GLA_DEVICE void frag_b(u32* b, const u16* baseT, int ld, int n0, int k0, int gid, int tig) {
  b[0] = ld32(baseT + (n0 + gid) * ld + k0 + 2 * tig);
  b[1] = ld32(baseT + (n0 + gid) * ld + k0 + 2 * tig + 8);
}

// ldmatrix (m8n8, 16-bit): lanes 8i..8i+7 give the row addresses of matrix i. Without .trans lane l gets
// (row l/4, cols 2(l%4), +1) of each matrix; with .trans (rows 2(l%4), +1; col l/4).
#ifndef CUDA_EMU
GLA_DEVICE u32 smem_u32(const void* p) {
  unsigned long long s;
  asm("cvta.to.shared.u64 %0, %1;" : "=l"(s) : "l"(reinterpret_cast<unsigned long long>(p)));
  return (u32)s;
}
GLA_DEVICE void ldsm_x4_trans(u32* r, const u16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
#else
inline void ldsm_x4_trans(u32* r, const u16* p) { emu_ldmatrix_x4(r, p, true); }
#endif
// A fragment (16 x 16) of A = M^T where M is stored row-major (M[k][m], row stride ld): rows of M k0..k0+15,
// columns m0..m0+15.
GLA_DEVICE void frag_a_trans(u32* a, const u16* M, int ld, int k0, int m0, int lane) {
  const int i = lane >> 3, r = lane & 7;
  ldsm_x4_trans(a, M + (k0 + r + 8 * (i >> 1)) * ld + m0 + 8 * (i & 1));
}
// B fragments of two adjacent n8 tiles (n0.., n0+8..) from B stored row-major (B[k][n], row stride ld)
GLA_DEVICE void frag_b2_rowmajor(u32* b01, u32* b23, const u16* Bm, int ld, int k0, int n0, int lane) {
  const int i = lane >> 3, r = lane & 7;
  u32 x[4];
  ldsm_x4_trans(x, Bm + (k0 + r + 8 * (i & 1)) * ld + n0 + 8 * (i >> 1));
  b01[0] = x[0];
  b01[1] = x[1];
  b23[0] = x[2];
  b23[1] = x[3];
}

struct __align__(16) V16 {
  u32 w[4];
};
GLA_DEVICE V16 ld16(const void* p) { return *reinterpret_cast<const V16*>(p); }
GLA_DEVICE u16 half_of(const V16& x, int j) { return (u16)((x.w[j >> 1] >> (16 * (j & 1))) & 0xffffu); }
template <typename T>
GLA_DEVICE float bits_to_f(u16 u) {
  return to_f(from_bits<T>(u));
}

// ---- loops over the fragments of a warp's accumulators (m16n8 tiles: rows gid, gid + 8; columns 2 tig, +1)

// acc[nt], acc[nt + 1] += a * (the n8 tiles of B at columns n0 + 8 nt, n0 + 8 nt + 8 and rows k0..k0+15), for
// even nt < NT with n0 + 8 nt < n_end (n_end - n0 a multiple of 16). B is 16-bit with row stride ld: row-major
// B[k][n] read with ldmatrix.trans (L), or stored transposed BT[n][k] and read as 32-bit pairs (!L).
template <typename T, bool L, int NT>
GLA_DEVICE void mma_n_tiles(float (&acc)[NT][4], const u32* a, const u16* Bm, int ld, int k0, int n0, int n_end,
                            int lane) {
  const int gid = lane >> 2, tig = lane & 3;
#pragma unroll
  for (int nt = 0; nt < NT; nt += 2) {
    if (n0 + 8 * nt < n_end) {
      u32 b0[2], b1[2];
      if constexpr (L) {
        frag_b2_rowmajor(b0, b1, Bm, ld, k0, n0 + 8 * nt, lane);
      } else {
        frag_b(b0, Bm, ld, n0 + 8 * nt, k0, gid, tig);
        frag_b(b1, Bm, ld, n0 + 8 * nt + 8, k0, gid, tig);
      }
      Mma<T>::mma(acc[nt], a, b0);
      Mma<T>::mma(acc[nt + 1], a, b1);
    }
  }
}

// out[r][c] = scale * acc (fp32 [K][V] row-major, row stride V): warp w's rows 16 w + gid (+8), columns < V
GLA_DEVICE void store_state_frags(float* out, const float (&acc)[16][4], int V, int w, int lane, float scale = 1.f) {
  const int r = 16 * w + (lane >> 2), tig = lane & 3;
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) {
    const int c = 8 * nt + 2 * tig;
    if (c < V) {
      out[(i64)r * V + c] = scale * acc[nt][0];
      out[(i64)r * V + c + 1] = scale * acc[nt][1];
      out[(i64)(r + 8) * V + c] = scale * acc[nt][2];
      out[(i64)(r + 8) * V + c + 1] = scale * acc[nt][3];
    }
  }
}

