// Rotary position embedding in place (the GPU twin of kvshare.ops.rope.apply_rope).
// x: float32 `[n_tok, n_heads, head_dim]` view (row and head strides in elements, unit stride
// along head_dim); cos, sin: float32 `[n_tok, half]` C-contiguous, n_rot = 2 * half <= head_dim.
// style 0 = NEOX, pairs (i, i + half); style 1 = NORM, pairs (2i, 2i + 1). For a pair (a, b)
// and angle t: a' = a cos t - b sin t, b' = b cos t + a sin t. Dims >= n_rot are untouched.
// One thread per (token, head, pair); each pair is read and written by exactly one thread.

extern "C" __global__ void rope_f32(
    float* __restrict__ x, i64 row_stride, i64 head_stride,
    const float* __restrict__ cos_t, const float* __restrict__ sin_t,
    int n_tok, int n_heads, int half, int style)
{
    const i64 per_tok = (i64)n_heads * half;
    const i64 total = (i64)n_tok * per_tok;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (i64)gridDim.x * blockDim.x) {
        const i64 t = idx / per_tok;
        const i64 rem = idx - t * per_tok;
        const i64 h = rem / half;
        const int i = (int)(rem - h * half);
        float* base = x + t * row_stride + h * head_stride;
        const int ia = style == 0 ? i : 2 * i;
        const int ib = style == 0 ? i + half : 2 * i + 1;
        const float c = cos_t[t * half + i];
        const float s = sin_t[t * half + i];
        const float a = base[ia];
        const float b = base[ib];
        // the NumPy twin's float32 roundings: no fused multiply-add
        base[ia] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
        base[ib] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
    }
}

// The rotation angles' cos and sin (the GPU twin of kvshare.ops.rope.rope_cos_sin) from
// positions on the device, so that a captured decode step takes them from its input buffer:
//   theta[t, i] = (positions[t] * scale) * inv_freq[i],   cos_t / sin_t = float32(cos / sin)
// in float64 as the NumPy op forms them (inv_freq = base^(-2i / n_rot) / freq_factors[i],
// computed on the host); cos_t, sin_t: float32 `[n_tok, half]`. One thread per (token, i).
extern "C" __global__ void rope_cos_sin_f32(
    const i64* __restrict__ positions, const double* __restrict__ inv_freq, double scale,
    float* __restrict__ cos_t, float* __restrict__ sin_t, int n_tok, int half)
{
    const i64 total = (i64)n_tok * half;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (i64)gridDim.x * blockDim.x) {
        const i64 t = idx / half;
        const int i = (int)(idx - t * half);
        const double theta = __dmul_rn(__dmul_rn((double)positions[t], scale), inv_freq[i]);
        cos_t[idx] = (float)cos(theta);
        sin_t[idx] = (float)sin(theta);
    }
}

// YaRN-scaled angles' cos and sin (the GPU twin of kvshare.ops.rope_yarn.yarn_cos_sin), from
// positions on the device as rope_cos_sin_f32 takes them:
//   theta_e = positions[t] * inv_freq[i],  theta_i = theta_e * freq_scale,
//   theta = theta_i * keep[i] + theta_e * mix[i],  cos_t / sin_t = float32(cos / sin * mscale)
// in float64 with the NumPy op's roundings (keep = 1 - mix, mix = the ramp times ext_factor,
// computed on the host; ext_factor 0 passes keep 1, mix 0: theta = theta_i exactly).
extern "C" __global__ void rope_cos_sin_yarn_f32(
    const i64* __restrict__ positions, const double* __restrict__ inv_freq,
    const double* __restrict__ keep, const double* __restrict__ mix, double freq_scale,
    double mscale, float* __restrict__ cos_t, float* __restrict__ sin_t, int n_tok, int half)
{
    const i64 total = (i64)n_tok * half;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (i64)gridDim.x * blockDim.x) {
        const i64 t = idx / half;
        const int i = (int)(idx - t * half);
        const double te = __dmul_rn((double)positions[t], inv_freq[i]);
        const double ti = __dmul_rn(te, freq_scale);
        const double theta = __dadd_rn(__dmul_rn(ti, keep[i]), __dmul_rn(te, mix[i]));
        cos_t[idx] = (float)__dmul_rn(cos(theta), mscale);
        sin_t[idx] = (float)__dmul_rn(sin(theta), mscale);
    }
}
