// CPU emulation of what gpu/daaf_attention.cu needs from CUDA, to test its indexing and maths on a
// machine without a GPU (tests/test_gpu_daaf.py builds gpu/daaf_emu.cpp with g++ -std=c++20).
//
// Each CUDA thread of a block is a std::thread; blocks run one after another. __syncthreads() is a
// std::barrier over the block, warp collectives (shuffles, ldmatrix, mma.sync) exchange operands
// through a per-warp buffer between two per-warp barriers. The PTX helpers follow the PTX ISA
// definitions literally:
//   * ldmatrix .x4: lanes 8i..8i+7 give the row addresses of matrix i, register i of lane L holds
//     row L/4, columns 2(L%4), 2(L%4)+1 of matrix i (.trans: rows 2(L%4), 2(L%4)+1 of column L/4);
//   * mma.m16n8k16 (row.col): A element (r, c) sits in lane (r%8)*4 + (c%8)/2, register
//     (r >= 8) + 2 (c >= 8), half c%2; B element (k, n) in lane n*4 + (k%8)/2, register k >= 8,
//     half k%2; C/D element (r, n) in lane (r%8)*4 + n/2, register 2 (r >= 8) + n%2;
//   * cp.async copies are deferred until the thread's cp.async.wait_group releases their group, so
//     a read of shared memory before the wait (and barrier) sees stale data, as on the GPU.
// It checks indexing and arithmetic, not performance; races between warps beyond that are not modelled.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <thread>
#include <vector>

#define DAAF_EMU 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static

typedef unsigned short u16;
typedef unsigned int u32;

struct daaf_dim3 {
    unsigned x = 1, y = 1, z = 1;
};
inline thread_local daaf_dim3 threadIdx, blockIdx;
inline daaf_dim3 blockDim, gridDim;

struct DaafVec16;
inline unsigned char* daaf_emu_smem_base = nullptr;  // the emulated dynamic shared memory
inline DaafVec16* daaf_emu_dynamic_smem() { return reinterpret_cast<DaafVec16*>(daaf_emu_smem_base); }

inline std::barrier<>* daaf_emu_block_bar = nullptr;
struct DaafWarpX {
    std::barrier<>* bar;
    u32 w[32][12];
    float f[32][4];
};
inline std::vector<DaafWarpX*> daaf_emu_warps;

inline int daaf_lane() { return threadIdx.x & 31; }
inline DaafWarpX& daaf_warp() { return *daaf_emu_warps[threadIdx.x >> 5]; }

inline void __syncthreads() { daaf_emu_block_bar->arrive_and_wait(); }

inline float __int_as_float(int x) {
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}
inline float __uint_as_float(u32 x) {
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}
inline u32 daaf_float_bits(float f) {
    u32 x;
    std::memcpy(&x, &f, 4);
    return x;
}
inline float expf(float x) { return std::exp(x); }
inline float fmaxf(float a, float b) { return std::fmax(a, b); }

inline float __shfl_xor_sync(unsigned, float x, int o) {
    DaafWarpX& w = daaf_warp();
    const int l = daaf_lane();
    w.f[l][0] = x;
    w.bar->arrive_and_wait();
    const float y = w.f[l ^ o][0];
    w.bar->arrive_and_wait();
    return y;
}

// ---------------------------------------------------------------- 16-bit conversions (round to nearest even)
inline float daaf_f16_to_f32(u16 h) {
    _Float16 x;
    std::memcpy(&x, &h, 2);
    return (float)x;
}
inline u16 daaf_f32_to_f16(float f) {
    const _Float16 x = (_Float16)f;
    u16 h;
    std::memcpy(&h, &x, 2);
    return h;
}
inline u16 daaf_f32_to_bf16(float f) {
    u32 x = daaf_float_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x40);  // NaN stays NaN
    x += 0x7fffu + ((x >> 16) & 1u);
    return (u16)(x >> 16);
}

// ---------------------------------------------------------------- shared addresses and cp.async
inline u32 daaf_smem_addr(const void* p) {
    return (u32)(reinterpret_cast<const unsigned char*>(p) - daaf_emu_smem_base);
}
struct DaafCopy {
    u32 dst;
    const void* src;
    int n;
};
inline thread_local std::vector<DaafCopy> daaf_emu_open;                 // not yet committed
inline thread_local std::deque<std::vector<DaafCopy>> daaf_emu_groups;  // committed, pending
inline void daaf_cp_async16(u32 dst, const void* src, int src_bytes) { daaf_emu_open.push_back({dst, src, src_bytes}); }
inline void daaf_cp_async_commit() {
    daaf_emu_groups.push_back(daaf_emu_open);
    daaf_emu_open.clear();
}
template <int N>
inline void daaf_cp_async_wait() {
    while ((int)daaf_emu_groups.size() > N) {
        for (const DaafCopy& c : daaf_emu_groups.front()) {
            unsigned char* d = daaf_emu_smem_base + c.dst;
            std::memset(d, 0, 16);
            std::memcpy(d, c.src, (size_t)c.n);
        }
        daaf_emu_groups.pop_front();
    }
}

// ---------------------------------------------------------------- ldmatrix
inline u16 daaf_emu_ld16(u32 addr) {
    u16 h;
    std::memcpy(&h, daaf_emu_smem_base + addr, 2);
    return h;
}
inline void daaf_emu_ldsm(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3, bool trans) {
    DaafWarpX& w = daaf_warp();
    const int l = daaf_lane();
    w.w[l][0] = addr;
    w.bar->arrive_and_wait();
    u32 out[4];
    for (int i = 0; i < 4; ++i) {
        u16 e0, e1;
        if (!trans) {  // row l/4 of matrix i, columns 2(l%4), 2(l%4)+1
            const u32 row = w.w[8 * i + l / 4][0];
            e0 = daaf_emu_ld16(row + 2 * (2 * (l % 4)));
            e1 = daaf_emu_ld16(row + 2 * (2 * (l % 4) + 1));
        } else {  // column l/4 of matrix i, rows 2(l%4), 2(l%4)+1
            e0 = daaf_emu_ld16(w.w[8 * i + 2 * (l % 4)][0] + 2 * (l / 4));
            e1 = daaf_emu_ld16(w.w[8 * i + 2 * (l % 4) + 1][0] + 2 * (l / 4));
        }
        out[i] = (u32)e0 | ((u32)e1 << 16);
    }
    w.bar->arrive_and_wait();
    r0 = out[0];
    r1 = out[1];
    r2 = out[2];
    r3 = out[3];
}
inline void daaf_ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) { daaf_emu_ldsm(addr, r0, r1, r2, r3, false); }
inline void daaf_ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) { daaf_emu_ldsm(addr, r0, r1, r2, r3, true); }

// ---------------------------------------------------------------- mma.sync m16n8k16, fp32 accumulation
template <bool BF>
inline float daaf_emu_half(u32 reg, int hi) {
    const u16 h = (u16)(hi ? reg >> 16 : reg & 0xffffu);
    return BF ? __uint_as_float(((u32)h) << 16) : daaf_f16_to_f32(h);
}
template <bool BF>
inline void daaf_mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    DaafWarpX& w = daaf_warp();
    const int l = daaf_lane();
    for (int i = 0; i < 4; ++i) w.w[l][i] = a[i];
    w.w[l][4] = b0;
    w.w[l][5] = b1;
    w.bar->arrive_and_wait();
    float A[16][16], B[16][8];
    for (int r = 0; r < 16; ++r)
        for (int cc = 0; cc < 16; ++cc)
            A[r][cc] = daaf_emu_half<BF>(w.w[(r % 8) * 4 + (cc % 8) / 2][(r >= 8) + 2 * (cc >= 8)], cc % 2);
    for (int kk = 0; kk < 16; ++kk)
        for (int n = 0; n < 8; ++n) B[kk][n] = daaf_emu_half<BF>(w.w[n * 4 + (kk % 8) / 2][4 + (kk >= 8)], kk % 2);
    w.bar->arrive_and_wait();
    const int g = l / 4, tig = l % 4;
    for (int i = 0; i < 4; ++i) {
        const int r = g + 8 * (i >= 2), n = 2 * tig + (i % 2);
        float acc = c[i];
        for (int kk = 0; kk < 16; ++kk) acc += A[r][kk] * B[kk][n];
        c[i] = acc;
    }
}

template <bool BF>
inline u32 daaf_pack2(float lo, float hi) {
    const u16 a = BF ? daaf_f32_to_bf16(lo) : daaf_f32_to_f16(lo);
    const u16 b = BF ? daaf_f32_to_bf16(hi) : daaf_f32_to_f16(hi);
    return (u32)a | ((u32)b << 16);
}
inline float daaf_ex2(float x) { return std::exp2(x); }

// ---------------------------------------------------------------- launch
template <typename F>
inline void daaf_emu_launch(daaf_dim3 grid, daaf_dim3 block, size_t dyn_smem, F&& body) {
    const unsigned nt = block.x;  // 1-D blocks only
    std::vector<unsigned char> smem(dyn_smem + 16, 0xA5);  // garbage, as on the GPU
    daaf_emu_smem_base = smem.data();
    blockDim = block;
    gridDim = grid;
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                std::barrier<> bar((std::ptrdiff_t)nt);
                daaf_emu_block_bar = &bar;
                std::vector<DaafWarpX*> warps;
                for (unsigned w = 0; w < (nt + 31) / 32; ++w) {
                    auto* x = new DaafWarpX();
                    x->bar = new std::barrier<>((std::ptrdiff_t)std::min(32u, nt - 32 * w));
                    warps.push_back(x);
                }
                daaf_emu_warps = warps;
                std::vector<std::thread> th;
                th.reserve(nt);
                for (unsigned t = 0; t < nt; ++t)
                    th.emplace_back([&, t, bx, by, bz] {
                        threadIdx = daaf_dim3{t, 0, 0};
                        blockIdx = daaf_dim3{bx, by, bz};
                        daaf_emu_open.clear();
                        daaf_emu_groups.clear();
                        body();
                    });
                for (auto& x : th) x.join();
                for (auto* x : warps) {
                    delete x->bar;
                    delete x;
                }
            }
}
