// DAAF windowed attention (causal) on NVIDIA GPUs, loaded by hpczeco/gpu/daaf.py with cupy.RawModule.
//
// Semantics (the same as hpczeco.daaf.plan_arrays documents). Per batch b and head h, query t
// attends to key j <= t when
//     t - j <= W            (the local window: the previous W keys and itself), or
//     gmask[j]              (j is a key-region token: every later query sees it), or
//     gmask[t]              (t is a key-region token: it sees every earlier key),
// and o[b,t,h] = sum_j softmax_j(scale * q[b,t,h] . k[b,j,h]) v[b,j,h] over that set, each key once.
// gidx holds the key-region positions (sorted ascending int32, n_global of them), gmask the same set
// as one byte per token. Layout: q, k [B, T, H, D], v, o [B, T, H, Dv], contiguous.
//
// Two implementations:
//   daaf_simple_{f32,f16,bf16}   one warp per query row, fp32 online softmax, any D, Dv <= 256.
//                                Visits exactly the keys of the row. The readable reference kernel.
//   daaf_tc_{bf16,f16}_d{64,128} flash-attention style, D == Dv: a block of 4 warps owns a tile of
//                                64 query rows (16 per warp); 64-key tiles of K and V are staged in
//                                shared memory by cp.async (two stages: the next tile loads while
//                                this one is used); S = Q K^T and O += P V run on the tensor cores
//                                (mma.sync m16n8k16, fp32 accumulation); the online softmax lives
//                                in registers. Key tiles per query tile [t0, t1]:
//                                  * if any row of the tile is a key-region token: the causal
//                                    tiles 0 .. t1 (masked per element only where needed);
//                                  * otherwise the key-region keys before the local range, gathered
//                                    by index from gidx (all of them allowed for every row), then
//                                    the local range [max(0, t0 - W), t1] (masked per element).
//                                  The local range starts after the gathered keys, so no key is
//                                  counted twice.
//
// No system #include: the file builds with NVRTC (CuPy; gpu/runtime.py inlines daaf_common.cuh) and with
// nvcc (-std=c++17) alike; 16-bit floats travel as raw bits (unsigned short) and are converted with PTX cvt
// instructions (sm_80+). After gpu/emu/cuda_emu.h (CUDA_EMU) the PTX helpers of daaf_common.cuh and the
// conversions below are the CPU emulator's instead (tests/test_gpu_daaf.py).

#include "daaf_common.cuh"  // u16/u32, daaf_imin/imax/lower_bound, DaafVec16, cp.async/ldmatrix/mma.sync helpers

// ------------------------------------------------------------------ 16-bit conversions
#ifndef CUDA_EMU
__device__ __forceinline__ float daaf_f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 daaf_f32_to_f16(float x) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
__device__ __forceinline__ u16 daaf_f32_to_bf16(float x) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
#else
inline float daaf_f16_to_f32(u16 h) { return emu_f16_to_f32(h); }
inline u16 daaf_f32_to_f16(float x) { return emu_f32_to_f16(x); }
inline u16 daaf_f32_to_bf16(float x) { return emu_f32_to_bf16(x); }
#endif
__device__ __forceinline__ float daaf_bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

// ------------------------------------------------------------------ element types (load/store as fp32)

struct ElemF32 {
    typedef float T;
    static __device__ __forceinline__ float ld(const float* p) { return *p; }
    static __device__ __forceinline__ void st(float* p, float x) { *p = x; }
};
struct ElemF16 {
    typedef u16 T;
    static __device__ __forceinline__ float ld(const u16* p) { return daaf_f16_to_f32(*p); }
    static __device__ __forceinline__ void st(u16* p, float x) { *p = daaf_f32_to_f16(x); }
};
struct ElemBF16 {
    typedef u16 T;
    static __device__ __forceinline__ float ld(const u16* p) { return daaf_bf16_to_f32(*p); }
    static __device__ __forceinline__ void st(u16* p, float x) { *p = daaf_f32_to_bf16(x); }
};

__device__ __forceinline__ float daaf_warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// ------------------------------------------------------------------ simple kernel: one warp per query row

template <class E, int MAXD>
__device__ __forceinline__ void daaf_simple_body(
    const typename E::T* __restrict__ q, const typename E::T* __restrict__ k, const typename E::T* __restrict__ v,
    typename E::T* __restrict__ o, const int* __restrict__ gidx, const unsigned char* __restrict__ gmask,
    int B, int T, int H, int D, int Dv, int n_global, int W, float scale)
{
    constexpr int NPL = MAXD / 32;  // elements of a row per lane
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= (long long)B * T * H) return;  // uniform across the warp
    const int h = (int)(row % H);
    const long long bt = row / H;
    const int t = (int)(bt % T);
    const long long b = bt / T;

    float qr[NPL], acc[NPL];
#pragma unroll
    for (int i = 0; i < NPL; ++i) {
        const int d = lane + 32 * i;
        qr[i] = d < D ? E::ld(q + row * D + d) * scale : 0.f;
        acc[i] = 0.f;
    }
    float m = DAAF_NEG_INF, l = 0.f;
    const long long kbase = b * T * H + h;  // flat row index of key 0 of this (b, h)

    auto visit = [&](int j) {
        const long long kr = kbase + (long long)j * H;
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < NPL; ++i) {
            const int d = lane + 32 * i;
            if (d < D) s += qr[i] * E::ld(k + kr * D + d);
        }
        s = daaf_warp_sum(s);
        const float mn = fmaxf(m, s);        // finite: s is finite
        const float alpha = expf(m - mn);    // exp(-inf) = 0 on the first key
        const float p = expf(s - mn);
        l = l * alpha + p;
        m = mn;
#pragma unroll
        for (int i = 0; i < NPL; ++i) {
            const int d = lane + 32 * i;
            if (d < Dv) acc[i] = acc[i] * alpha + p * E::ld(v + kr * Dv + d);
        }
    };

    if (gmask[t]) {
        for (int j = 0; j <= t; ++j) visit(j);  // key-region query: full causal
    } else {
        const int lo = daaf_imax(0, t - W);
        const int nb = daaf_lower_bound(gidx, n_global, lo);  // key-region keys before the window
        for (int i = 0; i < nb; ++i) visit(gidx[i]);
        for (int j = lo; j <= t; ++j) visit(j);
    }
    const float inv = 1.f / l;  // l >= 1: the row's own key is always visited
#pragma unroll
    for (int i = 0; i < NPL; ++i) {
        const int d = lane + 32 * i;
        if (d < Dv) E::st(o + row * Dv + d, acc[i] * inv);
    }
}

#define DAAF_SIMPLE_KERNEL(NAME, E)                                                                          \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                                   \
        const E::T* __restrict__ q, const E::T* __restrict__ k, const E::T* __restrict__ v, E::T* __restrict__ o, \
        const int* __restrict__ gidx, const unsigned char* __restrict__ gmask, int B, int T, int H, int D,     \
        int Dv, int n_global, int W, float scale) {                                                           \
        daaf_simple_body<E, 256>(q, k, v, o, gidx, gmask, B, T, H, D, Dv, n_global, W, scale);               \
    }

DAAF_SIMPLE_KERNEL(daaf_simple_f32, ElemF32)
DAAF_SIMPLE_KERNEL(daaf_simple_f16, ElemF16)
DAAF_SIMPLE_KERNEL(daaf_simple_bf16, ElemBF16)

// c[mt][n], c[mt][n + 1] += a[mt] * (b0, b1), (b2, b3) for every m-tile mt: each B fragment feeds MT mma
template <bool BF, int MT, int N>
__device__ __forceinline__ void daaf_mma_pair(float (&c)[MT][N][4], int n, const u32 (&a)[MT][4], u32 b0, u32 b1,
                                              u32 b2, u32 b3) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        daaf_mma<BF>(c[mt][n], a[mt], b0, b1);
        daaf_mma<BF>(c[mt][n + 1], a[mt], b2, b3);
    }
}

// ------------------------------------------------------------------ tensor-core kernel

constexpr int DAAF_TC_BR = 64;       // query rows per block per m-tile (16 per warp)
constexpr int DAAF_TC_BC = 64;       // keys per tile
constexpr int DAAF_TC_THREADS = 128; // 4 warps

// MT: 16-row m-tiles per warp (block of 64 * MT query rows). MT = 1 keeps the Q fragments in
// registers (the Q tile passes through the stage-1 buffer); MT = 2 keeps Q in its own shared
// buffer and reads its fragments per k-step, so that every K/V fragment from shared memory feeds
// two mma instead of one (half the shared-memory traffic per mma, more registers).
template <int D, int MT>
struct DaafTcShape {
    static constexpr int LDS = D + 8;                       // padded shared row (elements)
    static constexpr int TILE = DAAF_TC_BC * LDS;           // elements of one K or V tile
    static constexpr int BR = DAAF_TC_BR * MT;              // query rows per block
    static constexpr int SMEM_BYTES = 4 * TILE * 2 + (MT == 1 ? 0 : BR * LDS * 2);
};

template <bool BF, int D, int MT>
__device__ __forceinline__ void daaf_tc_body(
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, u16* __restrict__ o,
    const int* __restrict__ gidx, const unsigned char* __restrict__ gmask,
    int T, int H, int n_global, int W, float scale_log2, int reverse)
{
    typedef DaafTcShape<D, MT> S;
    constexpr int BR = S::BR, BC = DAAF_TC_BC, NTH = DAAF_TC_THREADS;
    constexpr int LDS = S::LDS;       // ldmatrix rows of a warp hit distinct banks
    constexpr int TILE = S::TILE;
    constexpr int KS = D / 16;        // k-steps of S = Q K^T
    constexpr int NDT = D / 8;        // 8-wide column tiles of O
    constexpr int CPR = D / 8;        // 16-byte chunks per row
    static_assert(MT == 1 || MT == 2, "one or two m-tiles per warp");
    static_assert(BR <= 2 * BC, "the output tile is staged in one K/V stage");
    static_assert(NTH % CPR == 0 && BC % (NTH / CPR) == 0, "tile loads must divide evenly among the threads");

    // dynamic shared memory: [stage 0: K | V][stage 1: K | V][Q tile, MT = 2], each K/V TILE elements
#ifdef CUDA_EMU
    DaafVec16* const daaf_smem = reinterpret_cast<DaafVec16*>(emu_dynamic_smem());
#else
    extern __shared__ DaafVec16 daaf_smem[];  // 16-byte aligned by its element type
#endif
    u16* const smem = reinterpret_cast<u16*>(daaf_smem);
    __shared__ int s_kpos[2][BC];             // key position of each tile row (-1: padding)
    __shared__ unsigned char s_kglob[2][BC];  // gmask of that key

    const int nqt = (T + BR - 1) / BR;
    const int qt = reverse ? (nqt - 1 - (int)blockIdx.x) : (int)blockIdx.x;  // reverse: long rows first
    const int h = blockIdx.y;
    const long long b = blockIdx.z;
    const int t0 = qt * BR;
    const int t1 = daaf_imin(t0 + BR, T) - 1;
    const long long rs = (long long)H * D;             // token stride in elements
    const long long base = (b * T * H + h) * (long long)D;
    const u16* const qb = q + base;
    const u16* const kb = k + base;
    const u16* const vb = v + base;
    u16* const ob = o + base;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tig = lane & 3;

    // which keys this query tile visits
    const int glo = daaf_lower_bound(gidx, n_global, t0);
    const int ghi = daaf_lower_bound(gidx, n_global, t1 + 1);
    const bool any_gq = ghi > glo;                      // some row is a key-region query
    const bool all_gq = (ghi - glo) == (t1 - t0 + 1);   // every row is
    int ks = 0, n_pre = 0, n_pre_tiles = 0, n_tiles;
    if (any_gq) {
        n_tiles = t1 / BC + 1;                          // causal: keys 0 .. t1
    } else {
        ks = daaf_imax(0, t0 - W);                      // local range [ks, t1]
        n_pre = daaf_lower_bound(gidx, n_global, ks);   // key-region keys before it: gathered
        n_pre_tiles = (n_pre + BC - 1) / BC;
        n_tiles = n_pre_tiles + (t1 - ks) / BC + 1;
    }

    auto key_of = [&](int i, int r) -> int {
        if (any_gq) {
            const int j = i * BC + r;
            return j <= t1 ? j : -1;
        }
        if (i < n_pre_tiles) {
            const int x = i * BC + r;
            return x < n_pre ? gidx[x] : -1;
        }
        const int j = ks + (i - n_pre_tiles) * BC + r;
        return j <= t1 ? j : -1;
    };

    // shared addresses as one base plus byte offsets (constant parts fold into the instructions)
    const u32 sbase = daaf_smem_addr(smem);
    constexpr u32 ROWB = LDS * 2;            // bytes per shared row
    constexpr u32 TILEB = TILE * 2;          // bytes per K or V tile
    constexpr u32 STAGEB = 2 * TILEB;        // bytes per stage (K and V)
    constexpr int RPI = NTH / CPR;           // rows covered by one pass of the block
    const int ld_r = tid / CPR, ld_c = tid % CPR;  // this thread's row / chunk in a pass
    const u32 ld_off = ld_r * ROWB + ld_c * 16;

    auto issue_tile = [&](int i, int st) {
        const u32 dK = sbase + st * STAGEB + ld_off;
#pragma unroll
        for (int it = 0; it < BC / RPI; ++it) {
            const int r = it * RPI + ld_r;
            const int j = key_of(i, r);
            const long long off = (long long)(j < 0 ? 0 : j) * rs + ld_c * 8;
            const int nb = j < 0 ? 0 : 16;
            daaf_cp_async16(dK + it * RPI * ROWB, kb + off, nb);
            daaf_cp_async16(dK + TILEB + it * RPI * ROWB, vb + off, nb);
            if (ld_c == 0) {
                s_kpos[st][r] = j;
                s_kglob[st][r] = j < 0 ? (unsigned char)0 : gmask[j];
            }
        }
        daaf_cp_async_commit();
    };

    // the Q tile: MT = 1 through the stage-1 buffer into registers; MT = 2 into its own buffer
    const u32 sQ = sbase + (MT == 1 ? STAGEB : 2 * STAGEB);
#pragma unroll
    for (int it = 0; it < BR / RPI; ++it) {
        const int t = t0 + it * RPI + ld_r;
        daaf_cp_async16(sQ + ld_off + it * RPI * ROWB, qb + (long long)(t <= t1 ? t : t0) * rs + ld_c * 8,
                        t <= t1 ? 16 : 0);
    }
    daaf_cp_async_commit();
    issue_tile(0, 0);
    daaf_cp_async_wait<1>();  // the Q group has landed
    __syncthreads();
    // A-fragment address of m-tile mt (rows mt * 64 + 16 * warp + 0..15), k-step kk: q_ld[mt] + kk * 32
    u32 q_ld[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) q_ld[mt] = sQ + (mt * 64 + 16 * warp + (lane & 15)) * ROWB + (lane >> 4) * 16;
    u32 qf[MT == 1 ? KS : 1][4];
    if constexpr (MT == 1) {
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) daaf_ldsm_x4(q_ld[0] + kk * 32, qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3]);
        __syncthreads();  // the stage-1 buffer is refilled below
    }
    // per-lane parts of the ldmatrix addresses for K (plain) and V (transposed)
    const u32 k_ld = ((lane >> 4) * 8 + (lane & 7)) * ROWB + ((lane >> 3) & 1) * 16;
    const u32 v_ld = TILEB + ((lane & 7) + ((lane >> 3) & 1) * 8) * ROWB + (lane >> 4) * 16;

    // this thread's query rows: fragment rows g and g + 8 of each of the warp's m-tiles
    int row[MT][2];
    bool gq[MT][2];
    float m_[MT][2], l_[MT][2];
    float acc[MT][NDT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            row[mt][hh] = t0 + mt * 64 + 16 * warp + g + 8 * hh;
            gq[mt][hh] = row[mt][hh] <= t1 && gmask[row[mt][hh]] != 0;
            m_[mt][hh] = DAAF_NEG_INF;
            l_[mt][hh] = 0.f;
        }
#pragma unroll
        for (int n = 0; n < NDT; ++n) acc[mt][n][0] = acc[mt][n][1] = acc[mt][n][2] = acc[mt][n][3] = 0.f;
    }

    for (int i = 0; i < n_tiles; ++i) {
        const int st = i & 1;
        if (i + 1 < n_tiles) {
            issue_tile(i + 1, st ^ 1);  // overlaps with the work on tile i
            daaf_cp_async_wait<1>();
        } else {
            daaf_cp_async_wait<0>();
        }
        __syncthreads();
        const u32 cS = sbase + st * STAGEB;

        // S = Q K^T : per m-tile 16 rows x 64 keys
        float s[MT][8][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int n = 0; n < 8; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
            u32 qa[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if constexpr (MT == 1) {
                    qa[mt][0] = qf[kk][0]; qa[mt][1] = qf[kk][1]; qa[mt][2] = qf[kk][2]; qa[mt][3] = qf[kk][3];
                } else {
                    daaf_ldsm_x4(q_ld[mt] + kk * 32, qa[mt][0], qa[mt][1], qa[mt][2], qa[mt][3]);
                }
            }
#pragma unroll
            for (int np = 0; np < 4; ++np) {
                u32 b0, b1, b2, b3;
                daaf_ldsm_x4(cS + k_ld + np * 16 * ROWB + kk * 32, b0, b1, b2, b3);
                daaf_mma_pair<BF>(s, 2 * np, qa, b0, b1, b2, b3);
            }
        }

        // mask, where some pair of this tile may be excluded
        bool full;
        if (any_gq) {
            const int kt0 = i * BC;
            full = (kt0 + BC - 1 <= t0) && (all_gq || t1 - kt0 <= W);
        } else if (i < n_pre_tiles) {
            full = (i + 1) * BC <= n_pre;  // gathered key-region keys: all allowed, except padding
        } else {
            full = false;                  // local range: window edges
        }
        if (!full) {
#pragma unroll
            for (int n = 0; n < 8; ++n) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = 8 * n + 2 * tig + e;
                    const int j = s_kpos[st][col];
                    const bool gj = s_kglob[st][col] != 0;
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                        for (int hh = 0; hh < 2; ++hh) {
                            const int r = row[mt][hh];
                            const bool ok = j >= 0 && j <= r && (r - j <= W || gj || gq[mt][hh]);
                            if (!ok) s[mt][n][2 * hh + e] = DAAF_NEG_INF;
                        }
                    }
                }
            }
        }

        // online softmax (base 2); a row is spread over the 4 threads of a quad
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                float mx = m_[mt][hh];
#pragma unroll
                for (int n = 0; n < 8; ++n) {
                    s[mt][n][2 * hh] *= scale_log2;
                    s[mt][n][2 * hh + 1] *= scale_log2;
                    mx = fmaxf(mx, fmaxf(s[mt][n][2 * hh], s[mt][n][2 * hh + 1]));
                }
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float bse = mx == DAAF_NEG_INF ? 0.f : mx;  // a row with nothing allowed yet
                const float al = daaf_ex2(m_[mt][hh] - bse);
                m_[mt][hh] = mx;
                float ls = 0.f;
#pragma unroll
                for (int n = 0; n < 8; ++n) {
                    s[mt][n][2 * hh] = daaf_ex2(s[mt][n][2 * hh] - bse);
                    s[mt][n][2 * hh + 1] = daaf_ex2(s[mt][n][2 * hh + 1] - bse);
                    ls += s[mt][n][2 * hh] + s[mt][n][2 * hh + 1];
                }
                l_[mt][hh] = l_[mt][hh] * al + ls;  // per-thread partial sums; the quad adds them at the end
#pragma unroll
                for (int n = 0; n < NDT; ++n) {
                    acc[mt][n][2 * hh] *= al;
                    acc[mt][n][2 * hh + 1] *= al;
                }
            }
        }

        // O += P V : P (16 x 64 per m-tile) from registers as A fragments, V tile via ldmatrix.trans
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                a[mt][0] = daaf_pack2<BF>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                a[mt][1] = daaf_pack2<BF>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                a[mt][2] = daaf_pack2<BF>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                a[mt][3] = daaf_pack2<BF>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
#pragma unroll
            for (int dp = 0; dp < NDT / 2; ++dp) {
                u32 b0, b1, b2, b3;
                daaf_ldsm_x4_t(cS + v_ld + kk * 16 * ROWB + dp * 32, b0, b1, b2, b3);
                daaf_mma_pair<BF>(acc, 2 * dp, a, b0, b1, b2, b3);
            }
        }
        __syncthreads();  // stage st is refilled by the next iteration's issue
    }

    // epilogue: normalise, stage the BR x D tile in shared memory (stage 0), 16-byte coalesced stores
    u16* const sO = smem;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float l = l_[mt][hh];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const float inv = l > 0.f ? 1.f / l : 0.f;  // l == 0 only on padding rows
            const int lr = mt * 64 + 16 * warp + g + 8 * hh;
#pragma unroll
            for (int n = 0; n < NDT; ++n)
                *reinterpret_cast<u32*>(sO + lr * LDS + 8 * n + 2 * tig) =
                    daaf_pack2<BF>(acc[mt][n][2 * hh] * inv, acc[mt][n][2 * hh + 1] * inv);
        }
    }
    __syncthreads();
#pragma unroll
    for (int it = 0; it < BR / RPI; ++it) {
        const int r = it * RPI + ld_r;
        const int t = t0 + r;
        if (t <= t1)
            *reinterpret_cast<DaafVec16*>(ob + (long long)t * rs + ld_c * 8) =
                *reinterpret_cast<const DaafVec16*>(sO + r * LDS + ld_c * 8);
    }
}

// LB: the launch bounds (threads per block, and optionally the resident blocks per SM to fit)
#define DAAF_TC_KERNEL(NAME, BF, D, MT, LB)                                                                   \
    extern "C" __global__ void LB NAME(                                                                       \
        const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, u16* __restrict__ o, \
        const int* __restrict__ gidx, const unsigned char* __restrict__ gmask, int T, int H, int n_global,     \
        int W, float scale_log2, int reverse) {                                                               \
        daaf_tc_body<BF, D, MT>(q, k, v, o, gidx, gmask, T, H, n_global, W, scale_log2, reverse);             \
    }

// "tc": 64 query rows per block, Q fragments in registers
DAAF_TC_KERNEL(daaf_tc_bf16_d128, true, 128, 1, __launch_bounds__(DAAF_TC_THREADS))
DAAF_TC_KERNEL(daaf_tc_f16_d128, false, 128, 1, __launch_bounds__(DAAF_TC_THREADS))
DAAF_TC_KERNEL(daaf_tc_bf16_d64, true, 64, 1, __launch_bounds__(DAAF_TC_THREADS))
DAAF_TC_KERNEL(daaf_tc_f16_d64, false, 64, 1, __launch_bounds__(DAAF_TC_THREADS))
// "tc3": the same with a register cap for 3 resident blocks per SM (a few bytes may spill at D=128)
DAAF_TC_KERNEL(daaf_tc3_bf16_d128, true, 128, 1, __launch_bounds__(DAAF_TC_THREADS, 3))
DAAF_TC_KERNEL(daaf_tc3_f16_d128, false, 128, 1, __launch_bounds__(DAAF_TC_THREADS, 3))
// "tc2": 128 query rows per block (two m-tiles per warp share each K/V fragment), Q read from shared memory
DAAF_TC_KERNEL(daaf_tc2_bf16_d128, true, 128, 2, __launch_bounds__(DAAF_TC_THREADS))
DAAF_TC_KERNEL(daaf_tc2_f16_d128, false, 128, 2, __launch_bounds__(DAAF_TC_THREADS))
DAAF_TC_KERNEL(daaf_tc2_bf16_d64, true, 64, 2, __launch_bounds__(DAAF_TC_THREADS))
DAAF_TC_KERNEL(daaf_tc2_f16_d64, false, 64, 2, __launch_bounds__(DAAF_TC_THREADS))
