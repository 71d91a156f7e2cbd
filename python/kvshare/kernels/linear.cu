// Helpers around the cuBLAS GEMM of kvshare.ops.gpu.linear (f16 weights, f16 activations,
// float32 accumulation and output via cublasGemmEx).
//
// Activations are float32 and may exceed the f16 range (65504): each row r is scaled by a
// power of two 2^e_r (exact in binary floating point) chosen so that its largest magnitude
// lands below 2^14, converted to f16, and the GEMM's float32 output row is multiplied back by
// 2^-e_r (again exact). So no row overflows or flushes to zero in f16, and the rounding error
// is the f16 rounding of each element relative to its row's scale.

// One warp per row: absmax, then the scaled conversion. x: float32 rows with a row stride
// (unit column stride); x16: C-contiguous f16 [n_rows, n_cols]; inv_scale[r] = 2^-e_r.
extern "C" __global__ void __launch_bounds__(128) f32_to_f16_rowscaled(
    const float* __restrict__ x, i64 x_stride, f16_t* __restrict__ x16,
    float* __restrict__ inv_scale, i64 n_rows, int n_cols)
{
    const int lane = threadIdx.x & (KVS_WARP - 1);
    const i64 warps_per_block = blockDim.x / KVS_WARP;
    for (i64 r = (i64)blockIdx.x * warps_per_block + (threadIdx.x >> 5); r < n_rows;
         r += (i64)gridDim.x * warps_per_block) {
        const float* xr = x + r * x_stride;
        float amax = 0.f;
        for (int i = lane; i < n_cols; i += KVS_WARP) amax = fmaxf(amax, fabsf(xr[i]));
        amax = kvs_warp_max(amax);
        int e = 0;
        // amax = m * 2^ex with m in [0.5, 1): scale by 2^(14 - ex) puts amax in [2^13, 2^14).
        // Zero, inf and NaN rows keep scale 1 (NaN/inf propagate as they would in f32).
        if (amax > 0.f && amax <= 3.402823466e38f) {
            int ex;
            frexpf(amax, &ex);
            e = 14 - ex;
            e = max(-126, min(126, e));
        }
        const float s = ldexpf(1.0f, e);
        for (int i = lane; i < n_cols; i += KVS_WARP) x16[r * n_cols + i] = kvs_f2h(xr[i] * s);
        if (lane == 0) inv_scale[r] = ldexpf(1.0f, -e);
    }
}

// y[r, c] = y[r, c] * inv_scale[r] (+ bias[c]) in place; y C-contiguous float32 [n_rows, n_cols].
extern "C" __global__ void rowscale_bias_f32(
    float* __restrict__ y, const float* __restrict__ inv_scale, const float* __restrict__ bias,
    int has_bias, i64 n_rows, i64 n_cols)
{
    const i64 total = n_rows * n_cols;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (i64)gridDim.x * blockDim.x) {
        const i64 r = idx / n_cols, c = idx - r * n_cols;
        float v = y[idx] * inv_scale[r];
        if (has_bias) v += bias[c];
        y[idx] = v;
    }
}
