// Common definitions for the GLA kernels (compiled by NVRTC through cupy.RawModule, by nvcc for
// the build check, and by g++ through gpu/emu/cuda_emu.h for the CPU emulation test).
// No CUDA headers are included: 16-bit types are plain structs converted with bit operations,
// so NVRTC needs no include path besides this folder.
#pragma once

#ifndef GLA_EMU
#define GLA_DEVICE __device__ __forceinline__
#else
#define GLA_DEVICE inline
#endif

typedef long long i64;

struct bf16 {
  unsigned short x;
};
struct f16 {
  unsigned short x;
};

GLA_DEVICE float bits_to_float(unsigned int u) {
#ifndef GLA_EMU
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, 4);
  return f;
#endif
}
GLA_DEVICE unsigned int float_to_bits(float f) {
#ifndef GLA_EMU
  return __float_as_uint(f);
#else
  unsigned int u;
  memcpy(&u, &f, 4);
  return u;
#endif
}

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
#ifndef GLA_EMU
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.x));
  return f;
#else
  _Float16 h;
  memcpy(&h, &v.x, 2);
  return (float)h;
#endif
}
GLA_DEVICE unsigned short f2h_bits(float f) {
#ifndef GLA_EMU
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  _Float16 h = (_Float16)f;
  unsigned short u;
  memcpy(&u, &h, 2);
  return u;
#endif
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
  static GLA_DEVICE bf16 from(float f) {
    bf16 r;
    r.x = f2bf_bits(f);
    return r;
  }
};
template <>
struct Conv<f16> {
  static GLA_DEVICE f16 from(float f) {
    f16 r;
    r.x = f2h_bits(f);
    return r;
  }
};
template <typename T>
GLA_DEVICE T from_f(float f) {
  return Conv<T>::from(f);
}

// exp of a non-positive argument (all decay factors here are <= 1); __expf is accurate to ~2 ulp
// for such arguments and flushes very negative ones to 0, which is the right limit.
GLA_DEVICE float dexp(float x) {
#ifndef GLA_EMU
  return __expf(x);
#else
  return expf(x);
#endif
}
