// Fused gated activations of the feed-forward block (the GPU twins of
// kvshare.ops.activation.geglu_tanh / swiglu), elementwise over `[n_rows, n_cols]` views with
// row strides in elements and unit column stride; `out` may alias `gate` (each element is read
// and written by one thread).
//   geglu_tanh: out = gate / (1 + exp(-2 z)) * up,  z = sqrt(2/pi) (gate + 0.044715 gate^3)
//               (= 0.5 gate (1 + tanh z) * up; has_up = 0: plain GELU)
//   swiglu:     out = gate / (1 + exp(-gate)) * up
// The constants are float32 roundings of the float64 products, as NumPy forms them; expf
// overflows to inf for large negative gate, and gate / inf = -0, the right limit.

#define ACT_C1 ((float)(-2.0 * 0.7978845608028654 * 0.044715))
#define ACT_C2 ((float)(2.0 * 0.7978845608028654))

extern "C" __global__ void geglu_tanh_f32(
    const float* gate, i64 gate_stride, const float* up, i64 up_stride, int has_up,
    float* out, i64 out_stride, i64 n_rows, i64 n_cols)
{
    const i64 total = n_rows * n_cols;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (i64)gridDim.x * blockDim.x) {
        const i64 r = idx / n_cols, c = idx - r * n_cols;
        const float g = gate[r * gate_stride + c];
        // the same float32 roundings as the NumPy twin (no fused multiply-add)
        float t = __fmul_rn(g, g);
        t = __fsub_rn(__fmul_rn(t, ACT_C1), ACT_C2);
        t = __fmul_rn(t, g);                      // t = -2 z
        float y = g / (1.0f + expf(t));
        if (has_up) y *= up[r * up_stride + c];
        out[r * out_stride + c] = y;
    }
}

extern "C" __global__ void swiglu_f32(
    const float* gate, i64 gate_stride, const float* up, i64 up_stride,
    float* out, i64 out_stride, i64 n_rows, i64 n_cols)
{
    const i64 total = n_rows * n_cols;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (i64)gridDim.x * blockDim.x) {
        const i64 r = idx / n_cols, c = idx - r * n_cols;
        const float g = gate[r * gate_stride + c];
        out[r * out_stride + c] = g / (1.0f + expf(-g)) * up[r * up_stride + c];
    }
}
