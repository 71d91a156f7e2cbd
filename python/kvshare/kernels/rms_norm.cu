// RMSNorm over the last axis (the GPU twin of kvshare.ops.norm.rms_norm):
//   out = x / sqrt(mean(x^2) + eps) * weight
// Rows are addressed as row r -> (r / inner) * stride0 + (r % inner) * stride1 (elements), the
// last axis has unit stride, so [N, d] rows and per-head [N, heads, head_dim] views of a fused
// projection both work without copies; `out` has its own strides and may be `x` (each element
// is read in the first pass and written in the second by the same lane). One warp per row;
// the sum of squares accumulates in float32 per lane, then across the warp.

extern "C" __global__ void __launch_bounds__(128) rms_norm_f32(
    const float* __restrict__ x, i64 x_stride0, i64 x_stride1,
    float* out, i64 o_stride0, i64 o_stride1,
    const float* __restrict__ weight, int has_weight,
    i64 n_rows, int inner, int d, float eps)
{
    const int lane = threadIdx.x & (KVS_WARP - 1);
    const i64 warps_per_block = blockDim.x / KVS_WARP;
    for (i64 r = (i64)blockIdx.x * warps_per_block + (threadIdx.x >> 5); r < n_rows;
         r += (i64)gridDim.x * warps_per_block) {
        const i64 r0 = r / inner, r1 = r - r0 * inner;
        const float* xr = x + r0 * x_stride0 + r1 * x_stride1;
        float* orow = out + r0 * o_stride0 + r1 * o_stride1;
        const float inv = kvs_warp_inv_rms(xr, d, eps, lane);
        for (int i = lane; i < d; i += KVS_WARP) {
            float v = xr[i] * inv;
            if (has_weight) v *= weight[i];
            orow[i] = v;
        }
    }
}
