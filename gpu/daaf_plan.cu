// DAAF planning on the device, loaded by hpczeco/gpu/daaf_plan.py with cupy.RawModule (and by the CPU
// emulation, gpu/emu). The rules are the CPU planner's (hpczeco/daaf/planner.py):
//
//   daaf_plan_entropy_{i32,i64}  one block per scan window w (start s = w * stride for the nreg regular
//                                windows, T - window for the one aligned to the end): the window's ids are
//                                sorted in shared memory (bitonic, padded to a power of two P2 with the
//                                largest int64), the runs of equal ids are counted into a histogram of
//                                run lengths c (shared memory), and h = sum_c n_c * (-p log2 p), p = c /
//                                window, over c in a fixed order (float64): a function of the window's
//                                count multiset, so windows equal up to a permutation of ids score
//                                exactly equal (ties rank by position, as on the CPU); with Miller-Madow the term
//                                (m - 1) / (2 window ln 2) is added (m: number of runs). Output: the
//                                normalised score clip(h / log2cap, 0, 1) (0 when log2cap == 0), and the
//                                smallest / largest id of the tokens [s, e) (e: the next window's start,
//                                or T: every token is looked at once, gaps of stride > window included).
//                                No vocabulary-sized histogram: ids may be any int64.
//   daaf_plan_select             ONE block: reduce the window scores (min, max, count >= threshold) and the
//                                id range; decide the policy (threshold, or the dense fallback / a report
//                                to the host when the rule cannot decide); chosen windows -> per-token
//                                key-region mask -> compaction (block-level scans over chunks of
//                                blockDim * DPLAN_ITEMS tokens): global_idx (sorted), n_global_before
//                                (optional), the key regions as [start, end) spans; info[] for the host.
//   daaf_plan_index              ONE block: checks of a given key-region index (range, strictly increasing,
//                                mask agreement) into flags[4], and optionally its mask (scatter).
//
// Blocks are a power of two of threads, a multiple of 32 and at most DPLAN_MAX_THREADS. Doubles travel as
// their 64-bit patterns (unsigned long long): the CPU emulation passes only int32/float32/uint64 scalars.

typedef long long i64;
typedef unsigned long long u64;

#define DPLAN_MAX_THREADS 1024
#define DPLAN_ITEMS 8  // tokens per thread per chunk of the compaction
#define DPLAN_I64_MAX 0x7fffffffffffffffLL
#define DPLAN_I64_MIN (-DPLAN_I64_MAX - 1)

// policy codes in info[3]
#define DPLAN_THRESHOLD 0
#define DPLAN_DENSE 1           // short text (mode 1): every token global
#define DPLAN_FALLBACK_DENSE 2  // the threshold rule could not decide: every token global
#define DPLAN_GIVEN 3           // chosen windows given by the host (mode 2)
#define DPLAN_NEED_HOST 4       // the threshold rule could not decide and the host picks (mode 3)

#ifdef CUDA_EMU
inline double dplan_as_double(u64 b) {
    double d;
    std::memcpy(&d, &b, 8);
    return d;
}
inline u64 dplan_double_bits(double d) {
    u64 b;
    std::memcpy(&b, &d, 8);
    return b;
}
// __shfl_up_sync on ints through the emulator's per-warp buffer
inline int dplan_shfl_up(int x, int d) {
    EmuWarp& w = emu_warp();
    const int l = emu_lane();
    w.u[l][0] = (uint32_t)x;
    w.bar->arrive_and_wait();
    const int y = l >= d ? (int)w.u[l - d][0] : x;
    w.bar->arrive_and_wait();
    return y;
}
inline void dplan_atomic_inc(int* p) { std::atomic_ref<int>(*p).fetch_add(1); }
#else
__device__ __forceinline__ void dplan_atomic_inc(int* p) { atomicAdd(p, 1); }
__device__ __forceinline__ double dplan_as_double(u64 b) { return __longlong_as_double((long long)b); }
__device__ __forceinline__ u64 dplan_double_bits(double d) { return (u64)__double_as_longlong(d); }
__device__ __forceinline__ int dplan_shfl_up(int x, int d) { return __shfl_up_sync(0xffffffffu, x, d); }
#endif

// Exclusive scan of one int per thread over the block; *total: the block's sum (every thread).
// s_warp: 32 ints of shared memory. Every thread of the block must call it (it synchronises).
__device__ __forceinline__ int dplan_block_excl_scan(int x, int* s_warp, int* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    int incl = x;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int y = dplan_shfl_up(incl, d);
        if (lane >= d) incl += y;
    }
    if (lane == 31) s_warp[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        int w = lane < nwarps ? s_warp[lane] : 0;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int y = dplan_shfl_up(w, d);
            if (lane >= d) w += y;
        }
        if (lane < nwarps) s_warp[lane] = w;
    }
    __syncthreads();
    const int before_warp = warp > 0 ? s_warp[warp - 1] : 0;
    *total = s_warp[nwarps - 1];
    __syncthreads();  // s_warp is reused by the next call
    return before_warp + incl - x;
}

// ------------------------------------------------------------------ entropy of the scan windows

template <typename TokT>
__device__ __forceinline__ void dplan_entropy_body(const TokT* __restrict__ tok, int T, int window, int stride,
                                                   int nreg, int nw, int P2, u64 log2cap_bits, int bias,
                                                   double* __restrict__ ent, i64* __restrict__ wmin,
                                                   i64* __restrict__ wmax) {
#ifdef CUDA_EMU
    i64* const keys = reinterpret_cast<i64*>(emu_dynamic_smem());
#else
    extern __shared__ i64 dplan_keys[];  // P2 ids, then window + 1 run-length counts (int)
    i64* const keys = dplan_keys;
#endif
    int* const hist = reinterpret_cast<int*>(keys + P2);
    __shared__ double s_h[DPLAN_MAX_THREADS];
    __shared__ int s_m[DPLAN_MAX_THREADS];
    __shared__ i64 s_lo[DPLAN_MAX_THREADS];
    __shared__ i64 s_hi[DPLAN_MAX_THREADS];
    const int w = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
    const int s = w < nreg ? w * stride : T - window;
    for (int i = tid; i < P2; i += nt) keys[i] = i < window ? (i64)tok[s + i] : DPLAN_I64_MAX;
    for (int c = tid; c <= window; c += nt) hist[c] = 0;
    __syncthreads();
    // bitonic sort, ascending: P2 / 2 compare-exchange pairs per step
    for (int k = 2; k <= P2; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int p = tid; p < (P2 >> 1); p += nt) {
                const int i = 2 * j * (p / j) + (p % j);
                const int ixj = i + j;
                const i64 a = keys[i], b = keys[ixj];
                const bool up = (i & k) == 0;
                if ((a > b) == up) {
                    keys[i] = b;
                    keys[ixj] = a;
                }
            }
            __syncthreads();
        }
    }
    // each run of equal ids [p, e) within [0, window) counts one at hist[e - p]
    for (int p = tid; p < window; p += nt) {
        const i64 key = keys[p];
        if (p == 0 || keys[p - 1] != key) {
            int lo = p + 1, hi = window;  // first position in (p, window) holding a larger id
            while (lo < hi) {
                const int mid = (lo + hi) >> 1;
                if (keys[mid] == key) lo = mid + 1; else hi = mid;
            }
            dplan_atomic_inc(&hist[lo - p]);
        }
    }
    __syncthreads();
    // h = sum_c n_c (-q log2 q), q = c / window: per thread over c = tid, tid + nt, ..., then the tree below
    const double N = (double)window;
    double h = 0.0;
    int m = 0;
    for (int c = 1 + tid; c <= window; c += nt) {
        const int n_c = hist[c];
        if (n_c) {
            const double q = (double)c / N;
            h -= (double)n_c * (q * log2(q));
            m += n_c;
        }
    }
    // the id range of [s, e): the window's ids are sorted; a gap up to the next window is read
    const int e = w + 1 < nw ? (w + 1 < nreg ? (w + 1) * stride : T - window) : T;
    i64 lo_id = DPLAN_I64_MAX, hi_id = DPLAN_I64_MIN;
    for (int i = s + window + tid; i < e; i += nt) {
        const i64 x = (i64)tok[i];
        lo_id = x < lo_id ? x : lo_id;
        hi_id = x > hi_id ? x : hi_id;
    }
    s_h[tid] = h;
    s_m[tid] = m;
    s_lo[tid] = lo_id;
    s_hi[tid] = hi_id;
    __syncthreads();
    for (int step = nt >> 1; step > 0; step >>= 1) {
        if (tid < step) {
            s_h[tid] += s_h[tid + step];
            s_m[tid] += s_m[tid + step];
            s_lo[tid] = s_lo[tid + step] < s_lo[tid] ? s_lo[tid + step] : s_lo[tid];
            s_hi[tid] = s_hi[tid + step] > s_hi[tid] ? s_hi[tid + step] : s_hi[tid];
        }
        __syncthreads();
    }
    if (tid == 0) {
        double hs = s_h[0];
        if (bias) hs += (double)(s_m[0] - 1) / (2.0 * N * 0.69314718055994530942);
        const double log2cap = dplan_as_double(log2cap_bits);
        double x = 0.0;
        if (log2cap > 0.0) {
            x = hs / log2cap;
            x = x < 0.0 ? 0.0 : (x > 1.0 ? 1.0 : x);
        }
        ent[w] = x;
        const i64 k0 = keys[0], k1 = keys[window - 1];
        wmin[w] = s_lo[0] < k0 ? s_lo[0] : k0;
        wmax[w] = s_hi[0] > k1 ? s_hi[0] : k1;
    }
}

#define DPLAN_ENTROPY_KERNEL(NAME, TOKT)                                                                       \
    extern "C" __global__ void NAME(const TOKT* __restrict__ tok, int T, int window, int stride, int nreg,    \
                                    int nw, int P2, u64 log2cap_bits, int bias, double* __restrict__ ent,      \
                                    i64* __restrict__ wmin, i64* __restrict__ wmax) {                          \
        dplan_entropy_body<TOKT>(tok, T, window, stride, nreg, nw, P2, log2cap_bits, bias, ent, wmin, wmax);   \
    }

DPLAN_ENTROPY_KERNEL(daaf_plan_entropy_i32, int)
DPLAN_ENTROPY_KERNEL(daaf_plan_entropy_i64, i64)

// ------------------------------------------------------------------ windows -> mask -> index (one block)
//
// mode 0: threshold rule, dense fallback when it cannot decide; 1: every token global (short text);
// 2: chosen[] given; 3: threshold rule, DPLAN_NEED_HOST (nothing else written) when it cannot decide.
// The rule cannot decide when max - min < uniform_eps or no score reaches the threshold (the CPU order).
// info (int64 [8]): n_global, n_regions, n_selected, policy code, min id, max id, min score, max score
// (the scores as float64 bit patterns). before / spans may be null: before [T + 1], spans [T + 1].

extern "C" __global__ void __launch_bounds__(DPLAN_MAX_THREADS) daaf_plan_select(
    const double* __restrict__ ent, const i64* __restrict__ wmin, const i64* __restrict__ wmax, int nw, int T,
    int window, int stride, int nreg, int mode, u64 thr_bits, u64 eps_bits, unsigned char* __restrict__ chosen,
    int* __restrict__ cpre, unsigned char* __restrict__ mask, int* __restrict__ gidx, int* __restrict__ before,
    int* __restrict__ spans, i64* __restrict__ info) {
    __shared__ double s_emin[DPLAN_MAX_THREADS];
    __shared__ double s_emax[DPLAN_MAX_THREADS];
    __shared__ i64 s_lo[DPLAN_MAX_THREADS];
    __shared__ i64 s_hi[DPLAN_MAX_THREADS];
    __shared__ int s_cnt[DPLAN_MAX_THREADS];
    __shared__ int s_warp[32];
    __shared__ int s_code;
    const int tid = threadIdx.x, nt = blockDim.x;
    const double thr = dplan_as_double(thr_bits), eps = dplan_as_double(eps_bits);

    // scores and ids over the windows
    double emin = 1e300, emax = -1e300;
    i64 lo = DPLAN_I64_MAX, hi = DPLAN_I64_MIN;
    int cnt = 0;
    for (int w = tid; w < nw; w += nt) {
        const double x = ent[w];
        emin = x < emin ? x : emin;
        emax = x > emax ? x : emax;
        cnt += x >= thr ? 1 : 0;
        lo = wmin[w] < lo ? wmin[w] : lo;
        hi = wmax[w] > hi ? wmax[w] : hi;
    }
    s_emin[tid] = emin;
    s_emax[tid] = emax;
    s_lo[tid] = lo;
    s_hi[tid] = hi;
    s_cnt[tid] = cnt;
    __syncthreads();
    for (int step = nt >> 1; step > 0; step >>= 1) {
        if (tid < step) {
            s_emin[tid] = s_emin[tid + step] < s_emin[tid] ? s_emin[tid + step] : s_emin[tid];
            s_emax[tid] = s_emax[tid + step] > s_emax[tid] ? s_emax[tid + step] : s_emax[tid];
            s_lo[tid] = s_lo[tid + step] < s_lo[tid] ? s_lo[tid + step] : s_lo[tid];
            s_hi[tid] = s_hi[tid + step] > s_hi[tid] ? s_hi[tid + step] : s_hi[tid];
            s_cnt[tid] += s_cnt[tid + step];
        }
        __syncthreads();
    }
    if (tid == 0) {
        int code;
        if (mode == 1) {
            code = DPLAN_DENSE;
        } else if (mode == 2) {
            code = DPLAN_GIVEN;
        } else {
            const bool undecided = (s_emax[0] - s_emin[0]) < eps || s_cnt[0] == 0;
            code = !undecided ? DPLAN_THRESHOLD : (mode == 0 ? DPLAN_FALLBACK_DENSE : DPLAN_NEED_HOST);
        }
        s_code = code;
        info[3] = code;
        info[4] = s_lo[0];
        info[5] = s_hi[0];
        info[6] = (i64)dplan_double_bits(s_emin[0]);
        info[7] = (i64)dplan_double_bits(s_emax[0]);
    }
    __syncthreads();
    const int code = s_code;
    if (code == DPLAN_NEED_HOST) {  // uniform over the block: nothing else to do
        if (tid == 0) info[0] = info[1] = info[2] = 0;
        return;
    }
    const bool dense = code == DPLAN_DENSE || code == DPLAN_FALLBACK_DENSE;

    // chosen windows and their exclusive prefix count cpre [nw + 1]
    int n_sel = 0;
    for (int w0 = 0; w0 < nw; w0 += nt) {
        const int w = w0 + tid;
        int c = 0;
        if (w < nw) {
            if (code == DPLAN_THRESHOLD) c = ent[w] >= thr ? 1 : 0;
            else if (code == DPLAN_GIVEN) c = chosen[w] != 0 ? 1 : 0;
            else c = 1;
            if (code != DPLAN_GIVEN) chosen[w] = (unsigned char)c;
        }
        int total;
        const int ex = dplan_block_excl_scan(c, s_warp, &total);
        if (w < nw) cpre[w] = n_sel + ex;
        n_sel += total;
    }
    if (tid == 0) cpre[nw] = n_sel;
    __syncthreads();  // cpre and chosen are read by every thread below

    // token t is a key-region token iff a chosen window covers it
    auto covered = [&](int t) -> bool {
        if (t < 0 || t >= T) return false;
        if (dense) return true;
        int khi = t / stride;
        if (khi > nreg - 1) khi = nreg - 1;
        const int num = t - window + 1;
        const int klo = num <= 0 ? 0 : (num + stride - 1) / stride;
        bool c = klo <= khi && cpre[khi + 1] - cpre[klo] > 0;
        if (!c && nw > nreg && t >= T - window) c = chosen[nreg] != 0;
        return c;
    };

    int g_run = 0, r_run = 0;  // key tokens and regions before the current chunk
    const int per = nt * DPLAN_ITEMS;
    for (int c0 = 0; c0 < T; c0 += per) {
        const int base = c0 + tid * DPLAN_ITEMS;
        unsigned bits = 0;  // bit i + 1: covered(base + i), i = -1 .. DPLAN_ITEMS
#pragma unroll
        for (int i = -1; i <= DPLAN_ITEMS; ++i)
            if (covered(base + i)) bits |= 1u << (i + 1);
        int n_set = 0, n_start = 0;
#pragma unroll
        for (int i = 0; i < DPLAN_ITEMS; ++i) {
            const bool m = (bits >> (i + 1)) & 1u;
            n_set += m ? 1 : 0;
            n_start += (m && !((bits >> i) & 1u)) ? 1 : 0;
        }
        int total;  // counts of one chunk fit in 16 bits each (at most DPLAN_MAX_THREADS * DPLAN_ITEMS)
        const int ex = dplan_block_excl_scan(n_set | (n_start << 16), s_warp, &total);
        int run = g_run + (ex & 0xffff);
        int r = r_run + (ex >> 16);
#pragma unroll
        for (int i = 0; i < DPLAN_ITEMS; ++i) {
            const int t = base + i;
            if (t < T) {
                const bool m = (bits >> (i + 1)) & 1u;
                mask[t] = m ? 1 : 0;
                if (before) before[t] = run;
                if (m) {
                    gidx[run++] = t;
                    if (!((bits >> i) & 1u)) {
                        if (spans) spans[2 * r] = t;
                        ++r;
                    }
                    if (!((bits >> (i + 2)) & 1u) && spans) spans[2 * (r - 1) + 1] = t + 1;
                }
            }
        }
        g_run += total & 0xffff;
        r_run += total >> 16;
    }
    if (tid == 0) {
        if (before) before[T] = g_run;
        info[0] = g_run;
        info[1] = r_run;
        info[2] = n_sel;
    }
}

// ------------------------------------------------------------------ checks of a given index (one block)
//
// flags (int32 [4]): bit 0 of flags[0]: some entry outside [0, T); bit 1: not strictly increasing; bit 2:
// mask_in is 0 at some entry; flags[1]: number of nonzero bytes of mask_in [T] (0 when null); flags[2] /
// flags[3]: smallest / largest entry (0 / -1 when n == 0). mask_out [T] (zeroed by the caller), when not
// null, gets a 1 at every entry inside [0, T).

extern "C" __global__ void __launch_bounds__(DPLAN_MAX_THREADS) daaf_plan_index(
    const int* __restrict__ gidx, int n, int T, const unsigned char* __restrict__ mask_in,
    unsigned char* __restrict__ mask_out, int* __restrict__ flags) {
    __shared__ int s_f[DPLAN_MAX_THREADS];
    __shared__ int s_c[DPLAN_MAX_THREADS];
    __shared__ int s_lo[DPLAN_MAX_THREADS];
    __shared__ int s_hi[DPLAN_MAX_THREADS];
    const int tid = threadIdx.x, nt = blockDim.x;
    int f = 0, c = 0, lo = 0x7fffffff, hi = -0x7fffffff - 1;
    for (int i = tid; i < n; i += nt) {
        const int x = gidx[i];
        lo = x < lo ? x : lo;
        hi = x > hi ? x : hi;
        const bool in = x >= 0 && x < T;
        if (!in) f |= 1;
        if (i > 0 && x <= gidx[i - 1]) f |= 2;
        if (in && mask_in && mask_in[x] == 0) f |= 4;
        if (in && mask_out) mask_out[x] = 1;
    }
    if (mask_in)
        for (int t = tid; t < T; t += nt) c += mask_in[t] != 0 ? 1 : 0;
    s_f[tid] = f;
    s_c[tid] = c;
    s_lo[tid] = lo;
    s_hi[tid] = hi;
    __syncthreads();
    for (int step = nt >> 1; step > 0; step >>= 1) {
        if (tid < step) {
            s_f[tid] |= s_f[tid + step];
            s_c[tid] += s_c[tid + step];
            s_lo[tid] = s_lo[tid + step] < s_lo[tid] ? s_lo[tid + step] : s_lo[tid];
            s_hi[tid] = s_hi[tid + step] > s_hi[tid] ? s_hi[tid + step] : s_hi[tid];
        }
        __syncthreads();
    }
    if (tid == 0) {
        flags[0] = s_f[0];
        flags[1] = s_c[0];
        flags[2] = n ? s_lo[0] : 0;
        flags[3] = n ? s_hi[0] : -1;
    }
}
