// Sampling on the device: one CTA per logits row picks the row's next token with the chain of
// `kvshare.engine.sampling.Sampler.sample` (llama.cpp's order: logit bias -> grammar mask ->
// penalties -> top-k -> top-p -> min-p -> temperature -> draw), and computes the raw
// distribution's logprobs (the chosen token's and the top n) when the row asks for them.
// Only token ids, logprobs and a status per row go back to the host (ops/gpu_sampling.py).
//
// Per row:
//   1. one pass over the logits: non-finite check, raw max, the grammar mask (disallowed
//      tokens -> -inf in the `scores` scratch row), the masked argmax (lowest index on ties,
//      as np.argmax) and the count of allowed tokens;
//   2. the sparse edits (logit bias, repetition penalty, frequency/presence penalty) of the
//      host's CSR list, one thread per token id, in the host's order; then the argmax again
//      over the edited row (only when the row has edits);
//   3. greedy: the argmax. Sampled: the top-K candidates (K = top_k, or 1024 when top_k <= 0)
//      selected exactly (a histogram of the distance below the max, the bins that hold the
//      K-th value gathered, a bitonic sort of (score, index) in shared memory), then
//      softmax / top-p / min-p / temperature softmax / inverse-CDF draw, each as NumPy computes
//      it: float32 sums in numpy's pairwise order, the cumulative sums sequential, the draw's
//      CDF in float64 normalised by its last value, the first entry > u (numpy's
//      Generator.choice: searchsorted side='right'), u drawn on the host from the sequence's RNG;
//   4. logprobs: log-softmax of the raw logits, the chosen token's and the top n.
// A row the kernel does not take (more candidates than it gathers, top_k > 1024, the
// candidates missing >= 0.1% of the tempered mass when top_k <= 0) gets SMP_HOST and is
// sampled on the host; errors get the host path's status (its SamplingError message).

#define SMP_THREADS 512       // one CTA per row (ops/gpu_sampling.py: SAMPLE_THREADS)
#define SMP_BINS 256          // histogram bins of the distance below the max
#define SMP_CAP 4096          // candidates gathered for the exact sort (a power of 2)
#define SMP_MAX_K 1024        // top-k the device takes (ops/gpu_sampling.py: MAX_TOP_K)
#define SMP_MAX_TOP 20        // top logprobs per row (ops/gpu_sampling.py: MAX_TOP_LOGPROBS)

// status per row (ops/gpu_sampling.py: STATUS_*)
#define SMP_OK 0
#define SMP_HOST 1
#define SMP_ERR_LOGITS 2
#define SMP_ERR_PENALTY 3
#define SMP_ERR_GRAMMAR 4
#define SMP_ERR_PROBS 5

// int parameters per row (ops/gpu_sampling.py: IP_*)
#define IP_GREEDY 0
#define IP_TOP_K 1
#define IP_N_TOP 2      // top logprobs wanted; -1: no logprobs
#define IP_MASK_OFF 3   // first word of the row's mask in `masks`
#define IP_MASK_WORDS 4 // 0: no mask
#define IP_EDIT_START 5
#define IP_EDIT_END 6
#define IP_COUNT 8
// float parameters per row (FP_*)
#define FP_TEMP 0       // max(temperature, 1e-6) as float32 (the host's divisor)
#define FP_MIN_P 1
#define FP_REPEAT 2
#define FP_COUNT 4
// double parameters per row (DP_*): top_p is compared in float64, as numpy's searchsorted does
#define DP_U 0          // the draw's uniform in [0, 1), from the sequence's RNG
#define DP_TOP_P 1
#define DP_COUNT 2
// edit flags (EDIT_*)
#define EDIT_BIAS 1
#define EDIT_REPEAT 2
#define EDIT_SUB 4

__device__ __forceinline__ bool smp_finite(float x) { return (x - x) == 0.0f; }

// float -> uint32 whose unsigned order is the float order (-inf lowest).
__device__ __forceinline__ unsigned smp_ordered(float v) {
    unsigned u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float smp_unordered(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
__device__ __forceinline__ float smp_key_value(unsigned long long key) {
    return smp_unordered((unsigned)(key >> 32));
}
__device__ __forceinline__ int smp_key_index(unsigned long long key) {
    return (int)(0xffffffffu - (unsigned)(key & 0xffffffffull));
}

// Histogram bin of a value at distance d = max - v: 1/8-logit bins up to 16 below the max,
// 1-logit bins up to 143 below it, then bin 255 (not counted: the far tail). Monotone in v.
__device__ __forceinline__ int smp_bin(float d) {
    if (d < 16.0f) return (int)(d * 8.0f);
    if (d < 143.0f) return 128 + (int)(d - 16.0f);
    return SMP_BINS - 1;
}

__device__ __forceinline__ bool smp_allowed(const unsigned* mask, int words, int i) {
    if (words == 0) return true;
    int w = i >> 5;
    return w < words && ((mask[w] >> (i & 31)) & 1u);
}

struct SmpShared {
    unsigned long long keys[SMP_CAP];  // candidates (score, index), sorted descending
    float e[SMP_MAX_K];                // exp values of the chain's softmaxes
    float redf[SMP_THREADS];
    int redi[SMP_THREADS];
    int hist[SMP_BINS];
    int ints[8];
    float floats[4];
};

// Block sum of a float (a tree over the threads: the same order on every launch).
__device__ float smp_sum(SmpShared& sh, float v) {
    const int t = threadIdx.x;
    sh.redf[t] = v;
    __syncthreads();
    for (int s = SMP_THREADS / 2; s > 0; s >>= 1) {
        if (t < s) sh.redf[t] += sh.redf[t + s];
        __syncthreads();
    }
    float r = sh.redf[0];
    __syncthreads();
    return r;
}

__device__ float smp_max(SmpShared& sh, float v) {
    const int t = threadIdx.x;
    sh.redf[t] = v;
    __syncthreads();
    for (int s = SMP_THREADS / 2; s > 0; s >>= 1) {
        if (t < s) sh.redf[t] = fmaxf(sh.redf[t], sh.redf[t + s]);
        __syncthreads();
    }
    float r = sh.redf[0];
    __syncthreads();
    return r;
}

// Block argmax of (v, i) pairs, i < 0 meaning none: the largest v, the lowest i on ties.
__device__ void smp_argmax(SmpShared& sh, float& v, int& i) {
    const int t = threadIdx.x;
    sh.redf[t] = v;
    sh.redi[t] = i;
    __syncthreads();
    for (int s = SMP_THREADS / 2; s > 0; s >>= 1) {
        if (t < s) {
            float ov = sh.redf[t + s];
            int oi = sh.redi[t + s];
            int mi = sh.redi[t];
            if (oi >= 0 && (mi < 0 || ov > sh.redf[t] || (ov == sh.redf[t] && oi < mi))) {
                sh.redf[t] = ov;
                sh.redi[t] = oi;
            }
        }
        __syncthreads();
    }
    v = sh.redf[0];
    i = sh.redi[0];
    __syncthreads();
}

// numpy's float32 pairwise sum (np.add.reduce of a contiguous array) of a[0..n), one thread:
// the same additions in the same order, so the same bits. Not inlined: `smp_np_sum`'s
// recursion below would inline 64 copies of it, which took NVRTC ~57 s (1.3 s as a call; one
// call per leaf of one row's sum, no stack frame, no spills).
__device__ __noinline__ float smp_np_sum_block(const float* a, int n) {
    if (n < 8) {
        float r = 0.0f;
        for (int i = 0; i < n; ++i) r = __fadd_rn(r, a[i]);
        return r;
    }
    float r[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) r[j] = a[j];
    int i = 8;
    for (; i < n - (n % 8); i += 8) {
#pragma unroll
        for (int j = 0; j < 8; ++j) r[j] = __fadd_rn(r[j], a[i + j]);
    }
    float res = __fadd_rn(__fadd_rn(__fadd_rn(r[0], r[1]), __fadd_rn(r[2], r[3])),
                          __fadd_rn(__fadd_rn(r[4], r[5]), __fadd_rn(r[6], r[7])));
    for (; i < n; ++i) res = __fadd_rn(res, a[i]);
    return res;
}

// numpy's recursion (n > 128: halves cut at a multiple of 8), unrolled as templates: depth
// 6 covers n <= SMP_MAX_K (each level at most halves n plus 8: 1024 -> 519 -> 263 -> 135 -> 71).
template <int D>
__device__ float smp_np_sum(const float* a, int n) {
    if (n <= 128) return smp_np_sum_block(a, n);
    int n2 = n / 2;
    n2 -= n2 % 8;
    return __fadd_rn(smp_np_sum<D - 1>(a, n2), smp_np_sum<D - 1>(a + n2, n - n2));
}
template <>
__device__ float smp_np_sum<0>(const float* a, int n) { return smp_np_sum_block(a, n); }

// The top `k` (1 <= k <= the number of values > -inf) of row `src` (max `vmax`) into
// sh.keys[0..k), sorted by value descending, lowest index first on ties. Returns the number
// gathered (>= k), or -1 when more than SMP_CAP values share the bins it must gather.
__device__ int smp_select(SmpShared& sh, const float* src, int V, float vmax, int k,
                          int n_finite) {
    const int t = threadIdx.x;
    for (int b = t; b < SMP_BINS; b += SMP_THREADS) sh.hist[b] = 0;
    __syncthreads();
    for (int i = t; i < V; i += SMP_THREADS) {
        float v = src[i];
        if (v == kvs_neg_inf()) continue;
        int b = smp_bin(vmax - v);
        if (b < SMP_BINS - 1) atomicAdd(&sh.hist[b], 1);
    }
    __syncthreads();
    if (t == 0) {
        int cum = 0, sel = SMP_BINS - 1;
        for (int b = 0; b < SMP_BINS - 1; ++b) {
            if (cum + sh.hist[b] >= k) { sel = b; cum += sh.hist[b]; break; }
            cum += sh.hist[b];
        }
        int total = sel < SMP_BINS - 1 ? cum : n_finite;
        sh.ints[0] = sel;
        sh.ints[1] = total;
        sh.ints[2] = 0;  // gather counter
    }
    __syncthreads();
    const int sel = sh.ints[0], total = sh.ints[1];
    if (total > SMP_CAP) return -1;  // uniform: every thread read the same total
    for (int i = t; i < V; i += SMP_THREADS) {
        float v = src[i];
        if (v == kvs_neg_inf() || smp_bin(vmax - v) > sel) continue;
        int pos = atomicAdd(&sh.ints[2], 1);
        if (pos < SMP_CAP)
            sh.keys[pos] = ((unsigned long long)smp_ordered(v) << 32) | (0xffffffffu - (unsigned)i);
    }
    __syncthreads();
    int p = 1;
    while (p < total) p <<= 1;
    for (int j = total + t; j < p; j += SMP_THREADS) sh.keys[j] = 0ull;  // below every key
    __syncthreads();
    for (int size = 2; size <= p; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = t; i < p; i += SMP_THREADS) {
                int j = i ^ stride;
                if (j > i) {
                    unsigned long long a = sh.keys[i], b = sh.keys[j];
                    bool desc = (i & size) == 0;
                    if (desc ? a < b : a > b) { sh.keys[i] = b; sh.keys[j] = a; }
                }
            }
            __syncthreads();
        }
    }
    return total;
}

extern "C" __global__ void __launch_bounds__(SMP_THREADS)
sample_rows(const unsigned long long* rows, float* scores, int V,
            const int* iparams, const float* fparams, const double* dparams,
            const unsigned* masks, const int* edit_ids, const int* edit_flags,
            const float* edit_bias, const float* edit_sub,
            int* out_status, int* out_token, float* out_lp, int* out_top_ids, float* out_top_lp) {
    __shared__ SmpShared sh;
    const int r = blockIdx.x, t = threadIdx.x;
    const float* logits = reinterpret_cast<const float*>(rows[r]);
    float* srow = scores + (i64)r * V;
    const int* ip = iparams + r * IP_COUNT;
    const float* fp = fparams + r * FP_COUNT;
    const unsigned* mask = masks + ip[IP_MASK_OFF];
    const int words = ip[IP_MASK_WORDS];
    const bool greedy = ip[IP_GREEDY] != 0;
    const int n_top = ip[IP_N_TOP];
    const int e0 = ip[IP_EDIT_START], e1 = ip[IP_EDIT_END];

    // 1. the raw row: finite?, raw max, masked scores, masked argmax, allowed count. A greedy
    // row without edits needs no scores row (only the argmax), so it writes none; the loop is
    // unrolled so that each thread has several of its loads in flight at once (a row of a
    // large vocabulary is hundreds of loads per thread, one CTA per row)
    const bool keep_scores = !greedy || e1 > e0;
    float nonfinite = 0.0f, allowed_n = 0.0f, rmax = kvs_neg_inf(), bv = kvs_neg_inf();
    int bi = -1;
#pragma unroll 4
    for (int i = t; i < V; i += SMP_THREADS) {
        float x = logits[i];
        if (!smp_finite(x)) nonfinite = 1.0f;
        rmax = fmaxf(rmax, x);
        bool ok = smp_allowed(mask, words, i);
        if (keep_scores) srow[i] = ok ? x : kvs_neg_inf();
        if (ok) {
            allowed_n += 1.0f;
            if (bi < 0 || x > bv) { bv = x; bi = i; }
        }
    }
    nonfinite = smp_sum(sh, nonfinite);
    const int n_allowed = (int)smp_sum(sh, allowed_n);
    if (n_top >= 0) rmax = smp_max(sh, rmax);
    // 2. the edits (the host's order: bias, repetition, frequency/presence), then the argmax
    float bad = 0.0f;
    if (e1 > e0) {
        for (int e = e0 + t; e < e1; e += SMP_THREADS) {
            int id = edit_ids[e], f = edit_flags[e];
            float v = logits[id];
            if (f & EDIT_BIAS) v = __fadd_rn(v, edit_bias[e]);
            if (f & EDIT_REPEAT) v = v > 0.0f ? v / fp[FP_REPEAT] : __fmul_rn(v, fp[FP_REPEAT]);
            if (f & EDIT_SUB) v = __fsub_rn(v, edit_sub[e]);
            if (!smp_finite(v)) bad = 1.0f;
            if (smp_allowed(mask, words, id)) srow[id] = v;
        }
        bad = smp_sum(sh, bad);  // its barrier also orders the edits before the reads below
        bv = kvs_neg_inf();
        bi = -1;
        for (int i = t; i < V; i += SMP_THREADS) {
            float s = srow[i];
            if (s != kvs_neg_inf() && (bi < 0 || s > bv)) { bv = s; bi = i; }
        }
    }
    smp_argmax(sh, bv, bi);
    int status = SMP_OK, token = bi;
    if (nonfinite > 0.0f) status = SMP_ERR_LOGITS;
    else if (bad > 0.0f) status = SMP_ERR_PENALTY;
    else if (n_allowed == 0) status = SMP_ERR_GRAMMAR;

    // 3. sampled rows: the candidates, then the chain
    if (status == SMP_OK && !greedy) {
        const int top_k = ip[IP_TOP_K];
        const int K = (top_k > 0 && top_k < V) ? top_k : min(V, SMP_MAX_K);
        const int kc = min(K, n_allowed);  // the rest of the K are -inf: probability 0
        const float tm = fp[FP_TEMP];
        if (K > SMP_MAX_K || smp_select(sh, srow, V, bv, kc, n_allowed) < 0) {
            status = SMP_HOST;
        } else if (top_k <= 0 && K < V) {
            // `_draw` falls back to the whole vocabulary when the candidates hold < 0.999 of
            // the tempered distribution: the host takes rows near that line
            const float mt = bv / tm;
            float part = 0.0f;
            for (int i = t; i < V; i += SMP_THREADS) part += expf(srow[i] / tm - mt);
            const float all = smp_sum(sh, part);
            part = 0.0f;
            for (int j = t; j < kc; j += SMP_THREADS) part += expf(smp_key_value(sh.keys[j]) / tm - mt);
            const float cand = smp_sum(sh, part);
            if (!(cand >= 0.9991f * all)) status = SMP_HOST;
        }
        if (status == SMP_OK) {
            const float c0 = smp_key_value(sh.keys[0]);
            for (int j = t; j < K; j += SMP_THREADS)
                sh.e[j] = j < kc ? expf(smp_key_value(sh.keys[j]) - c0) : 0.0f;
            __syncthreads();
            if (t == 0) sh.floats[0] = smp_np_sum<6>(sh.e, K);
            __syncthreads();
            // the probabilities, divided in parallel (thread 0's loops below only add and compare)
            const float sum0 = sh.floats[0];
            for (int j = t; j < K; j += SMP_THREADS) sh.e[j] = sh.e[j] / sum0;
            __syncthreads();
            if (t == 0) {
                int keep = K;
                const double top_p = dparams[r * DP_COUNT + DP_TOP_P];
                const float min_p = fp[FP_MIN_P];
                if (top_p < 1.0) {
                    float cum = 0.0f;
                    for (int j = 0; j < K; ++j) {
                        cum = __fadd_rn(cum, sh.e[j]);
                        if ((double)cum >= top_p) { keep = j + 1; break; }
                    }
                }
                if (min_p > 0.0f) {
                    const float thr = __fmul_rn(min_p, sh.e[0]);
                    int n = 0;
                    for (int j = 0; j < K; ++j) n += (sh.e[j] >= thr) ? 1 : 0;
                    keep = min(keep, max(1, n));
                }
                sh.ints[3] = keep;
            }
            __syncthreads();
            const int keep = sh.ints[3];
            const float x0 = c0 / tm;
            for (int j = t; j < keep; j += SMP_THREADS)
                sh.e[j] = j < kc ? expf(smp_key_value(sh.keys[j]) / tm - x0) : 0.0f;
            __syncthreads();
            if (t == 0) sh.floats[0] = smp_np_sum<6>(sh.e, keep);
            __syncthreads();
            const float sum = sh.floats[0];
            for (int j = t; j < keep; j += SMP_THREADS) sh.e[j] = sh.e[j] / sum;
            __syncthreads();
            if (t == 0) {
                int st = SMP_OK, pick = 0;
                if (!(smp_finite(sum) && sum > 0.0f)) {
                    st = SMP_ERR_PROBS;
                } else {
                    // numpy's Generator.choice(p=final): cdf = cumsum(float64), cdf /= cdf[-1],
                    // the first entry > u
                    double c = 0.0;
                    for (int j = 0; j < keep; ++j) c += (double)sh.e[j];
                    const double last = c, u = dparams[r * DP_COUNT + DP_U];
                    c = 0.0;
                    pick = keep - 1;
                    for (int j = 0; j < keep; ++j) {
                        c += (double)sh.e[j];
                        if (c / last > u) { pick = j; break; }
                    }
                    pick = min(pick, kc - 1);
                }
                sh.ints[4] = st;
                sh.ints[5] = smp_key_index(sh.keys[pick]);
            }
            __syncthreads();
            status = sh.ints[4];
            token = sh.ints[5];
        }
    }

    // 4. logprobs of the raw distribution (sampling.top_logprobs)
    if (status == SMP_OK && n_top >= 0) {
        float part = 0.0f;
        for (int i = t; i < V; i += SMP_THREADS) part += expf(logits[i] - rmax);
        const float lse = rmax + logf(smp_sum(sh, part));
        const int n = min(n_top, SMP_MAX_TOP);
        int got = n > 0 ? smp_select(sh, logits, V, rmax, n, V) : 0;
        if (got < 0) {
            status = SMP_HOST;
        } else if (t < n) {
            unsigned long long key = sh.keys[t];
            out_top_ids[r * SMP_MAX_TOP + t] = smp_key_index(key);
            out_top_lp[r * SMP_MAX_TOP + t] = smp_key_value(key) - lse;
        }
        if (t == 0) out_lp[r] = logits[token] - lse;
    }
    if (t == 0) {
        out_status[r] = status;
        out_token[r] = token;
    }
}
