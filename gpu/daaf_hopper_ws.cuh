// The warp-specialised wgmma kernel of gpu/daaf_hopper.cu (daaf_hws_*), included by that file after its tile
// rules (dh_plan_of, dh_key_of, dh_key_tile, dh_pair_allowed), layouts and descriptors (FlashAttention-3's
// structure on the DAAF tile rule):
//
//   * CTA = 1 producer warpgroup + NC consumer warpgroups (64 query rows each, BM = 64 NC rows).
//     setmaxnreg moves registers from the producer (DhWsCfg::REG_PRODUCER) to the consumers (REG_CONSUMER).
//   * Producer: every K/V tile of the CTA's key list (the gathered key-region rows by index from gidx, or a
//     contiguous range) by cp.async into two rings of ST slots, one for K and one for V; each slot completes
//     on its own "full" mbarrier (cp.async.mbarrier.arrive.noinc: the barrier counts each producer thread once
//     its copies landed) and is refilled after its "empty" mbarrier says every consumer is done with it. K(i)
//     is done when S(i) retires, V(i) only when P(i) V(i) does, an iteration later: with separate rings the
//     next K tiles load about two iterations ahead of their use instead of one. A gathered tile whose
//     key-region keys are one run (the usual case: regions are runs of tokens) takes its keys from the run's
//     first index, without a gidx load per row. No CTA-wide barrier after the start: warpgroups drift apart.
//   * Consumers: Q (their 64 rows) by their own cp.async; then per key tile the hwg loop: S(i) = Q K(i)^T and
//     O += P(i-1) V(i-1) issued together, the softmax of tile i while P V runs; K(i) released once S(i)
//     retired, V(i-1) once P(i-1) V(i-1) retired. Each consumer fences the proxies after its mbarrier waits
//     (the copies are generic-proxy writes the tensor cores read). The per-element mask reads the key-region
//     flags from gmask (only partial tiles need them).
//   * PP (ping-pong, FlashAttention-3's scheduler barrier): the consumer warpgroups issue their wgmma batches
//     in turn (named barrier 1 + c, passed round robin), so that one warpgroup's softmax runs while the
//     tensor cores work on the other's products.
#pragma once

template <int D, int BN, int NC, int ST>
struct DhWsCfg {
    static constexpr int BM = 64 * NC;          // query rows per CTA
    static constexpr int NTH = 128 * (NC + 1);  // producer warpgroup + consumers
    static constexpr int CPR = D / 8;           // 16-byte chunks per row
    static constexpr int Q_BYTES = BM * D * 2;
    static constexpr int TILE_BYTES = BN * D * 2;
    static constexpr int STAGE_BYTES = 2 * TILE_BYTES;  // K and V
    static constexpr int OFF_Q = 0;
    static constexpr int OFF_KV = Q_BYTES;
    static constexpr int OFF_BAR = OFF_KV + ST * STAGE_BYTES;  // mbarriers: K full, V full, K empty, V empty [ST]
    static constexpr int SMEM_BYTES = OFF_BAR + 4 * ST * 8 + 1024;  // + alignment slack
    // registers per thread: the cap at entry (ptxas: 65536 / NTH, a multiple of 8), then setmaxnreg moves
    // them from the producer to the consumers; an increase comes only from what the CTA's decreases released
    // (else setmaxnreg.inc waits forever). NC = 2: 168 -> 40 / 232 (FlashAttention-3: 24 / 240, but a 24- or
    // 32-register producer spills here); NC = 3: 128 -> 32 / 160.
    static constexpr int REG_CAP = 65536 / NTH / 8 * 8;
    static constexpr int REG_PRODUCER = NC == 2 ? 40 : 32;
    static constexpr int REG_CONSUMER = NC == 2 ? 232 : 160;
    static_assert(128 * (REG_CAP - REG_PRODUCER) >= 128 * NC * (REG_CONSUMER - REG_CAP), "setmaxnreg pool");
};

template <bool BF, int D, int BN, int NC, int ST, bool PP>
__device__ __forceinline__ void dh_ws_body(
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, u16* __restrict__ o,
    const int* __restrict__ gidx, const unsigned char* __restrict__ gmask,
    int B, int T, int H, int n_global, int W, float scale_log2, int sched)
{
    typedef DhWsCfg<D, BN, NC, ST> C;
    DH_EXPECT_SMEM(C::SMEM_BYTES);
    constexpr int BM = C::BM, CPR = C::CPR;
    constexpr int NS = BN / 2;   // S accumulators per thread
    constexpr int NO = D / 2;    // O accumulators per thread
    constexpr int KQ = D / 16;   // k-steps of S = Q K^T
    constexpr int KP = BN / 16;  // k-steps of O += P V
    static_assert(NC == 2 || NC == 3, "2 or 3 consumer warpgroups");
    static_assert(ST >= 2, "two stages at least");
    static_assert(D == 64 || D == 128, "D in {64, 128}");
    static_assert(BN == 64 || BN == 128, "BN in {64, 128}");
    static_assert((BN * CPR) % 128 == 0 && (64 * CPR) % 128 == 0, "tile loads divide among 128 threads");

    const DhHead hd = dh_head_of<BM, D>(q, k, v, o, B, T, H, sched);
    const int t0 = hd.t0, t1 = hd.t1;
    const long long rs = hd.rs;
    const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127;

    DH_DYNAMIC_SMEM(raw);
    const u32 sraw = daaf_smem_addr(raw);
    const u32 sb = (sraw + 1023u) & ~1023u;
    unsigned char* const pb = raw + (sb - sraw);
    const u32 sQ = sb + C::OFF_Q;
    const u32 bars = sb + C::OFF_BAR;
    auto full_k = [&](int s) { return bars + 8u * (u32)s; };
    auto full_v = [&](int s) { return bars + 8u * (u32)(ST + s); };
    auto empty_k = [&](int s) { return bars + 8u * (u32)(2 * ST + s); };
    auto empty_v = [&](int s) { return bars + 8u * (u32)(3 * ST + s); };
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < ST; ++s) {
            dh_mbar_init(full_k(s), 128);
            dh_mbar_init(full_v(s), 128);
            dh_mbar_init(empty_k(s), 128 * NC);
            dh_mbar_init(empty_v(s), 128 * NC);
        }
        dh_mbar_init_fence();
    }
    __syncthreads();  // the barriers are initialised; the last CTA-wide barrier of the kernel

    if (wg == 0) {
        // ------------------------------------------------ producer warpgroup: K/V tiles into the ring
        dh_setmaxnreg_dec<C::REG_PRODUCER>();
        bool unused;
        const DhPlan p = dh_plan_of<BN>(gidx, n_global, t0, t1, W, t0, t1, unused);
        const u16* const kb = hd.kb;
        const u16* const vb = hd.vb;
        for (int i = 0; i < p.n_tiles; ++i) {
            const int s = i % ST, u = i / ST;
            // the keys of tile i: row r is key run0 + r when run0 >= 0 (a contiguous range, or a gathered
            // tile whose key-region keys are one run), else gidx[i BN + r]; n_keys rows (the rest: zeros)
            int run0 = -1, n_keys = BN;
            if (i < p.n_pre_tiles) {
                const int x0 = i * BN;
                n_keys = daaf_imin(BN, p.n_pre - x0);
                const int first = gidx[x0];
                if (gidx[x0 + n_keys - 1] - first == n_keys - 1) run0 = first;
            } else {
                run0 = p.any_gq ? i * BN : p.ks + (i - p.n_pre_tiles) * BN;
                n_keys = daaf_imin(BN, p.t1 - run0 + 1);
            }
            auto key = [&](int r) { return r >= n_keys ? -1 : run0 >= 0 ? run0 + r : gidx[i * BN + r]; };
            if (u > 0) dh_mbar_wait(empty_k(s), (u32)((u - 1) & 1));  // every consumer is done with K(i - ST)
            const u32 dK = sb + C::OFF_KV + s * C::STAGE_BYTES;
#pragma unroll 2  // (4 needs more than the producer's 32 registers: ptxas spills)
            for (int it = 0; it < BN * CPR / 128; ++it) {
                const int idx = it * 128 + wtid, r = idx / CPR, c = idx % CPR;
                const int j = key(r);
                daaf_cp_async16(dK + dh_chunk_off<1, D>(r, c, BN), kb + (long long)(j < 0 ? 0 : j) * rs + c * 8,
                                j < 0 ? 0 : 16);
            }
            dh_cp_async_mbar_arrive(full_k(s));
            if (u > 0) dh_mbar_wait(empty_v(s), (u32)((u - 1) & 1));  // ... and with V(i - ST)
#pragma unroll 2
            for (int it = 0; it < BN * CPR / 128; ++it) {
                const int idx = it * 128 + wtid, r = idx / CPR, c = idx % CPR;
                const int j = key(r);
                daaf_cp_async16(dK + C::TILE_BYTES + dh_chunk_off<1, D>(r, c, BN),
                                vb + (long long)(j < 0 ? 0 : j) * rs + c * 8, j < 0 ? 0 : 16);
            }
            dh_cp_async_mbar_arrive(full_v(s));
        }
        // leave only once the last copies have landed (the V barrier of the last tile counts every producer
        // thread after all of its copies)
        const int last = p.n_tiles - 1;
        dh_mbar_wait(full_v(last % ST), (u32)((last / ST) & 1));
        return;
    }

    // ---------------------------------------------------- consumer warpgroup cw: 64 query rows
    dh_setmaxnreg_inc<C::REG_CONSUMER>();
    const int cw = wg - 1, wq = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, tq = lane & 3;
    const int rw0 = t0 + 64 * cw;
    const int rw1 = daaf_imin(rw0 + 63, t1);
    bool wg_all_gq;
    const DhPlan p = dh_plan_of<BN>(gidx, n_global, t0, t1, W, rw0, rw1, wg_all_gq);
    const int bar_own = 1 + NC + cw;  // this warpgroup's named barrier (ping-pong: 1 + c)

    // Q: this warpgroup's rows (its own cp.async group), landed and visible to the tensor cores
#pragma unroll
    for (int it = 0; it < 64 * CPR / 128; ++it) {
        const int idx = it * 128 + wtid, r = idx / CPR, c = idx % CPR;
        const int t = rw0 + r;
        daaf_cp_async16(sQ + dh_chunk_off<1, D>(64 * cw + r, c, BM), hd.qb + (long long)(t <= t1 ? t : t0) * rs + c * 8,
                        t <= t1 ? 16 : 0);
    }
    daaf_cp_async_commit();
    daaf_cp_async_wait<0>();
    dh_fence_proxy_async();
    dh_bar_sync(bar_own, 128);

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
    // the turn of this warpgroup to issue wgmma batches (ping-pong); the first warpgroup holds it first
    auto turn_begin = [&] {
        if constexpr (PP) dh_bar_sync(1 + cw, 256);
    };
    auto turn_end = [&](bool last) {  // the last turn of the last warpgroup passes nothing on (no one waits)
        if constexpr (PP) {
            if (!(last && cw == NC - 1)) dh_bar_arrive(1 + (cw + 1) % NC, 256);
        }
    };
    if constexpr (PP) {
        if (cw == 0) dh_bar_arrive(1, 256);
    }
    auto wait_k = [&](int i) { dh_mbar_wait(full_k(i % ST), (u32)((i / ST) & 1)); };
    auto wait_v = [&](int i) { dh_mbar_wait(full_v(i % ST), (u32)((i / ST) & 1)); };
    auto release_k = [&](int i) { dh_mbar_arrive(empty_k(i % ST)); };
    auto release_v = [&](int i) { dh_mbar_arrive(empty_v(i % ST)); };
    auto issue_s = [&](int i) {  // S = Q K(i)^T (one batch)
        const u32 sK = sb + C::OFF_KV + (i % ST) * C::STAGE_BYTES;
#pragma unroll
        for (int kk = 0; kk < KQ; ++kk)
            dh_wgmma_ss<BF, BN, 0>(S, dh_desc_k<1, D>(sQ, BM, 64 * cw, kk), dh_desc_k<1, D>(sK, BN, 0, kk),
                                   kk > 0 ? 1 : 0);
        dh_wg_commit();
    };
    auto issue_pv = [&](int i) {  // O += P(i) V(i) (one batch)
        const u32 sV = sb + C::OFF_KV + (i % ST) * C::STAGE_BYTES + C::TILE_BYTES;
#pragma unroll
        for (int kk = 0; kk < KP; ++kk) dh_wgmma_rs<BF, D, 1>(O, P[kk], dh_desc_mn<1, D>(sV, BN, kk), 1);
        dh_wg_commit();
    };
    // mask where some pair of tile i may be excluded for some row of this warpgroup (key-region flags from
    // gmask), then the online softmax in base 2: S becomes P (fp32)
    auto softmax = [&](int i, float (&alpha)[2]) {
        const DhKeyTile kt = dh_key_tile<BN>(p, i, rw0, rw1, wg_all_gq, W);
        if (!kt.full) {
            const unsigned char* const fl = gmask + kt.kt0;  // read only for local keys j = kt0 + col <= row
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
    wait_k(0);
    dh_fence_proxy_async();
    pin_s();
    turn_begin();
    dh_wg_fence();
    issue_s(0);
    turn_end(false);
    dh_wg_wait<0>();
    pin_s();
    release_k(0);
    softmax(0, alpha);
    pack_p();
    // tiles 1 ..: S(i) and P(i-1) V(i-1) in flight together; the softmax of tile i overlaps P V
    for (int i = 1; i < p.n_tiles; ++i) {
        wait_k(i);
        wait_v(i - 1);
        dh_fence_proxy_async();
        pin_s();
        pin_o();
        pin_p();
        turn_begin();
        dh_wg_fence();
        issue_s(i);
        issue_pv(i - 1);
        turn_end(false);
        dh_wg_wait<1>();  // S is ready (P V may still run): K(i) is free
        pin_s();
        release_k(i);
        softmax(i, alpha);
        dh_wg_wait<0>();  // P(i-1) V(i-1) is in O; the P registers and V(i-1) are free
        pin_o();
        pin_p();
        release_v(i - 1);
#pragma unroll
        for (int x = 0; x < NO; ++x) O[x] *= alpha[(x >> 1) & 1];
        pack_p();
    }
    // the last P V
    wait_v(p.n_tiles - 1);
    dh_fence_proxy_async();
    pin_o();
    pin_p();
    turn_begin();
    dh_wg_fence();
    issue_pv(p.n_tiles - 1);
    turn_end(true);
    dh_wg_wait<0>();
    pin_o();
    release_v(p.n_tiles - 1);

    // epilogue: normalise, stage this warpgroup's 64 rows in its part of the Q buffer (its own S products,
    // the only readers of those rows, have retired), 16-byte coalesced stores
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
        const int lr = 64 * cw + 16 * wq + g + 8 * hh;
        *reinterpret_cast<u32*>(pb + C::OFF_Q + dh_chunk_off<1, D>(lr, x >> 2, BM) + 4 * tq) =
            daaf_pack2<BF>(O[x] * inv[hh], O[x + 1] * inv[hh]);
    }
    dh_bar_sync(bar_own, 128);
#pragma unroll
    for (int it = 0; it < 64 * CPR / 128; ++it) {
        const int idx = it * 128 + wtid;
        const int lr = 64 * cw + idx / CPR, c = idx % CPR;
        const int t = t0 + lr;
        if (t <= t1)
            *reinterpret_cast<DaafVec16*>(hd.ob + (long long)t * rs + c * 8) =
                *reinterpret_cast<const DaafVec16*>(pb + C::OFF_Q + dh_chunk_off<1, D>(lr, c, BM));
    }
}
