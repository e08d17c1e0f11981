// Shared pieces of the tensor-core kernels (gla_tc.cu, gla_zeco.cu): mma.sync m16n8k16 on 16-bit operands
// with fp32 accumulation, fragment loads (32-bit pairs and ldmatrix.trans), 16-byte vector loads, the
// shared-memory layout of the GLA forward. Compiled by NVRTC (inlined by gpu/gla.py), nvcc and the CPU emulation.
#pragma once
#include "gla_common.cuh"

#define TC_THREADS 256
#define TC_KP 136  // padded row of 16-bit [.][K] tiles (K <= 128)
#define TC_CP 72   // padded row of 16-bit [.][64] tiles
#define TC_BP 132  // padded row of the fp32 cumulative gate

// shared-memory layout (bytes); gpu/gla_tc.py mirrors TC_SMEM_STATE / TC_SMEM_OUTPUT
#define TC_OFF_BS 0
#define TC_OFF_VT (TC_OFF_BS + 64 * TC_BP * 4)
#define TC_OFF_KT (TC_OFF_VT + 128 * TC_CP * 2)
#define TC_OFF_KR (TC_OFF_KT + 128 * TC_CP * 2)  // raw k tile of the state kernel
#define TC_SMEM_STATE (TC_OFF_KR + 64 * TC_KP * 2)
#define TC_OFF_QH (TC_OFF_KT + 128 * TC_CP * 2)  // the output kernel reuses the KR region
#define TC_OFF_KH (TC_OFF_QH + 64 * TC_KP * 2)
#define TC_OFF_KO (TC_OFF_KH + 64 * TC_KP * 2)
#define TC_OFF_QI (TC_OFF_KO + 6 * 16 * TC_KP * 2)
#define TC_OFF_AS (TC_OFF_QI + 64 * TC_KP * 2)
#define TC_OFF_ST (TC_OFF_AS + 64 * TC_CP * 2)
#define TC_OFF_SP (TC_OFF_ST + 128 * TC_KP * 2)
#define TC_SMEM_OUTPUT (TC_OFF_SP + 16)

#ifndef GLA_EMU
#define TC_DYN_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#else
#define TC_DYN_SMEM(name) static unsigned char name[TC_SMEM_OUTPUT] __attribute__((aligned(16)))
#endif

typedef unsigned short u16;
typedef unsigned int u32;

GLA_DEVICE int float_to_int_bits(float f) { return (int)float_to_bits(f); }

#ifdef GLA_EMU
// emulation of mma.sync.m16n8k16.row.col (fp32 accumulate): lanes exchange fragments through memory
struct EmuMmaLane {
  u32 a[4];
  u32 b[2];
};
inline EmuMmaLane emu_mma_buf[32][32];
template <typename Back>
inline void emu_mma(float* d, const u32* a, const u32* b, Back back) {
  const unsigned tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const unsigned w = tid / 32, lane = tid % 32;
  for (int i = 0; i < 4; ++i) emu_mma_buf[w][lane].a[i] = a[i];
  for (int i = 0; i < 2; ++i) emu_mma_buf[w][lane].b[i] = b[i];
  __syncwarp();
  float A[16][16], Bm[16][8];
  for (int l = 0; l < 32; ++l) {
    const int gid = l >> 2, tig = l & 3;
    const EmuMmaLane& m = emu_mma_buf[w][l];
    A[gid][2 * tig] = back(m.a[0] & 0xffff);
    A[gid][2 * tig + 1] = back(m.a[0] >> 16);
    A[gid + 8][2 * tig] = back(m.a[1] & 0xffff);
    A[gid + 8][2 * tig + 1] = back(m.a[1] >> 16);
    A[gid][2 * tig + 8] = back(m.a[2] & 0xffff);
    A[gid][2 * tig + 9] = back(m.a[2] >> 16);
    A[gid + 8][2 * tig + 8] = back(m.a[3] & 0xffff);
    A[gid + 8][2 * tig + 9] = back(m.a[3] >> 16);
    Bm[2 * tig][gid] = back(m.b[0] & 0xffff);
    Bm[2 * tig + 1][gid] = back(m.b[0] >> 16);
    Bm[2 * tig + 8][gid] = back(m.b[1] & 0xffff);
    Bm[2 * tig + 9][gid] = back(m.b[1] >> 16);
  }
  __syncwarp();
  const int gid = lane >> 2, tig = lane & 3;
  for (int i = 0; i < 4; ++i) {
    const int r = gid + (i >= 2 ? 8 : 0), c = 2 * tig + (i & 1);
    float acc = d[i];
    for (int kk = 0; kk < 16; ++kk) acc += A[r][kk] * Bm[kk][c];
    d[i] = acc;
  }
}
#endif

template <typename T>
struct Mma;
template <>
struct Mma<bf16> {
  static GLA_DEVICE u16 cvt(float f) {
#ifndef GLA_EMU
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
#else
    return f2bf_bits(f);
#endif
  }
  static GLA_DEVICE float back(u32 u) { return bits_to_float(u << 16); }
  static GLA_DEVICE void mma(float* d, const u32* a, const u32* b) {
#ifndef GLA_EMU
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    emu_mma(d, a, b, back);
#endif
  }
};
template <>
struct Mma<f16> {
  static GLA_DEVICE u16 cvt(float f) { return f2h_bits(f); }
  static GLA_DEVICE float back(u32 u) {
    f16 h;
    h.x = (u16)u;
    return to_f(h);
  }
  static GLA_DEVICE void mma(float* d, const u32* a, const u32* b) {
#ifndef GLA_EMU
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    emu_mma(d, a, b, back);
#endif
  }
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
#ifndef GLA_EMU
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
inline const u16* emu_ldsm_ptr[32][32];
inline void ldsm_x4_trans(u32* r, const u16* p) {
  const unsigned tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const unsigned w = tid / 32, lane = tid % 32;
  emu_ldsm_ptr[w][lane] = p;
  __syncwarp();
  const int gid = lane >> 2, tig = lane & 3;
  for (int i = 0; i < 4; ++i) {
    const u16* r0 = emu_ldsm_ptr[w][8 * i + 2 * tig];
    const u16* r1 = emu_ldsm_ptr[w][8 * i + 2 * tig + 1];
    r[i] = (u32)r0[gid] | ((u32)r1[gid] << 16);
  }
  __syncwarp();
}
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
  T x;
  x.x = u;
  return to_f(x);
}

