// CPU emulation of the CUDA execution model and of the PTX instructions the kernels in gpu/*.cu use, to test
// their indexing and arithmetic on a machine without a GPU. gpu/emu/__init__.py compiles a kernel source after
// this header with g++ -std=c++20 and launches its kernels by name (tests/test_cuda_build.py,
// tests/test_gpu_daaf.py, tests/test_daaf_hopper_emu.py). Kernel files test CUDA_EMU where they need the
// emulated form of a PTX helper.
//
// Every CUDA thread of a block is a fiber on the launching OS thread (emu_core.h: each runs until it waits, then the
// next); blocks run one after another, so __shared__ arrays become
// function-local statics, and the dynamic shared memory is one buffer per launch (garbage on entry, as on the
// GPU). __syncthreads() is a barrier over the block; warp collectives (__syncwarp, shuffles, ldmatrix,
// mma.sync) exchange operands through a per-warp buffer between two per-warp barriers. The PTX helpers follow
// the PTX ISA definitions literally:
//   * ldmatrix .x4: lanes 8i..8i+7 give the row addresses of matrix i, register i of lane L holds
//     row L/4, columns 2(L%4), 2(L%4)+1 of matrix i (.trans: rows 2(L%4), 2(L%4)+1 of column L/4);
//   * mma.m16n8k16 (row.col): A element (r, c) sits in lane (r%8)*4 + (c%8)/2, register
//     (r >= 8) + 2 (c >= 8), half c%2; B element (k, n) in lane n*4 + (k%8)/2, register k >= 8,
//     half k%2; C/D element (r, n) in lane (r%8)*4 + n/2, register 2 (r >= 8) + n%2;
//   * cp.async copies are deferred until the thread's cp.async.wait_group releases their group, so
//     a read of shared memory before the wait (and barrier) sees stale data, as on the GPU; they land
//     through the generic proxy: the async proxy (wgmma operands) sees them only after the writing
//     thread's fence.proxy.async;
//   * bar.sync / bar.arrive with an id other than 0 (named barriers) count towards a barrier of the count
//     the first arriving thread of a phase names, per block;
//   * mbarriers (init, arrive, try_wait.parity, and cp.async.mbarrier.arrive.noinc, whose tracked copies
//     land at once and reach the async proxy only through a fence.proxy.async of the reading thread after
//     they landed); transaction counts (mbarrier.arrive.expect_tx, complete_tx); setmaxnreg moves registers
//     through the CTA's pool (an increase the decreases do not cover waits forever, as on the GPU);
//   * the tensor memory accelerator's tiled loads (cp.async.bulk.tensor with an emulated tensor map: zeros outside
//     the tensor, the 128-byte swizzle on the shared address, complete_tx on the mbarrier; async-proxy writes that
//     a thread's wgmma may read once it has completed a wait on that mbarrier after they landed);
//   * the warpgroup MMA (wgmma) with its shared-memory descriptors and asynchronous retirement: wgmma_emu.h.
// Broken rules the emulation sees (a cp.async outside the dynamic shared memory or misaligned, copies
// still pending at kernel exit, a launch whose dynamic shared memory is not the size a kernel states with
// emu_expect_dynamic_smem, an mbarrier used before its init, named-barrier arrivals left over at block
// exit, a wait that can never complete (a deadlock), and wgmma_emu.h's checks) are recorded with emu_error; the launch
// entry point counts them per launch and gpu/emu/__init__.py raises EmuCheckError with the first.
// It checks indexing and arithmetic, not performance; races between warps beyond that are not modelled.
#pragma once

#include "emu_core.h"   // the execution model: threads, warps, shared memory, proxies, checks
#include "wgmma_emu.h"  // the warpgroup MMA (built on emu_core.h)

// ---------------------------------------------------------------- launch by name

// what a thread must not leave behind at kernel exit
inline void emu_thread_exit_checks() {
  bool copies = !emu_cp_open.empty();
  for (const auto& grp : emu_cp_groups) copies |= !grp.empty();
  if (copies) emu_error("cp.async copies still pending at kernel exit");
  emu_wgmma_exit_checks();
}

template <typename... A, std::size_t... I>
void emu_call(void (*k)(A...), void** args, std::index_sequence<I...>) {
  k(*reinterpret_cast<std::remove_reference_t<A>*>(args[I])...);
}

struct alignas(128) EmuSmemLine {
  unsigned char b[128];
};

// the fibers' stacks (kept between launches; pages are touched only as deep as a kernel's frames go)
inline constexpr std::size_t EMU_STACK_BYTES = 1 << 20;
struct EmuStacks {
  std::vector<void*> s;
  void* get(std::size_t i) {
    while (s.size() <= i) {
      void* m = mmap(nullptr, EMU_STACK_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                     -1, 0);
      if (m == MAP_FAILED) throw std::bad_alloc();
      s.push_back(m);
    }
    return s[i];
  }
};
inline EmuStacks emu_stacks;

// one fiber's body: the kernel, the exit checks, then back to the launcher for good
inline std::function<void()> emu_fiber_body;  // the kernel with the launch's arguments
inline std::vector<char> emu_ended;           // per thread of the running block
inline void emu_fiber_entry() {
  emu_fiber_body();
  emu_thread_exit_checks();
  emu_ended[emu_cur] = 1;
  --emu_live;
  emu_idle = 0;
}

template <typename... A>
void emu_launch(void (*k)(A...), dim3 grid, dim3 block, std::size_t smem_bytes, void** args) {
  const unsigned nt = block.x * block.y * block.z;
  std::vector<EmuSmemLine> smem((smem_bytes + 16 + 127) / 128);
  std::memset(smem.data(), 0xA5, smem.size() * sizeof(EmuSmemLine));  // garbage, as on the GPU
  emu_smem_base = smem.data()->b;
  emu_smem_bytes = smem_bytes;
  emu_unfenced_chunks = smem.size() * sizeof(EmuSmemLine) / 16;
  emu_unfenced_writer = std::make_unique<std::atomic<int>[]>(emu_unfenced_chunks);
  emu_chunk_landed = std::make_unique<std::atomic<long long>[]>(emu_unfenced_chunks);
  emu_chunk_bar = std::make_unique<std::atomic<uint32_t>[]>(emu_unfenced_chunks);
  emu_wait_abandoned = false;
  blockDim = block;
  gridDim = grid;
  emu_fiber_body = [=] { emu_call(k, args, std::index_sequence_for<A...>{}); };
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        EmuBarrier bar((std::ptrdiff_t)nt);
        emu_block_barrier = &bar;
        blockIdx = dim3{bx, by, bz};
        emu_named_barriers.clear();
        emu_mbars.clear();
        emu_reg_pool = 0;
        for (std::size_t c = 0; c < emu_unfenced_chunks; ++c) {
          emu_unfenced_writer[c].store(-1);
          emu_chunk_landed[c].store(0);
          emu_chunk_bar[c].store(0);
        }
        emu_warps.clear();
        for (unsigned w = 0; w < (nt + 31) / 32; ++w) {
          emu_warps.push_back(std::make_unique<EmuWarp>());
          emu_warps.back()->bar = std::make_unique<EmuBarrier>((std::ptrdiff_t)std::min(32u, nt - 32 * w));
        }
        for (auto& reset : emu_per_thread_resets()) reset(nt);
        for (unsigned t = 0; t < nt; ++t)
          emu_thread_idx.v[t] = dim3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
        emu_fibers.assign(nt, ucontext_t{});
        emu_ended.assign(nt, 0);
        for (unsigned t = 0; t < nt; ++t) {
          getcontext(&emu_fibers[t]);
          emu_fibers[t].uc_stack.ss_sp = emu_stacks.get(t);
          emu_fibers[t].uc_stack.ss_size = EMU_STACK_BYTES;
          emu_fibers[t].uc_link = &emu_sched_ctx;  // the body's return ends the fiber
          makecontext(&emu_fibers[t], emu_fiber_entry, 0);
        }
        emu_live = (int)nt;
        emu_idle = 0;
        while (emu_live > 0)  // round robin over the threads that have not ended
          for (unsigned t = 0; t < nt; ++t) {
            if (emu_ended[t]) continue;
            emu_cur = (int)t;
            swapcontext(&emu_sched_ctx, &emu_fibers[t]);
          }
        emu_named_exit_checks();
      }
  emu_warps.clear();
  emu_named_barriers.clear();
  emu_mbars.clear();
  emu_smem_base = nullptr;
  emu_smem_bytes = 0;
  emu_block_barrier = nullptr;
}

using EmuKernel = std::function<void(dim3, dim3, std::size_t, void**)>;
inline std::map<std::string, EmuKernel>& emu_registry() {
  static std::map<std::string, EmuKernel> r;
  return r;
}
struct EmuReg {
  template <typename... A>
  EmuReg(const char* name, void (*k)(A...)) {
    emu_registry()[name] = [k](dim3 g, dim3 b, std::size_t s, void** a) { emu_launch(k, g, b, s, a); };
  }
};
#define EMU_CAT2(a, b) a##b
#define EMU_CAT(a, b) EMU_CAT2(a, b)
// EMU_REGISTER("name expression", kernel): launchable by that name through emu_launch_by_name
#define EMU_REGISTER(name, ...) static EmuReg EMU_CAT(emu_reg_, __COUNTER__)(name, __VA_ARGS__);

// the library's entry points (one translation unit per build): the launch (0, or 1 for a name that is not
// registered) and the checks of the last launch (how many failed, the first message)
#define EMU_DEFINE_ENTRY                                                                                        \
  extern "C" int emu_launch_by_name(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx,      \
                                    unsigned by, unsigned bz, unsigned long long smem_bytes, void** args) {    \
    auto it = emu_registry().find(name);                                                                        \
    if (it == emu_registry().end()) return 1;                                                                   \
    emu_error_count = 0;                                                                                        \
    emu_error_first.clear();                                                                                    \
    it->second(dim3{gx, gy, gz}, dim3{bx, by, bz}, (std::size_t)smem_bytes, args);                              \
    return 0;                                                                                                   \
  }                                                                                                             \
  extern "C" int emu_last_error_count() { return emu_error_count.load(); }                                      \
  extern "C" const char* emu_last_error() { return emu_error_first.c_str(); }
