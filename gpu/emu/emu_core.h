// The CUDA execution model of the emulation (gpu/emu/cuda_emu.h is the header kernels are built after):
// threads, blocks, warps and their collectives (shuffles, ldmatrix, mma.sync), shared memory, cp.async and
// the proxies, named barriers, mbarriers (with transaction counts), the tensor memory accelerator's tiled loads
// (cp.async.bulk.tensor), setmaxnreg, and emu_error, which records a broken rule. The
// warpgroup MMA builds on it (wgmma_emu.h); the launch by name comes last (cuda_emu.h).
#pragma once
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <sys/mman.h>
#include <ucontext.h>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#define CUDA_EMU 1
#define GLA_EMU 1  // the former name of CUDA_EMU, for kernel files written before the two emulators merged

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __grid_constant__

using std::max;
using std::min;

// ---------------------------------------------------------------- threads, blocks, warps

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
inline dim3 blockIdx, blockDim, gridDim;

// Every CUDA thread of a block is a fiber (ucontext) on the launching OS thread: it runs until it waits (a
// barrier, a warp collective, an mbarrier, setmaxnreg.inc), then the next one runs (round robin). A wait costs
// a user-space switch, not an OS thread's wake-up, and a wait no thread can end is seen at once (every live
// thread waits and none made progress over rounds of all of them): a deadlock.
inline int emu_cur = 0;                     // the running thread of the block (its linear index)
inline ucontext_t emu_sched_ctx;            // the launcher's context, which picks the next thread
inline std::vector<ucontext_t> emu_fibers;  // of the running block
inline void emu_yield() { swapcontext(&emu_fibers[emu_cur], &emu_sched_ctx); }

// per-thread state of the emulation: one slot per thread of the running block, fresh when a block starts
inline std::vector<std::function<void(std::size_t)>>& emu_per_thread_resets() {
  static std::vector<std::function<void(std::size_t)>> r;
  return r;
}
template <typename T>
struct EmuPerThread {
  std::deque<T> v;  // (not a vector: vector<bool> has no bool&)
  T init;
  explicit EmuPerThread(T x = T{}) : init(std::move(x)) {
    emu_per_thread_resets().push_back([this](std::size_t n) { v.assign(n, init); });
  }
  T& get() { return v[emu_cur]; }
};
inline EmuPerThread<dim3> emu_thread_idx;
#define threadIdx (emu_thread_idx.get())

// waits: `done()` is polled once per round of the block's threads. `emu_idle` counts polls that found their
// wait not done since a thread last made progress (began a wait, finished one, or ended); past a few rounds of
// every live thread, no wait can end: a deadlock. Then every wait of the launch gives up (returns false).
inline std::atomic<bool> emu_wait_abandoned{false};
inline long long emu_idle = 0;
inline int emu_live = 0;  // threads of the block not ended
template <typename F>
inline bool emu_wait(F done) {
  emu_idle = 0;
  while (!done()) {
    if (emu_wait_abandoned.load()) return false;
    if (++emu_idle > 4LL * emu_live + 8) return false;  // a deadlock: the caller records it
    emu_yield();
  }
  emu_idle = 0;
  return true;
}

// a barrier of `n` threads (the block's for __syncthreads, a warp's for its collectives)
struct EmuBarrier {
  std::ptrdiff_t n, arrived = 0;
  long long gen = 0;
  explicit EmuBarrier(std::ptrdiff_t count) : n(count) {}
  void arrive_and_wait();
};

struct EmuWarp {
  std::unique_ptr<EmuBarrier> bar;
  uint32_t u[32][6];  // per lane: mma operands (a[4], b0, b1), wgmma A registers
  const void* p[32];  // per lane: ldmatrix row address
  uint32_t x[32];     // per lane: shuffle value (bits)
};
inline EmuBarrier* emu_block_barrier = nullptr;
inline std::vector<std::unique_ptr<EmuWarp>> emu_warps;  // of the running block

inline unsigned emu_tid() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }
inline int emu_lane() { return (int)(emu_tid() % 32); }
inline EmuWarp& emu_warp() { return *emu_warps[emu_tid() / 32]; }

inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu_warp().bar->arrive_and_wait(); }

// ---------------------------------------------------------------- checks (counted per launch)

inline std::atomic<int> emu_error_count{0};
inline std::string emu_error_first;  // the first message of the launch
inline void emu_error(const std::string& msg) {
  if (emu_error_count.fetch_add(1) == 0)
    emu_error_first = msg + " (block " + std::to_string(blockIdx.x) + ", thread " + std::to_string(emu_tid()) + ")";
}

// wait until done(); false (and the error recorded once, for the first wait that gives up) on a deadlock
template <typename F>
inline bool emu_wait_until(F done, const char* what) {
  if (emu_wait(done)) return true;
  if (!emu_wait_abandoned.exchange(true)) emu_error(std::string(what) + " never completed (deadlock?)");
  return done();
}
inline void EmuBarrier::arrive_and_wait() {
  const long long g = gen;
  if (++arrived >= n) {
    arrived = 0;
    ++gen;
    emu_idle = 0;
    return;
  }
  emu_wait_until([&] { return gen != g; }, "barrier");
}

// bar.sync / bar.arrive id, nthreads (id > 0): the first thread to arrive at `id` in a phase sets the count;
// bar.arrive counts without waiting. Arrivals left over at block exit are recorded (emu_named_exit_checks).
struct EmuNamedBar {
  int expected = 0, arrived = 0;
  long long gen = 0;
};
inline std::map<int, EmuNamedBar> emu_named_barriers;  // of the running block
inline long long emu_named_arrive_locked(int id, int nthreads) {
  EmuNamedBar& b = emu_named_barriers[id];
  if (b.arrived == 0) b.expected = nthreads;
  else if (b.expected != nthreads)
    emu_error("named barrier " + std::to_string(id) + ": thread count " + std::to_string(nthreads) +
              " differs from the phase's " + std::to_string(b.expected));
  const long long gen = b.gen;
  if (++b.arrived >= b.expected) {
    b.arrived = 0;
    ++b.gen;
  }
  return gen;
}
inline void emu_bar_sync(int id, int nthreads) {
  const long long gen = emu_named_arrive_locked(id, nthreads);
  EmuNamedBar& b = emu_named_barriers[id];
  emu_wait_until([&] { return b.gen != gen; }, "named barrier bar.sync");
}
inline void emu_bar_arrive(int id, int nthreads) { emu_named_arrive_locked(id, nthreads); }
inline void emu_named_exit_checks() {
  for (const auto& [id, b] : emu_named_barriers)
    if (b.arrived)
      emu_error("named barrier " + std::to_string(id) + ": " + std::to_string(b.arrived) + " of " +
                std::to_string(b.expected) + " arrivals left over at block exit");
}

inline int atomicMax(int* p, int v) {
  std::atomic_ref<int> a(*p);
  int old = a.load();
  while (old < v && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}

// ---------------------------------------------------------------- bit casts, intrinsics, 16-bit conversions

inline float __uint_as_float(uint32_t x) {
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}
inline float __int_as_float(int x) {
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}
inline uint32_t __float_as_uint(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  return x;
}
inline float __expf(float x) { return expf(x); }

// shfl.sync: this lane's value goes to the warp, the value of lane `src` comes back
inline uint32_t emu_shfl_bits(uint32_t v, int src) {
  EmuWarp& w = emu_warp();
  const int l = emu_lane();
  w.x[l] = v;
  w.bar->arrive_and_wait();
  const uint32_t y = w.x[src & 31];
  w.bar->arrive_and_wait();
  return y;
}
inline float __shfl_xor_sync(unsigned, float x, int lane_mask) {
  return __uint_as_float(emu_shfl_bits(__float_as_uint(x), emu_lane() ^ lane_mask));
}
inline int __shfl_sync(unsigned, int x, int src_lane) { return (int)emu_shfl_bits((uint32_t)x, src_lane); }
inline float emu_ex2(float x) { return std::exp2(x); }  // ex2.approx.f32

// cvt.f32.f16, cvt.rn.f16.f32, cvt.rn.bf16.f32 (round to nearest even; NaN stays a quiet NaN)
inline float emu_f16_to_f32(uint16_t h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return (float)x;
}
inline uint16_t emu_f32_to_f16(float f) {
  const _Float16 x = (_Float16)f;
  uint16_t h;
  std::memcpy(&h, &x, 2);
  return h;
}
inline uint16_t emu_f32_to_bf16(float f) {
  uint32_t x = __float_as_uint(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return (uint16_t)(x >> 16);
}
// cvt.rn.{bf16x2,f16x2}.f32: two fp32 -> a packed 16-bit pair (lo in the low half)
template <bool BF>
inline uint32_t emu_pack2(float lo, float hi) {
  const uint16_t a = BF ? emu_f32_to_bf16(lo) : emu_f32_to_f16(lo);
  const uint16_t b = BF ? emu_f32_to_bf16(hi) : emu_f32_to_f16(hi);
  return (uint32_t)a | ((uint32_t)b << 16);
}

// ---------------------------------------------------------------- shared memory and cp.async

inline unsigned char* emu_smem_base = nullptr;  // the launch's dynamic shared memory (shared address 0)
inline std::size_t emu_smem_bytes = 0;          // its size
inline unsigned char* emu_dynamic_smem() { return emu_smem_base; }
// a shared-window address (cvta.to.shared) of a pointer into the dynamic shared memory
inline uint32_t emu_smem_addr(const void* p) {
  return (uint32_t)(reinterpret_cast<const unsigned char*>(p) - emu_smem_base);
}

// a kernel whose shared-memory layout has `bytes` checks that the launch gave exactly that many
inline void emu_expect_dynamic_smem(std::size_t bytes) {
  if (emu_smem_bytes != bytes)
    emu_error("launched with " + std::to_string(emu_smem_bytes) + " bytes of dynamic shared memory; the kernel's " +
              "layout has " + std::to_string(bytes));
}

// generic and async proxy: per 16-byte chunk of the dynamic shared memory, the thread whose cp.async
// wrote it and which has not fenced since (-1: none; EMU_MBAR_WRITER: copies completed on an mbarrier,
// see emu_cp_async_mbar_arrive); reset per block
inline constexpr int EMU_MBAR_WRITER = -2;
inline constexpr int EMU_TMA_WRITER = -3;  // written by a tensor copy (async proxy): visible after an mbarrier wait
inline std::unique_ptr<std::atomic<int>[]> emu_unfenced_writer;
inline std::unique_ptr<std::atomic<long long>[]> emu_chunk_landed;  // when an mbarrier-tracked copy landed
inline std::unique_ptr<std::atomic<uint32_t>[]> emu_chunk_bar;      // the mbarrier a tensor copy completed on
inline std::size_t emu_unfenced_chunks = 0;
inline std::atomic<long long> emu_proxy_clock{0};                // ticks at every such landing and fence
inline EmuPerThread<long long> emu_fenced_at_pt{-1};  // this thread's last fence.proxy.async
#define emu_fenced_at (emu_fenced_at_pt.get())
inline EmuPerThread<std::map<uint32_t, long long>> emu_waited_at_pt;  // per mbarrier: this thread's last completed wait
#define emu_waited_at (emu_waited_at_pt.get())
inline EmuPerThread<std::vector<uint32_t>> emu_unfenced_mine_pt;  // chunks this thread wrote since its fence
#define emu_unfenced_mine (emu_unfenced_mine_pt.get())
// fence.proxy.async.shared::cta: this thread's cp.async writes become visible to the async proxy, and so do,
// for this thread's own async-proxy reads, the mbarrier-tracked copies that landed before it (the consumer
// side fence after an mbarrier wait)
inline void emu_fence_proxy_async() {
  for (uint32_t c : emu_unfenced_mine) {
    int me = (int)emu_tid();
    emu_unfenced_writer[c].compare_exchange_strong(me, -1);
  }
  emu_unfenced_mine.clear();
  emu_fenced_at = ++emu_proxy_clock;
}
// the async proxy of this thread sees the byte at shared address `addr`: no unfenced cp.async write to its
// chunk (by the writer's fence, or, for copies completed on an mbarrier, by this thread's fence after they
// landed)
// (a tensor copy's bytes: once this thread has completed a wait on the copy's mbarrier after they landed)
inline bool emu_async_proxy_sees(uint32_t addr) {
  const int w = emu_unfenced_writer[addr / 16].load();
  if (w == EMU_MBAR_WRITER) return emu_chunk_landed[addr / 16].load() < emu_fenced_at;
  if (w == EMU_TMA_WRITER) {
    const auto it = emu_waited_at.find(emu_chunk_bar[addr / 16].load());
    return it != emu_waited_at.end() && emu_chunk_landed[addr / 16].load() < it->second;
  }
  return w < 0;
}

struct EmuCopy {
  unsigned char* dst;
  const void* src;
  int n;
};
inline EmuPerThread<std::vector<EmuCopy>> emu_cp_open_pt;  // not yet committed
#define emu_cp_open (emu_cp_open_pt.get())
inline EmuPerThread<std::deque<std::vector<EmuCopy>>> emu_cp_groups_pt;  // committed, pending
#define emu_cp_groups (emu_cp_groups_pt.get())
// cp.async.cg.shared.global 16 bytes, src_bytes of them from src (the rest zero); the emulation takes
// destinations in the dynamic shared memory
inline void emu_cp_async16(void* dst, const void* src, int src_bytes) {
  const uintptr_t d = reinterpret_cast<uintptr_t>(dst), base = reinterpret_cast<uintptr_t>(emu_smem_base);
  if (d % 16) emu_error("cp.async destination not 16-byte aligned");
  if (d < base || d - base + 16 > emu_smem_bytes) {
    emu_error("cp.async destination outside the dynamic shared memory");
    return;
  }
  emu_cp_open.push_back({static_cast<unsigned char*>(dst), src, src_bytes});
}
inline void emu_cp_async_commit() {
  emu_cp_groups.push_back(emu_cp_open);
  emu_cp_open.clear();
}
inline void emu_cp_async_wait(int pending) {
  while ((int)emu_cp_groups.size() > pending) {
    for (const EmuCopy& c : emu_cp_groups.front()) {
      std::memset(c.dst, 0, 16);
      std::memcpy(c.dst, c.src, (size_t)c.n);
      const uint32_t chunk = emu_smem_addr(c.dst) / 16;
      emu_unfenced_writer[chunk].store((int)emu_tid());
      emu_unfenced_mine.push_back(chunk);
    }
    emu_cp_groups.pop_front();
  }
}

// ---------------------------------------------------------------- mbarrier

// mbarrier objects (8 bytes of shared memory each, by shared address; reset per block): a phase completes
// when `expected` arrivals have happened and its transaction count (expect_tx adds bytes, a tensor copy's
// complete_tx takes them off) is back at zero; try_wait.parity(p) succeeds once the phase of parity p completed,
// i.e. while the number of completed phases has the other parity. Waits block (a wait no thread can end is a deadlock, recorded).
struct EmuMbar {
  int expected = 0, pending = 0;
  long long tx = 0;     // transaction bytes still expected in the current phase
  long long phase = 0;  // completed phases
};
inline std::map<uint32_t, EmuMbar> emu_mbars;  // of the running block
inline EmuMbar* emu_mbar_at_locked(uint32_t addr) {
  auto it = emu_mbars.find(addr);
  if (it == emu_mbars.end()) {
    emu_error("mbarrier at shared address " + std::to_string(addr) + " used before mbarrier.init");
    return nullptr;
  }
  return &it->second;
}
inline void emu_mbar_init(uint32_t addr, int count) {
  if (addr % 8 || addr + 8 > emu_smem_bytes) emu_error("mbarrier not 8-byte aligned inside the dynamic shared memory");
  if (count < 1) emu_error("mbarrier.init with a count below 1");
  emu_mbars[addr] = EmuMbar{count, count, 0};
}
inline void emu_mbar_maybe_complete(EmuMbar* b) {
  if (b->pending < 0) emu_error("mbarrier: more arrivals than its count in one phase");
  if (b->pending <= 0 && b->tx == 0) {
    ++b->phase;
    b->pending = b->expected;
  }
}
inline void emu_mbar_arrive_locked(uint32_t addr) {
  EmuMbar* b = emu_mbar_at_locked(addr);
  if (b == nullptr) return;
  --b->pending;
  emu_mbar_maybe_complete(b);
}
inline void emu_mbar_arrive(uint32_t addr) {
  emu_mbar_arrive_locked(addr);
}
// mbarrier.arrive.expect_tx: the phase expects `bytes` more transaction bytes, then one arrival
inline void emu_mbar_arrive_expect_tx(uint32_t addr, uint32_t bytes) {
  EmuMbar* b = emu_mbar_at_locked(addr);
  if (b == nullptr) return;
  b->tx += bytes;
  --b->pending;
  emu_mbar_maybe_complete(b);
}
// complete_tx of a tensor copy: `bytes` of the phase's transactions have landed
inline void emu_mbar_complete_tx(uint32_t addr, uint32_t bytes) {
  EmuMbar* b = emu_mbar_at_locked(addr);
  if (b == nullptr) return;
  b->tx -= bytes;
  emu_mbar_maybe_complete(b);
}
// mbarrier.try_wait.parity in a loop: until the phase of parity `parity` has completed
inline void emu_mbar_wait(uint32_t addr, uint32_t parity) {
  EmuMbar* b = emu_mbar_at_locked(addr);
  if (b == nullptr) return;
  auto done = [&] { return (uint32_t)(b->phase & 1) != (parity & 1); };
  if (!emu_wait(done) && !emu_wait_abandoned.exchange(true))
    emu_error("mbarrier wait never completed (deadlock?): shared address " + std::to_string(addr) + ", parity " +
              std::to_string(parity) + ", " + std::to_string(b->phase) + " phases completed, " +
              std::to_string(b->pending) + " arrivals and " + std::to_string(b->tx) + " bytes pending");
  emu_waited_at[addr] = ++emu_proxy_clock;
}
// cp.async.mbarrier.arrive.noinc: one arrival once every earlier cp.async of this thread has landed. The
// emulation lands them now (their groups empty out); the async proxy sees them only in a thread that executes
// fence.proxy.async after they landed (the consumer of the barrier, after its wait).
inline void emu_cp_async_mbar_arrive(uint32_t addr) {
  auto land = [](const EmuCopy& c) {
    std::memset(c.dst, 0, 16);
    std::memcpy(c.dst, c.src, (size_t)c.n);
    const uint32_t chunk = emu_smem_addr(c.dst) / 16;
    emu_chunk_landed[chunk].store(++emu_proxy_clock);
    emu_unfenced_writer[chunk].store(EMU_MBAR_WRITER);
  };
  for (auto& grp : emu_cp_groups) {
    for (const EmuCopy& c : grp) land(c);
    grp.clear();
  }
  for (const EmuCopy& c : emu_cp_open) land(c);
  emu_cp_open.clear();
  emu_mbar_arrive(addr);
}
// cp.async.mbarrier.arrive (without .noinc): the pending count goes up by one now and down by one when this
// thread's earlier cp.async have landed (at once here): no net arrival; someone else's arrival ends the phase
inline void emu_cp_async_mbar_arrive_inc(uint32_t addr) {
  {
      EmuMbar* b = emu_mbar_at_locked(addr);
    if (b == nullptr) return;
    ++b->pending;
  }
  emu_cp_async_mbar_arrive(addr);
}

// ---------------------------------------------------------------- tensor memory accelerator (tiled loads)

// The emulation's tensor map (128 bytes, as CUtensorMap; filled by gpu/emu/__init__.py tensor_map): global base
// address, rank, element size, dims and byte strides (stride[0] = element size), box, swizzle (0 none, 3 128-byte)
struct EmuTensorMap {
  uint64_t magic;
  uint64_t base;
  uint64_t dims[5];
  uint64_t strides[5];
  uint32_t box[5];
  uint32_t rank, elem, swizzle;
};
static_assert(sizeof(EmuTensorMap) == 128, "a tensor map is 128 bytes");
inline constexpr uint64_t EMU_TMAP_MAGIC = 0x70616d54756d45ull;  // "EmuTmap"

// cp.async.bulk.tensor.Nd.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [map, {c}], [mbar]: the box
// at coordinates c (elements; outside the tensor: zeros) into shared memory at `dst`, rows of box[0] elements one
// after another, the 128-byte swizzle applied to the shared address (16-byte chunk bits [4, 7) XOR bits [7, 10)),
// then complete_tx of the box's bytes on `mbar`. The bytes land at issue; the async proxy (wgmma) of a thread sees
// them once that thread has completed a wait on `mbar` after they landed.
inline void emu_tma_load(uint32_t dst, const void* map, const int* c, int rank, uint32_t mbar) {
  EmuTensorMap m;
  std::memcpy(&m, map, sizeof m);
  if (m.magic != EMU_TMAP_MAGIC) {
    emu_error("cp.async.bulk.tensor: not a tensor map (made by gpu/emu tensor_map)");
    return;
  }
  if ((int)m.rank != rank) emu_error("cp.async.bulk.tensor: the instruction's rank differs from the tensor map's");
  const uint32_t align = m.swizzle == 3 ? 1024 : 128;
  if (dst % align) emu_error("cp.async.bulk.tensor: shared destination not aligned to the swizzle pattern");
  if (m.swizzle == 3 && m.box[0] * m.elem > 128) emu_error("cp.async.bulk.tensor: a 128-byte swizzled row is wider");
  uint64_t n = 1;
  for (int d = 0; d < rank; ++d) n *= m.box[d];
  const uint64_t bytes = n * m.elem;
  if (dst + bytes > emu_smem_bytes) {
    emu_error("cp.async.bulk.tensor: destination beyond the dynamic shared memory");
    return;
  }
  for (uint64_t e = 0; e < n; ++e) {
    uint64_t rest = e, src = m.base;
    bool in = true;
    for (int d = 0; d < rank; ++d) {
      const long long x = (long long)c[d] + (long long)(rest % m.box[d]);
      rest /= m.box[d];
      if (x < 0 || x >= (long long)m.dims[d]) in = false;
      else src += (uint64_t)x * m.strides[d];
    }
    uint32_t a = dst + (uint32_t)(e * m.elem);
    if (m.swizzle == 3) a ^= ((a >> 7) & 7u) << 4;
    if (in) std::memcpy(emu_smem_base + a, reinterpret_cast<const void*>(src), m.elem);
    else std::memset(emu_smem_base + a, 0, m.elem);
  }
  for (uint64_t off = 0; off < bytes; off += 16) {
    const uint32_t chunk = (dst + (uint32_t)off) / 16;
    emu_chunk_landed[chunk].store(++emu_proxy_clock);
    emu_chunk_bar[chunk].store(mbar);
    emu_unfenced_writer[chunk].store(EMU_TMA_WRITER);
  }
  emu_mbar_complete_tx(mbar, (uint32_t)bytes);
}

// setmaxnreg.{inc,dec}.sync.aligned.u32 n: per-thread register budgets moved between the warpgroups of a CTA.
// The CTA starts with the kernel's register cap per thread (ptxas: 65536 / threads, a multiple of 8); dec
// returns cap - n registers per thread to the CTA's pool, inc takes n - cap from it and waits until the pool
// has them (so an inc the decs never cover is a deadlock, recorded).
inline long long emu_reg_pool = 0;  // of the running block
inline int emu_reg_cap() {
  const unsigned nt = blockDim.x * blockDim.y * blockDim.z;
  return (int)std::min(256u, 65536u / nt / 8u * 8u);
}
inline bool emu_setmaxnreg_count_ok(int n) {
  if (n >= 24 && n <= 256 && n % 8 == 0) return true;
  emu_error("setmaxnreg count must be a multiple of 8 in [24, 256]");
  return false;
}
inline void emu_setmaxnreg_dec(int n) {
  if (!emu_setmaxnreg_count_ok(n)) return;
  if (n > emu_reg_cap()) emu_error("setmaxnreg.dec above the kernel's register cap");
  emu_reg_pool += emu_reg_cap() - n;
}
inline void emu_setmaxnreg_inc(int n) {
  if (!emu_setmaxnreg_count_ok(n)) return;
  const long long need = n - emu_reg_cap();
  if (need < 0) emu_error("setmaxnreg.inc below the kernel's register cap");
  if (emu_wait_until([&] { return emu_reg_pool >= need; },
                     "setmaxnreg.inc (the registers released by setmaxnreg.dec in the CTA do not cover it)"))
    emu_reg_pool -= need;
}

// ---------------------------------------------------------------- ldmatrix and mma.sync

inline uint16_t emu_ld16(const void* row, int col) {
  uint16_t h;
  std::memcpy(&h, static_cast<const unsigned char*>(row) + 2 * col, 2);
  return h;
}
// ldmatrix.sync.aligned.m8n8.x4[.trans].b16: row = this lane's row address (16-bit elements)
inline void emu_ldmatrix_x4(uint32_t* r, const void* row, bool trans) {
  EmuWarp& w = emu_warp();
  const int l = emu_lane();
  w.p[l] = row;
  w.bar->arrive_and_wait();
  uint32_t out[4];
  for (int i = 0; i < 4; ++i) {
    uint16_t e0, e1;
    if (!trans) {  // row l/4 of matrix i, columns 2(l%4), 2(l%4)+1
      e0 = emu_ld16(w.p[8 * i + l / 4], 2 * (l % 4));
      e1 = emu_ld16(w.p[8 * i + l / 4], 2 * (l % 4) + 1);
    } else {  // column l/4 of matrix i, rows 2(l%4), 2(l%4)+1
      e0 = emu_ld16(w.p[8 * i + 2 * (l % 4)], l / 4);
      e1 = emu_ld16(w.p[8 * i + 2 * (l % 4) + 1], l / 4);
    }
    out[i] = (uint32_t)e0 | ((uint32_t)e1 << 16);
  }
  w.bar->arrive_and_wait();
  for (int i = 0; i < 4; ++i) r[i] = out[i];
}

template <bool BF>
inline float emu_half(uint32_t reg, int hi) {
  const uint16_t h = (uint16_t)(hi ? reg >> 16 : reg & 0xffffu);
  return BF ? __uint_as_float(((uint32_t)h) << 16) : emu_f16_to_f32(h);
}
// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: d[16x8] += a[16x16] b[16x8], fp32 accumulation
template <bool BF>
inline void emu_mma_m16n8k16(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  EmuWarp& w = emu_warp();
  const int l = emu_lane();
  for (int i = 0; i < 4; ++i) w.u[l][i] = a[i];
  w.u[l][4] = b0;
  w.u[l][5] = b1;
  w.bar->arrive_and_wait();
  float A[16][16], B[16][8];
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) A[r][c] = emu_half<BF>(w.u[(r % 8) * 4 + (c % 8) / 2][(r >= 8) + 2 * (c >= 8)], c % 2);
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < 8; ++n) B[k][n] = emu_half<BF>(w.u[n * 4 + (k % 8) / 2][4 + (k >= 8)], k % 2);
  w.bar->arrive_and_wait();
  const int g = l / 4, tig = l % 4;
  for (int i = 0; i < 4; ++i) {
    const int r = g + 8 * (i >= 2), n = 2 * tig + (i % 2);
    float acc = d[i];
    for (int k = 0; k < 16; ++k) acc += A[r][k] * B[k][n];
    d[i] = acc;
  }
}
