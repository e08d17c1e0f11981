// A planted-fault kernel for the CPU emulation's wgmma checks (gpu/emu/wgmma_emu.h), appended to the source of
// gpu/daaf_hopper.cu by tests/test_daaf_hopper_emu.py (it uses that file's layout helpers); emulation only.
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
