// Planted-fault kernels for the CPU emulation's checks (gpu/emu/cuda_emu.h, wgmma_emu.h), appended to the source
// of gpu/daaf_hopper.cu by tests/test_daaf_hopper_emu.py (they use that file's layout helpers); emulation only.
//
// One warpgroup computes d[64][128] = a[64][128] b^T (b: [128][128], K-major, 128-byte swizzle) as the wgmma
// unit kernel does, with one fault: 0 none, 1 no fence.proxy.async after the copies, 2 B overwritten by
// cp.async while the wgmma is pending, 3 accumulator written while pending, 4 no wgmma.fence, 5 accumulators
// read before wait_group (the result is then wrong; no error is recorded, as on the GPU).
__global__ void daaf_wgmma_fault_check(const u16* a, const u16* b, float* d, int fault) {
    DH_EXPECT_SMEM(DH_UNIT_SMEM_BYTES);
    DH_DYNAMIC_SMEM(raw);
    const u32 sb = (daaf_smem_addr(raw) + 1023u) & ~1023u;
    const u32 sA = sb, sB = sb + 64 * 128 * 2;
    dh_unit_load<1>(a, b, sA, sB);
    if (fault != 1) dh_fence_proxy_async();
    __syncthreads();
    float acc[64];
    for (int x = 0; x < 64; ++x) acc[x] = 0.f;
    if (fault != 4) dh_wg_fence();
    for (int kk = 0; kk < 8; ++kk)
        dh_wgmma_ss<true, 128, 0>(acc, dh_desc_k<1, 128>(sA, 64, 0, kk), dh_desc_k<1, 128>(sB, 128, 0, kk), 1);
    dh_wg_commit();
    if (fault == 2) {     // refill B (with A's rows) while the wgmma may still read it
        __syncthreads();  // every thread has issued (so the fault is the refill, not a stale read at issue)
        dh_unit_copy_rows<1>(a, sB, 64, 128);
        daaf_cp_async_commit();
        daaf_cp_async_wait<0>();
        dh_fence_proxy_async();
    }
    if (fault == 3) acc[5] += 1.f;
    float early[64];
    for (int x = 0; x < 64; ++x) early[x] = acc[x];
    dh_wg_wait<0>();
    dh_unit_store(fault == 5 ? early : acc, d);
}

// A planted-fault kernel for the emulation's mbarrier, proxy and named-barrier checks (gpu/emu/cuda_emu.h), in
// the producer/consumer form of daaf_hws (gpu/daaf_hopper_ws.cuh). 384 threads (a register cap of 168 at entry):
// warpgroup 0 copies A and B by cp.async completing on an mbarrier (after setmaxnreg.dec to 24); warpgroup 1
// waits, fences the proxies and computes d = a b^T as above; warpgroups 1 and 2 take setmaxnreg.inc to 240
// (exactly what the decrease released), warpgroup 2 then leaves. fault: 0 none, 1 the consumer does not
// fence.proxy.async after its mbarrier wait, 2 the producer refills B while the consumer's wgmma is pending (no
// "empty" wait), 3 a wait on a phase that never completes, 4 a bar.arrive nobody syncs with, 5 an mbarrier
// used without mbarrier.init, 6 a producer decreasing to 32 only (the increases then never complete).
enum { DH_MBAR_FAULT_SMEM_BYTES = DH_UNIT_SMEM_BYTES + 64 };
__global__ void daaf_mbar_fault_check(const u16* a, const u16* b, float* d, int fault) {
    DH_EXPECT_SMEM(DH_MBAR_FAULT_SMEM_BYTES);
    DH_DYNAMIC_SMEM(raw);
    const u32 sb = (daaf_smem_addr(raw) + 1023u) & ~1023u;
    const u32 sA = sb, sB = sb + 64 * 128 * 2, full = sB + 128 * 128 * 2, issued = full + 8, refilled = full + 16;
    const int tid = threadIdx.x;
    if (tid == 0 && fault != 5) {
        dh_mbar_init(full, 128);
        dh_mbar_init(issued, 128);
        dh_mbar_init(refilled, 128);
        dh_mbar_init_fence();
    }
    __syncthreads();
    if (tid >= 256) {
        dh_setmaxnreg_inc<240>();
        return;
    }
    if (tid < 128) {  // producer
        if (fault == 6) dh_setmaxnreg_dec<32>();
        else dh_setmaxnreg_dec<24>();
        dh_unit_copy_rows<1>(a, sA, 64, 64);
        dh_unit_copy_rows<1>(b, sB, 128, 128);
        dh_cp_async_mbar_arrive(full);
        if (fault == 2) {
            dh_mbar_wait(issued, 0);
            dh_unit_copy_rows<1>(a, sB, 64, 128);
            dh_cp_async_mbar_arrive(refilled);
        }
        return;
    }
    dh_setmaxnreg_inc<240>();
    dh_mbar_wait(full, 0);
    if (fault != 1) dh_fence_proxy_async();
    float acc[64];
    for (int x = 0; x < 64; ++x) acc[x] = 0.f;
    dh_wg_fence();
    for (int kk = 0; kk < 8; ++kk)
        dh_wgmma_ss<true, 128, 0>(acc, dh_desc_k<1, 128>(sA, 64, 0, kk), dh_desc_k<1, 128>(sB, 128, 0, kk), 1);
    dh_wg_commit();
    if (fault == 2) {
        dh_mbar_arrive(issued);
        dh_mbar_wait(refilled, 0);
    }
    if (fault == 3) dh_mbar_wait(refilled, 0);  // nobody arrives there
    if (fault == 4) dh_bar_arrive(5, 256);       // nobody syncs there
    dh_wg_wait<0>();
    const int wq = (tid >> 5) & 3, g = (tid & 31) >> 2, tq = tid & 3;
    for (int x = 0; x < 64; ++x)
        d[(16 * wq + g + 8 * ((x >> 1) & 1)) * 128 + 8 * (x >> 2) + 2 * tq + (x & 1)] = acc[x];
}
