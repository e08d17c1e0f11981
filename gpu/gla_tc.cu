// Tensor-core GLA forward for 16-bit inputs (bf16 / fp16), chunk 64, K and V multiples of 16 up to 128.
//
// The sequence of each (b, h) is cut into segments of NC chunks of 64 tokens.
//   gla_tc_seg_state : per segment, its local state (zero start) and its total log decay
//   gla_state_scan   : (gla_kernels.cu) incoming state of every segment
//   gla_tc_seg_output: per segment, from its incoming state, chunk after chunk:
//                      o = scale * (A V + (q*exp(b)) S),  S <- diag(exp(bL)) S + (k*exp(bL-b))^T V
// Products run on mma.sync.m16n8k16 (16-bit operands, fp32 accumulation); S stays in fp32 registers
// (accumulator fragments) and is rounded to 16 bits only as the operand of (q*exp(b)) S.
// Intra-chunk scores A (64 x 64, lower triangle) come in 16 x 16 blocks of sub-chunks I >= J:
//   I > J:  (q_I * exp(b - r_I)) (k_J * exp(r_I - b))^T      both factors <= 1 (r_I = b at I's first row)
//   I == J: same with the diagonal k factor exp(r_I - b) >= 1, bounded by exp(span_I); where span_I
//           exceeds span_limit the block is computed elementwise: sum_k q k exp(b_t - b_s), s <= t.
#include "gla_mma.cuh"

// One chunk of q, k, v, g in registers: 16-byte pieces, four per thread per array (K, V <= 128).
struct ChunkRegs {
  V16 g[4], k[4], q[4], v[4];
};

// Issue the loads of one chunk (all before any use); rows t >= len and absent q are zero.
// Needs K, V multiples of 8 (<= 128) and 256 threads.
template <typename T>
GLA_DEVICE void tc_fetch(ChunkRegs& r, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                         const T* __restrict__ g, int b, int h, int t0, int len, int Tlen, int H, int K, int V) {
  const int tid = threadIdx.x, k8 = K / 8, v8 = V / 8;
  const V16 zero = {{0u, 0u, 0u, 0u}};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int e = tid + i * TC_THREADS;
    const int t = e / k8, c = (e % k8) * 8;
    const bool ok = e < 64 * k8 && t < len;
    const i64 off = ((i64)(b * Tlen + t0 + t) * H + h) * K + c;
    r.g[i] = ok ? ld16(g + off) : zero;
    r.k[i] = ok ? ld16(k + off) : zero;
    r.q[i] = (ok && q != nullptr) ? ld16(q + off) : zero;
    const int tv = e / v8, cv = (e % v8) * 8;
    r.v[i] = (e < 64 * v8 && tv < len) ? ld16(v + ((i64)(b * Tlen + t0 + tv) * H + h) * V + cv) : zero;
  }
}

// Registers -> shared memory: g -> bs (fp32), k -> Kraw[t][k], q -> Qraw[t][k] (if Qraw), v -> VT
// (L: row-major V[t][v]; else transposed VT[v][t]).
template <typename T, bool L>
GLA_DEVICE void tc_stash(const ChunkRegs& r, float* bs, u16* Qraw, u16* Kraw, u16* VT, int K, int V) {
  const int tid = threadIdx.x, k8 = K / 8, v8 = V / 8;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int e = tid + i * TC_THREADS;
    if (e < 64 * k8) {
      const int t = e / k8, c = (e % k8) * 8;
#pragma unroll
      for (int j = 0; j < 8; ++j) bs[t * TC_BP + c + j] = bits_to_f<T>(half_of(r.g[i], j));
      *reinterpret_cast<V16*>(Kraw + t * TC_KP + c) = r.k[i];
      if (Qraw != nullptr) *reinterpret_cast<V16*>(Qraw + t * TC_KP + c) = r.q[i];
    }
    if (e < 64 * v8) {
      const int tv = e / v8, cv = (e % v8) * 8;
      if constexpr (L) {
        *reinterpret_cast<V16*>(VT + tv * TC_KP + cv) = r.v[i];  // row-major V[t][v]
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) VT[(cv + j) * TC_CP + tv] = half_of(r.v[i], j);
      }
    }
  }
}

template <typename T, bool L>
GLA_DEVICE void tc_load_chunk(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                              const T* __restrict__ g, float* bs, u16* Qraw, u16* Kraw, u16* VT, int b, int h,
                              int t0, int len, int Tlen, int H, int K, int V) {
  ChunkRegs r;
  tc_fetch<T>(r, Qraw != nullptr ? q : nullptr, k, v, g, b, h, t0, len, Tlen, H, K, V);
  tc_stash<T, L>(r, bs, Qraw, Kraw, VT, K, V);
}

// inclusive cumulative sum over the 64 rows of bs, two threads per column (rows 0..31, 32..63)
GLA_DEVICE void tc_cumsum(float* bs, int K) {
  const int kk = threadIdx.x % 128, part = threadIdx.x / 128;
  if (kk < K) {
    float run = 0.f;
#pragma unroll 8
    for (int t = 32 * part; t < 32 * part + 32; ++t) {
      run += bs[t * TC_BP + kk];
      bs[t * TC_BP + kk] = run;
    }
  }
  __syncthreads();
  if (part == 1 && kk < K) {
    const float add = bs[31 * TC_BP + kk];
#pragma unroll 8
    for (int t = 32; t < 64; ++t) bs[t * TC_BP + kk] += add;
  }
}

// S (warp w owns rows 16w..16w+15 of K, all V in n8 tiles): S = diag(exp(bL)) S + KT V
// (L: KT holds (k*decay)[t][k] and VT holds V[t][v], both row-major, read with ldmatrix.trans)
template <typename T, bool L>
GLA_DEVICE void tc_state_update(float (&sacc)[16][4], const float* bs, const u16* KT, const u16* VT, int len, int K,
                                int V, int w, int gid, int tig) {
  const int lane = 4 * gid + tig;
  if (16 * w >= K) return;
  const float e0 = dexp(bs[(len - 1) * TC_BP + 16 * w + gid]);
  const float e1 = dexp(bs[(len - 1) * TC_BP + 16 * w + gid + 8]);
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) {
    sacc[nt][0] *= e0;
    sacc[nt][1] *= e0;
    sacc[nt][2] *= e1;
    sacc[nt][3] *= e1;
  }
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    u32 a[4];
    if constexpr (L) {
      frag_a_trans(a, KT, TC_KP, 16 * ks, 16 * w, lane);
      mma_n_tiles<T, true>(sacc, a, VT, TC_KP, 16 * ks, 0, V, lane);
    } else {  // one n8 tile at a time
      frag_a(a, KT, TC_CP, 16 * w, 16 * ks, gid, tig);
#pragma unroll
      for (int nt = 0; nt < 16; ++nt) {
        if (8 * nt < V) {
          u32 bb[2];
          frag_b(bb, VT, TC_CP, 8 * nt, 16 * ks, gid, tig);
          Mma<T>::mma(sacc[nt], a, bb);
        }
      }
    }
  }
}

// per segment: local state from zero (st[bh, seg] fp32 [K, V]) and total log decay (gseg[bh, seg, K])
template <typename T, bool L>
__global__ void __launch_bounds__(TC_THREADS, 1) gla_tc_seg_state(const T* __restrict__ k, const T* __restrict__ v,
                                                                const T* __restrict__ g, float* __restrict__ st,
                                                                float* __restrict__ gseg, int B, int Tlen, int H,
                                                                int K, int V, int NC, int NS) {
  TC_DYN_SMEM(smem);
  float* bs = reinterpret_cast<float*>(smem + TC_OFF_BS);
  u16* VT = reinterpret_cast<u16*>(smem + TC_OFF_VT);
  u16* KT = reinterpret_cast<u16*>(smem + TC_OFF_KT);
  u16* Kr = reinterpret_cast<u16*>(smem + TC_OFF_KR);
  const int seg = blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;
  const int tid = threadIdx.x, w = tid / 32, lane = tid % 32, gid = lane >> 2, tig = lane & 3;
  float sacc[16][4];
  set_zero(sacc);
  float gsum = 0.f;  // thread kk = tid (< K) accumulates the segment's total log decay
  for (int ci = 0; ci < NC; ++ci) {
    const int t0 = (seg * NC + ci) * 64;
    if (t0 >= Tlen) break;
    const int len = min(64, Tlen - t0);
    tc_load_chunk<T, L>(nullptr, k, v, g, bs, nullptr, Kr, VT, b, h, t0, len, Tlen, H, K, V);
    __syncthreads();
    tc_cumsum(bs, K);
    __syncthreads();
    if (tid < K) gsum += bs[(len - 1) * TC_BP + tid];
    for (int e = tid; e < 64 * K; e += TC_THREADS) {
      const int t = e / K, kk = e % K;
      const float kv = bits_to_f<T>(Kr[t * TC_KP + kk]);
      const u16 kd = Mma<T>::cvt(kv * dexp(bs[(len - 1) * TC_BP + kk] - bs[t * TC_BP + kk]));
      if constexpr (L)
        KT[t * TC_KP + kk] = kd;
      else
        KT[kk * TC_CP + t] = kd;
    }
    __syncthreads();
    tc_state_update<T, L>(sacc, bs, KT, VT, len, K, V, w, gid, tig);
    __syncthreads();
  }
  if (16 * w < K) store_state_frags(st + ((i64)bh * NS + seg) * K * V, sacc, V, w, lane);
  if (tid < K) gseg[((i64)bh * NS + seg) * K + tid] = gsum;
}

// per segment, from its incoming state S_in[bh, seg]: o for every token of the segment
// One chunk per block: mode 0: out[bh, c] = sum_t (left_t * exp(bL - b_t))^T right_t   (local chunk state)
//                     mode 1: out[bh, c] = scale * sum_t (left_t * exp(b_t))^T right_t (local d-state)
// with b the gate's cumulative sum inside the chunk (fp32 [K, V] per chunk); gtot[bh, c] = bL (log decay).
template <typename T>
__global__ void __launch_bounds__(TC_THREADS, 1) gla_tc_chunk_outer(const T* __restrict__ left,
                                                                    const T* __restrict__ right,
                                                                    const T* __restrict__ g, float* __restrict__ out,
                                                                    float* __restrict__ gtot, int B, int Tlen, int H,
                                                                    int K, int V, int NT, int mode, float scale) {
  TC_DYN_SMEM(smem);
  float* bs = reinterpret_cast<float*>(smem + TC_OFF_BS);
  u16* Rs = reinterpret_cast<u16*>(smem + TC_OFF_VT);  // right, row-major [t][v]
  u16* Ld = reinterpret_cast<u16*>(smem + TC_OFF_KT);  // left * decay, row-major [t][k]
  u16* Lr = reinterpret_cast<u16*>(smem + TC_OFF_KR);  // left, raw
  const int c = blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;
  const int tid = threadIdx.x, w = tid / 32, lane = tid % 32, gid = lane >> 2, tig = lane & 3;
  const int t0 = c * 64, len = min(64, Tlen - t0);
  tc_load_chunk<T, true>(nullptr, left, right, g, bs, nullptr, Lr, Rs, b, h, t0, len, Tlen, H, K, V);
  __syncthreads();
  tc_cumsum(bs, K);
  __syncthreads();
  for (int e = tid; e < 64 * K; e += TC_THREADS) {
    const int t = e / K, kk = e % K;
    const float lv = bits_to_f<T>(Lr[t * TC_KP + kk]);
    const float bt = bs[t * TC_BP + kk];
    const float f = mode == 0 ? dexp(bs[(len - 1) * TC_BP + kk] - bt) : scale * dexp(bt);
    Ld[t * TC_KP + kk] = Mma<T>::cvt(lv * f);
  }
  __syncthreads();
  float sacc[16][4];
  set_zero(sacc);
  tc_state_update<T, true>(sacc, bs, Ld, Rs, len, K, V, w, gid, tig);
  if (16 * w < K) store_state_frags(out + ((i64)bh * NT + c) * K * V, sacc, V, w, lane);
  if (gtot != nullptr && tid < K) gtot[((i64)bh * NT + c) * K + tid] = bs[(len - 1) * TC_BP + tid];
}

// PF: the next chunk's loads are issued into registers before this chunk's matrix work (overlap)
template <typename T, bool L, bool PF>
__global__ void __launch_bounds__(TC_THREADS, 1)
    gla_tc_seg_output(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                      const T* __restrict__ g, const float* __restrict__ S_in, T* __restrict__ o, float scale, int B,
                      int Tlen, int H, int K, int V, int NC, int NS, float span_limit, const float* __restrict__ S0,
                      const float* __restrict__ pre) {
  TC_DYN_SMEM(smem);
  float* bs = reinterpret_cast<float*>(smem + TC_OFF_BS);
  u16* VT = reinterpret_cast<u16*>(smem + TC_OFF_VT);
  u16* KT = reinterpret_cast<u16*>(smem + TC_OFF_KT);
  u16* Qh = reinterpret_cast<u16*>(smem + TC_OFF_QH);
  u16* Kh = reinterpret_cast<u16*>(smem + TC_OFF_KH);
  u16* Ko = reinterpret_cast<u16*>(smem + TC_OFF_KO);
  u16* Qi = reinterpret_cast<u16*>(smem + TC_OFF_QI);
  u16* As = reinterpret_cast<u16*>(smem + TC_OFF_AS);
  u16* ST = reinterpret_cast<u16*>(smem + TC_OFF_ST);
  float* span = reinterpret_cast<float*>(smem + TC_OFF_SP);
  const int seg = blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;
  const int tid = threadIdx.x, w = tid / 32, lane = tid % 32, gid = lane >> 2, tig = lane & 3;

  float sacc[16][4];
  {
    const float* Sb = S_in + ((i64)bh * NS + seg) * K * V;  // zero-start incoming state of the segment
    const int r = 16 * w + gid;
    float e0 = 0.f, e1 = 0.f;  // exp(log decay before the segment) for rows r, r + 8: weight of S0
    if (S0 != nullptr && 16 * w < K) {
      e0 = dexp(pre[((i64)bh * NS + seg) * K + r]);
      e1 = dexp(pre[((i64)bh * NS + seg) * K + r + 8]);
    }
    const float* S0b = S0 != nullptr ? S0 + (i64)bh * K * V : nullptr;
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      const int c = 8 * nt + 2 * tig;
      const bool ok = 16 * w < K && c < V;
      sacc[nt][0] = ok ? Sb[(i64)r * V + c] : 0.f;
      sacc[nt][1] = ok ? Sb[(i64)r * V + c + 1] : 0.f;
      sacc[nt][2] = ok ? Sb[(i64)(r + 8) * V + c] : 0.f;
      sacc[nt][3] = ok ? Sb[(i64)(r + 8) * V + c + 1] : 0.f;
      if (ok && S0b != nullptr) {
        sacc[nt][0] += e0 * S0b[(i64)r * V + c];
        sacc[nt][1] += e0 * S0b[(i64)r * V + c + 1];
        sacc[nt][2] += e1 * S0b[(i64)(r + 8) * V + c];
        sacc[nt][3] += e1 * S0b[(i64)(r + 8) * V + c + 1];
      }
    }
  }
  for (int e = tid; e < 64 * TC_CP; e += TC_THREADS) As[e] = 0;  // upper blocks stay zero
  __syncthreads();
  ChunkRegs nxt;  // PF: the chunk loaded ahead

  for (int ci = 0; ci < NC; ++ci) {
    const int t0 = (seg * NC + ci) * 64;
    if (t0 >= Tlen) break;
    const int len = min(64, Tlen - t0);
    // (a) g, v, q (raw, into Qi), k (raw, into Kh)
    if constexpr (PF) {
      if (ci == 0) tc_fetch<T>(nxt, q, k, v, g, b, h, t0, len, Tlen, H, K, V);
      tc_stash<T, L>(nxt, bs, Qi, Kh, VT, K, V);
    } else {
      tc_load_chunk<T, L>(q, k, v, g, bs, Qi, Kh, VT, b, h, t0, len, Tlen, H, K, V);
    }
    if (tid < 4) span[tid] = 0.f;
    // S (incoming state of this chunk) as the 16-bit operand ST[v][k]
    if (16 * w < K) {
#pragma unroll
      for (int nt = 0; nt < 16; ++nt) {
        const int c = 8 * nt + 2 * tig, r = 16 * w + gid;
        if (c < V) {
          if constexpr (L) {  // row-major S[k][v], two columns per 32-bit store
            *reinterpret_cast<u32*>(ST + r * TC_KP + c) =
                (u32)Mma<T>::cvt(sacc[nt][0]) | ((u32)Mma<T>::cvt(sacc[nt][1]) << 16);
            *reinterpret_cast<u32*>(ST + (r + 8) * TC_KP + c) =
                (u32)Mma<T>::cvt(sacc[nt][2]) | ((u32)Mma<T>::cvt(sacc[nt][3]) << 16);
          } else {
            ST[c * TC_KP + r] = Mma<T>::cvt(sacc[nt][0]);
            ST[(c + 1) * TC_KP + r] = Mma<T>::cvt(sacc[nt][1]);
            ST[c * TC_KP + r + 8] = Mma<T>::cvt(sacc[nt][2]);
            ST[(c + 1) * TC_KP + r + 8] = Mma<T>::cvt(sacc[nt][3]);
          }
        }
      }
    }
    __syncthreads();
    // (b) cumulative gate inside the chunk; span of each sub-chunk
    tc_cumsum(bs, K);
    __syncthreads();
    // (c) operands (each thread rewrites the raw q / k elements it read, in place)
    for (int e = tid; e < 64 * K; e += TC_THREADS) {
      const int t = e / K, kk = e % K, I = t / 16;
      const float qv = bits_to_f<T>(Qi[t * TC_KP + kk]);
      const float kv = bits_to_f<T>(Kh[t * TC_KP + kk]);
      const float bt = bs[t * TC_BP + kk];
      const float r = bs[(16 * I) * TC_BP + kk];
      if (t % 16 == 0) {  // span of sub-chunk I along this column (>= 0: float order == int order)
        const float sp = fmaxf(r - bs[(t + 15) * TC_BP + kk], 0.f);
        atomicMax(reinterpret_cast<int*>(span) + I, float_to_int_bits(sp));
      }
      Qh[t * TC_KP + kk] = Mma<T>::cvt(qv * dexp(bt - r));
      Qi[t * TC_KP + kk] = Mma<T>::cvt(qv * dexp(bt));
      Kh[t * TC_KP + kk] = Mma<T>::cvt(kv * expf(fminf(r - bt, span_limit)));
      const u16 kd = Mma<T>::cvt(kv * dexp(bs[(len - 1) * TC_BP + kk] - bt));
      if constexpr (L)
        KT[t * TC_KP + kk] = kd;
      else
        KT[kk * TC_CP + t] = kd;
      for (int I2 = I + 1; I2 < 4; ++I2) {
        const int pair = I2 * (I2 - 1) / 2 + I;
        Ko[(pair * 16 + (t % 16)) * TC_KP + kk] = Mma<T>::cvt(kv * dexp(bs[(16 * I2) * TC_BP + kk] - bt));
      }
    }
    __syncthreads();
    if constexpr (PF) {  // issue the next chunk's loads now; they land while the matrix work runs
      const int tn = t0 + 64;
      if (ci + 1 < NC && tn < Tlen) tc_fetch<T>(nxt, q, k, v, g, b, h, tn, min(64, Tlen - tn), Tlen, H, K, V);
    }
    // (d) intra-chunk scores, 10 blocks (I >= J) of 16 x 16 over 8 warps
    for (int blk = w; blk < 10; blk += 8) {
      int I = 0, J = 0;
      {
        int n = blk;  // blocks in order (0,0) (1,0) (1,1) (2,0) (2,1) (2,2) (3,0) ...
        while (n > I) {
          n -= I + 1;
          ++I;
        }
        J = n;
      }
      if (I == J && span[I] > span_limit) {  // exact elementwise diagonal block
        for (int p = lane; p < 256; p += 32) {
          const int tl = p / 16, sl = p % 16, t = 16 * I + tl, s = 16 * I + sl;
          float a = 0.f;
          if (sl <= tl && t < len) {
            const i64 it = ((i64)(b * Tlen + t0 + t) * H + h) * K, is = ((i64)(b * Tlen + t0 + s) * H + h) * K;
            for (int kk = 0; kk < K; ++kk)
              a += to_f(q[it + kk]) * to_f(k[is + kk]) * dexp(bs[t * TC_BP + kk] - bs[s * TC_BP + kk]);
          }
          As[t * TC_CP + s] = Mma<T>::cvt(a);
        }
        continue;
      }
      const u16* Bop = (I == J) ? (Kh + 16 * I * TC_KP) : (Ko + (I * (I - 1) / 2 + J) * 16 * TC_KP);
      float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
      for (int ks = 0; ks < K / 16; ++ks) {
        u32 a[4];
        frag_a(a, Qh, TC_KP, 16 * I, 16 * ks, gid, tig);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          u32 bb[2];
          frag_b(bb, Bop, TC_KP, 8 * nt, 16 * ks, gid, tig);
          Mma<T>::mma(acc[nt], a, bb);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int tl = gid + (i >= 2 ? 8 : 0), sl = 8 * nt + 2 * tig + (i & 1);
          const float val = (I == J && sl > tl) ? 0.f : acc[nt][i];
          As[(16 * I + tl) * TC_CP + 16 * J + sl] = Mma<T>::cvt(val);
        }
    }
    __syncthreads();
    // (e) o = scale * (A V + Qi S): warp w -> rows 16 (w % 4), columns 64 (w / 4) .. + 63
    {
      const int tw = w % 4, v0 = 64 * (w / 4);
      if (v0 < V) {
        float oacc[8][4];
        set_zero(oacc);
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
          u32 a[4];
          frag_a(a, As, TC_CP, 16 * tw, 16 * ks, gid, tig);
          mma_n_tiles<T, L>(oacc, a, VT, L ? TC_KP : TC_CP, 16 * ks, v0, V, lane);
        }
        for (int ks = 0; ks < K / 16; ++ks) {
          u32 a[4];
          frag_a(a, Qi, TC_KP, 16 * tw, 16 * ks, gid, tig);
          mma_n_tiles<T, L>(oacc, a, ST, TC_KP, 16 * ks, v0, V, lane);
        }
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const int c = v0 + 8 * nt + 2 * tig;
          if (c < V) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const int t = 16 * tw + gid + 8 * half;
              if (t < len) {
                const u32 lo = from_f<T>(scale * oacc[nt][2 * half]).x;
                const u32 hi = from_f<T>(scale * oacc[nt][2 * half + 1]).x;
                *reinterpret_cast<u32*>(o + ((i64)(b * Tlen + t0 + t) * H + h) * V + c) = lo | (hi << 16);
              }
            }
          }
        }
      }
    }
    // (f) state update (reads bs, KT, VT only)
    tc_state_update<T, L>(sacc, bs, KT, VT, len, K, V, w, gid, tig);
    __syncthreads();
  }
}

#ifdef GLA_INSTANTIATE
#define GLA_INST_TC(T, L, PF)                                                                                       \
  template __global__ void gla_tc_seg_state<T, L>(const T*, const T*, const T*, float*, float*, int, int, int, int, \
                                                  int, int, int);                                                   \
  template __global__ void gla_tc_seg_output<T, L, PF>(const T*, const T*, const T*, const T*, const float*, T*,    \
                                                       float, int, int, int, int, int, int, int, float, const float*, \
                                                       const float*);
GLA_INST_TC(bf16, true, true)
GLA_INST_TC(f16, false, false)
template __global__ void gla_tc_chunk_outer<bf16>(const bf16*, const bf16*, const bf16*, float*, float*, int, int, int,
                                                  int, int, int, int, float);
#ifndef GLA_INSTANTIATE_FAST
GLA_INST_TC(bf16, false, false)
GLA_INST_TC(f16, true, true)
template __global__ void gla_tc_seg_output<bf16, true, false>(const bf16*, const bf16*, const bf16*, const bf16*,
                                                              const float*, bf16*, float, int, int, int, int, int,
                                                              int, int, float, const float*, const float*);
#endif
#endif
