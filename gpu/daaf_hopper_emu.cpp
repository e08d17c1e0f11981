// CPU build of gpu/daaf_hopper.cu for tests (gpu/daaf_emu.h + gpu/wgmma_emu.h):
//   g++ -std=c++20 -O2 -shared -fPIC -pthread gpu/daaf_hopper_emu.cpp -o daaf_hopper_emu.so
// The entry points launch the kernels as gpu/daaf_hopper.py does on the GPU and return the number
// of errors the emulation recorded (dh_emu_last_error() gives the first one), or -1 for an unknown
// kernel name.
#include <cstring>
#include <string>

#include "daaf_emu.h"
#include "wgmma_emu.h"
#include "daaf_hopper.cu"

typedef void (*DhAttnKernel)(const u16*, const u16*, const u16*, u16*, const int*, const unsigned char*, int, int,
                             int, int, int, float, int);

struct DhEntry {
    const char* name;
    DhAttnKernel fn;
    int threads, rows, smem;
};

#define DH_WG_ENTRY(NAME, D, BN, NWG, ST) {#NAME, NAME, 128 * NWG, 64 * NWG, DhWgCfg<D, BN, NWG, ST>::SMEM_BYTES}
#define DH_FA2_ENTRY(NAME, D, ST) {#NAME, NAME, 256, 128, DhFa2Cfg<D, ST>::SMEM_BYTES}

static const DhEntry dh_entries[] = {
    DH_WG_ENTRY(daaf_hwg_bf16_d128_n128_w2_s3, 128, 128, 2, 3),
    DH_WG_ENTRY(daaf_hwg_f16_d128_n128_w2_s3, 128, 128, 2, 3),
    DH_WG_ENTRY(daaf_hwg_bf16_d128_n64_w2_s4, 128, 64, 2, 4),
    DH_WG_ENTRY(daaf_hwg_bf16_d128_n64_w3_s3, 128, 64, 3, 3),
    DH_WG_ENTRY(daaf_hwg_bf16_d128_n128_w1_s3, 128, 128, 1, 3),
    DH_WG_ENTRY(daaf_hwg_bf16_d64_n128_w2_s3, 64, 128, 2, 3),
    DH_WG_ENTRY(daaf_hwg_f16_d64_n128_w2_s3, 64, 128, 2, 3),
    DH_WG_ENTRY(daaf_hwg_bf16_d128_n128_w2_s3_nosw, 128, 128, 2, 3),
    DH_FA2_ENTRY(daaf_hfa2_bf16_d128_s3, 128, 3),
    DH_FA2_ENTRY(daaf_hfa2_f16_d128_s3, 128, 3),
    DH_FA2_ENTRY(daaf_hfa2_bf16_d128_s2, 128, 2),
    DH_FA2_ENTRY(daaf_hfa2_bf16_d64_s3, 64, 3),
    DH_FA2_ENTRY(daaf_hfa2_f16_d64_s3, 64, 3),
};

extern "C" int dh_emu_smem_bytes(const char* name) {
    for (const DhEntry& e : dh_entries)
        if (std::strcmp(e.name, name) == 0) return e.smem;
    return -1;
}

extern "C" const char* dh_emu_last_error() { return dh_emu_error_text.c_str(); }

extern "C" int dh_emu_attention(const char* name, const u16* q, const u16* k, const u16* v, u16* o, const int* gidx,
                                const unsigned char* gmask, int B, int T, int H, int n_global, int W,
                                float scale_log2, int sched) {
    for (const DhEntry& e : dh_entries) {
        if (std::strcmp(e.name, name) != 0) continue;
        dh_emu_errors = 0;
        dh_emu_error_text.clear();
        const unsigned nqt = (unsigned)((T + e.rows - 1) / e.rows);
        dh_emu_launch(nqt * (unsigned)(H * B), (unsigned)e.threads, (size_t)e.smem,
                      [&] { e.fn(q, k, v, o, gidx, gmask, B, T, H, n_global, W, scale_log2, sched); });
        return dh_emu_errors.load();
    }
    return -1;
}

// the wgmma unit check: swz 1 (128-byte swizzle) or 0; bf 1 (bf16) or 0 (f16)
extern "C" int dh_emu_wgmma_unit(int bf, int swz, const u16* a, const u16* b, float* d, int mode) {
    dh_emu_errors = 0;
    dh_emu_error_text.clear();
    if (bf && swz) dh_emu_launch(1, 128, DH_UNIT_SMEM_BYTES, [&] { daaf_wgmma_unit_bf16_sw128(a, b, d, mode); });
    else if (bf) dh_emu_launch(1, 128, DH_UNIT_SMEM_BYTES, [&] { daaf_wgmma_unit_bf16_nosw(a, b, d, mode); });
    else if (swz) dh_emu_launch(1, 128, DH_UNIT_SMEM_BYTES, [&] { daaf_wgmma_unit_f16_sw128(a, b, d, mode); });
    else return -1;
    return dh_emu_errors.load();
}

// ---------------------------------------------------------------- self-test of the emulation's checks
// One warpgroup computes d[64][128] = a[64][128] b^T (b: [128][128], K-major, 128-byte swizzle) as the
// unit kernel does, with one planted fault: 0 none, 1 no fence.proxy.async after the copies, 2 B
// overwritten by cp.async while the wgmma is pending, 3 accumulator written while pending, 4 no
// wgmma.fence, 5 accumulators read before wait_group (the result is then wrong; no error is recorded).
static void dh_selftest_body(const u16* a, const u16* b, float* d, int fault) {
    constexpr int D = 128, CPR = 16;
    unsigned char* raw = dh_emu_dynamic_smem();
    const u32 sb = (dh_smem_addr(raw) + 1023u) & ~1023u;
    const u32 sA = sb, sB = sb + 64 * D * 2;
    const int tid = threadIdx.x, wq = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
    for (int idx = tid; idx < 64 * CPR; idx += 128)
        dh_cp_async16(sA + dh_chunk_off<1, D>(idx / CPR, idx % CPR, 64), a + (idx / CPR) * D + (idx % CPR) * 8, 16);
    for (int idx = tid; idx < 128 * CPR; idx += 128)
        dh_cp_async16(sB + dh_chunk_off<1, D>(idx / CPR, idx % CPR, 128), b + (idx / CPR) * D + (idx % CPR) * 8, 16);
    dh_cp_async_commit();
    dh_cp_async_wait<0>();
    if (fault != 1) dh_fence_proxy_async();
    __syncthreads();
    float acc[64];
    for (int x = 0; x < 64; ++x) acc[x] = 0.f;
    if (fault != 4) dh_wg_fence();
    for (int kk = 0; kk < 8; ++kk)
        dh_wgmma_ss<true, 128, 0>(acc, dh_desc_k<1, D>(sA, 64, 0, kk), dh_desc_k<1, D>(sB, 128, 0, kk), 1);
    dh_wg_commit();
    if (fault == 2) {  // refill B (with A's rows) while the wgmma may still read it
        __syncthreads();  // every thread has issued (so the fault is the refill, not a stale read at issue)
        for (int idx = tid; idx < 64 * CPR; idx += 128)
            dh_cp_async16(sB + dh_chunk_off<1, D>(idx / CPR, idx % CPR, 128), a + (idx / CPR) * D + (idx % CPR) * 8, 16);
        dh_cp_async_commit();
        dh_cp_async_wait<0>();
        dh_fence_proxy_async();
    }
    if (fault == 3) acc[5] += 1.f;
    float early[64];
    for (int x = 0; x < 64; ++x) early[x] = acc[x];
    dh_wg_wait<0>();
    for (int x = 0; x < 64; ++x) {
        const int m = 16 * wq + g + 8 * ((x >> 1) & 1), n = 8 * (x >> 2) + 2 * tq + (x & 1);
        d[m * 128 + n] = fault == 5 ? early[x] : acc[x];
    }
}

extern "C" int dh_emu_selftest(const u16* a, const u16* b, float* d, int fault) {
    dh_emu_errors = 0;
    dh_emu_error_text.clear();
    dh_emu_launch(1, 128, DH_UNIT_SMEM_BYTES, [&] { dh_selftest_body(a, b, d, fault); });
    return dh_emu_errors.load();
}
