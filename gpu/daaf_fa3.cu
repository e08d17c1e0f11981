// DAAF attention with key regions in FlashAttention-3's design on Hopper (sm_90a), loaded by gpu/daaf_fa3.py.
// Design, stages, budgets and schedule: docs/benchmarks/daaf_hopper_design.md ("The FA3-design kernel hfa3").
//
// Semantics: those of gpu/daaf_hopper.cu (query t sees key j <= t when t - j <= W, or gmask[j], or gmask[t];
// softmax over that set). q, k, v, o: [B, T, H, D] contiguous 16-bit (bf16/f16), D in {64, 128, 256}; the key tiles
// a query tile visits and the masks of partial tiles are daaf_hopper.cu's (dh_plan_of rule, dh_key_tile,
// dh_pair_allowed): whole tiles are skipped, masks are applied only where a tile is partial.
//
// Structure (one persistent CTA per SM, 384 threads):
//   * warpgroup 0 = producer: setmaxnreg.dec; warp 0 only (warps 1-3 leave). Lane 0 takes query tiles from a
//     global queue (atomicAdd; the longest rows first: dh_tile_of's order with sched bit 0), computes the tile's
//     key-tile plan with the warp, publishes it to the consumers (a 2-slot tile-info ring on mbarriers), and loads
//     Q (NQ buffers) and the K and V tiles (two rings of ST slots, each slot a "full" and an "empty" mbarrier) by
//     TMA (cp.async.bulk.tensor, 128-byte swizzle, completing on the full barrier's transaction count): contiguous
//     key ranges (the local window, causal rows, and key-region tiles whose keys are one run of tokens) are one
//     box per 64 columns. A key-region tile whose keys are not one run is gathered by the warp's 32 lanes with
//     cp.async (cp.async.mbarrier.arrive without .noinc, then one arrival by lane 0), and flagged: its consumers
//     fence the proxies after their wait (generic-proxy writes read by the tensor cores).
//   * warpgroups 1, 2 = consumers (64 query rows each): setmaxnreg.inc; per key tile S(i) = Q K(i)^T and
//     O += P(i-1) V(i-1) issued as two wgmma batches, the online softmax of tile i while P V runs (intra-warpgroup
//     overlap), K(i) released when S(i) retires, V(i-1) when P V does. PP (ping-pong): the two consumer
//     warpgroups issue their batches in turn (named barriers 1, 2), so that one's softmax runs under the other's
//     products. Epilogue: O normalised into the warpgroup's own rows of its Q buffer, 16-byte stores, then the
//     buffer is released (q_empty) for the producer's next Q.
//   * the queue's counter ([0] next tile, [1] CTAs done) is reset by the last CTA to finish, so each launch finds
//     it at zero (one counter per stream: gpu/daaf_fa3.py).
//
// No #include of system headers (NVRTC builds it as it is; gpu/runtime.py inlines the local headers); with g++
// after gpu/emu/cuda_emu.h for the CPU emulation (CUDA_EMU: TMA, mbarrier transaction counts, setmaxnreg, wgmma).

#undef DH_GROUP
#define DH_GROUP 99  // daaf_hopper.cu's tile rules, layouts and PTX helpers, none of its kernels
#include "daaf_hopper.cu"

// the tensor map of a [B, T, H, D] tensor (CUtensorMap: 128 bytes, 64-byte aligned), a __grid_constant__ parameter
struct alignas(64) Fa3TensorMap {
    unsigned long long v[16];
};

#ifndef CUDA_EMU
__device__ __forceinline__ void fa3_mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// box (64 columns, 1 head, rows, 1 batch) of the 4-d map at coordinates (c0, c1, c2, c3) into shared memory at dst
__device__ __forceinline__ void fa3_tma_load(u32 dst, const Fa3TensorMap* map, int c0, int c1, int c2, int c3,
                                             u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
        "[%6];" ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
        "r"(bar)
        : "memory");
}
__device__ __forceinline__ void fa3_prefetch_map(const Fa3TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}
// the mbarrier tracks this thread's earlier cp.async (pending count +1 now, -1 when they have landed)
__device__ __forceinline__ void fa3_cp_async_mbar_arrive_inc(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ int fa3_atomic_add(int* p, int v) { return atomicAdd(p, v); }
__device__ __forceinline__ void fa3_atomic_exch(int* p, int v) { atomicExch(p, v); }
__device__ __forceinline__ void fa3_threadfence() { __threadfence(); }
#else
inline void fa3_mbar_arrive_expect_tx(u32 bar, u32 bytes) { emu_mbar_arrive_expect_tx(bar, bytes); }
inline void fa3_tma_load(u32 dst, const Fa3TensorMap* map, int c0, int c1, int c2, int c3, u32 bar) {
    const int c[4] = {c0, c1, c2, c3};
    emu_tma_load(dst, map, c, 4, bar);
}
inline void fa3_prefetch_map(const Fa3TensorMap*) {}
inline void fa3_cp_async_mbar_arrive_inc(u32 bar) { emu_cp_async_mbar_arrive_inc(bar); }
inline int fa3_atomic_add(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline void fa3_atomic_exch(int* p, int v) { std::atomic_ref<int>(*p).store(v); }
inline void fa3_threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
#endif

// D -> keys per tile BN, K/V stages ST, Q buffers NQ (gpu/daaf_fa3.py CONFIG)
template <int D, int BN, int ST, int NQ>
struct Fa3Cfg {
    static constexpr int NC = 2;              // consumer warpgroups
    static constexpr int BM = 64 * NC;        // query rows per tile
    static constexpr int NTH = 128 * (NC + 1);
    static constexpr int CPR = D / 8;         // 16-byte chunks per row
    static constexpr int Q_BYTES = BM * D * 2;
    static constexpr int TILE_BYTES = BN * D * 2;
    static constexpr int OFF_Q = 0;                            // NQ Q buffers (each also its tile's O staging)
    static constexpr int OFF_K = NQ * Q_BYTES;                 // ST K slots
    static constexpr int OFF_V = OFF_K + ST * TILE_BYTES;      // ST V slots
    static constexpr int OFF_BAR = OFF_V + ST * TILE_BYTES;    // mbarriers (8 bytes each)
    // full_k[ST], full_v[ST], empty_k[ST], empty_v[ST], q_full[NQ], q_empty[NQ], info_full[2], info_empty[2]
    static constexpr int N_BAR = 4 * ST + 2 * NQ + 4;
    static constexpr int INFO_INTS = 16;                       // one tile-info slot
    static constexpr int OFF_INFO = OFF_BAR + 8 * N_BAR;       // 2 slots
    static constexpr int OFF_FLAG = OFF_INFO + 2 * INFO_INTS * 4;  // per K and V slot: 1 = gathered by cp.async
    static constexpr int SMEM_BYTES = OFF_FLAG + ((2 * ST * 4 + 15) / 16) * 16 + 1024;  // + alignment slack
    // registers: 65536 / 384 = 168 at entry; producer 40, consumers 232 (what the producer releases covers it)
    static constexpr int REG_CAP = 65536 / NTH / 8 * 8;
    static constexpr int REG_PRODUCER = 40;
    static constexpr int REG_CONSUMER = 232;
    static_assert(128 * (REG_CAP - REG_PRODUCER) >= 128 * NC * (REG_CONSUMER - REG_CAP), "setmaxnreg pool");
    static_assert(SMEM_BYTES <= 232448, "a block has 227 KB of shared memory");
};

// tile-info slot fields
enum {
    FA3_I_TILE = 0, FA3_I_B, FA3_I_H, FA3_I_T0, FA3_I_T1, FA3_I_KS, FA3_I_NPRE, FA3_I_NPRE_TILES, FA3_I_NTILES,
    FA3_I_ANY_GQ, FA3_I_ALL_GQ0, FA3_I_ALL_GQ1
};

template <bool BF, int D, int BN, int ST, int NQ, bool PP>
__device__ __forceinline__ void fa3_body(const Fa3TensorMap* tm_q, const Fa3TensorMap* tm_k, const Fa3TensorMap* tm_v,
                                         const u16* __restrict__ k, const u16* __restrict__ v,
                                         u16* __restrict__ o, const int* __restrict__ gidx,
                                         const unsigned char* __restrict__ gmask, int* __restrict__ queue, int B,
                                         int T, int H, int n_global, int W, float scale_log2, int sched, int n_work) {
    typedef Fa3Cfg<D, BN, ST, NQ> C;
    DH_EXPECT_SMEM(C::SMEM_BYTES);
    constexpr int BM = C::BM, CPR = C::CPR, NC = C::NC;
    constexpr int NS = BN / 2;              // S accumulators per thread
    constexpr int NO = D / 2;               // O accumulators per thread
    constexpr int KQ = D / 16;              // k-steps of S = Q K^T
    constexpr int KP = BN / 16;             // k-steps of O += P V
    constexpr int NPV = D < 128 ? D : 128;  // N of one P V wgmma (D = 256: two halves of 128 columns)
    constexpr int NH = D / NPV;
    static_assert(D == 64 || D == 128 || D == 256, "D in {64, 128, 256}");
    static_assert(BN == 64 || BN == 128, "BN in {64, 128}");
    static_assert(ST >= 2 && NQ >= 1, "two stages, one Q buffer at least");

    const int tid = threadIdx.x, wg = tid >> 7;
    const int nqt = (T + BM - 1) / BM;
    const long long rs = (long long)H * D;  // token stride (elements)

    DH_DYNAMIC_SMEM(raw);
    const u32 sraw = daaf_smem_addr(raw);
    const u32 sb = (sraw + 1023u) & ~1023u;
    unsigned char* const pb = raw + (sb - sraw);
    const u32 bars = sb + C::OFF_BAR;
    auto full_k = [&](int s) { return bars + 8u * (u32)s; };
    auto full_v = [&](int s) { return bars + 8u * (u32)(ST + s); };
    auto empty_k = [&](int s) { return bars + 8u * (u32)(2 * ST + s); };
    auto empty_v = [&](int s) { return bars + 8u * (u32)(3 * ST + s); };
    auto q_full = [&](int s) { return bars + 8u * (u32)(4 * ST + s); };
    auto q_empty = [&](int s) { return bars + 8u * (u32)(4 * ST + NQ + s); };
    auto info_full = [&](int s) { return bars + 8u * (u32)(4 * ST + 2 * NQ + s); };
    auto info_empty = [&](int s) { return bars + 8u * (u32)(4 * ST + 2 * NQ + 2 + s); };
    int* const info = reinterpret_cast<int*>(pb + C::OFF_INFO);
    int* const flags = reinterpret_cast<int*>(pb + C::OFF_FLAG);  // [0, ST): K slots, [ST, 2 ST): V slots
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < ST; ++s) {
            dh_mbar_init(full_k(s), 1);
            dh_mbar_init(full_v(s), 1);
            dh_mbar_init(empty_k(s), 128 * NC);
            dh_mbar_init(empty_v(s), 128 * NC);
        }
#pragma unroll
        for (int s = 0; s < NQ; ++s) {
            dh_mbar_init(q_full(s), 1);
            dh_mbar_init(q_empty(s), 128 * NC);
        }
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            dh_mbar_init(info_full(s), 1);
            dh_mbar_init(info_empty(s), 128 * NC);
        }
        dh_mbar_init_fence();
    }
    __syncthreads();  // the barriers are initialised; the only CTA-wide barrier

    if (wg == 0) {
        // ------------------------------------------------ producer: warp 0 of warpgroup 0
        dh_setmaxnreg_dec<C::REG_PRODUCER>();
        if (tid >= 32) return;
        const int lane = tid;
        // the warp waits through lane 0: a lane that waited on a barrier it never arrives on could fall a phase
        // behind (parity waits cannot tell phase u from u + 2); __syncwarp orders the others after it
        auto pwait = [&](u32 bar, u32 parity) {
            if (lane == 0) dh_mbar_wait(bar, parity);
            __syncwarp();
        };
        if (lane == 0) {
            fa3_prefetch_map(tm_q);
            fa3_prefetch_map(tm_k);
            fa3_prefetch_map(tm_v);
        }
        int it = 0;  // K/V tiles loaded so far (over all query tiles of this CTA)
        for (int n = 0;; ++n) {
            int work = 0;
            if (lane == 0) work = fa3_atomic_add(queue, 1);
            work = __shfl_sync(0xffffffffu, work, 0);
            const bool done = work >= n_work;
            int qt = 0, h = 0, b = 0;
            if (!done) dh_tile_of(work, nqt, H, B, sched, qt, h, b);
            const int t0 = qt * BM, t1 = daaf_imin(t0 + BM, T) - 1;
            // the key tiles of [t0, t1] (dh_plan_of) and, per consumer warpgroup, whether all its rows are
            // key-region queries
            const int ks = daaf_imax(0, t0 - W), mid = daaf_imin(t0 + 64, t1 + 1);
            const int xs[5] = {t0, t1 + 1, ks, mid, mid};
            int lb[5];
            dh_bounds5(gidx, n_global, xs, lb);
            DhPlan p;
            p.t0 = t0;
            p.t1 = t1;
            p.any_gq = lb[1] > lb[0];
            if (p.any_gq) {
                p.ks = 0;
                p.n_pre = 0;
                p.n_pre_tiles = 0;
                p.n_tiles = t1 / BN + 1;
            } else {
                p.ks = ks;
                p.n_pre = lb[2];
                p.n_pre_tiles = (p.n_pre + BN - 1) / BN;
                p.n_tiles = p.n_pre_tiles + (t1 - ks) / BN + 1;
            }
            // publish the tile (slot n % 2, once the consumers have read its use n - 2)
            const int sl = n & 1;
            if (n >= 2) pwait(info_empty(sl), (u32)(((n - 2) >> 1) & 1));
            if (lane == 0) {
                int* const f = info + sl * C::INFO_INTS;
                f[FA3_I_TILE] = done ? -1 : work;
                f[FA3_I_B] = b;
                f[FA3_I_H] = h;
                f[FA3_I_T0] = t0;
                f[FA3_I_T1] = t1;
                f[FA3_I_KS] = p.ks;
                f[FA3_I_NPRE] = p.n_pre;
                f[FA3_I_NPRE_TILES] = p.n_pre_tiles;
                f[FA3_I_NTILES] = p.n_tiles;
                f[FA3_I_ANY_GQ] = p.any_gq ? 1 : 0;
                f[FA3_I_ALL_GQ0] = (lb[3] - lb[0]) == (mid - t0) ? 1 : 0;
                f[FA3_I_ALL_GQ1] = mid <= t1 && (lb[1] - lb[4]) == (t1 + 1 - mid) ? 1 : 0;
                dh_mbar_arrive(info_full(sl));
            }
            if (done) break;
            // Q: the tile's BM rows (rows past T: zeros), once the consumers are done with this buffer's last tile
            const int qb = n % NQ;
            if (n >= NQ) pwait(q_empty(qb), (u32)(((n - NQ) / NQ) & 1));
            if (lane == 0) {
                const u32 dq = sb + C::OFF_Q + (u32)(qb * C::Q_BYTES);
                fa3_mbar_arrive_expect_tx(q_full(qb), (u32)C::Q_BYTES);
#pragma unroll
                for (int c = 0; c < D / 64; ++c) fa3_tma_load(dq + (u32)(c * BM * 128), tm_q, 64 * c, h, t0, b, q_full(qb));
            }
            // K and V tiles
            for (int i = 0; i < p.n_tiles; ++i, ++it) {
                const int s = it % ST, u = it / ST;
                // the keys of tile i: run0 + r when run0 >= 0 (a contiguous range, or gathered key-region keys that
                // are one run of tokens), else gidx[i BN + r]; n_keys of them (rows past them are masked)
                int run0 = -1, n_keys = BN;
                if (i < p.n_pre_tiles) {
                    const int x0 = i * BN;
                    n_keys = daaf_imin(BN, p.n_pre - x0);
                    const int first = gidx[x0];
                    if (gidx[x0 + n_keys - 1] - first == n_keys - 1) run0 = first;
                } else {
                    run0 = p.any_gq ? i * BN : p.ks + (i - p.n_pre_tiles) * BN;
                }
#pragma unroll
                for (int kv = 0; kv < 2; ++kv) {
                    const u32 full = kv == 0 ? full_k(s) : full_v(s);
                    if (u > 0) pwait(kv == 0 ? empty_k(s) : empty_v(s), (u32)((u - 1) & 1));
                    const u32 dst = sb + (u32)((kv == 0 ? C::OFF_K : C::OFF_V) + s * C::TILE_BYTES);
                    const Fa3TensorMap* const map = kv == 0 ? tm_k : tm_v;
                    if (run0 >= 0) {
                        if (lane == 0) {
                            flags[kv * ST + s] = 0;
                            fa3_mbar_arrive_expect_tx(full, (u32)C::TILE_BYTES);
#pragma unroll
                            for (int c = 0; c < D / 64; ++c)
                                fa3_tma_load(dst + (u32)(c * BN * 128), map, 64 * c, h, run0, b, full);
                        }
                    } else {
                        // rows by index: the warp's cp.async (zeros past n_keys); the barrier tracks each lane's
                        // copies, then lane 0's arrival (after every lane has registered) ends the phase
                        const u16* const base = (kv == 0 ? k : v) + (long long)b * T * rs + (long long)h * D;
                        for (int r = lane; r < BN; r += 32) {
                            const int j = r < n_keys ? gidx[i * BN + r] : -1;
                            const u16* const src = base + (long long)(j < 0 ? 0 : j) * rs;
#pragma unroll 4
                            for (int c = 0; c < CPR; ++c)
                                daaf_cp_async16(dst + dh_chunk_off<1, D>(r, c, BN), src + c * 8, j < 0 ? 0 : 16);
                        }
                        fa3_cp_async_mbar_arrive_inc(full);
                        __syncwarp();
                        if (lane == 0) {
                            flags[kv * ST + s] = 1;
                            dh_mbar_arrive(full);
                        }
                    }
                }
            }
        }
        // leave once the last tile's copies have landed (cp.async of this warp must not outlive it)
        if (it > 0) pwait(full_v((it - 1) % ST), (u32)(((it - 1) / ST) & 1));
        // the last CTA to finish resets the queue for the next launch
        if (lane == 0) {
            fa3_threadfence();
            if (fa3_atomic_add(queue + 1, 1) == (int)gridDim.x - 1) {
                fa3_atomic_exch(queue, 0);
                fa3_atomic_exch(queue + 1, 0);
            }
        }
        return;
    }

    // ---------------------------------------------------- consumer warpgroup cw: 64 query rows of each tile
    dh_setmaxnreg_inc<C::REG_CONSUMER>();
    const int cw = wg - 1, wtid = tid & 127, wq = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, tq = lane & 3;

    // ping-pong: the consumers issue their wgmma batches in turn, warpgroup 0 first (named barrier 1 + c is c's
    // turn, 256 threads: c syncs, the other arrives)
    auto turn_begin = [&] {
        if constexpr (PP) dh_bar_sync(1 + cw, 256);
    };
    auto turn_end = [&] {
        if constexpr (PP) dh_bar_arrive(2 - cw, 256);
    };
    if constexpr (PP) {
        if (cw == 1) dh_bar_arrive(1, 256);
    }

    float S[NS], O[NO];
    u32 P[KP][4];
    auto pin_s = [&] {
#pragma unroll
        for (int x = 0; x < NS; ++x) dh_fence_operand(S[x]);
    };
    auto pin_o = [&] {
#pragma unroll
        for (int x = 0; x < NO; ++x) dh_fence_operand(O[x]);
    };
    auto pin_p = [&] {
#pragma unroll
        for (int x = 0; x < KP; ++x) {
            dh_fence_operand(P[x][0]);
            dh_fence_operand(P[x][1]);
            dh_fence_operand(P[x][2]);
            dh_fence_operand(P[x][3]);
        }
    };

    int it = 0;  // K/V tiles consumed so far
    for (int n = 0;; ++n) {
        const int sl = n & 1;
        dh_mbar_wait(info_full(sl), (u32)((n >> 1) & 1));
        const int* const f = info + sl * C::INFO_INTS;
        const int work = f[FA3_I_TILE];
        DhPlan p;
        p.t0 = f[FA3_I_T0];
        p.t1 = f[FA3_I_T1];
        p.ks = f[FA3_I_KS];
        p.n_pre = f[FA3_I_NPRE];
        p.n_pre_tiles = f[FA3_I_NPRE_TILES];
        p.n_tiles = f[FA3_I_NTILES];
        p.any_gq = f[FA3_I_ANY_GQ] != 0;
        const bool wg_all_gq = f[cw == 0 ? FA3_I_ALL_GQ0 : FA3_I_ALL_GQ1] != 0;
        const int b = f[FA3_I_B], h = f[FA3_I_H];
        dh_mbar_arrive(info_empty(sl));
        if (work < 0) break;

        const int t0 = p.t0, t1 = p.t1;
        const int rw0 = t0 + 64 * cw;
        const int rw1 = daaf_imin(rw0 + 63, t1);
        const int qb = n % NQ;
        const u32 sQ = sb + C::OFF_Q + (u32)(qb * C::Q_BYTES);
        int row[2];
        bool gq[2];
        float m_[2], l_[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {  // padding rows (beyond t1) compute row t1's values, never stored
            row[hh] = daaf_imin(rw0 + 16 * wq + g + 8 * hh, t1);
            gq[hh] = gmask[row[hh]] != 0;
            m_[hh] = DAAF_NEG_INF;
            l_[hh] = 0.f;
        }
#pragma unroll
        for (int x = 0; x < NS; ++x) S[x] = 0.f;
#pragma unroll
        for (int x = 0; x < NO; ++x) O[x] = 0.f;
#pragma unroll
        for (int x = 0; x < KP; ++x) P[x][0] = P[x][1] = P[x][2] = P[x][3] = 0u;

        const int it0 = it;
        auto wait_kv = [&](int i, int kv) {  // tile i's K (kv 0) or V (1) has landed (and is visible to wgmma)
            const int s = (it0 + i) % ST;
            dh_mbar_wait(kv == 0 ? full_k(s) : full_v(s), (u32)(((it0 + i) / ST) & 1));
            if (flags[kv * ST + s]) dh_fence_proxy_async();  // gathered by cp.async: generic-proxy writes
        };
        auto release = [&](int i, int kv) {
            const int s = (it0 + i) % ST;
            dh_mbar_arrive(kv == 0 ? empty_k(s) : empty_v(s));
        };
        auto issue_s = [&](int i) {  // S = Q K(i)^T (one batch)
            const u32 sK = sb + (u32)(C::OFF_K + ((it0 + i) % ST) * C::TILE_BYTES);
#pragma unroll
            for (int kk = 0; kk < KQ; ++kk)
                dh_wgmma_ss<BF, BN, 0>(S, dh_desc_k<1, D>(sQ, BM, 64 * cw, kk), dh_desc_k<1, D>(sK, BN, 0, kk),
                                       kk > 0 ? 1 : 0);
            dh_wg_commit();
        };
        auto issue_pv = [&](int i) {  // O += P(i) V(i) (one batch; D = 256: two column halves)
            const u32 sV = sb + (u32)(C::OFF_V + ((it0 + i) % ST) * C::TILE_BYTES);
#pragma unroll
            for (int kk = 0; kk < KP; ++kk) {
#pragma unroll
                for (int hv = 0; hv < NH; ++hv)
                    dh_wgmma_rs<BF, NPV, 1>(*reinterpret_cast<float(*)[NPV / 2]>(O + hv * (NPV / 2)), P[kk],
                                            dh_desc_mn<1, D>(sV + (u32)(hv * (NPV / 64) * BN * 128), BN, kk), 1);
            }
            dh_wg_commit();
        };
        // mask where some pair of tile i may be excluded for some row of this warpgroup, then the online softmax
        // in base 2 (the scale folded into the exponent's FFMA): S becomes P (fp32)
        auto softmax = [&](int i, float (&alpha)[2]) {
            const DhKeyTile kt = dh_key_tile<BN>(p, i, rw0, rw1, wg_all_gq, W);
            if (!kt.full) {
                const unsigned char* const fl = gmask + (long long)kt.kt0;  // read only for local keys <= row
#pragma unroll
                for (int x = 0; x < NS; ++x) {
                    const int col = 8 * (x >> 2) + 2 * tq + (x & 1);
                    const int hh = (x >> 1) & 1;
                    if (!dh_pair_allowed<BN>(p, kt, i, col, row[hh], gq[hh], W, fl)) S[x] = DAAF_NEG_INF;
                }
            }
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                float mx = DAAF_NEG_INF;
#pragma unroll
                for (int x = 0; x < NS; ++x)
                    if (((x >> 1) & 1) == hh) mx = fmaxf(mx, S[x]);
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float mn = fmaxf(m_[hh], mx * scale_log2);
                const float bse = mn == DAAF_NEG_INF ? 0.f : mn;  // nothing allowed yet in this row
                alpha[hh] = daaf_ex2(m_[hh] - bse);
                m_[hh] = mn;
                float ls = 0.f;
#pragma unroll
                for (int x = 0; x < NS; ++x) {
                    if (((x >> 1) & 1) == hh) {
                        S[x] = daaf_ex2(fmaf(S[x], scale_log2, -bse));
                        ls += S[x];
                    }
                }
                l_[hh] = l_[hh] * alpha[hh] + ls;  // per-thread partial sums; the quad adds them at the end
            }
        };
        auto pack_p = [&] {
#pragma unroll
            for (int kk = 0; kk < KP; ++kk) {
#pragma unroll
                for (int r = 0; r < 4; ++r) P[kk][r] = daaf_pack2<BF>(S[8 * kk + 2 * r], S[8 * kk + 2 * r + 1]);
            }
        };

        dh_mbar_wait(q_full(qb), (u32)((n / NQ) & 1));  // Q by TMA: async-proxy writes, no fence needed
        float alpha[2];
        // tile 0: S only
        wait_kv(0, 0);
        pin_s();
        turn_begin();
        dh_wg_fence();
        issue_s(0);
        turn_end();
        dh_wg_wait<0>();
        pin_s();
        release(0, 0);
        softmax(0, alpha);
        pack_p();
        // tiles 1 ..: S(i) and P(i-1) V(i-1) in flight together; the softmax of tile i overlaps P V
        for (int i = 1; i < p.n_tiles; ++i) {
            wait_kv(i, 0);
            wait_kv(i - 1, 1);
            pin_s();
            pin_o();
            pin_p();
            turn_begin();
            dh_wg_fence();
            issue_s(i);
            issue_pv(i - 1);
            turn_end();
            dh_wg_wait<1>();  // S is ready (P V may still run): K(i) is free
            pin_s();
            release(i, 0);
            softmax(i, alpha);
            dh_wg_wait<0>();  // P(i-1) V(i-1) is in O; the P registers and V(i-1) are free
            pin_o();
            pin_p();
            release(i - 1, 1);
#pragma unroll
            for (int x = 0; x < NO; ++x) O[x] *= alpha[(x >> 1) & 1];
            pack_p();
        }
        // the last P V
        wait_kv(p.n_tiles - 1, 1);
        pin_o();
        pin_p();
        turn_begin();
        dh_wg_fence();
        issue_pv(p.n_tiles - 1);
        turn_end();
        dh_wg_wait<0>();
        pin_o();
        release(p.n_tiles - 1, 1);
        it += p.n_tiles;

        // epilogue: normalise, stage this warpgroup's 64 rows in its rows of the Q buffer (its S products, their
        // only readers, have retired), 16-byte coalesced stores, then the buffer goes back to the producer
        float inv[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float l = l_[hh];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            inv[hh] = l > 0.f ? 1.f / l : 0.f;  // l == 0 only on padding rows
        }
        unsigned char* const pq = pb + C::OFF_Q + qb * C::Q_BYTES;
#pragma unroll
        for (int x = 0; x < NO; x += 2) {
            const int hh = (x >> 1) & 1;
            const int lr = 64 * cw + 16 * wq + g + 8 * hh;
            *reinterpret_cast<u32*>(pq + dh_chunk_off<1, D>(lr, x >> 2, BM) + 4 * tq) =
                daaf_pack2<BF>(O[x] * inv[hh], O[x + 1] * inv[hh]);
        }
        dh_bar_sync(3 + cw, 128);
        u16* const ob = o + ((long long)b * T * H + h) * (long long)D;
#pragma unroll 4
        for (int it2 = 0; it2 < 64 * CPR / 128; ++it2) {
            const int idx = it2 * 128 + wtid;
            const int lr = 64 * cw + idx / CPR, c = idx % CPR;
            const int t = t0 + lr;
            if (t <= t1)
                *reinterpret_cast<DaafVec16*>(ob + (long long)t * rs + c * 8) =
                    *reinterpret_cast<const DaafVec16*>(pq + dh_chunk_off<1, D>(lr, c, BM));
        }
        dh_fence_proxy_async();  // these generic accesses before the producer's next tensor copy into the buffer
        dh_mbar_arrive(q_empty(qb));
    }
    if constexpr (PP) {
        if (cw == 0) dh_bar_sync(1, 256);  // the other warpgroup's last pass of the turn
    }
}

// q is read through tm_q only (its pointer is passed for the launcher's uniform argument list)
#define FA3_KERNEL(NAME, BF, D, BN, ST, NQ, PP)                                                                 \
    extern "C" __global__ void __launch_bounds__(384, 1) NAME(                                                   \
        const __grid_constant__ Fa3TensorMap tm_q, const __grid_constant__ Fa3TensorMap tm_k,                    \
        const __grid_constant__ Fa3TensorMap tm_v, const u16* __restrict__ q, const u16* __restrict__ k,         \
        const u16* __restrict__ v, u16* __restrict__ o, const int* __restrict__ gidx,                            \
        const unsigned char* __restrict__ gmask, int* __restrict__ queue, int B, int T, int H, int n_global,     \
        int W, float scale_log2, int sched, int n_work) {                                                        \
        (void)q;                                                                                                 \
        fa3_body<BF, D, BN, ST, NQ, PP>(&tm_q, &tm_k, &tm_v, k, v, o, gidx, gmask, queue, B, T, H, n_global, W, \
                                        scale_log2, sched, n_work);                                              \
    }

// name: daaf_hfa3_{elem}_d{D}[_pp|_s3]; (BN, ST, NQ) as gpu/daaf_fa3.py's variants' configs. FA3_GROUP (default 0: all) builds
// one group (gpu/daaf_fa3.py GROUPS: the groups compile in parallel); the sm_90 compile check of every gpu/*.cu
// (-DGLA_INSTANTIATE_FAST) builds group 1 only.
#ifndef FA3_GROUP
#ifdef GLA_INSTANTIATE_FAST
#define FA3_GROUP 1
#else
#define FA3_GROUP 0
#endif
#endif
#define FA3_IN_GROUP(g) (FA3_GROUP == 0 || FA3_GROUP == (g))
#if FA3_IN_GROUP(1)
FA3_KERNEL(daaf_hfa3_bf16_d128, true, 128, 128, 2, 2, false)
FA3_KERNEL(daaf_hfa3_f16_d128, false, 128, 128, 2, 2, false)
#endif
#if FA3_IN_GROUP(2)
FA3_KERNEL(daaf_hfa3_bf16_d128_pp, true, 128, 128, 2, 2, true)
FA3_KERNEL(daaf_hfa3_f16_d128_pp, false, 128, 128, 2, 2, true)
#endif
#if FA3_IN_GROUP(3)
FA3_KERNEL(daaf_hfa3_bf16_d64, true, 64, 128, 4, 2, false)
FA3_KERNEL(daaf_hfa3_f16_d64, false, 64, 128, 4, 2, false)
FA3_KERNEL(daaf_hfa3_bf16_d64_pp, true, 64, 128, 4, 2, true)
FA3_KERNEL(daaf_hfa3_f16_d64_pp, false, 64, 128, 4, 2, true)
#endif
#if FA3_IN_GROUP(4)
FA3_KERNEL(daaf_hfa3_bf16_d256, true, 256, 64, 2, 1, false)
FA3_KERNEL(daaf_hfa3_f16_d256, false, 256, 64, 2, 1, false)
#endif
#if FA3_IN_GROUP(5)
FA3_KERNEL(daaf_hfa3_bf16_d256_pp, true, 256, 64, 2, 1, true)
FA3_KERNEL(daaf_hfa3_f16_d256_pp, false, 256, 64, 2, 1, true)
#endif
// hfa3s3: D = 128 with 3 K/V stages and one Q buffer (a deeper K/V ring instead of the next tile's Q in advance)
#if FA3_IN_GROUP(6)
FA3_KERNEL(daaf_hfa3_bf16_d128_s3, true, 128, 128, 3, 1, false)
#endif
