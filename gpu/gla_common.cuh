// Common definitions for the GLA kernels (compiled by NVRTC through cupy.RawModule, by nvcc for
// the build check, and by g++ after gpu/emu/cuda_emu.h for the CPU emulation, which defines CUDA_EMU
// and the intrinsics used here). No CUDA headers are included: 16-bit types are plain structs
// converted with bit operations, so NVRTC needs no include path besides this folder.
#pragma once

#define GLA_DEVICE __device__ __forceinline__

typedef long long i64;

struct bf16 {
  unsigned short x;
};
struct f16 {
  unsigned short x;
};

GLA_DEVICE float bits_to_float(unsigned int u) { return __uint_as_float(u); }
GLA_DEVICE unsigned int float_to_bits(float f) { return __float_as_uint(f); }

GLA_DEVICE float to_f(float v) { return v; }
GLA_DEVICE float to_f(double v) { return (float)v; }
GLA_DEVICE float to_f(bf16 v) { return bits_to_float(((unsigned int)v.x) << 16); }
GLA_DEVICE unsigned short f2bf_bits(float f) {
  unsigned int u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                                   // round to nearest even
  return (unsigned short)(u >> 16);
}
GLA_DEVICE float to_f(f16 v) {
#ifndef CUDA_EMU
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.x));
  return f;
#else
  return emu_f16_to_f32(v.x);
#endif
}
GLA_DEVICE unsigned short f2h_bits(float f) {
#ifndef CUDA_EMU
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  return emu_f32_to_f16(f);
#endif
}
// a 16-bit type (bf16, f16) holding the bit pattern u
template <typename H>
GLA_DEVICE H from_bits(unsigned short u) {
  H r;
  r.x = u;
  return r;
}

template <typename T>
struct Conv;
template <>
struct Conv<float> {
  static GLA_DEVICE float from(float f) { return f; }
};
template <>
struct Conv<double> {
  static GLA_DEVICE double from(float f) { return (double)f; }
};
template <>
struct Conv<bf16> {
  static GLA_DEVICE bf16 from(float f) { return from_bits<bf16>(f2bf_bits(f)); }
};
template <>
struct Conv<f16> {
  static GLA_DEVICE f16 from(float f) { return from_bits<f16>(f2h_bits(f)); }
};
template <typename T>
GLA_DEVICE T from_f(float f) {
  return Conv<T>::from(f);
}

// exp of a non-positive argument (all decay factors here are <= 1); __expf is accurate to ~2 ulp
// for such arguments and flushes very negative ones to 0, which is the right limit.
GLA_DEVICE float dexp(float x) { return __expf(x); }

// x = 0 (a register tile: accumulators, fragments)
template <int R, int C>
GLA_DEVICE void set_zero(float (&x)[R][C]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int c = 0; c < C; ++c) x[r][c] = 0.f;
}
