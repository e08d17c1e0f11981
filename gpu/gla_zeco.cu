// Tensor-core kernels for ZeCO's per-rank glue, 16-bit inputs (bf16 / fp16), K and V multiples of 16 up to 128.
// G is the inclusive cumulative log decay from the slice start (fp32 [B, T, H, K]); every exp(G) <= 1.
//
//   zeco_tc_correction: o[t] += scale * (q[t] * exp(G[t])) S_in          (per b, h; 128 tokens per block)
//   zeco_tc_qT_do     : U_part[seg] = scale * sum_{t in seg} (q[t] * exp(G[t]))^T do[t]   (sum the parts)
//
// Operands are rounded to 16 bits (S_in too); products accumulate in fp32 (mma.sync m16n8k16).
#include "gla_mma.cuh"

#define ZC_TOK 128  // tokens per block of the correction
#define ZC_SMEM_CORRECTION (64 * TC_KP * 2 + 128 * TC_KP * 2)  // gpu/gla_zeco.py mirrors it

// q*exp(G) of 64 rows t0.. (rows >= len zero) -> Qe[t][k] (16-bit, row stride TC_KP)
template <typename T>
GLA_DEVICE void zc_load_qe(u16* Qe, const T* __restrict__ q, const float* __restrict__ G, int b, int h, int t0,
                           int len, int Tlen, int H, int K) {
  const int k8 = K / 8;
  for (int e = threadIdx.x; e < 64 * k8; e += TC_THREADS) {
    const int t = e / k8, c = (e % k8) * 8;
    u32 w[4] = {0u, 0u, 0u, 0u};
    if (t < len) {
      const i64 off = ((i64)(b * Tlen + t0 + t) * H + h) * K + c;
      const V16 qv = ld16(q + off);
#pragma unroll
      for (int j = 0; j < 8; j += 2) {
        const float lo = bits_to_f<T>(half_of(qv, j)) * dexp(G[off + j]);
        const float hi = bits_to_f<T>(half_of(qv, j + 1)) * dexp(G[off + j + 1]);
        w[j / 2] = (u32)Mma<T>::cvt(lo) | ((u32)Mma<T>::cvt(hi) << 16);
      }
    }
    V16 out;
    out.w[0] = w[0];
    out.w[1] = w[1];
    out.w[2] = w[2];
    out.w[3] = w[3];
    *reinterpret_cast<V16*>(Qe + t * TC_KP + c) = out;
  }
}

template <typename T>
__global__ void __launch_bounds__(TC_THREADS) zeco_tc_correction(T* __restrict__ o, const T* __restrict__ q,
                                                                  const float* __restrict__ G,
                                                                  const float* __restrict__ S_in, float scale, int B,
                                                                  int Tlen, int H, int K, int V) {
  TC_DYN_SMEM(smem);  // ZC_SMEM_CORRECTION bytes: Qe [64][TC_KP], Ss [128][TC_KP] (16-bit)
  u16* Qe = reinterpret_cast<u16*>(smem);
  u16* Ss = reinterpret_cast<u16*>(smem + 64 * TC_KP * 2);
  const int bh = blockIdx.y, b = bh / H, h = bh % H;
  const int tid = threadIdx.x, w = tid / 32, lane = tid % 32, gid = lane >> 2, tig = lane & 3;
  const float* Sb = S_in + (i64)bh * K * V;
  for (int e = tid; e < K * V / 2; e += TC_THREADS) {  // S_in -> 16-bit row-major [k][v]
    const int kk = (2 * e) / V, j = (2 * e) % V;
    *reinterpret_cast<u32*>(Ss + kk * TC_KP + j) =
        (u32)Mma<T>::cvt(Sb[(i64)kk * V + j]) | ((u32)Mma<T>::cvt(Sb[(i64)kk * V + j + 1]) << 16);
  }
  for (int sub = 0; sub < ZC_TOK / 64; ++sub) {
    const int t0 = blockIdx.x * ZC_TOK + sub * 64;
    if (t0 >= Tlen) break;
    const int len = min(64, Tlen - t0);
    zc_load_qe<T>(Qe, q, G, b, h, t0, len, Tlen, H, K);
    __syncthreads();
    const int tw = w % 4, v0 = 64 * (w / 4);
    if (v0 < V) {
      float acc[8][4];
      set_zero(acc);
      for (int ks = 0; ks < K / 16; ++ks) {
        u32 a[4];
        frag_a(a, Qe, TC_KP, 16 * tw, 16 * ks, gid, tig);
        mma_n_tiles<T, true>(acc, a, Ss, TC_KP, 16 * ks, v0, V, lane);
      }
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int c = v0 + 8 * nt + 2 * tig;
        if (c < V) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int t = 16 * tw + gid + 8 * half;
            if (t < len) {
              u32* dst = reinterpret_cast<u32*>(o + ((i64)(b * Tlen + t0 + t) * H + h) * V + c);
              const u32 old = *dst;
              const float lo = bits_to_f<T>((u16)(old & 0xffffu)) + scale * acc[nt][2 * half];
              const float hi = bits_to_f<T>((u16)(old >> 16)) + scale * acc[nt][2 * half + 1];
              *dst = (u32)from_f<T>(lo).x | ((u32)from_f<T>(hi).x << 16);
            }
          }
        }
      }
    }
    __syncthreads();  // Qe is rewritten by the next sub-tile
  }
}

// U_part[bh, seg] (fp32 [K, V]) = scale * sum over the segment's tokens of (q*exp(G))^T do
template <typename T>
__global__ void __launch_bounds__(TC_THREADS, 1) zeco_tc_qT_do(const T* __restrict__ q, const float* __restrict__ G,
                                                               const T* __restrict__ dout, float* __restrict__ U_part,
                                                               float scale, int B, int Tlen, int H, int K, int V,
                                                               int NC, int NS) {
  __shared__ __align__(16) u16 Qe[64 * TC_KP];
  __shared__ __align__(16) u16 Ds[64 * TC_KP];
  const int seg = blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;
  const int tid = threadIdx.x, w = tid / 32, lane = tid % 32;
  float acc[16][4];
  set_zero(acc);
  const int v8 = V / 8;
  for (int ci = 0; ci < NC; ++ci) {
    const int t0 = (seg * NC + ci) * 64;
    if (t0 >= Tlen) break;
    const int len = min(64, Tlen - t0);
    zc_load_qe<T>(Qe, q, G, b, h, t0, len, Tlen, H, K);
    for (int e = tid; e < 64 * v8; e += TC_THREADS) {
      const int t = e / v8, c = (e % v8) * 8;
      V16 x = {{0u, 0u, 0u, 0u}};
      if (t < len) x = ld16(dout + ((i64)(b * Tlen + t0 + t) * H + h) * V + c);
      *reinterpret_cast<V16*>(Ds + t * TC_KP + c) = x;
    }
    __syncthreads();
    if (16 * w < K) {
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        u32 a[4];
        frag_a_trans(a, Qe, TC_KP, 16 * ks, 16 * w, lane);
        mma_n_tiles<T, true>(acc, a, Ds, TC_KP, 16 * ks, 0, V, lane);
      }
    }
    __syncthreads();
  }
  if (16 * w < K) store_state_frags(U_part + ((i64)bh * NS + seg) * K * V, acc, V, w, lane, scale);
}

#ifdef GLA_INSTANTIATE
template __global__ void zeco_tc_correction<bf16>(bf16*, const bf16*, const float*, const float*, float, int, int,
                                                  int, int, int);
template __global__ void zeco_tc_qT_do<bf16>(const bf16*, const float*, const bf16*, float*, float, int, int, int,
                                             int, int, int, int);
#ifndef GLA_INSTANTIATE_FAST
template __global__ void zeco_tc_correction<f16>(f16*, const f16*, const float*, const float*, float, int, int, int,
                                                 int, int);
template __global__ void zeco_tc_qT_do<f16>(const f16*, const float*, const f16*, float*, float, int, int, int, int,
                                            int, int, int);
#endif
#endif
