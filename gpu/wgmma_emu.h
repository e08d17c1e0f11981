// CPU emulation of what gpu/daaf_hopper.cu needs beyond gpu/daaf_emu.h: the warpgroup MMA (wgmma)
// with shared-memory matrix descriptors, cp.async with proxy tracking, fence.proxy.async, named
// barriers, and a few warp intrinsics. Include after daaf_emu.h (which defines DAAF_EMU, the thread
// model -- each CUDA thread a std::thread, blocks one after another -- ldmatrix and mma.sync).
//
// Model of wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16} (PTX ISA, "Asynchronous Warpgroup
// Level Matrix Multiply-Accumulate"; the canonical layouts as CUTLASS cute/atom/mma_traits_sm90_gmma.hpp
// states them, in bytes):
//   descriptor: start address (bits 0-13, >> 4), leading byte offset LBO (16-29, >> 4), stride byte
//   offset SBO (32-45, >> 4), base offset (49-51; must be 0 here), layout (62-63: 0 interleave,
//   1 128-byte swizzle, 2 64-byte, 3 32-byte; SB = the swizzle width in bytes);
//   K-major element (mn, k), k < 16:
//     interleave: start + (mn%8) 16 + (mn/8) SBO + (k%8) 2 + (k/8) LBO
//     swizzled:   start + (mn%8) SB + (mn/8) SBO + 2k                  (LBO unused)
//   MN-major element (k, mn):
//     interleave: start + (mn%8) 2 + (mn/8) SBO + (k%8) 16 + (k/8) LBO
//     swizzled:   start + (mn % (SB/2)) 2 + (mn / (SB/2)) LBO + (k%8) SB + (k/8) SBO
//   the swizzle XORs address bits [4, 4+b) with bits [7, 7+b), b = 3, 2, 1 for 128, 64, 32 bytes,
//   on the shared-memory address itself (the emulated shared memory starts at address 0).
//   A from registers: warp w of the warpgroup holds rows 16w .. 16w+15 in the mma.m16n8k16 A layout;
//   accumulator value v of lane l of warp w: row 16w + l/4 + 8((v/2)%2), column 8(v/4) + 2(l%4) + v%2.
// Asynchrony: an issued wgmma is only recorded (operands read and snapshotted, accumulator
// snapshotted); commit_group closes a batch; wait_group N computes the retired batches in order
// and writes the accumulators then. So a kernel that reads accumulators before the wait sees stale
// values, as on the GPU. Errors recorded (dh_emu_errors, first message in dh_emu_error_text):
//   * a wgmma without a wgmma.fence since the thread's last wait_group (or start);
//   * an operand in shared memory written by cp.async (the generic proxy) without a later
//     fence.proxy.async by the writing thread;
//   * shared-memory operand bytes that changed between issue and retirement (a write racing the
//     asynchronous read), accumulator or A registers changed while their wgmma was pending;
//   * wgmma batches or cp.async copies still pending at kernel exit; base offset != 0.
#pragma once
#include <atomic>
#include <cmath>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#ifndef DAAF_EMU
#error "include gpu/daaf_emu.h first"
#endif

// ---------------------------------------------------------------- errors
inline std::atomic<int> dh_emu_errors{0};
inline std::mutex dh_emu_mu;
inline std::string dh_emu_error_text;
inline void dh_emu_error(const std::string& msg) {
    if (dh_emu_errors.fetch_add(1) == 0) {
        std::lock_guard<std::mutex> g(dh_emu_mu);
        dh_emu_error_text = msg + " (block " + std::to_string(blockIdx.x) + ", thread " +
                            std::to_string(threadIdx.x) + ")";
    }
}

// ---------------------------------------------------------------- block state
inline size_t dh_emu_smem_size = 0;
inline std::vector<std::atomic<int>>* dh_emu_owner = nullptr;  // per 16-byte chunk: unfenced writer or -1
inline std::map<int, std::barrier<>*> dh_emu_named;
inline unsigned char* dh_emu_dynamic_smem() { return daaf_emu_smem_base; }

inline void dh_emu_block_reset() {  // thread 0, before the block's first barrier
    delete dh_emu_owner;
    dh_emu_owner = new std::vector<std::atomic<int>>(dh_emu_smem_size / 16 + 1);
    for (auto& x : *dh_emu_owner) x.store(-1);
    for (auto& kv : dh_emu_named) delete kv.second;
    dh_emu_named.clear();
}

// ---------------------------------------------------------------- warp intrinsics
inline int __shfl_sync(unsigned, int x, int src) {
    DaafWarpX& w = daaf_warp();
    const int l = daaf_lane();
    w.w[l][0] = (u32)x;
    w.bar->arrive_and_wait();
    const int y = (int)w.w[src & 31][0];
    w.bar->arrive_and_wait();
    return y;
}
inline void __syncwarp(unsigned = 0xffffffffu) { daaf_warp().bar->arrive_and_wait(); }

inline void dh_bar_sync(int id, int nthreads) {
    std::barrier<>* b;
    {
        std::lock_guard<std::mutex> g(dh_emu_mu);
        auto it = dh_emu_named.find(id);
        if (it == dh_emu_named.end()) {
            b = new std::barrier<>((std::ptrdiff_t)nthreads);
            dh_emu_named[id] = b;
        } else {
            b = it->second;
        }
    }
    b->arrive_and_wait();
}

// ---------------------------------------------------------------- shared addresses, cp.async, proxy fence
inline u32 dh_smem_addr(const void* p) { return daaf_smem_addr(p); }

struct DhCopy {
    u32 dst;
    const void* src;
    int n;
};
inline thread_local std::vector<DhCopy> dh_emu_cp_open;
inline thread_local std::deque<std::vector<DhCopy>> dh_emu_cp_groups;
inline thread_local std::vector<u32> dh_emu_dirty;  // chunks this thread wrote since its last proxy fence

inline void dh_cp_async16(u32 dst, const void* src, int src_bytes) {
    if (dst % 16) dh_emu_error("cp.async destination not 16-byte aligned");
    if (dst + 16 > dh_emu_smem_size) dh_emu_error("cp.async destination beyond the dynamic shared memory");
    dh_emu_cp_open.push_back({dst, src, src_bytes});
}
inline void dh_cp_async_commit() {
    dh_emu_cp_groups.push_back(dh_emu_cp_open);
    dh_emu_cp_open.clear();
}
template <int N>
inline void dh_cp_async_wait() {
    while ((int)dh_emu_cp_groups.size() > N) {
        for (const DhCopy& c : dh_emu_cp_groups.front()) {
            unsigned char* d = daaf_emu_smem_base + c.dst;
            std::memset(d, 0, 16);
            std::memcpy(d, c.src, (size_t)c.n);
            (*dh_emu_owner)[c.dst / 16].store((int)threadIdx.x);
            dh_emu_dirty.push_back(c.dst / 16);
        }
        dh_emu_cp_groups.pop_front();
    }
}
inline void dh_fence_proxy_async() {
    for (u32 c : dh_emu_dirty) {
        int me = (int)threadIdx.x;
        (*dh_emu_owner)[c].compare_exchange_strong(me, -1);
    }
    dh_emu_dirty.clear();
}

// ---------------------------------------------------------------- ldmatrix, mma.sync, conversions (daaf_emu.h)
inline void dh_ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) { daaf_ldsm_x4(addr, r0, r1, r2, r3); }
inline void dh_ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) { daaf_ldsm_x4_t(addr, r0, r1, r2, r3); }
template <bool BF>
inline void dh_mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) { daaf_mma<BF>(c, a, b0, b1); }
template <bool BF>
inline u32 dh_pack2(float lo, float hi) { return daaf_pack2<BF>(lo, hi); }
inline float dh_ex2(float x) { return std::exp2(x); }
inline void dh_fence_operand(float&) {}
inline void dh_fence_operand(u32&) {}

// ---------------------------------------------------------------- wgmma
struct DhDesc {
    u32 start, lbo, sbo;
    int base_off, layout;
};
inline DhDesc dh_emu_decode(unsigned long long d) {
    DhDesc r;
    r.start = (u32)(d & 0x3FFFu) << 4;
    r.lbo = (u32)((d >> 16) & 0x3FFFu) << 4;
    r.sbo = (u32)((d >> 32) & 0x3FFFu) << 4;
    r.base_off = (int)((d >> 49) & 7u);
    r.layout = (int)((d >> 62) & 3u);
    return r;
}
inline u32 dh_emu_swizzle(u32 a, int layout) {
    const int b = layout == 1 ? 3 : layout == 2 ? 2 : layout == 3 ? 1 : 0;
    return a ^ (((a >> 7) & ((1u << b) - 1u)) << 4);
}
inline int dh_emu_width(int layout) { return layout == 1 ? 128 : layout == 2 ? 64 : 32; }
// byte address of element (mn, k) of a K-major operand, k < 16
inline u32 dh_emu_addr_k(const DhDesc& d, int mn, int k) {
    if (d.layout == 0) return d.start + (mn % 8) * 16 + (mn / 8) * d.sbo + (k % 8) * 2 + (k / 8) * d.lbo;
    return dh_emu_swizzle(d.start + (mn % 8) * dh_emu_width(d.layout) + (mn / 8) * d.sbo + 2 * k, d.layout);
}
// byte address of element (k, mn) of an MN-major operand, k < 16
inline u32 dh_emu_addr_mn(const DhDesc& d, int k, int mn) {
    if (d.layout == 0) return d.start + (mn % 8) * 2 + (mn / 8) * d.sbo + (k % 8) * 16 + (k / 8) * d.lbo;
    const int sb = dh_emu_width(d.layout), e = sb / 2;
    return dh_emu_swizzle(d.start + (mn % e) * 2 + (mn / e) * d.lbo + (k % 8) * sb + (k / 8) * d.sbo, d.layout);
}

template <bool BF>
inline float dh_emu_smem16(u32 addr, bool check_fence) {
    if (addr + 2 > dh_emu_smem_size) {
        dh_emu_error("wgmma operand beyond the dynamic shared memory");
        return 0.f;
    }
    if (check_fence && (*dh_emu_owner)[addr / 16].load() >= 0)
        dh_emu_error("wgmma reads shared memory written through the generic proxy without fence.proxy.async");
    u16 h;
    std::memcpy(&h, daaf_emu_smem_base + addr, 2);
    return BF ? __uint_as_float(((u32)h) << 16) : daaf_f16_to_f32(h);
}

struct DhWgOp {
    float* d;
    int n;          // N of the instruction
    int scale_d;
    bool bf;
    int kind;       // 0: A and B from shared memory, 1: A from registers
    int tnsp_b;
    unsigned long long da, db;
    const u32* ap;  // the A registers of this thread (kind 1)
    u32 aval[4];
    float a[2][16];               // this thread's two A rows
    std::vector<float> b;         // [16][N/4]: B columns of this thread's accumulators
    std::vector<float> snap;      // accumulator at issue (updated when an earlier wgmma on it retires)
    std::vector<float> orig;      // accumulator at issue
};
inline thread_local std::vector<DhWgOp> dh_emu_wg_open;
inline thread_local std::deque<std::vector<DhWgOp>> dh_emu_wg_groups;
inline thread_local bool dh_emu_wg_fenced = false;

// operand reads of op (at issue: check the proxy fence; at retirement: compare)
template <bool BF>
inline void dh_emu_read_operands(DhWgOp& op, bool at_issue, std::vector<float>* bout, float (*aout)[16]) {
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const DhDesc db = dh_emu_decode(op.db);
    if (db.base_off) dh_emu_error("wgmma descriptor base offset != 0 is not modelled");
    const int nc = op.n / 4;
    bout->assign(16 * nc, 0.f);
    for (int k = 0; k < 16; ++k) {
        for (int c = 0; c < nc; ++c) {
            const int n = 8 * (c >> 1) + 2 * tq + (c & 1);
            const u32 addr = op.tnsp_b ? dh_emu_addr_mn(db, k, n) : dh_emu_addr_k(db, n, k);
            (*bout)[k * nc + c] = dh_emu_smem16<BF>(addr, at_issue);
        }
    }
    if (op.kind == 0) {
        const DhDesc da = dh_emu_decode(op.da);
        if (da.base_off) dh_emu_error("wgmma descriptor base offset != 0 is not modelled");
        for (int hh = 0; hh < 2; ++hh)
            for (int k = 0; k < 16; ++k) aout[hh][k] = dh_emu_smem16<BF>(dh_emu_addr_k(da, 16 * warp + g + 8 * hh, k), at_issue);
    }
}

template <bool BF, int N>
inline void dh_emu_wgmma_issue(float* d, int kind, int tnsp_b, unsigned long long da, const u32* a,
                               unsigned long long db, int scale_d) {
    if (!dh_emu_wg_fenced) dh_emu_error("wgmma without wgmma.fence since the last wait_group");
    DhWgOp op;
    op.d = d;
    op.n = N;
    op.scale_d = scale_d;
    op.bf = BF;
    op.kind = kind;
    op.tnsp_b = tnsp_b;
    op.da = da;
    op.db = db;
    op.ap = a;
    const int lane = threadIdx.x & 31, g = lane >> 2;
    if (kind == 1) {  // the warp's A fragments: rows g (regs 0, 2) and g + 8 (regs 1, 3) of lanes 4g .. 4g+3
        DaafWarpX& w = daaf_warp();
        for (int r = 0; r < 4; ++r) {
            w.w[lane][r] = a[r];
            op.aval[r] = a[r];
        }
        w.bar->arrive_and_wait();
        for (int hh = 0; hh < 2; ++hh) {
            for (int k = 0; k < 16; ++k) {
                const u32 reg = w.w[g * 4 + (k % 8) / 2][hh + 2 * (k >= 8)];
                op.a[hh][k] = daaf_emu_half<BF>(reg, k % 2);
            }
        }
        w.bar->arrive_and_wait();
    }
    dh_emu_read_operands<BF>(op, true, &op.b, op.a);
    op.snap.assign(d, d + N / 2);
    op.orig = op.snap;
    auto same_acc = [&](const DhWgOp& x) {
        if (x.d == d && std::memcmp(x.orig.data(), d, sizeof(float) * (N / 2)) != 0)
            dh_emu_error("accumulator registers written while an earlier wgmma on them was pending");
    };
    for (const auto& x : dh_emu_wg_open) same_acc(x);
    for (const auto& grp : dh_emu_wg_groups)
        for (const auto& x : grp) same_acc(x);
    dh_emu_wg_open.push_back(std::move(op));
}

inline void dh_emu_retire(DhWgOp& op) {
    const int nv = op.n / 2, nc = op.n / 4, tq = threadIdx.x & 3;
    if (std::memcmp(op.snap.data(), op.d, sizeof(float) * nv) != 0)
        dh_emu_error("accumulator registers changed while their wgmma was pending (read/write before wait_group)");
    if (op.kind == 1)
        for (int r = 0; r < 4; ++r)
            if (op.ap[r] != op.aval[r]) dh_emu_error("A registers changed while their wgmma was pending");
    std::vector<float> b2;
    float a2[2][16];
    std::memcpy(a2, op.a, sizeof a2);
    if (op.bf) dh_emu_read_operands<true>(op, false, &b2, a2);
    else dh_emu_read_operands<false>(op, false, &b2, a2);
    if (b2 != op.b || std::memcmp(a2, op.a, sizeof a2) != 0)
        dh_emu_error("shared-memory operand of a pending wgmma was overwritten before wait_group");
    (void)tq;
    std::vector<float> res(nv);
    for (int x = 0; x < nv; ++x) {
        const int hh = (x >> 1) & 1, c = 2 * (x >> 2) + (x & 1);
        float acc = op.scale_d ? op.snap[x] : 0.f;
        for (int k = 0; k < 16; ++k) acc += op.a[hh][k] * op.b[k * nc + c];
        res[x] = acc;
    }
    std::memcpy(op.d, res.data(), sizeof(float) * nv);
    auto chain = [&](DhWgOp& y) {
        if (&y != &op && y.d == op.d) y.snap = res;
    };
    for (auto& y : dh_emu_wg_open) chain(y);
    for (auto& grp : dh_emu_wg_groups)
        for (auto& y : grp) chain(y);
}

inline void dh_wg_fence() { dh_emu_wg_fenced = true; }
inline void dh_wg_commit() {
    dh_emu_wg_groups.push_back(std::move(dh_emu_wg_open));
    dh_emu_wg_open.clear();
}
template <int N>
inline void dh_wg_wait() {
    while ((int)dh_emu_wg_groups.size() > N) {
        for (auto& op : dh_emu_wg_groups.front()) dh_emu_retire(op);
        dh_emu_wg_groups.pop_front();
    }
    dh_emu_wg_fenced = false;
}

template <bool BF, int N>
struct DhWgmmaSS {
    template <int TB>
    static void run(float (&d)[N / 2], unsigned long long da, unsigned long long db, int scale_d) {
        dh_emu_wgmma_issue<BF, N>(d, 0, TB, da, nullptr, db, scale_d);
    }
};
template <bool BF, int N>
struct DhWgmmaRS {
    template <int TB>
    static void run(float (&d)[N / 2], const u32 (&a)[4], unsigned long long db, int scale_d) {
        dh_emu_wgmma_issue<BF, N>(d, 1, TB, 0, a, db, scale_d);
    }
};

// ---------------------------------------------------------------- launch
inline void dh_emu_thread_start() {
    dh_emu_cp_open.clear();
    dh_emu_cp_groups.clear();
    dh_emu_dirty.clear();
    dh_emu_wg_open.clear();
    dh_emu_wg_groups.clear();
    dh_emu_wg_fenced = false;
}
inline void dh_emu_thread_end() {
    if (!dh_emu_wg_open.empty() || !dh_emu_wg_groups.empty()) dh_emu_error("wgmma still pending at kernel exit");
    bool copies = !dh_emu_cp_open.empty();
    for (const auto& grp : dh_emu_cp_groups) copies |= !grp.empty();
    if (copies) dh_emu_error("cp.async copies still pending at kernel exit");
}

// launch `body` (the kernel call) on a 1-D grid of 1-D blocks with `smem` bytes of dynamic shared memory
template <typename F>
inline void dh_emu_launch(unsigned grid, unsigned block, size_t smem, F&& body) {
    dh_emu_smem_size = smem;
    daaf_emu_launch(daaf_dim3{grid, 1, 1}, daaf_dim3{block, 1, 1}, smem, [&] {
        if (threadIdx.x == 0) dh_emu_block_reset();
        dh_emu_thread_start();
        __syncthreads();
        body();
        dh_emu_thread_end();
    });
}
