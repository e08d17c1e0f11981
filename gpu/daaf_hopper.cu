// DAAF windowed attention with key regions on Hopper (sm_90a), loaded by gpu/daaf_hopper.py.
//
// Semantics: those of gpu/daaf_attention.cu (and hpczeco.daaf.plan_arrays). Per batch b and head h,
// query t attends to key j <= t when t - j <= W (local window), or gmask[j] (j is a key-region
// token), or gmask[t] (t is one: it sees every earlier key); softmax over that set, each key once.
// gidx: the key-region positions (sorted int32, n_global of them); gmask: the same set, one byte
// per token. q, k, v, o: [B, T, H, D] contiguous, 16-bit (bf16 or f16), D in {64, 128}.
//
// Kernels (one CTA per query tile, 1-D grid, see dh_tile_of for the order):
//   daaf_hwg_*     warpgroup MMA (wgmma). NWG warpgroups of 128 threads, each owning 64 query rows
//                  (a tile of 64 NWG rows) over shared BN-key K/V tiles; ST shared-memory stages
//                  filled by cp.async (16-byte chunks: gathered key-region rows need an index per
//                  row); S = Q K^T with A = Q and B = K from shared memory (both K-major); online
//                  softmax in registers (fp32, exp2, scale folded in one FFMA); O += P V with P from
//                  registers (the accumulator layout of S is the A-fragment layout of the next
//                  wgmma, as in FlashAttention-3) and B = V from shared memory, MN-major. Within a
//                  warpgroup the P V product of tile i-1 runs on the tensor cores while the softmax
//                  of tile i runs on the other units.
//   daaf_hfa2_*    mma.sync m16n8k16 fallback (FlashAttention-2 layout): 8 warps x 16 query rows =
//                  128 rows per CTA, Q fragments in registers, 64-key tiles in padded shared rows
//                  read by ldmatrix, cp.async with ST stages.
//   daaf_wgmma_unit_*  one warpgroup, one D[64 x 128] = A[64 x 128] B[128 x 128] product through the
//                  same layouts and descriptors as daaf_hwg (device self-check of this file's
//                  understanding of the wgmma descriptor and fragment layouts).
//
// Key tiles a query tile [t0, t1] visits (the rule of gpu/daaf_attention.cu's tc kernels):
//   * some row of the tile is a key-region query: the causal tiles 0 .. t1 (masked per element only
//     where needed);
//   * else the key-region keys before the local range gathered by index from gidx (all allowed for
//     every row), then the local range [max(0, t0 - W), t1] (masked per element).
//
// Shared-memory tile layout (dh_chunk_off): SWZ = 1 is the canonical 128-byte-swizzle layout of
// wgmma: the tile [R rows][D] is stored as D/64 column blocks of [R][64] (128-byte rows), and
// 16-byte chunk c of row r sits at chunk position c ^ (r % 8) (PTX: address bits [4,7) XOR bits
// [7,10)); every block 1024-byte aligned. SWZ = 0 is the unswizzled ("interleave") layout of 8 x 8
// core matrices (8 rows x 16 bytes, 128 contiguous bytes), core matrix (r/8, c) at
// ((r/8) (D/8) + c) 128 bytes: a fallback with bank conflicts, in case the swizzled form
// misbehaves on the hardware. The same tile serves as the K-major B operand of Q K^T (rows = keys =
// N, columns = d = K) and as the MN-major B operand of P V (rows = keys = K, columns = d = N).
//
// No #include of system headers: the file builds with NVRTC (gpu/runtime.py inlines the local headers) and
// nvcc (-std=c++17) alike, and with g++ after gpu/emu/cuda_emu.h for the CPU emulation (CUDA_EMU).

#include "daaf_hopper_ptx.cuh"  // + daaf_common.cuh: daaf_imin/imax/lower_bound, DaafVec16, the mma.sync helpers

// ------------------------------------------------------------------ tile order
// sched bit 0: reverse the query tiles (the longest rows first); bit 1: heads (then batches) vary
// fastest, so that the CTAs running at once share query tiles (the same key-region rows) across heads.
__device__ __forceinline__ void dh_tile_of(int id, int nqt, int H, int B, int sched, int& qt, int& h, int& b) {
    if (sched & 2) {
        h = id % H;
        id /= H;
        b = id % B;
        qt = id / B;
    } else {
        qt = id % nqt;
        id /= nqt;
        h = id % H;
        b = id / H;
    }
    if (sched & 1) qt = nqt - 1 - qt;
}

// ------------------------------------------------------------------ key tiles of a query tile
struct DhPlan {
    int t0, t1;         // query rows of the CTA (t1 inclusive, clipped to T - 1)
    int ks;             // first key of the local range (not any_gq)
    int n_pre;          // key-region keys before ks (gathered)
    int n_pre_tiles;    // tiles of them
    int n_tiles;        // all key tiles
    bool any_gq;        // some row is a key-region query: causal tiles 0 .. t1
};

// the lower bounds a CTA needs, one per lane of each warp (independent loads in flight at once)
// xs: up to 5 positions; returns lower_bound(gidx, n_global, xs[lane]) broadcast as out[0..4]
__device__ __forceinline__ void dh_bounds5(const int* __restrict__ gidx, int n_global, const int (&xs)[5], int (&out)[5]) {
    const int lane = threadIdx.x & 31;
    int x = xs[0];
#pragma unroll
    for (int i = 1; i < 5; ++i) x = lane == i ? xs[i] : x;
    const int r = lane < 5 ? daaf_lower_bound(gidx, n_global, x) : 0;
#pragma unroll
    for (int i = 0; i < 5; ++i) out[i] = __shfl_sync(0xffffffffu, r, i);
}

template <int BN>
__device__ __forceinline__ int dh_key_of(const DhPlan& p, const int* __restrict__ gidx, int i, int r) {
    if (p.any_gq) {
        const int j = i * BN + r;
        return j <= p.t1 ? j : -1;
    }
    if (i < p.n_pre_tiles) {
        const int x = i * BN + r;
        return x < p.n_pre ? gidx[x] : -1;
    }
    const int j = p.ks + (i - p.n_pre_tiles) * BN + r;
    return j <= p.t1 ? j : -1;
}

// the query tile of this CTA (BM rows, dh_tile_of) and its head's rows of q, k, v, o (token stride rs elements)
struct DhHead {
    int t0, t1;  // query rows (t1 inclusive, clipped to T - 1)
    long long rs;
    const u16* qb;
    const u16* kb;
    const u16* vb;
    u16* ob;
};
template <int BM, int D>
__device__ __forceinline__ DhHead dh_head_of(const u16* q, const u16* k, const u16* v, u16* o, int B, int T, int H,
                                            int sched) {
    int qt, h, b;
    dh_tile_of((int)blockIdx.x, (T + BM - 1) / BM, H, B, sched, qt, h, b);
    DhHead r;
    r.t0 = qt * BM;
    r.t1 = daaf_imin(r.t0 + BM, T) - 1;
    r.rs = (long long)H * D;
    const long long base = ((long long)b * T * H + h) * (long long)D;
    r.qb = q + base;
    r.kb = k + base;
    r.vb = v + base;
    r.ob = o + base;
    return r;
}

// the key tiles (BN keys) of query tile [t0, t1]; rows_all_gq: every row of [r0, r1] (the caller's warpgroup
// or warp) is a key-region query
template <int BN>
__device__ __forceinline__ DhPlan dh_plan_of(const int* __restrict__ gidx, int n_global, int t0, int t1, int W,
                                            int r0, int r1, bool& rows_all_gq) {
    DhPlan p;
    p.t0 = t0;
    p.t1 = t1;
    const int ks = daaf_imax(0, t0 - W);
    const int xs[5] = {t0, t1 + 1, ks, r0, r1 + 1};
    int lb[5];
    dh_bounds5(gidx, n_global, xs, lb);
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
    rows_all_gq = r0 <= r1 && (lb[4] - lb[3]) == (r1 - r0 + 1);
    return p;
}

// key tile i for the rows [r0, r1]: gathered key-region keys or a causal/local range from kt0; full: every pair
// of the tile is allowed for every row (no per-element mask)
struct DhKeyTile {
    bool gathered;
    int kt0;
    bool full;
};
template <int BN>
__device__ __forceinline__ DhKeyTile dh_key_tile(const DhPlan& p, int i, int r0, int r1, bool rows_all_gq, int W) {
    DhKeyTile kt;
    kt.gathered = i < p.n_pre_tiles;
    kt.kt0 = p.any_gq ? i * BN : (kt.gathered ? 0 : p.ks + (i - p.n_pre_tiles) * BN);
    if (kt.gathered) kt.full = (i + 1) * BN <= p.n_pre;
    else kt.full = kt.kt0 + BN - 1 <= r0 && (rows_all_gq || r1 - kt.kt0 <= W);
    return kt;
}
// row r (r_gq: a key-region query) may see column col of key tile i (fl: the tile's key-region flags)
template <int BN>
__device__ __forceinline__ bool dh_pair_allowed(const DhPlan& p, const DhKeyTile& kt, int i, int col, int r, bool r_gq,
                                                int W, const unsigned char* fl) {
    if (kt.gathered) return i * BN + col < p.n_pre;
    const int j = kt.kt0 + col;
    return j <= r && (r - j <= W || fl[col] != 0 || r_gq);
}

// ------------------------------------------------------------------ shared-memory tile layout and descriptors

// byte offset of 16-byte chunk c (of D/8) of row r in a tile of R rows (R a multiple of 8)
template <int SWZ, int D>
__device__ __forceinline__ u32 dh_chunk_off(int r, int c, int R) {
    if constexpr (SWZ) {
        return (u32)((c >> 3) * (R * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4));
    } else {
        return (u32)(((r >> 3) * (D / 8) + c) * 128 + (r & 7) * 16);
    }
}

// wgmma shared-memory matrix descriptor: start address, leading / stride byte offsets (all >> 4,
// 14 bits each, at bits 0, 16, 32), base offset 0 (bits 49-51), layout type (bits 62-63:
// 0 = interleave / no swizzle, 1 = 128-byte swizzle, 2 = 64-byte, 3 = 32-byte)
__device__ __forceinline__ unsigned long long dh_desc(u32 addr, u32 lbo, u32 sbo, int layout) {
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFFu) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3FFFu) << 32) | ((unsigned long long)layout << 62);
}

// K-major operand: rows r0 .. r0 + (64 or N) - 1 of a tile of R rows at `base`, columns 16 kk .. 16 kk + 15.
// SWZ: 8-row groups 1024 bytes apart (SBO), rows 128 bytes apart within a group, the 16 columns
// 32 contiguous bytes of the (unswizzled) row: k-step kk starts 32 kk bytes into column block kk / 4
// (the hardware applies the XOR to the address bits, so advancing the start address is exact); LBO
// is unused (1). Interleave: core matrices adjacent in K 128 bytes apart (LBO), in M/N (D/8) 128 (SBO).
template <int SWZ, int D>
__device__ __forceinline__ unsigned long long dh_desc_k(u32 base, int R, int r0, int kk) {
    if constexpr (SWZ) {
        return dh_desc(base + (u32)((kk >> 2) * (R * 128) + r0 * 128 + (kk & 3) * 32), 16, 1024, 1);
    } else {
        return dh_desc(base + (u32)(((r0 >> 3) * (D / 8) + 2 * kk) * 128), 128, (D / 8) * 128, 0);
    }
}

// MN-major operand B[k][n]: k = tile rows 16 kk .. 16 kk + 15, n = the D columns (N = D).
// SWZ: 8-row (k) groups 1024 bytes apart (SBO), the 64-column (n) blocks R * 128 bytes apart (LBO).
// Interleave: core matrices adjacent in K (D/8) 128 bytes apart (LBO), adjacent in N 128 (SBO).
template <int SWZ, int D>
__device__ __forceinline__ unsigned long long dh_desc_mn(u32 base, int R, int kk) {
    if constexpr (SWZ) {
        return dh_desc(base + (u32)(kk * 16 * 128), (u32)(R * 128), 1024, 1);
    } else {
        return dh_desc(base + (u32)(2 * kk * (D / 8) * 128), (D / 8) * 128, 128, 0);
    }
}

// DH_EXPECT_SMEM(bytes): the layout's size; the emulation checks that the launch gave exactly that
#ifdef CUDA_EMU
#define DH_DYNAMIC_SMEM(name) unsigned char* const name = emu_dynamic_smem()
#define DH_EXPECT_SMEM(bytes) emu_expect_dynamic_smem(bytes)
#else
#define DH_EXPECT_SMEM(bytes)
#define DH_DYNAMIC_SMEM(name)                        \
    extern __shared__ DaafVec16 dh_smem_raw_[];      \
    unsigned char* const name = reinterpret_cast<unsigned char*>(dh_smem_raw_)
#endif

// ------------------------------------------------------------------ wgmma kernel

template <int D, int BN, int NWG, int ST>
struct DhWgCfg {
    static constexpr int BM = 64 * NWG;        // query rows per CTA
    static constexpr int NTH = 128 * NWG;      // threads
    static constexpr int CPR = D / 8;          // 16-byte chunks per row
    static constexpr int Q_BYTES = BM * D * 2;
    static constexpr int TILE_BYTES = BN * D * 2;
    static constexpr int STAGE_BYTES = 2 * TILE_BYTES;  // K and V
    static constexpr int OFF_Q = 0;
    static constexpr int OFF_KV = Q_BYTES;
    static constexpr int OFF_FLAG = Q_BYTES + ST * STAGE_BYTES;  // gmask of each tile row, per stage
    static constexpr int SMEM_BYTES = OFF_FLAG + ((ST * BN + 15) / 16) * 16 + 1024;  // + alignment slack
};

template <bool BF, int D, int BN, int NWG, int ST, int SWZ>
__device__ __forceinline__ void dh_wg_body(
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, u16* __restrict__ o,
    const int* __restrict__ gidx, const unsigned char* __restrict__ gmask,
    int B, int T, int H, int n_global, int W, float scale_log2, int sched)
{
    typedef DhWgCfg<D, BN, NWG, ST> C;
    DH_EXPECT_SMEM(C::SMEM_BYTES);
    constexpr int BM = C::BM, NTH = C::NTH, CPR = C::CPR;
    constexpr int NS = BN / 2;     // S accumulators per thread
    constexpr int NO = D / 2;      // O accumulators per thread
    constexpr int KQ = D / 16;     // k-steps of S = Q K^T
    constexpr int KP = BN / 16;    // k-steps of O += P V
    static_assert(ST >= 3, "P V of tile i-1 runs during iteration i: three stages at least");
    static_assert(D == 64 || D == 128, "D in {64, 128}");
    static_assert(BN == 64 || BN == 128, "BN in {64, 128}");
    static_assert(BN % 8 == 0 && BM % 8 == 0, "whole 8-row groups");

    const DhHead hd = dh_head_of<BM, D>(q, k, v, o, B, T, H, sched);
    const int t0 = hd.t0, t1 = hd.t1;
    const long long rs = hd.rs;  // token stride (elements)
    const u16* const qb = hd.qb;
    const u16* const kb = hd.kb;
    const u16* const vb = hd.vb;
    u16* const ob = hd.ob;

    const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127, wq = (tid >> 5) & 3;
    const int lane = tid & 31, g = lane >> 2, tq = lane & 3;

    // rows of this warpgroup: [rw0, rw1]
    const int rw0 = t0 + 64 * wg;
    const int rw1 = daaf_imin(rw0 + 63, t1);
    bool wg_all_gq;
    const DhPlan p = dh_plan_of<BN>(gidx, n_global, t0, t1, W, rw0, rw1, wg_all_gq);

    DH_DYNAMIC_SMEM(raw);
    const u32 sraw = daaf_smem_addr(raw);
    const u32 sb = (sraw + 1023u) & ~1023u;
    unsigned char* const pb = raw + (sb - sraw);
    const u32 sQ = sb + C::OFF_Q;
    unsigned char* const kflag = pb + C::OFF_FLAG;

    auto issue_tile = [&](int i, int st) {
        const u32 dK = sb + C::OFF_KV + st * C::STAGE_BYTES;
#pragma unroll
        for (int it = 0; it < (BN * CPR + NTH - 1) / NTH; ++it) {
            const int idx = it * NTH + tid;
            if ((BN * CPR) % NTH == 0 || idx < BN * CPR) {
                const int r = idx / CPR, c = idx % CPR;
                const int j = dh_key_of<BN>(p, gidx, i, r);
                const long long off = (long long)(j < 0 ? 0 : j) * rs + c * 8;
                const int nb = j < 0 ? 0 : 16;
                const u32 co = dh_chunk_off<SWZ, D>(r, c, BN);
                daaf_cp_async16(dK + co, kb + off, nb);
                daaf_cp_async16(dK + C::TILE_BYTES + co, vb + off, nb);
                if (c == 0) kflag[st * BN + r] = j < 0 ? (unsigned char)0 : gmask[j];
            }
        }
    };

    // prologue: the Q tile, then tiles 0 .. ST-3 (one commit group each)
#pragma unroll
    for (int it = 0; it < (BM * CPR + NTH - 1) / NTH; ++it) {
        const int idx = it * NTH + tid;
        if ((BM * CPR) % NTH == 0 || idx < BM * CPR) {
            const int r = idx / CPR, c = idx % CPR;
            const int t = t0 + r;
            daaf_cp_async16(sQ + dh_chunk_off<SWZ, D>(r, c, BM), qb + (long long)(t <= t1 ? t : t0) * rs + c * 8,
                            t <= t1 ? 16 : 0);
        }
    }
    daaf_cp_async_commit();
#pragma unroll
    for (int s = 0; s < ST - 2; ++s) {
        if (s < p.n_tiles) issue_tile(s, s);
        daaf_cp_async_commit();
    }

    // this thread's rows: accumulator rows g and g + 8 of its warp's 16
    int row[2];
    bool gq[2];
    float m_[2], l_[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        row[hh] = rw0 + 16 * wq + g + 8 * hh;
        gq[hh] = row[hh] <= t1 && gmask[row[hh]] != 0;
        m_[hh] = DAAF_NEG_INF;
        l_[hh] = 0.f;
    }
    float S[NS], O[NO];
    u32 P[KP][4];
#pragma unroll
    for (int x = 0; x < NS; ++x) S[x] = 0.f;
#pragma unroll
    for (int x = 0; x < NO; ++x) O[x] = 0.f;
#pragma unroll
    for (int x = 0; x < KP; ++x) P[x][0] = P[x][1] = P[x][2] = P[x][3] = 0u;

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
    auto wait_tile = [&](int i) {
        (void)i;
        daaf_cp_async_wait<ST - 3>();  // this thread's copies of tile i (and Q) have landed
        dh_fence_proxy_async();      // ... and are visible to the tensor cores
        __syncthreads();             // everyone's; and everyone is done with tile i - 2's stage
    };
    auto issue_s = [&](int i) {      // S = Q K(i)^T (one batch)
        const u32 sK = sb + C::OFF_KV + (i % ST) * C::STAGE_BYTES;
#pragma unroll
        for (int kk = 0; kk < KQ; ++kk)
            dh_wgmma_ss<BF, BN, 0>(S, dh_desc_k<SWZ, D>(sQ, BM, 64 * wg, kk), dh_desc_k<SWZ, D>(sK, BN, 0, kk),
                                   kk > 0 ? 1 : 0);
        dh_wg_commit();
    };
    auto issue_pv = [&](int i) {     // O += P(i) V(i) (one batch)
        const u32 sV = sb + C::OFF_KV + (i % ST) * C::STAGE_BYTES + C::TILE_BYTES;
#pragma unroll
        for (int kk = 0; kk < KP; ++kk) dh_wgmma_rs<BF, D, 1>(O, P[kk], dh_desc_mn<SWZ, D>(sV, BN, kk), 1);
        dh_wg_commit();
    };
    auto prefetch = [&](int i) {     // the copies of tile i + ST - 2 into the stage of tile i - 2
        if (i + ST - 2 < p.n_tiles) issue_tile(i + ST - 2, (i + ST - 2) % ST);
        daaf_cp_async_commit();
    };
    // mask where some pair of tile i may be excluded for some row of this warpgroup, then the online
    // softmax in base 2 (the scale folded into the exponent's FFMA): S becomes P (fp32)
    auto softmax = [&](int i, float (&alpha)[2]) {
        const DhKeyTile kt = dh_key_tile<BN>(p, i, rw0, rw1, wg_all_gq, W);
        if (!kt.full) {
            const unsigned char* const fl = kflag + (i % ST) * BN;
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

    float alpha[2];
    // tile 0: S only
    wait_tile(0);
    pin_s();
    dh_wg_fence();
    issue_s(0);
    prefetch(0);
    dh_wg_wait<0>();
    pin_s();
    softmax(0, alpha);
    pack_p();
    // tiles 1 ..: S(i) and P(i-1) V(i-1) in flight together; the softmax of tile i overlaps P V
    for (int i = 1; i < p.n_tiles; ++i) {
        wait_tile(i);
        pin_s();
        pin_o();
        pin_p();
        dh_wg_fence();
        issue_s(i);
        issue_pv(i - 1);
        prefetch(i);
        dh_wg_wait<1>();  // S is ready (P V may still run)
        pin_s();
        softmax(i, alpha);
        dh_wg_wait<0>();  // P(i-1) V(i-1) is in O; the P registers are free
        pin_o();
        pin_p();
#pragma unroll
        for (int x = 0; x < NO; ++x) O[x] *= alpha[(x >> 1) & 1];
        pack_p();
    }
    // the last P V
    pin_o();
    pin_p();
    dh_wg_fence();
    issue_pv(p.n_tiles - 1);
    dh_wg_wait<0>();
    pin_o();

    // epilogue: normalise, stage this warpgroup's 64 rows in its part of the Q buffer (no other
    // warpgroup reads those rows), 16-byte coalesced stores
    float inv[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        float l = l_[hh];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        inv[hh] = l > 0.f ? 1.f / l : 0.f;  // l == 0 only on padding rows
    }
#pragma unroll
    for (int x = 0; x < NO; x += 2) {
        const int hh = (x >> 1) & 1;
        const int lr = 64 * wg + 16 * wq + g + 8 * hh;
        *reinterpret_cast<u32*>(pb + C::OFF_Q + dh_chunk_off<SWZ, D>(lr, x >> 2, BM) + 4 * tq) =
            daaf_pack2<BF>(O[x] * inv[hh], O[x + 1] * inv[hh]);
    }
    dh_bar_sync(1 + wg, 128);
#pragma unroll
    for (int it = 0; it < 64 * CPR / 128; ++it) {
        const int idx = it * 128 + wtid;
        const int lr = 64 * wg + idx / CPR, c = idx % CPR;
        const int t = t0 + lr;
        if (t <= t1)
            *reinterpret_cast<DaafVec16*>(ob + (long long)t * rs + c * 8) =
                *reinterpret_cast<const DaafVec16*>(pb + C::OFF_Q + dh_chunk_off<SWZ, D>(lr, c, BM));
    }
}

// LB: __launch_bounds__(threads, 1)
#define DH_WG_KERNEL(NAME, BF, D, BN, NWG, ST, SWZ)                                                            \
    extern "C" __global__ void __launch_bounds__(128 * NWG, 1) NAME(                                          \
        const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, u16* __restrict__ o, \
        const int* __restrict__ gidx, const unsigned char* __restrict__ gmask, int B, int T, int H,           \
        int n_global, int W, float scale_log2, int sched) {                                                   \
        dh_wg_body<BF, D, BN, NWG, ST, SWZ>(q, k, v, o, gidx, gmask, B, T, H, n_global, W, scale_log2, sched); \
    }

// name: daaf_hwg_{elem}_d{D}_n{BN}_w{NWG}_s{ST}[_nosw]. DH_GROUP (default 0: all) builds one group of
// kernels only, so that a launcher can compile the groups in parallel (gpu/daaf_hopper.py GROUPS).
#ifndef DH_GROUP
#define DH_GROUP 0
#endif
#define DH_IN_GROUP(g) (DH_GROUP == 0 || DH_GROUP == (g))
#if DH_IN_GROUP(1)
DH_WG_KERNEL(daaf_hwg_bf16_d128_n128_w2_s3, true, 128, 128, 2, 3, 1)
#endif
#if DH_IN_GROUP(2)
DH_WG_KERNEL(daaf_hwg_f16_d128_n128_w2_s3, false, 128, 128, 2, 3, 1)
#endif
#if DH_IN_GROUP(3)
DH_WG_KERNEL(daaf_hwg_bf16_d128_n64_w2_s4, true, 128, 64, 2, 4, 1)
#endif
#if DH_IN_GROUP(4)
DH_WG_KERNEL(daaf_hwg_bf16_d128_n64_w3_s3, true, 128, 64, 3, 3, 1)
#endif
#if DH_IN_GROUP(5)
DH_WG_KERNEL(daaf_hwg_bf16_d128_n128_w1_s3, true, 128, 128, 1, 3, 1)
#endif
#if DH_IN_GROUP(6)
DH_WG_KERNEL(daaf_hwg_bf16_d64_n128_w2_s3, true, 64, 128, 2, 3, 1)
DH_WG_KERNEL(daaf_hwg_f16_d64_n128_w2_s3, false, 64, 128, 2, 3, 1)
#endif
#if DH_IN_GROUP(7)
DH_WG_KERNEL(daaf_hwg_bf16_d128_n128_w2_s3_nosw, true, 128, 128, 2, 3, 0)
#endif

// ------------------------------------------------------------------ warp-specialised and window-only kernels
#include "daaf_hopper_ws.cuh"   // dh_ws_body: producer warpgroup + NC consumer warpgroups, mbarrier ring
#include "daaf_hopper_win.cuh"  // dh_win_body: plans without key regions, W <= 128, the whole band at once

#define DH_WS_KERNEL(NAME, BF, D, BN, NC, ST, PP)                                                              \
    extern "C" __global__ void __launch_bounds__(128 * (NC + 1), 1) NAME(                                     \
        const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, u16* __restrict__ o, \
        const int* __restrict__ gidx, const unsigned char* __restrict__ gmask, int B, int T, int H,           \
        int n_global, int W, float scale_log2, int sched) {                                                   \
        dh_ws_body<BF, D, BN, NC, ST, PP>(q, k, v, o, gidx, gmask, B, T, H, n_global, W, scale_log2, sched);   \
    }
// the window kernels take the same arguments (gidx, gmask, n_global unused: the launcher checks n_global == 0)
#define DH_WIN_KERNEL(NAME, BF, D, NWG)                                                                        \
    extern "C" __global__ void __launch_bounds__(128 * NWG, NWG == 1 ? 2 : 1) NAME(                           \
        const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, u16* __restrict__ o, \
        const int* __restrict__ gidx, const unsigned char* __restrict__ gmask, int B, int T, int H,           \
        int n_global, int W, float scale_log2, int sched) {                                                   \
        (void)gidx;                                                                                            \
        (void)gmask;                                                                                           \
        (void)n_global;                                                                                        \
        dh_win_body<BF, D, NWG>(q, k, v, o, B, T, H, W, scale_log2, sched);                                    \
    }

// names: daaf_hws_{elem}_d{D}_n{BN}_c{NC}_s{ST}[_pp], daaf_hwin_{elem}_d{D}_w{NWG}
#if DH_IN_GROUP(11)
DH_WS_KERNEL(daaf_hws_bf16_d128_n128_c2_s3, true, 128, 128, 2, 3, false)
#endif
#if DH_IN_GROUP(12)
DH_WS_KERNEL(daaf_hws_f16_d128_n128_c2_s3, false, 128, 128, 2, 3, false)
DH_WS_KERNEL(daaf_hws_bf16_d64_n128_c2_s3, true, 64, 128, 2, 3, false)
DH_WS_KERNEL(daaf_hws_f16_d64_n128_c2_s3, false, 64, 128, 2, 3, false)
#endif
#if DH_IN_GROUP(13)
DH_WS_KERNEL(daaf_hws_bf16_d128_n128_c2_s3_pp, true, 128, 128, 2, 3, true)
#endif
#if DH_IN_GROUP(14)
DH_WS_KERNEL(daaf_hws_bf16_d128_n64_c2_s6, true, 128, 64, 2, 6, false)
#endif
#if DH_IN_GROUP(15)
DH_WS_KERNEL(daaf_hws_bf16_d128_n64_c3_s5, true, 128, 64, 3, 5, false)
#endif
#if DH_IN_GROUP(16)
DH_WS_KERNEL(daaf_hws_bf16_d128_n64_c3_s5_pp, true, 128, 64, 3, 5, true)
#endif
#if DH_IN_GROUP(17)
DH_WIN_KERNEL(daaf_hwin_bf16_d128_w1, true, 128, 1)
DH_WIN_KERNEL(daaf_hwin_f16_d128_w1, false, 128, 1)
DH_WIN_KERNEL(daaf_hwin_bf16_d64_w1, true, 64, 1)
DH_WIN_KERNEL(daaf_hwin_f16_d64_w1, false, 64, 1)
#endif
#if DH_IN_GROUP(18)
DH_WIN_KERNEL(daaf_hwin_bf16_d128_w2, true, 128, 2)
#endif

// ------------------------------------------------------------------ wgmma unit check
// One warpgroup. a: [64][128] (row-major, K-major), b: mode & 1 ? [128 (k)][128 (n)] (n contiguous:
// MN-major, as the V tile) : [128 (n)][128 (k)] (k contiguous: K-major, as the K tile); d: [64][128]
// fp32 = a b. mode & 2: A from registers (the P V path), else from shared memory (the Q K^T path).
enum { DH_UNIT_SMEM_BYTES = (64 + 128) * 128 * 2 + 1024 };  // A, B, alignment slack

// rows [0, rows) of src ([rows][128], row-major) into the tile of R rows at shared address dst (layout SWZ), by
// cp.async over one warpgroup (the caller commits and waits)
template <int SWZ>
__device__ __forceinline__ void dh_unit_copy_rows(const u16* __restrict__ src, u32 dst, int rows, int R) {
    constexpr int D = 128, CPR = D / 8;
    for (int idx = threadIdx.x; idx < rows * CPR; idx += 128)
        daaf_cp_async16(dst + dh_chunk_off<SWZ, D>(idx / CPR, idx % CPR, R), src + (idx / CPR) * D + (idx % CPR) * 8,
                        16);
}
// a ([64][128]) at sA and bm ([128][128]) at sB, landed (before the proxy fence)
template <int SWZ>
__device__ __forceinline__ void dh_unit_load(const u16* __restrict__ a, const u16* __restrict__ bm, u32 sA, u32 sB) {
    dh_unit_copy_rows<SWZ>(a, sA, 64, 64);
    dh_unit_copy_rows<SWZ>(bm, sB, 128, 128);
    daaf_cp_async_commit();
    daaf_cp_async_wait<0>();
}
// the warpgroup's accumulators of D[64][128] into d (row-major fp32)
__device__ __forceinline__ void dh_unit_store(const float (&acc)[64], float* __restrict__ d) {
    const int wq = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, tq = threadIdx.x & 3;
#pragma unroll
    for (int x = 0; x < 64; ++x) {
        const int m = 16 * wq + g + 8 * ((x >> 1) & 1), n = 8 * (x >> 2) + 2 * tq + (x & 1);
        d[m * 128 + n] = acc[x];
    }
}

template <bool BF, int SWZ>
__device__ __forceinline__ void dh_unit_body(const u16* __restrict__ a, const u16* __restrict__ bm,
                                             float* __restrict__ d, int mode) {
    constexpr int D = 128, R = 128;
    DH_EXPECT_SMEM(DH_UNIT_SMEM_BYTES);
    DH_DYNAMIC_SMEM(raw);
    const u32 sraw = daaf_smem_addr(raw);
    const u32 sb = (sraw + 1023u) & ~1023u;
    const u32 sA = sb, sB = sb + 64 * D * 2;
    const int tid = threadIdx.x, wq = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
    dh_unit_load<SWZ>(a, bm, sA, sB);
    dh_fence_proxy_async();
    __syncthreads();
    float acc[64];
#pragma unroll
    for (int x = 0; x < 64; ++x) acc[x] = 0.f;
    u32 af[8][4];
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int m = 16 * wq + g + 8 * (r & 1), c = 16 * kk + 2 * tq + 8 * (r >> 1);
            af[kk][r] = (u32)a[m * D + c] | ((u32)a[m * D + c + 1] << 16);
        }
    }
#pragma unroll
    for (int x = 0; x < 64; ++x) dh_fence_operand(acc[x]);
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
        dh_fence_operand(af[kk][0]);
        dh_fence_operand(af[kk][1]);
        dh_fence_operand(af[kk][2]);
        dh_fence_operand(af[kk][3]);
    }
    dh_wg_fence();
    if (mode & 2) {
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            if (mode & 1) dh_wgmma_rs<BF, 128, 1>(acc, af[kk], dh_desc_mn<SWZ, D>(sB, R, kk), 1);
            else dh_wgmma_rs<BF, 128, 0>(acc, af[kk], dh_desc_k<SWZ, D>(sB, R, 0, kk), 1);
        }
    } else {
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            if (mode & 1) dh_wgmma_ss<BF, 128, 1>(acc, dh_desc_k<SWZ, D>(sA, 64, 0, kk), dh_desc_mn<SWZ, D>(sB, R, kk), 1);
            else dh_wgmma_ss<BF, 128, 0>(acc, dh_desc_k<SWZ, D>(sA, 64, 0, kk), dh_desc_k<SWZ, D>(sB, R, 0, kk), 1);
        }
    }
    dh_wg_commit();
    dh_wg_wait<0>();
#pragma unroll
    for (int x = 0; x < 64; ++x) dh_fence_operand(acc[x]);
    dh_unit_store(acc, d);
}

#define DH_UNIT_KERNEL(NAME, BF, SWZ)                                                                        \
    extern "C" __global__ void __launch_bounds__(128, 1) NAME(const u16* __restrict__ a, const u16* __restrict__ b, \
                                                             float* __restrict__ d, int mode) {             \
        dh_unit_body<BF, SWZ>(a, b, d, mode);                                                                 \
    }
#if DH_IN_GROUP(8)
DH_UNIT_KERNEL(daaf_wgmma_unit_bf16_sw128, true, 1)
DH_UNIT_KERNEL(daaf_wgmma_unit_bf16_nosw, true, 0)
DH_UNIT_KERNEL(daaf_wgmma_unit_f16_sw128, false, 1)
#endif

// ------------------------------------------------------------------ mma.sync fallback (FlashAttention-2 layout)

template <int D, int ST>
struct DhFa2Cfg {
    static constexpr int BM = 128, BN = 64, NTH = 256, CPR = D / 8;
    static constexpr int LDS = D + 8;                  // padded shared row (elements): ldmatrix rows hit distinct banks
    static constexpr int ROWB = LDS * 2;
    static constexpr int TILE_BYTES = BN * ROWB;
    static constexpr int STAGE_BYTES = 2 * TILE_BYTES;
    static constexpr int OFF_Q = 0;                    // the Q tile, later the output tile
    static constexpr int OFF_KV = BM * ROWB;
    static constexpr int OFF_FLAG = OFF_KV + ST * STAGE_BYTES;
    static constexpr int SMEM_BYTES = OFF_FLAG + ((ST * BN + 15) / 16) * 16 + 16;
};

template <bool BF, int D, int ST>
__device__ __forceinline__ void dh_fa2_body(
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, u16* __restrict__ o,
    const int* __restrict__ gidx, const unsigned char* __restrict__ gmask,
    int B, int T, int H, int n_global, int W, float scale_log2, int sched)
{
    typedef DhFa2Cfg<D, ST> C;
    DH_EXPECT_SMEM(C::SMEM_BYTES);
    constexpr int BM = C::BM, BN = C::BN, NTH = C::NTH, CPR = C::CPR;
    constexpr u32 ROWB = C::ROWB;
    constexpr int KS = D / 16;   // k-steps of S = Q K^T
    constexpr int NDT = D / 8;   // 8-wide column tiles of O
    static_assert(ST >= 2, "two stages at least");
    static_assert((BN * CPR) % NTH == 0 && (BM * CPR) % NTH == 0, "tile loads divide evenly among the threads");

    const DhHead hd = dh_head_of<BM, D>(q, k, v, o, B, T, H, sched);
    const int t0 = hd.t0, t1 = hd.t1;
    const long long rs = hd.rs;
    const u16* const qb = hd.qb;
    const u16* const kb = hd.kb;
    const u16* const vb = hd.vb;
    u16* const ob = hd.ob;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;

    const int rw0 = t0 + 16 * warp;  // this warp's rows [rw0, rw1]
    const int rw1 = daaf_imin(rw0 + 15, t1);
    bool w_all_gq;
    const DhPlan p = dh_plan_of<BN>(gidx, n_global, t0, t1, W, rw0, rw1, w_all_gq);

    DH_DYNAMIC_SMEM(raw);
    const u32 sb = daaf_smem_addr(raw);
    const u32 sQ = sb + C::OFF_Q;
    unsigned char* const kflag = raw + C::OFF_FLAG;
    constexpr int RPI = NTH / CPR;  // rows per pass
    const int ld_r = tid / CPR, ld_c = tid % CPR;
    const u32 ld_off = ld_r * ROWB + ld_c * 16;

    auto issue_tile = [&](int i, int st) {
        const u32 dK = sb + C::OFF_KV + st * C::STAGE_BYTES + ld_off;
#pragma unroll
        for (int it = 0; it < BN / RPI; ++it) {
            const int r = it * RPI + ld_r;
            const int j = dh_key_of<BN>(p, gidx, i, r);
            const long long off = (long long)(j < 0 ? 0 : j) * rs + ld_c * 8;
            const int nb = j < 0 ? 0 : 16;
            daaf_cp_async16(dK + it * RPI * ROWB, kb + off, nb);
            daaf_cp_async16(dK + C::TILE_BYTES + it * RPI * ROWB, vb + off, nb);
            if (ld_c == 0) kflag[st * BN + r] = j < 0 ? (unsigned char)0 : gmask[j];
        }
    };

#pragma unroll
    for (int it = 0; it < BM / RPI; ++it) {
        const int t = t0 + it * RPI + ld_r;
        daaf_cp_async16(sQ + ld_off + it * RPI * ROWB, qb + (long long)(t <= t1 ? t : t0) * rs + ld_c * 8,
                        t <= t1 ? 16 : 0);
    }
    daaf_cp_async_commit();
#pragma unroll
    for (int s = 0; s < ST - 1; ++s) {
        if (s < p.n_tiles) issue_tile(s, s);
        daaf_cp_async_commit();
    }
    daaf_cp_async_wait<ST - 1>();  // the Q group
    __syncthreads();
    u32 qf[KS][4];
    {
        const u32 q_ld = sQ + (16 * warp + (lane & 15)) * ROWB + (lane >> 4) * 16;
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) daaf_ldsm_x4(q_ld + kk * 32, qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3]);
    }
    // per-lane parts of the ldmatrix addresses for K (plain) and V (transposed)
    const u32 k_ld = ((lane >> 4) * 8 + (lane & 7)) * ROWB + ((lane >> 3) & 1) * 16;
    const u32 v_ld = C::TILE_BYTES + ((lane & 7) + ((lane >> 3) & 1) * 8) * ROWB + (lane >> 4) * 16;

    int row[2];
    bool gq[2];
    float m_[2], l_[2];
    float acc[NDT][4];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        row[hh] = rw0 + g + 8 * hh;
        gq[hh] = row[hh] <= t1 && gmask[row[hh]] != 0;
        m_[hh] = DAAF_NEG_INF;
        l_[hh] = 0.f;
    }
#pragma unroll
    for (int n = 0; n < NDT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

    for (int i = 0; i < p.n_tiles; ++i) {
        const int st = i % ST;
        daaf_cp_async_wait<ST - 2>();  // tile i has landed (this thread's copies)
        __syncthreads();             // everyone's; everyone is done with tile i - 1
        if (i + ST - 1 < p.n_tiles) issue_tile(i + ST - 1, (i + ST - 1) % ST);
        daaf_cp_async_commit();
        const u32 cS = sb + C::OFF_KV + st * C::STAGE_BYTES;

        float s[8][4];
#pragma unroll
        for (int n = 0; n < 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
            for (int np = 0; np < 4; ++np) {
                u32 b0, b1, b2, b3;
                daaf_ldsm_x4(cS + k_ld + np * 16 * ROWB + kk * 32, b0, b1, b2, b3);
                daaf_mma<BF>(s[2 * np], qf[kk], b0, b1);
                daaf_mma<BF>(s[2 * np + 1], qf[kk], b2, b3);
            }
        }

        const DhKeyTile kt = dh_key_tile<BN>(p, i, rw0, rw1, w_all_gq, W);
        if (!kt.full) {
            const unsigned char* const fl = kflag + st * BN;
#pragma unroll
            for (int n = 0; n < 8; ++n) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = 8 * n + 2 * tq + e;
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        if (!dh_pair_allowed<BN>(p, kt, i, col, row[hh], gq[hh], W, fl))
                            s[n][2 * hh + e] = DAAF_NEG_INF;
                    }
                }
            }
        }

#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float mx = DAAF_NEG_INF;
#pragma unroll
            for (int n = 0; n < 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * hh], s[n][2 * hh + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mn = fmaxf(m_[hh], mx * scale_log2);
            const float bse = mn == DAAF_NEG_INF ? 0.f : mn;
            const float al = daaf_ex2(m_[hh] - bse);
            m_[hh] = mn;
            float ls = 0.f;
#pragma unroll
            for (int n = 0; n < 8; ++n) {
                s[n][2 * hh] = daaf_ex2(fmaf(s[n][2 * hh], scale_log2, -bse));
                s[n][2 * hh + 1] = daaf_ex2(fmaf(s[n][2 * hh + 1], scale_log2, -bse));
                ls += s[n][2 * hh] + s[n][2 * hh + 1];
            }
            l_[hh] = l_[hh] * al + ls;
#pragma unroll
            for (int n = 0; n < NDT; ++n) {
                acc[n][2 * hh] *= al;
                acc[n][2 * hh + 1] *= al;
            }
        }

#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            u32 a[4];
            a[0] = daaf_pack2<BF>(s[2 * kk][0], s[2 * kk][1]);
            a[1] = daaf_pack2<BF>(s[2 * kk][2], s[2 * kk][3]);
            a[2] = daaf_pack2<BF>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            a[3] = daaf_pack2<BF>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int dp = 0; dp < NDT / 2; ++dp) {
                u32 b0, b1, b2, b3;
                daaf_ldsm_x4_t(cS + v_ld + kk * 16 * ROWB + dp * 32, b0, b1, b2, b3);
                daaf_mma<BF>(acc[2 * dp], a, b0, b1);
                daaf_mma<BF>(acc[2 * dp + 1], a, b2, b3);
            }
        }
    }

    // epilogue: the warp's 16 rows into its rows of the Q buffer (only this warp read them), then
    // 16-byte stores; a warp-level exchange needs only __syncwarp
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        float l = l_[hh];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const int lr = 16 * warp + g + 8 * hh;
#pragma unroll
        for (int n = 0; n < NDT; ++n)
            *reinterpret_cast<u32*>(raw + C::OFF_Q + lr * ROWB + (8 * n + 2 * tq) * 2) =
                daaf_pack2<BF>(acc[n][2 * hh] * inv, acc[n][2 * hh + 1] * inv);
    }
    __syncwarp();
#pragma unroll
    for (int it = 0; it < 16 * CPR / 32; ++it) {
        const int idx = it * 32 + lane;
        const int lr = 16 * warp + idx / CPR, c = idx % CPR;
        const int t = t0 + lr;
        if (t <= t1)
            *reinterpret_cast<DaafVec16*>(ob + (long long)t * rs + c * 8) =
                *reinterpret_cast<const DaafVec16*>(raw + C::OFF_Q + lr * ROWB + c * 16);
    }
}

#define DH_FA2_KERNEL(NAME, BF, D, ST)                                                                         \
    extern "C" __global__ void __launch_bounds__(256, 1) NAME(                                                 \
        const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, u16* __restrict__ o,  \
        const int* __restrict__ gidx, const unsigned char* __restrict__ gmask, int B, int T, int H,            \
        int n_global, int W, float scale_log2, int sched) {                                                    \
        dh_fa2_body<BF, D, ST>(q, k, v, o, gidx, gmask, B, T, H, n_global, W, scale_log2, sched);              \
    }

// name: daaf_hfa2_{elem}_d{D}_s{ST}
#if DH_IN_GROUP(9)
DH_FA2_KERNEL(daaf_hfa2_bf16_d128_s3, true, 128, 3)
DH_FA2_KERNEL(daaf_hfa2_bf16_d128_s2, true, 128, 2)
#endif
#if DH_IN_GROUP(10)
DH_FA2_KERNEL(daaf_hfa2_f16_d128_s3, false, 128, 3)
DH_FA2_KERNEL(daaf_hfa2_bf16_d64_s3, true, 64, 3)
DH_FA2_KERNEL(daaf_hfa2_f16_d64_s3, false, 64, 3)
#endif
