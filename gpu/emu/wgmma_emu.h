// CPU model of the warpgroup MMA of sm_90a (wgmma), part of the CUDA emulation: built on the execution
// model of emu_core.h (warps, checks, dynamic shared memory and proxy state); cuda_emu.h includes both.
// Kernels reach it through their own wrappers under CUDA_EMU (gpu/daaf_hopper_ptx.cuh).
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
//   on the shared-memory address itself (the emulated dynamic shared memory starts at address 0).
//   A from registers: warp w of the warpgroup holds rows 16w .. 16w+15 in the mma.m16n8k16 A layout;
//   accumulator value v of lane l of warp w: row 16w + l/4 + 8((v/2)%2), column 8(v/4) + 2(l%4) + v%2.
// Asynchrony: an issued wgmma is only recorded (operands read and snapshotted, accumulator
// snapshotted); commit_group closes a batch; wait_group N computes the retired batches in order
// and writes the accumulators then. So a kernel that reads accumulators before the wait sees stale
// values, as on the GPU. Errors recorded (emu_error):
//   * a wgmma without a wgmma.fence since the thread's last wait_group (or start);
//   * an operand in shared memory written by cp.async (the generic proxy) without a later
//     fence.proxy.async by the writing thread;
//   * shared-memory operand bytes that changed between issue and retirement (a write racing the
//     asynchronous read), accumulator or A registers changed while their wgmma was pending;
//   * wgmma batches still pending at kernel exit; descriptor base offset != 0.
#pragma once

#include "emu_core.h"

struct EmuWgDesc {
  uint32_t start, lbo, sbo;
  int base_off, layout;
};
inline EmuWgDesc emu_wgmma_decode(unsigned long long d) {
  EmuWgDesc r;
  r.start = (uint32_t)(d & 0x3FFFu) << 4;
  r.lbo = (uint32_t)((d >> 16) & 0x3FFFu) << 4;
  r.sbo = (uint32_t)((d >> 32) & 0x3FFFu) << 4;
  r.base_off = (int)((d >> 49) & 7u);
  r.layout = (int)((d >> 62) & 3u);
  if (r.base_off) emu_error("wgmma descriptor base offset != 0 is not modelled");
  return r;
}
inline uint32_t emu_wgmma_swizzle(uint32_t a, int layout) {
  const int b = layout == 1 ? 3 : layout == 2 ? 2 : layout == 3 ? 1 : 0;
  return a ^ (((a >> 7) & ((1u << b) - 1u)) << 4);
}
inline int emu_wgmma_width(int layout) { return layout == 1 ? 128 : layout == 2 ? 64 : 32; }
// byte address of element (mn, k) of a K-major operand, k < 16
inline uint32_t emu_wgmma_addr_k(const EmuWgDesc& d, int mn, int k) {
  if (d.layout == 0) return d.start + (mn % 8) * 16 + (mn / 8) * d.sbo + (k % 8) * 2 + (k / 8) * d.lbo;
  return emu_wgmma_swizzle(d.start + (mn % 8) * emu_wgmma_width(d.layout) + (mn / 8) * d.sbo + 2 * k, d.layout);
}
// byte address of element (k, mn) of an MN-major operand, k < 16
inline uint32_t emu_wgmma_addr_mn(const EmuWgDesc& d, int k, int mn) {
  if (d.layout == 0) return d.start + (mn % 8) * 2 + (mn / 8) * d.sbo + (k % 8) * 16 + (k / 8) * d.lbo;
  const int sb = emu_wgmma_width(d.layout), e = sb / 2;
  return emu_wgmma_swizzle(d.start + (mn % e) * 2 + (mn / e) * d.lbo + (k % 8) * sb + (k / 8) * d.sbo, d.layout);
}

// a 16-bit operand at shared address `addr` as fp32 (at issue: the async proxy must see it)
inline float emu_wgmma_smem16(bool bf, uint32_t addr, bool at_issue) {
  if (addr + 2 > emu_smem_bytes) {
    emu_error("wgmma operand beyond the dynamic shared memory");
    return 0.f;
  }
  if (at_issue && !emu_async_proxy_sees(addr))
    emu_error(emu_unfenced_writer[addr / 16].load() == EMU_TMA_WRITER
                  ? "wgmma reads shared memory a tensor copy wrote before this thread waited on the copy's mbarrier"
                  : "wgmma reads shared memory written through the generic proxy without fence.proxy.async");
  uint16_t h;
  std::memcpy(&h, emu_smem_base + addr, 2);
  return bf ? __uint_as_float(((uint32_t)h) << 16) : emu_f16_to_f32(h);
}

struct EmuWgOp {
  float* d;
  int n;  // N of the instruction
  int scale_d;
  bool bf;
  int tnsp_b;
  unsigned long long da, db;  // da: 0 with A from registers
  const uint32_t* ap;         // the A registers of this thread (nullptr: A from shared memory)
  uint32_t aval[4];
  float a[2][16];           // this thread's two A rows
  std::vector<float> b;     // [16][N/4]: B columns of this thread's accumulators
  std::vector<float> snap;  // accumulator at issue (updated when an earlier wgmma on it retires)
  std::vector<float> orig;  // accumulator at issue
};
inline EmuPerThread<std::vector<EmuWgOp>> emu_wg_open_pt;  // issued, not yet committed
#define emu_wg_open (emu_wg_open_pt.get())
inline EmuPerThread<std::deque<std::vector<EmuWgOp>>> emu_wg_groups_pt;  // committed batches, pending
#define emu_wg_groups (emu_wg_groups_pt.get())
inline EmuPerThread<bool> emu_wg_fenced_pt{false};
#define emu_wg_fenced (emu_wg_fenced_pt.get())

// the shared-memory operands of op as this thread uses them (at issue: checks the proxy fence)
inline void emu_wgmma_read_operands(const EmuWgOp& op, bool at_issue, std::vector<float>& bout, float (*aout)[16]) {
  const int warp = (emu_tid() >> 5) & 3, lane = emu_lane(), g = lane >> 2, tq = lane & 3;
  const EmuWgDesc db = emu_wgmma_decode(op.db);
  const int nc = op.n / 4;
  bout.assign(16 * nc, 0.f);
  for (int k = 0; k < 16; ++k)
    for (int c = 0; c < nc; ++c) {
      const int n = 8 * (c >> 1) + 2 * tq + (c & 1);
      const uint32_t addr = op.tnsp_b ? emu_wgmma_addr_mn(db, k, n) : emu_wgmma_addr_k(db, n, k);
      bout[k * nc + c] = emu_wgmma_smem16(op.bf, addr, at_issue);
    }
  if (op.ap == nullptr) {
    const EmuWgDesc da = emu_wgmma_decode(op.da);
    for (int hh = 0; hh < 2; ++hh)
      for (int k = 0; k < 16; ++k)
        aout[hh][k] = emu_wgmma_smem16(op.bf, emu_wgmma_addr_k(da, 16 * warp + g + 8 * hh, k), at_issue);
  }
}

// wgmma.mma_async m64nNk16: d[N/2] (this thread's accumulators) (+)= A B; A from the registers `a` (the
// warp's A fragments) or, with a == nullptr, through descriptor da; B through db (tnsp_b: MN-major)
template <bool BF, int N>
inline void emu_wgmma(float* d, const uint32_t* a, unsigned long long da, unsigned long long db, int tnsp_b,
                      int scale_d) {
  if (!emu_wg_fenced) emu_error("wgmma without wgmma.fence since the last wait_group");
  EmuWgOp op{d, N, scale_d, BF, tnsp_b, da, db, a, {}, {}, {}, {}, {}};
  if (a != nullptr) {  // rows g (regs 0, 2) and g + 8 (regs 1, 3) of lanes 4g .. 4g+3
    EmuWarp& w = emu_warp();
    const int lane = emu_lane(), g = lane >> 2;
    for (int r = 0; r < 4; ++r) w.u[lane][r] = op.aval[r] = a[r];
    w.bar->arrive_and_wait();
    for (int hh = 0; hh < 2; ++hh)
      for (int k = 0; k < 16; ++k) op.a[hh][k] = emu_half<BF>(w.u[g * 4 + (k % 8) / 2][hh + 2 * (k >= 8)], k % 2);
    w.bar->arrive_and_wait();
  }
  emu_wgmma_read_operands(op, true, op.b, op.a);
  op.snap.assign(d, d + N / 2);
  op.orig = op.snap;
  auto same_acc = [&](const EmuWgOp& x) {
    if (x.d == d && std::memcmp(x.orig.data(), d, sizeof(float) * (N / 2)) != 0)
      emu_error("accumulator registers written while an earlier wgmma on them was pending");
  };
  for (const auto& x : emu_wg_open) same_acc(x);
  for (const auto& grp : emu_wg_groups)
    for (const auto& x : grp) same_acc(x);
  emu_wg_open.push_back(std::move(op));
}

inline void emu_wgmma_retire(EmuWgOp& op) {
  const int nv = op.n / 2, nc = op.n / 4;
  if (std::memcmp(op.snap.data(), op.d, sizeof(float) * nv) != 0)
    emu_error("accumulator registers changed while their wgmma was pending (read/write before wait_group)");
  if (op.ap != nullptr)
    for (int r = 0; r < 4; ++r)
      if (op.ap[r] != op.aval[r]) emu_error("A registers changed while their wgmma was pending");
  std::vector<float> b2;
  float a2[2][16];
  std::memcpy(a2, op.a, sizeof a2);
  emu_wgmma_read_operands(op, false, b2, a2);
  if (b2 != op.b || std::memcmp(a2, op.a, sizeof a2) != 0)
    emu_error("shared-memory operand of a pending wgmma was overwritten before wait_group");
  std::vector<float> res(nv);
  for (int x = 0; x < nv; ++x) {
    const int hh = (x >> 1) & 1, c = 2 * (x >> 2) + (x & 1);
    float acc = op.scale_d ? op.snap[x] : 0.f;
    for (int k = 0; k < 16; ++k) acc += op.a[hh][k] * op.b[k * nc + c];
    res[x] = acc;
  }
  std::memcpy(op.d, res.data(), sizeof(float) * nv);
  auto chain = [&](EmuWgOp& y) {
    if (&y != &op && y.d == op.d) y.snap = res;
  };
  for (auto& y : emu_wg_open) chain(y);
  for (auto& grp : emu_wg_groups)
    for (auto& y : grp) chain(y);
}

// wgmma.fence, wgmma.commit_group, wgmma.wait_group N
inline void emu_wgmma_fence() { emu_wg_fenced = true; }
inline void emu_wgmma_commit() {
  emu_wg_groups.push_back(std::move(emu_wg_open));
  emu_wg_open.clear();
}
inline void emu_wgmma_wait(int pending) {
  while ((int)emu_wg_groups.size() > pending) {
    for (auto& op : emu_wg_groups.front()) emu_wgmma_retire(op);
    emu_wg_groups.pop_front();
  }
  emu_wg_fenced = false;
}

inline void emu_wgmma_exit_checks() {
  if (!emu_wg_open.empty() || !emu_wg_groups.empty()) emu_error("wgmma still pending at kernel exit");
}
