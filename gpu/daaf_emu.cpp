// CPU build of gpu/daaf_attention.cu for tests (see gpu/daaf_emu.h):
//   g++ -std=c++20 -O1 -shared -fPIC -pthread gpu/daaf_emu.cpp -o daaf_emu.so
// The entry points launch the kernels exactly as gpu/daaf.py does on the GPU.
#include "daaf_emu.h"
#include "daaf_attention.cu"

// mt: 1 ("tc", 64 query rows per block) or 2 ("tc2", 128)
extern "C" int daaf_emu_tc(int bf, int D, int mt, const u16* q, const u16* k, const u16* v, u16* o, const int* gidx,
                           const unsigned char* gmask, int B, int T, int H, int n_global, int W, float scale_log2,
                           int reverse) {
    const int br = DAAF_TC_BR * mt;
    const unsigned nqt = (unsigned)((T + br - 1) / br);
    const daaf_dim3 grid{nqt, (unsigned)H, (unsigned)B}, block{DAAF_TC_THREADS, 1, 1};
    auto run = [&](auto kernel, size_t smem) {
        daaf_emu_launch(grid, block, smem, [&] { kernel(q, k, v, o, gidx, gmask, T, H, n_global, W, scale_log2, reverse); });
    };
    if (mt == 1 && bf && D == 128) run(daaf_tc_bf16_d128, DaafTcShape<128, 1>::SMEM_BYTES);
    else if (mt == 1 && !bf && D == 128) run(daaf_tc_f16_d128, DaafTcShape<128, 1>::SMEM_BYTES);
    else if (mt == 1 && bf && D == 64) run(daaf_tc_bf16_d64, DaafTcShape<64, 1>::SMEM_BYTES);
    else if (mt == 1 && !bf && D == 64) run(daaf_tc_f16_d64, DaafTcShape<64, 1>::SMEM_BYTES);
    else if (mt == 2 && bf && D == 128) run(daaf_tc2_bf16_d128, DaafTcShape<128, 2>::SMEM_BYTES);
    else if (mt == 2 && !bf && D == 128) run(daaf_tc2_f16_d128, DaafTcShape<128, 2>::SMEM_BYTES);
    else if (mt == 2 && bf && D == 64) run(daaf_tc2_bf16_d64, DaafTcShape<64, 2>::SMEM_BYTES);
    else if (mt == 2 && !bf && D == 64) run(daaf_tc2_f16_d64, DaafTcShape<64, 2>::SMEM_BYTES);
    else return 1;
    return 0;
}

// elem: 0 = float32, 1 = float16, 2 = bfloat16
extern "C" int daaf_emu_simple(int elem, const void* q, const void* k, const void* v, void* o, const int* gidx,
                               const unsigned char* gmask, int B, int T, int H, int D, int Dv, int n_global, int W,
                               float scale) {
    const long long rows = (long long)B * T * H;
    const daaf_dim3 grid{(unsigned)((rows + 3) / 4), 1, 1}, block{128, 1, 1};
    if (elem == 0) {
        daaf_emu_launch(grid, block, 0, [&] {
            daaf_simple_f32((const float*)q, (const float*)k, (const float*)v, (float*)o, gidx, gmask, B, T, H, D, Dv,
                            n_global, W, scale);
        });
    } else if (elem == 1) {
        daaf_emu_launch(grid, block, 0, [&] {
            daaf_simple_f16((const u16*)q, (const u16*)k, (const u16*)v, (u16*)o, gidx, gmask, B, T, H, D, Dv,
                            n_global, W, scale);
        });
    } else if (elem == 2) {
        daaf_emu_launch(grid, block, 0, [&] {
            daaf_simple_bf16((const u16*)q, (const u16*)k, (const u16*)v, (u16*)o, gidx, gmask, B, T, H, D, Dv,
                             n_global, W, scale);
        });
    } else {
        return 1;
    }
    return 0;
}
