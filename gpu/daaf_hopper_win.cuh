// The window-only wgmma kernel of gpu/daaf_hopper.cu (daaf_hwin_*), included by that file after its layouts
// and descriptors: plans without key regions (n_global == 0) and a window W <= DH_WIN_WMAX.
//
// Query t sees keys t - W .. t. A CTA of NWG warpgroups owns BM = 64 NWG query rows [t0, t0 + BM) and loads,
// in one go, Q and the band of NB = BM + 128 keys [t0 - 128, t0 + BM) (K, then V: two cp.async groups, no
// ring: every byte is in flight at once). Warpgroup w (rows t0 + 64 w ..) computes S over its 192 keys
// [t0 + 64 w - 128, t0 + 64 w + 64) with one wgmma.m64n192k16 batch, masks, takes an exact softmax (a single
// key block: no online rescaling), and O = P V with P from registers. NWG = 1: 115712 bytes of shared memory,
// two CTAs per SM (one computes while the other's loads are in flight); NWG = 2: the band is shared by two
// warpgroups (256 keys for 128 rows: fewer bytes from L2 per row), one CTA per SM.
#pragma once

#define DH_WIN_WMAX 128

template <int D, int NWG>
struct DhWinCfg {
    static constexpr int BM = 64 * NWG;
    static constexpr int NTH = 128 * NWG;
    static constexpr int NB = BM + DH_WIN_WMAX;  // band keys
    static constexpr int NK = 64 + DH_WIN_WMAX;  // keys per warpgroup (the N of its S product)
    static constexpr int CPR = D / 8;
    static constexpr int Q_BYTES = BM * D * 2;
    static constexpr int BAND_BYTES = NB * D * 2;
    static constexpr int OFF_Q = 0;
    static constexpr int OFF_K = Q_BYTES;
    static constexpr int OFF_V = OFF_K + BAND_BYTES;
    static constexpr int SMEM_BYTES = OFF_V + BAND_BYTES + 1024;  // + alignment slack
};

template <bool BF, int D, int NWG>
__device__ __forceinline__ void dh_win_body(
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, u16* __restrict__ o,
    int B, int T, int H, int W, float scale_log2, int sched)
{
    typedef DhWinCfg<D, NWG> C;
    DH_EXPECT_SMEM(C::SMEM_BYTES);
    constexpr int BM = C::BM, NTH = C::NTH, NB = C::NB, NK = C::NK, CPR = C::CPR;
    constexpr int NS = NK / 2;   // S accumulators per thread (96)
    constexpr int NO = D / 2;    // O accumulators per thread
    constexpr int KQ = D / 16;   // k-steps of S = Q K^T
    constexpr int KP = NK / 16;  // k-steps of O = P V (12)
    static_assert(D == 64 || D == 128, "D in {64, 128}");
    static_assert((BM * CPR) % NTH == 0 && (NB * CPR) % NTH == 0, "tile loads divide among the threads");

    const DhHead hd = dh_head_of<BM, D>(q, k, v, o, B, T, H, sched);
    const int t0 = hd.t0, t1 = hd.t1;
    const long long rs = hd.rs;
    const int kb0 = t0 - DH_WIN_WMAX;  // key of band row 0 (negative rows: zeros, masked)
    const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127, wq = (tid >> 5) & 3;
    const int lane = tid & 31, g = lane >> 2, tq = lane & 3;

    DH_DYNAMIC_SMEM(raw);
    const u32 sraw = daaf_smem_addr(raw);
    const u32 sb = (sraw + 1023u) & ~1023u;
    unsigned char* const pb = raw + (sb - sraw);
    const u32 sQ = sb + C::OFF_Q, sK = sb + C::OFF_K, sV = sb + C::OFF_V;

    // group 0: Q and the K band; group 1: the V band
#pragma unroll
    for (int it = 0; it < BM * CPR / NTH; ++it) {
        const int idx = it * NTH + tid, r = idx / CPR, c = idx % CPR;
        const int t = t0 + r;
        daaf_cp_async16(sQ + dh_chunk_off<1, D>(r, c, BM), hd.qb + (long long)(t <= t1 ? t : t0) * rs + c * 8,
                        t <= t1 ? 16 : 0);
    }
#pragma unroll 4
    for (int it = 0; it < NB * CPR / NTH; ++it) {
        const int idx = it * NTH + tid, r = idx / CPR, c = idx % CPR;
        const int j = kb0 + r;
        const bool ok = j >= 0 && j <= t1;
        daaf_cp_async16(sK + dh_chunk_off<1, D>(r, c, NB), hd.kb + (long long)(ok ? j : 0) * rs + c * 8, ok ? 16 : 0);
    }
    daaf_cp_async_commit();
#pragma unroll 4
    for (int it = 0; it < NB * CPR / NTH; ++it) {
        const int idx = it * NTH + tid, r = idx / CPR, c = idx % CPR;
        const int j = kb0 + r;
        const bool ok = j >= 0 && j <= t1;
        daaf_cp_async16(sV + dh_chunk_off<1, D>(r, c, NB), hd.vb + (long long)(ok ? j : 0) * rs + c * 8, ok ? 16 : 0);
    }
    daaf_cp_async_commit();

    // this thread's rows (padding rows beyond t1 compute row t1's values, never stored)
    int row[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) row[hh] = daaf_imin(t0 + 64 * wg + 16 * wq + g + 8 * hh, t1);
    const int kw0 = kb0 + 64 * wg;  // key of this warpgroup's S column 0

    float S[NS], O[NO];
    u32 P[KP][4];
#pragma unroll
    for (int x = 0; x < NS; ++x) S[x] = 0.f;
#pragma unroll
    for (int x = 0; x < NO; ++x) O[x] = 0.f;

    daaf_cp_async_wait<1>();  // Q and K of this thread
    dh_fence_proxy_async();
    __syncthreads();          // everyone's
#pragma unroll
    for (int x = 0; x < NS; ++x) dh_fence_operand(S[x]);
    dh_wg_fence();
#pragma unroll
    for (int kk = 0; kk < KQ; ++kk)
        dh_wgmma_ss<BF, NK, 0>(S, dh_desc_k<1, D>(sQ, BM, 64 * wg, kk), dh_desc_k<1, D>(sK, NB, 64 * wg, kk),
                               kk > 0 ? 1 : 0);
    dh_wg_commit();
    dh_wg_wait<0>();
#pragma unroll
    for (int x = 0; x < NS; ++x) dh_fence_operand(S[x]);

    // mask (j in [row - W, row]) and the softmax of the whole band, base 2, the scale folded into the FFMA
    float inv[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int r = row[hh];
        float mx = DAAF_NEG_INF;
#pragma unroll
        for (int x = 0; x < NS; ++x) {
            if (((x >> 1) & 1) != hh) continue;
            const int j = kw0 + 8 * (x >> 2) + 2 * tq + (x & 1);
            if (j < 0 || j > r || r - j > W) S[x] = DAAF_NEG_INF;
            mx = fmaxf(mx, S[x]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float bse = mx * scale_log2;  // finite: key `row` is always allowed
        float ls = 0.f;
#pragma unroll
        for (int x = 0; x < NS; ++x) {
            if (((x >> 1) & 1) != hh) continue;
            S[x] = daaf_ex2(fmaf(S[x], scale_log2, -bse));
            ls += S[x];
        }
        ls += __shfl_xor_sync(0xffffffffu, ls, 1);
        ls += __shfl_xor_sync(0xffffffffu, ls, 2);
        inv[hh] = 1.f / ls;
    }
#pragma unroll
    for (int kk = 0; kk < KP; ++kk) {
#pragma unroll
        for (int r = 0; r < 4; ++r) P[kk][r] = daaf_pack2<BF>(S[8 * kk + 2 * r], S[8 * kk + 2 * r + 1]);
    }

    daaf_cp_async_wait<0>();  // V
    dh_fence_proxy_async();
    __syncthreads();
#pragma unroll
    for (int x = 0; x < NO; ++x) dh_fence_operand(O[x]);
#pragma unroll
    for (int x = 0; x < KP; ++x) {
        dh_fence_operand(P[x][0]);
        dh_fence_operand(P[x][1]);
        dh_fence_operand(P[x][2]);
        dh_fence_operand(P[x][3]);
    }
    dh_wg_fence();
#pragma unroll
    for (int kk = 0; kk < KP; ++kk)
        dh_wgmma_rs<BF, D, 1>(O, P[kk], dh_desc_mn<1, D>(sV + 64 * wg * 128, NB, kk), kk > 0 ? 1 : 0);
    dh_wg_commit();
    dh_wg_wait<0>();
#pragma unroll
    for (int x = 0; x < NO; ++x) dh_fence_operand(O[x]);

    // epilogue: this warpgroup's 64 rows into its rows of the Q buffer (only its S product read them, and it
    // has retired), then 16-byte coalesced stores
#pragma unroll
    for (int x = 0; x < NO; x += 2) {
        const int hh = (x >> 1) & 1;
        const int lr = 64 * wg + 16 * wq + g + 8 * hh;
        *reinterpret_cast<u32*>(pb + C::OFF_Q + dh_chunk_off<1, D>(lr, x >> 2, BM) + 4 * tq) =
            daaf_pack2<BF>(O[x] * inv[hh], O[x + 1] * inv[hh]);
    }
    if constexpr (NWG == 1) dh_bar_sync(1, 128);  // a constant id: ptxas then reserves 2 barriers, not 16
    else dh_bar_sync(1 + wg, 128);
#pragma unroll
    for (int it = 0; it < 64 * CPR / 128; ++it) {
        const int idx = it * 128 + wtid;
        const int lr = 64 * wg + idx / CPR, c = idx % CPR;
        const int t = t0 + lr;
        if (t <= t1)
            *reinterpret_cast<DaafVec16*>(hd.ob + (long long)t * rs + c * 8) =
                *reinterpret_cast<const DaafVec16*>(pb + C::OFF_Q + dh_chunk_off<1, D>(lr, c, BM));
    }
}
