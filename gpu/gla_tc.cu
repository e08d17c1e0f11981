// Tensor-core GLA forward for 16-bit inputs (bf16 / fp16), chunk 64, K and V multiples of 16 up to 128.
//
// The sequence of each (b, h) is cut into segments of NC chunks of 64 tokens.
//   gla_tc_seg_state : per segment, its local state (zero start) and its total log decay
//   gla_state_scan   : (gla_kernels.cu) incoming state of every segment
//   gla_tc_seg_output: per segment, from its incoming state, chunk after chunk:
//                      o = scale * (A V + (q*exp(b)) S),  S <- diag(exp(bL)) S + (k*exp(bL-b))^T V
// Products run on mma.sync.m16n8k16 (16-bit operands, fp32 accumulation); S stays in fp32 registers
// (accumulator fragments) and is rounded to 16 bits only as the operand of (q*exp(b)) S.
// Intra-chunk scores A (64 x 64, lower triangle) come in 16 x 16 blocks of sub-chunks I >= J:
//   I > J:  (q_I * exp(b - r_I)) (k_J * exp(r_I - b))^T      both factors <= 1 (r_I = b at I's first row)
//   I == J: same with the diagonal k factor exp(r_I - b) >= 1, bounded by exp(span_I); where span_I
//           exceeds span_limit the block is computed elementwise: sum_k q k exp(b_t - b_s), s <= t.
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

// One chunk of q, k, v, g in registers: 16-byte pieces, four per thread per array (K, V <= 128).
struct ChunkRegs {
  V16 g[4], k[4], q[4], v[4];
};

// Issue the loads of one chunk (all before any use); rows t >= len and absent q are zero.
// Needs K, V multiples of 8 (<= 128) and 256 threads.
template <typename T>
GLA_DEVICE void tc_fetch(ChunkRegs& r, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                         const T* __restrict__ g, int b, int h, int t0, int len, int Tlen, int H, int K, int V) {
  const int tid = threadIdx.x, k8 = K / 8, v8 = V / 8;
  const V16 zero = {{0u, 0u, 0u, 0u}};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int e = tid + i * TC_THREADS;
    const int t = e / k8, c = (e % k8) * 8;
    const bool ok = e < 64 * k8 && t < len;
    const i64 off = ((i64)(b * Tlen + t0 + t) * H + h) * K + c;
    r.g[i] = ok ? ld16(g + off) : zero;
    r.k[i] = ok ? ld16(k + off) : zero;
    r.q[i] = (ok && q != nullptr) ? ld16(q + off) : zero;
    const int tv = e / v8, cv = (e % v8) * 8;
    r.v[i] = (e < 64 * v8 && tv < len) ? ld16(v + ((i64)(b * Tlen + t0 + tv) * H + h) * V + cv) : zero;
  }
}

// Registers -> shared memory: g -> bs (fp32), k -> Kraw[t][k], q -> Qraw[t][k] (if Qraw), v -> VT
// (L: row-major V[t][v]; else transposed VT[v][t]).
template <typename T, bool L>
GLA_DEVICE void tc_stash(const ChunkRegs& r, float* bs, u16* Qraw, u16* Kraw, u16* VT, int K, int V) {
  const int tid = threadIdx.x, k8 = K / 8, v8 = V / 8;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int e = tid + i * TC_THREADS;
    if (e < 64 * k8) {
      const int t = e / k8, c = (e % k8) * 8;
#pragma unroll
      for (int j = 0; j < 8; ++j) bs[t * TC_BP + c + j] = bits_to_f<T>(half_of(r.g[i], j));
      *reinterpret_cast<V16*>(Kraw + t * TC_KP + c) = r.k[i];
      if (Qraw != nullptr) *reinterpret_cast<V16*>(Qraw + t * TC_KP + c) = r.q[i];
    }
    if (e < 64 * v8) {
      const int tv = e / v8, cv = (e % v8) * 8;
      if constexpr (L) {
        *reinterpret_cast<V16*>(VT + tv * TC_KP + cv) = r.v[i];  // row-major V[t][v]
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) VT[(cv + j) * TC_CP + tv] = half_of(r.v[i], j);
      }
    }
  }
}

template <typename T, bool L>
GLA_DEVICE void tc_load_chunk(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                              const T* __restrict__ g, float* bs, u16* Qraw, u16* Kraw, u16* VT, int b, int h,
                              int t0, int len, int Tlen, int H, int K, int V) {
  ChunkRegs r;
  tc_fetch<T>(r, Qraw != nullptr ? q : nullptr, k, v, g, b, h, t0, len, Tlen, H, K, V);
  tc_stash<T, L>(r, bs, Qraw, Kraw, VT, K, V);
}

// inclusive cumulative sum over the 64 rows of bs, two threads per column (rows 0..31, 32..63)
GLA_DEVICE void tc_cumsum(float* bs, int K) {
  const int kk = threadIdx.x % 128, part = threadIdx.x / 128;
  if (kk < K) {
    float run = 0.f;
#pragma unroll 8
    for (int t = 32 * part; t < 32 * part + 32; ++t) {
      run += bs[t * TC_BP + kk];
      bs[t * TC_BP + kk] = run;
    }
  }
  __syncthreads();
  if (part == 1 && kk < K) {
    const float add = bs[31 * TC_BP + kk];
#pragma unroll 8
    for (int t = 32; t < 64; ++t) bs[t * TC_BP + kk] += add;
  }
}

// S (warp w owns rows 16w..16w+15 of K, all V in n8 tiles): S = diag(exp(bL)) S + KT V
// (L: KT holds (k*decay)[t][k] and VT holds V[t][v], both row-major, read with ldmatrix.trans)
template <typename T, bool L>
GLA_DEVICE void tc_state_update(float (*sacc)[4], const float* bs, const u16* KT, const u16* VT, int len, int K,
                                int V, int w, int gid, int tig) {
  const int lane = 4 * gid + tig;
  if (16 * w >= K) return;
  const float e0 = dexp(bs[(len - 1) * TC_BP + 16 * w + gid]);
  const float e1 = dexp(bs[(len - 1) * TC_BP + 16 * w + gid + 8]);
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) {
    sacc[nt][0] *= e0;
    sacc[nt][1] *= e0;
    sacc[nt][2] *= e1;
    sacc[nt][3] *= e1;
  }
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    u32 a[4];
    if constexpr (L) {
      frag_a_trans(a, KT, TC_KP, 16 * ks, 16 * w, lane);
#pragma unroll
      for (int nt = 0; nt < 16; nt += 2) {
        if (8 * nt < V) {
          u32 b0[2], b1[2];
          frag_b2_rowmajor(b0, b1, VT, TC_KP, 16 * ks, 8 * nt, lane);
          Mma<T>::mma(sacc[nt], a, b0);
          Mma<T>::mma(sacc[nt + 1], a, b1);
        }
      }
    } else {
      frag_a(a, KT, TC_CP, 16 * w, 16 * ks, gid, tig);
#pragma unroll
      for (int nt = 0; nt < 16; ++nt) {
        if (8 * nt < V) {
          u32 bb[2];
          frag_b(bb, VT, TC_CP, 8 * nt, 16 * ks, gid, tig);
          Mma<T>::mma(sacc[nt], a, bb);
        }
      }
    }
  }
}

// per segment: local state from zero (st[bh, seg] fp32 [K, V]) and total log decay (gseg[bh, seg, K])
template <typename T, bool L>
__global__ void __launch_bounds__(TC_THREADS, 1) gla_tc_seg_state(const T* __restrict__ k, const T* __restrict__ v,
                                                                const T* __restrict__ g, float* __restrict__ st,
                                                                float* __restrict__ gseg, int B, int Tlen, int H,
                                                                int K, int V, int NC, int NS) {
  TC_DYN_SMEM(smem);
  float* bs = reinterpret_cast<float*>(smem + TC_OFF_BS);
  u16* VT = reinterpret_cast<u16*>(smem + TC_OFF_VT);
  u16* KT = reinterpret_cast<u16*>(smem + TC_OFF_KT);
  u16* Kr = reinterpret_cast<u16*>(smem + TC_OFF_KR);
  const int seg = blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;
  const int tid = threadIdx.x, w = tid / 32, lane = tid % 32, gid = lane >> 2, tig = lane & 3;
  float sacc[16][4];
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) sacc[nt][0] = sacc[nt][1] = sacc[nt][2] = sacc[nt][3] = 0.f;
  float gsum = 0.f;  // thread kk = tid (< K) accumulates the segment's total log decay
  for (int ci = 0; ci < NC; ++ci) {
    const int t0 = (seg * NC + ci) * 64;
    if (t0 >= Tlen) break;
    const int len = min(64, Tlen - t0);
    tc_load_chunk<T, L>(nullptr, k, v, g, bs, nullptr, Kr, VT, b, h, t0, len, Tlen, H, K, V);
    __syncthreads();
    tc_cumsum(bs, K);
    __syncthreads();
    if (tid < K) gsum += bs[(len - 1) * TC_BP + tid];
    for (int e = tid; e < 64 * K; e += TC_THREADS) {
      const int t = e / K, kk = e % K;
      const float kv = bits_to_f<T>(Kr[t * TC_KP + kk]);
      const u16 kd = Mma<T>::cvt(kv * dexp(bs[(len - 1) * TC_BP + kk] - bs[t * TC_BP + kk]));
      if constexpr (L)
        KT[t * TC_KP + kk] = kd;
      else
        KT[kk * TC_CP + t] = kd;
    }
    __syncthreads();
    tc_state_update<T, L>(sacc, bs, KT, VT, len, K, V, w, gid, tig);
    __syncthreads();
  }
  if (16 * w < K) {
    float* out = st + ((i64)bh * NS + seg) * K * V;
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      const int c = 8 * nt + 2 * tig;
      if (c < V) {
        const int r = 16 * w + gid;
        out[(i64)r * V + c] = sacc[nt][0];
        out[(i64)r * V + c + 1] = sacc[nt][1];
        out[(i64)(r + 8) * V + c] = sacc[nt][2];
        out[(i64)(r + 8) * V + c + 1] = sacc[nt][3];
      }
    }
  }
  if (tid < K) gseg[((i64)bh * NS + seg) * K + tid] = gsum;
}

// per segment, from its incoming state S_in[bh, seg]: o for every token of the segment
// PF: the next chunk's loads are issued into registers before this chunk's matrix work (overlap)
template <typename T, bool L, bool PF>
__global__ void __launch_bounds__(TC_THREADS, 1)
    gla_tc_seg_output(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                      const T* __restrict__ g, const float* __restrict__ S_in, T* __restrict__ o, float scale, int B,
                      int Tlen, int H, int K, int V, int NC, int NS, float span_limit) {
  TC_DYN_SMEM(smem);
  float* bs = reinterpret_cast<float*>(smem + TC_OFF_BS);
  u16* VT = reinterpret_cast<u16*>(smem + TC_OFF_VT);
  u16* KT = reinterpret_cast<u16*>(smem + TC_OFF_KT);
  u16* Qh = reinterpret_cast<u16*>(smem + TC_OFF_QH);
  u16* Kh = reinterpret_cast<u16*>(smem + TC_OFF_KH);
  u16* Ko = reinterpret_cast<u16*>(smem + TC_OFF_KO);
  u16* Qi = reinterpret_cast<u16*>(smem + TC_OFF_QI);
  u16* As = reinterpret_cast<u16*>(smem + TC_OFF_AS);
  u16* ST = reinterpret_cast<u16*>(smem + TC_OFF_ST);
  float* span = reinterpret_cast<float*>(smem + TC_OFF_SP);
  const int seg = blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;
  const int tid = threadIdx.x, w = tid / 32, lane = tid % 32, gid = lane >> 2, tig = lane & 3;

  float sacc[16][4];
  {
    const float* Sb = S_in + ((i64)bh * NS + seg) * K * V;
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      const int c = 8 * nt + 2 * tig, r = 16 * w + gid;
      const bool ok = 16 * w < K && c < V;
      sacc[nt][0] = ok ? Sb[(i64)r * V + c] : 0.f;
      sacc[nt][1] = ok ? Sb[(i64)r * V + c + 1] : 0.f;
      sacc[nt][2] = ok ? Sb[(i64)(r + 8) * V + c] : 0.f;
      sacc[nt][3] = ok ? Sb[(i64)(r + 8) * V + c + 1] : 0.f;
    }
  }
  for (int e = tid; e < 64 * TC_CP; e += TC_THREADS) As[e] = 0;  // upper blocks stay zero
  __syncthreads();
  ChunkRegs pre;  // PF: the chunk loaded ahead

  for (int ci = 0; ci < NC; ++ci) {
    const int t0 = (seg * NC + ci) * 64;
    if (t0 >= Tlen) break;
    const int len = min(64, Tlen - t0);
    // (a) g, v, q (raw, into Qi), k (raw, into Kh)
    if constexpr (PF) {
      if (ci == 0) tc_fetch<T>(pre, q, k, v, g, b, h, t0, len, Tlen, H, K, V);
      tc_stash<T, L>(pre, bs, Qi, Kh, VT, K, V);
    } else {
      tc_load_chunk<T, L>(q, k, v, g, bs, Qi, Kh, VT, b, h, t0, len, Tlen, H, K, V);
    }
    if (tid < 4) span[tid] = 0.f;
    // S (incoming state of this chunk) as the 16-bit operand ST[v][k]
    if (16 * w < K) {
#pragma unroll
      for (int nt = 0; nt < 16; ++nt) {
        const int c = 8 * nt + 2 * tig, r = 16 * w + gid;
        if (c < V) {
          if constexpr (L) {  // row-major S[k][v], two columns per 32-bit store
            *reinterpret_cast<u32*>(ST + r * TC_KP + c) =
                (u32)Mma<T>::cvt(sacc[nt][0]) | ((u32)Mma<T>::cvt(sacc[nt][1]) << 16);
            *reinterpret_cast<u32*>(ST + (r + 8) * TC_KP + c) =
                (u32)Mma<T>::cvt(sacc[nt][2]) | ((u32)Mma<T>::cvt(sacc[nt][3]) << 16);
          } else {
            ST[c * TC_KP + r] = Mma<T>::cvt(sacc[nt][0]);
            ST[(c + 1) * TC_KP + r] = Mma<T>::cvt(sacc[nt][1]);
            ST[c * TC_KP + r + 8] = Mma<T>::cvt(sacc[nt][2]);
            ST[(c + 1) * TC_KP + r + 8] = Mma<T>::cvt(sacc[nt][3]);
          }
        }
      }
    }
    __syncthreads();
    // (b) cumulative gate inside the chunk; span of each sub-chunk
    tc_cumsum(bs, K);
    __syncthreads();
    // (c) operands (each thread rewrites the raw q / k elements it read, in place)
    for (int e = tid; e < 64 * K; e += TC_THREADS) {
      const int t = e / K, kk = e % K, I = t / 16;
      const float qv = bits_to_f<T>(Qi[t * TC_KP + kk]);
      const float kv = bits_to_f<T>(Kh[t * TC_KP + kk]);
      const float bt = bs[t * TC_BP + kk];
      const float r = bs[(16 * I) * TC_BP + kk];
      if (t % 16 == 0) {  // span of sub-chunk I along this column (>= 0: float order == int order)
        const float sp = fmaxf(r - bs[(t + 15) * TC_BP + kk], 0.f);
        atomicMax(reinterpret_cast<int*>(span) + I, float_to_int_bits(sp));
      }
      Qh[t * TC_KP + kk] = Mma<T>::cvt(qv * dexp(bt - r));
      Qi[t * TC_KP + kk] = Mma<T>::cvt(qv * dexp(bt));
      Kh[t * TC_KP + kk] = Mma<T>::cvt(kv * expf(fminf(r - bt, span_limit)));
      const u16 kd = Mma<T>::cvt(kv * dexp(bs[(len - 1) * TC_BP + kk] - bt));
      if constexpr (L)
        KT[t * TC_KP + kk] = kd;
      else
        KT[kk * TC_CP + t] = kd;
      for (int I2 = I + 1; I2 < 4; ++I2) {
        const int pair = I2 * (I2 - 1) / 2 + I;
        Ko[(pair * 16 + (t % 16)) * TC_KP + kk] = Mma<T>::cvt(kv * dexp(bs[(16 * I2) * TC_BP + kk] - bt));
      }
    }
    __syncthreads();
    if constexpr (PF) {  // issue the next chunk's loads now; they land while the matrix work runs
      const int tn = t0 + 64;
      if (ci + 1 < NC && tn < Tlen) tc_fetch<T>(pre, q, k, v, g, b, h, tn, min(64, Tlen - tn), Tlen, H, K, V);
    }
    // (d) intra-chunk scores, 10 blocks (I >= J) of 16 x 16 over 8 warps
    for (int blk = w; blk < 10; blk += 8) {
      int I = 0, J = 0;
      {
        int n = blk;  // blocks in order (0,0) (1,0) (1,1) (2,0) (2,1) (2,2) (3,0) ...
        while (n > I) {
          n -= I + 1;
          ++I;
        }
        J = n;
      }
      if (I == J && span[I] > span_limit) {  // exact elementwise diagonal block
        for (int p = lane; p < 256; p += 32) {
          const int tl = p / 16, sl = p % 16, t = 16 * I + tl, s = 16 * I + sl;
          float a = 0.f;
          if (sl <= tl && t < len) {
            const i64 it = ((i64)(b * Tlen + t0 + t) * H + h) * K, is = ((i64)(b * Tlen + t0 + s) * H + h) * K;
            for (int kk = 0; kk < K; ++kk)
              a += to_f(q[it + kk]) * to_f(k[is + kk]) * dexp(bs[t * TC_BP + kk] - bs[s * TC_BP + kk]);
          }
          As[t * TC_CP + s] = Mma<T>::cvt(a);
        }
        continue;
      }
      const u16* Bop = (I == J) ? (Kh + 16 * I * TC_KP) : (Ko + (I * (I - 1) / 2 + J) * 16 * TC_KP);
      float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
      for (int ks = 0; ks < K / 16; ++ks) {
        u32 a[4];
        frag_a(a, Qh, TC_KP, 16 * I, 16 * ks, gid, tig);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          u32 bb[2];
          frag_b(bb, Bop, TC_KP, 8 * nt, 16 * ks, gid, tig);
          Mma<T>::mma(acc[nt], a, bb);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int tl = gid + (i >= 2 ? 8 : 0), sl = 8 * nt + 2 * tig + (i & 1);
          const float val = (I == J && sl > tl) ? 0.f : acc[nt][i];
          As[(16 * I + tl) * TC_CP + 16 * J + sl] = Mma<T>::cvt(val);
        }
    }
    __syncthreads();
    // (e) o = scale * (A V + Qi S): warp w -> rows 16 (w % 4), columns 64 (w / 4) .. + 63
    {
      const int tw = w % 4, v0 = 64 * (w / 4);
      if (v0 < V) {
        float oacc[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) oacc[nt][0] = oacc[nt][1] = oacc[nt][2] = oacc[nt][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
          u32 a[4];
          frag_a(a, As, TC_CP, 16 * tw, 16 * ks, gid, tig);
#pragma unroll
          for (int nt = 0; nt < 8; nt += 2) {
            if (v0 + 8 * nt < V) {
              u32 b0[2], b1[2];
              if constexpr (L) {
                frag_b2_rowmajor(b0, b1, VT, TC_KP, 16 * ks, v0 + 8 * nt, lane);
              } else {
                frag_b(b0, VT, TC_CP, v0 + 8 * nt, 16 * ks, gid, tig);
                frag_b(b1, VT, TC_CP, v0 + 8 * nt + 8, 16 * ks, gid, tig);
              }
              Mma<T>::mma(oacc[nt], a, b0);
              Mma<T>::mma(oacc[nt + 1], a, b1);
            }
          }
        }
        for (int ks = 0; ks < K / 16; ++ks) {
          u32 a[4];
          frag_a(a, Qi, TC_KP, 16 * tw, 16 * ks, gid, tig);
#pragma unroll
          for (int nt = 0; nt < 8; nt += 2) {
            if (v0 + 8 * nt < V) {
              u32 b0[2], b1[2];
              if constexpr (L) {
                frag_b2_rowmajor(b0, b1, ST, TC_KP, 16 * ks, v0 + 8 * nt, lane);
              } else {
                frag_b(b0, ST, TC_KP, v0 + 8 * nt, 16 * ks, gid, tig);
                frag_b(b1, ST, TC_KP, v0 + 8 * nt + 8, 16 * ks, gid, tig);
              }
              Mma<T>::mma(oacc[nt], a, b0);
              Mma<T>::mma(oacc[nt + 1], a, b1);
            }
          }
        }
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const int c = v0 + 8 * nt + 2 * tig;
          if (c < V) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const int t = 16 * tw + gid + 8 * half;
              if (t < len) {
                const u32 lo = from_f<T>(scale * oacc[nt][2 * half]).x;
                const u32 hi = from_f<T>(scale * oacc[nt][2 * half + 1]).x;
                *reinterpret_cast<u32*>(o + ((i64)(b * Tlen + t0 + t) * H + h) * V + c) = lo | (hi << 16);
              }
            }
          }
        }
      }
    }
    // (f) state update (reads bs, KT, VT only)
    tc_state_update<T, L>(sacc, bs, KT, VT, len, K, V, w, gid, tig);
    __syncthreads();
  }
}

#ifdef GLA_INSTANTIATE
#define GLA_INST_TC(T, L, PF)                                                                                       \
  template __global__ void gla_tc_seg_state<T, L>(const T*, const T*, const T*, float*, float*, int, int, int, int, \
                                                  int, int, int);                                                   \
  template __global__ void gla_tc_seg_output<T, L, PF>(const T*, const T*, const T*, const T*, const float*, T*,    \
                                                       float, int, int, int, int, int, int, int, float);
GLA_INST_TC(bf16, true, true)
GLA_INST_TC(f16, false, false)
#ifndef GLA_INSTANTIATE_FAST
GLA_INST_TC(bf16, false, false)
GLA_INST_TC(f16, true, true)
template __global__ void gla_tc_seg_output<bf16, true, false>(const bf16*, const bf16*, const bf16*, const bf16*,
                                                              const float*, bf16*, float, int, int, int, int, int,
                                                              int, int, float);
#endif
#endif
