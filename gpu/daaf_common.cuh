// Device helpers of the DAAF attention kernels (gpu/daaf_attention.cu, gpu/daaf_hopper.cu): integer helpers,
// the lower bound in the sorted key-region index, a 16-byte vector, and the PTX helpers of the tensor-core
// paths (cvta.to.shared, cp.async, ldmatrix, mma.sync m16n8k16, cvt to 16-bit pairs, ex2). Inlined by
// gpu/runtime.py for NVRTC, found beside the kernel file by nvcc; after gpu/emu/cuda_emu.h (CUDA_EMU) the
// PTX helpers are the CPU emulator's forms. No system #include (NVRTC builds it as it is).
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;

#define DAAF_NEG_INF (__int_as_float(0xff800000))

__device__ __forceinline__ int daaf_imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int daaf_imax(int a, int b) { return a > b ? a : b; }

// number of entries of the sorted array a[0:n] that are < x
__device__ __forceinline__ int daaf_lower_bound(const int* __restrict__ a, int n, int x) {
    int lo = 0, hi = n;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (a[mid] < x) lo = mid + 1; else hi = mid;
    }
    return lo;
}

struct alignas(16) DaafVec16 { u32 x, y, z, w; };

// ------------------------------------------------------------------ PTX helpers (sm_80+)
#ifndef CUDA_EMU

__device__ __forceinline__ u32 daaf_smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16-byte global -> shared copy; src_bytes = 0 writes zeros (padding rows)
__device__ __forceinline__ void daaf_cp_async16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void daaf_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void daaf_cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

__device__ __forceinline__ void daaf_ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void daaf_ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// c[16x8] += a[16x16] (row) * b[16x8] (col), fp32 accumulation
template <bool BF>
__device__ __forceinline__ void daaf_mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    if constexpr (BF) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                     "{%8, %9}, {%0, %1, %2, %3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                     "{%8, %9}, {%0, %1, %2, %3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// two fp32 -> packed 16-bit pair (lo in the low half)
template <bool BF>
__device__ __forceinline__ u32 daaf_pack2(float lo, float hi) {
    u32 r;
    if constexpr (BF) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
}

__device__ __forceinline__ float daaf_ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
#else  // the CPU emulator's forms (shared addresses are offsets into its dynamic shared memory)
inline u32 daaf_smem_addr(const void* p) { return emu_smem_addr(p); }
inline void daaf_cp_async16(u32 dst, const void* src, int src_bytes) {
    emu_cp_async16(emu_dynamic_smem() + dst, src, src_bytes);
}
inline void daaf_cp_async_commit() { emu_cp_async_commit(); }
template <int N>
inline void daaf_cp_async_wait() { emu_cp_async_wait(N); }
inline void daaf_ldsm(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3, bool trans) {
    u32 r[4];
    emu_ldmatrix_x4(r, emu_dynamic_smem() + addr, trans);
    r0 = r[0]; r1 = r[1]; r2 = r[2]; r3 = r[3];
}
inline void daaf_ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) { daaf_ldsm(addr, r0, r1, r2, r3, false); }
inline void daaf_ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) { daaf_ldsm(addr, r0, r1, r2, r3, true); }
template <bool BF>
inline void daaf_mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) { emu_mma_m16n8k16<BF>(c, a, b0, b1); }
template <bool BF>
inline u32 daaf_pack2(float lo, float hi) { return emu_pack2<BF>(lo, hi); }
inline float daaf_ex2(float x) { return emu_ex2(x); }
#endif  // CUDA_EMU
