// Planted faults for the CPU emulation's tensor-copy checks (gpu/emu/emu_core.h: TMA, mbarrier transaction counts),
// appended to the source of gpu/daaf_fa3.cu by tests/test_daaf_fa3_emu.py (its TMA helpers and daaf_hopper.cu's
// layouts); emulation only.
//
// 256 threads: thread 0 loads a [64][128] and b [128][128] (bf16 bits, tensor maps of the [1, rows, 1, 128] layout,
// boxes of 64 columns) by TMA completing on one mbarrier, then arrives on a second ("issued"); warpgroup 1 waits
// and computes d = a b^T as the wgmma unit kernel does. fault: 0 none, 1 the consumer waits on "issued" only (the
// copies have landed, but it never waited on their barrier), 2 expect_tx 16 bytes short (the phase never
// completes), 3 a destination not aligned to the swizzle pattern, 4 a tensor map that is not one.
enum { FA3_FAULT_SMEM_BYTES = (64 + 128) * 128 * 2 + 64 + 1024 };
__global__ void daaf_tma_fault_check(const __grid_constant__ Fa3TensorMap ma, const __grid_constant__ Fa3TensorMap mb,
                                     float* d, int fault) {
    DH_EXPECT_SMEM(FA3_FAULT_SMEM_BYTES);
    DH_DYNAMIC_SMEM(raw);
    const u32 sb = (daaf_smem_addr(raw) + 1023u) & ~1023u;
    const u32 sA = sb, sB = sb + 64 * 128 * 2, bar = sB + 128 * 128 * 2, issued = bar + 8;
    const int tid = threadIdx.x;
    if (tid == 0) {
        dh_mbar_init(bar, 1);
        dh_mbar_init(issued, 1);
        dh_mbar_init_fence();
    }
    __syncthreads();
    if (tid < 128) {
        if (tid == 0) {
            fa3_mbar_arrive_expect_tx(bar, (64 + 128) * 128 * 2 - (fault == 2 ? 16 : 0));
            for (int c = 0; c < 2; ++c)
                fa3_tma_load(sA + c * 64 * 128 + (fault == 3 ? 128 : 0), &ma, 64 * c, 0, 0, 0, bar);
            const Fa3TensorMap* mbp = fault == 4 ? reinterpret_cast<const Fa3TensorMap*>(d) : &mb;
            for (int c = 0; c < 2; ++c) fa3_tma_load(sB + c * 128 * 128, mbp, 64 * c, 0, 0, 0, bar);
            dh_mbar_arrive(issued);
        }
        return;
    }
    dh_mbar_wait(fault == 1 ? issued : bar, 0);
    float acc[64];
    for (int x = 0; x < 64; ++x) acc[x] = 0.f;
    dh_wg_fence();
    for (int kk = 0; kk < 8; ++kk)
        dh_wgmma_ss<true, 128, 0>(acc, dh_desc_k<1, 128>(sA, 64, 0, kk), dh_desc_k<1, 128>(sB, 128, 0, kk), 1);
    dh_wg_commit();
    dh_wg_wait<0>();
    const int t = tid - 128, wq = t >> 5, g = (t & 31) >> 2, tq = t & 3;
    for (int x = 0; x < 64; ++x) {
        const int m = 16 * wq + g + 8 * ((x >> 1) & 1), n = 8 * (x >> 2) + 2 * tq + (x & 1);
        d[m * 128 + n] = acc[x];
    }
}
