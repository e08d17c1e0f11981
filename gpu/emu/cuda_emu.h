// A minimal CPU emulation of the CUDA execution model, for testing the kernels in gpu/*.cu on a
// machine without a GPU (tests/test_cuda_build.py). Every CUDA thread of a block is a std::thread;
// __syncthreads() is a std::barrier over the block; blocks run one after another, so __shared__
// arrays become function-local statics. Warp-collective helpers (the mma emulation) use a
// per-warp barrier. It checks indexing and maths, not performance or races.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#define GLA_EMU 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
inline std::barrier<>* emu_block_barrier = nullptr;
inline std::vector<std::barrier<>*> emu_warp_barriers;

inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) {
  unsigned tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  emu_warp_barriers[tid / 32]->arrive_and_wait();
}
using std::max;
using std::min;

template <typename... A, std::size_t... I>
void emu_call(void (*k)(A...), void** args, std::index_sequence<I...>) {
  k(*reinterpret_cast<std::remove_reference_t<A>*>(args[I])...);
}

template <typename... A>
void emu_launch(void (*k)(A...), dim3 grid, dim3 block, void** args) {
  const unsigned nt = block.x * block.y * block.z;
  blockDim = block;
  gridDim = grid;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        std::barrier<> bar((std::ptrdiff_t)nt);
        std::vector<std::barrier<>*> wb;
        for (unsigned w = 0; w < (nt + 31) / 32; ++w) wb.push_back(new std::barrier<>((std::ptrdiff_t)std::min(32u, nt - 32 * w)));
        emu_block_barrier = &bar;
        emu_warp_barriers = wb;
        std::vector<std::thread> th;
        th.reserve(nt);
        for (unsigned t = 0; t < nt; ++t)
          th.emplace_back([=] {
            threadIdx = dim3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
            blockIdx = dim3{bx, by, bz};
            emu_call(k, args, std::index_sequence_for<A...>{});
          });
        for (auto& x : th) x.join();
        for (auto* p : wb) delete p;
      }
}

inline std::map<std::string, std::function<void(dim3, dim3, void**)>>& emu_registry() {
  static std::map<std::string, std::function<void(dim3, dim3, void**)>> r;
  return r;
}
struct EmuReg {
  template <typename... A>
  EmuReg(const char* name, void (*k)(A...)) {
    emu_registry()[name] = [k](dim3 g, dim3 b, void** a) { emu_launch(k, g, b, a); };
  }
};
#define EMU_CAT2(a, b) a##b
#define EMU_CAT(a, b) EMU_CAT2(a, b)
#define EMU_REGISTER(name, ...) static EmuReg EMU_CAT(emu_reg_, __COUNTER__)(name, __VA_ARGS__);

extern "C" int emu_launch_by_name(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                  unsigned bz, void** args);
#define EMU_DEFINE_ENTRY                                                                                   \
  extern "C" int emu_launch_by_name(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, \
                                    unsigned by, unsigned bz, void** args) {                              \
    auto it = emu_registry().find(name);                                                                   \
    if (it == emu_registry().end()) return 1;                                                              \
    it->second(dim3{gx, gy, gz}, dim3{bx, by, bz}, args);                                                  \
    return 0;                                                                                              \
  }

#include <atomic>
inline int atomicMax(int* p, int v) {
  std::atomic_ref<int> a(*p);
  int old = a.load();
  while (old < v && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}
