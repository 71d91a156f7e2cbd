// The element-wise parts of qwen35's gated delta net decode step
// (kvshare.ops.gpu_hybrid.gdn_gates / silu_l2norm_qk / mul_silu; model/qwen35.py
// GatedDeltaNetLayer.gpu_step), each one launch that takes no host values but sizes and
// strides and writes only its outputs, so a CUDA graph of the step holds them as they are.
// The formulas of kvshare.model.hybrid's NumPy helpers, in float32:
//
//   sigmoid(x)  = 1 / (1 + exp(-x))
//   silu(x)     = x * sigmoid(x)
//   softplus(x) = x                              x > 20 (ggml)
//               = x + log1p(exp(-x))             0 < x <= 20  } NumPy's logaddexp(0, x): the
//               = log1p(exp(x))                  x <= 0       } numerically stable form
//   l2 norm     x / max(||x||, eps)              (ggml_l2_norm)
//
// with each product and sum rounded on its own (__fmul_rn / __fadd_rn: no FMA contraction,
// as NumPy computes them) and expf / log1pf / sqrtf and the division at CUDA's default
// (IEEE-rounded division and square root; expf and log1pf within 2 ulp), so a result is
// NumPy's within a few float32 ulp (not bit for bit: the transcendental functions differ).
//
// Strides are in elements; the last axis of every array has unit stride.

__device__ __forceinline__ float gdn_sigmoid(float x) {
    return 1.0f / __fadd_rn(1.0f, expf(-x));
}

__device__ __forceinline__ float gdn_silu(float x) {
    return __fmul_rn(x, gdn_sigmoid(x));
}

__device__ __forceinline__ float gdn_softplus(float x) {
    if (x > 20.0f) return x;
    return x > 0.0f ? __fadd_rn(x, log1pf(expf(-x))) : log1pf(expf(x));
}

// gdn_gates_f32: per row r and value head h (grid-stride over the n * H pairs, h fastest),
// from the b and a columns of the fused projection (views of it: b[r, h] at r * b_sr + h,
// a[r, h] at r * a_sr + h):
//   beta[r, h] = sigmoid(b[r, h])
//   g[r, h]    = softplus(a[r, h] + dt_bias[h]) * ssm_a[h]
// dt_bias, ssm_a [H] contiguous; beta, g rows at r * beta_sr, r * g_sr.
extern "C" __global__ void gdn_gates_f32(
    const float* __restrict__ b, i64 b_sr, const float* __restrict__ a, i64 a_sr,
    const float* __restrict__ dt_bias, const float* __restrict__ ssm_a, int n, int H,
    float* __restrict__ beta, i64 beta_sr, float* __restrict__ g, i64 g_sr)
{
    const i64 total = (i64)n * H;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (i64)gridDim.x * blockDim.x) {
        const int r = (int)(idx / H);
        const int h = (int)(idx - (i64)r * H);
        beta[(i64)r * beta_sr + h] = gdn_sigmoid(b[(i64)r * b_sr + h]);
        const float x = __fadd_rn(a[(i64)r * a_sr + h], dt_bias[h]);
        g[(i64)r * g_sr + h] = __fmul_rn(gdn_softplus(x), ssm_a[h]);
    }
}

// silu_l2norm_qk_f32: in place on the conv output qkv [n, C] (row r at r * sr; channels q
// [Hk * D] | k [Hk * D] | v [C - 2 Hk D]): silu on every value, then each of the 2 Hk
// heads of q and k (D values) divided by max(||head||, eps), the norm of the silu'd values.
//
// Grid: the first n_norm_ctas CTAs (NORM_WARPS warps each) hold one warp per (row, head)
// pair of q and k, pair p = r * 2 Hk + head, warp w of CTA c taking p = c * NORM_WARPS + w:
// lane l reads its values i = l, l + 32, ... of the head, applies silu, stores it back and
// sums the squares (the sum of lane l in ascending i, each square rounded, then added), the
// 32 lane sums added by the xor butterfly of kvs_warp_sum (offsets 16, 8, 4, 2, 1: a fixed
// order); then lane l divides its own values (it reads back only what it wrote: no barrier).
// The other CTAs apply silu to v, grid-stride over the n * (C - 2 Hk D) values, the
// channel fastest. Heads of a warp and v's values are disjoint: no thread reads what
// another writes.
#define NORM_WARPS 4

extern "C" __global__ void __launch_bounds__(128) silu_l2norm_qk_f32(
    float* qkv, i64 sr, int n, int C, int Hk, int D, float eps, int n_norm_ctas)
{
    const int kd2 = 2 * Hk * D;
    if ((int)blockIdx.x < n_norm_ctas) {
        const int lane = threadIdx.x & (KVS_WARP - 1);
        const i64 p = (i64)blockIdx.x * NORM_WARPS + (threadIdx.x >> 5);
        if (p >= (i64)n * 2 * Hk) return;  // a whole warp leaves: its shuffles need no partner
        const int r = (int)(p / (2 * Hk));
        const int hd = (int)(p - (i64)r * 2 * Hk);
        float* x = qkv + (i64)r * sr + (i64)hd * D;
        float ss = 0.f;
        for (int i = lane; i < D; i += KVS_WARP) {
            const float s = gdn_silu(x[i]);
            x[i] = s;
            ss = __fadd_rn(ss, __fmul_rn(s, s));
        }
        ss = kvs_warp_sum(ss);
        const float nrm = fmaxf(sqrtf(ss), eps);
        for (int i = lane; i < D; i += KVS_WARP) x[i] = x[i] / nrm;
        return;
    }
    const int vd = C - kd2;
    const i64 total = (i64)n * vd;
    const i64 stride = (i64)(gridDim.x - n_norm_ctas) * blockDim.x;
    for (i64 idx = (i64)(blockIdx.x - n_norm_ctas) * blockDim.x + threadIdx.x; idx < total;
         idx += stride) {
        const int r = (int)(idx / vd);
        const int c = (int)(idx - (i64)r * vd);
        float* x = qkv + (i64)r * sr + kd2 + c;
        *x = gdn_silu(*x);
    }
}

// mul_silu_f32: o[r, c] = o[r, c] * silu(z[r, c]) for n rows of d values (o rows at
// r * o_sr, z rows at r * z_sr: a view of the fused projection), grid-stride, c fastest.
extern "C" __global__ void mul_silu_f32(
    float* o, i64 o_sr, const float* __restrict__ z, i64 z_sr, int n, int d)
{
    const i64 total = (i64)n * d;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (i64)gridDim.x * blockDim.x) {
        const int r = (int)(idx / d);
        const int c = (int)(idx - (i64)r * d);
        float* p = o + (i64)r * o_sr + c;
        *p = __fmul_rn(*p, gdn_silu(z[(i64)r * z_sr + c]));
    }
}
