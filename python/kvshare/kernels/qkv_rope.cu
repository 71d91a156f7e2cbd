// The tail of an attention layer's Q/K/V projection in one launch (the GPU twin of
// kvshare.ops.rope.qkv_rope_write): from the fused projection's rows
//   qkv[t] = [q heads (n_head x head_dim) | k heads (n_kv x head_dim) | v heads (n_kv x head_dim)]
// each q and k head gets its per-head RMSNorm (where the model has q/k norms: flags
// QR_Q_NORM / QR_K_NORM) and its rotation (rope.cu's rule: style 0 = NEOX, pairs (i, i + half);
// 1 = NORM, pairs (2i, 2i + 1); dims >= n_rot = 2 * half pass through); q is written back in
// place (qkv's q columns), K and V are stored at row slots[t] of the paged caches
// (`[n_blocks, block_size, n_kv, head_dim]`, C-contiguous, f16 rounded to nearest even or f32).
// A slot outside [0, n_slots) stores nothing (a CUDA graph's padding rows carry -1); q is
// still rotated.
//
// One warp per (token, head) with head < n_head + n_kv: a q head, or k head j and v head j.
// The norm's scale is rms_norm.cu's (common.cuh kvs_warp_inv_rms; out = x * inv * weight),
// the rotation rope.cu's (__fmul_rn / __fadd_rn / __fsub_rn: the NumPy op's float32
// roundings, no FMA). Each element of the head is read by any lane in the norm's first pass,
// but after the warp sum (a warp-wide exchange) only the lane that owns its pair or
// pass-through dim reads and writes it, so the in-place q update has no race.

#define QR_Q_NORM 1
#define QR_K_NORM 2

template <typename T>
__device__ __forceinline__ void qkv_rope_write_impl(
    float* __restrict__ qkv, i64 row_stride, const float* __restrict__ cos_t,
    const float* __restrict__ sin_t, const float* __restrict__ q_norm,
    const float* __restrict__ k_norm, int flags, float eps, T* __restrict__ k_cache,
    T* __restrict__ v_cache, const i64* __restrict__ slots, i64 n_slots, int n_tok,
    int n_head, int n_kv, int head_dim, int half, int style)
{
    const int lane = threadIdx.x & (KVS_WARP - 1);
    const int wpb = blockDim.x / KVS_WARP;
    const int heads = n_head + n_kv;
    const i64 total = (i64)n_tok * heads;
    const int n_rot = 2 * half;
    for (i64 w = (i64)blockIdx.x * wpb + (threadIdx.x >> 5); w < total;
         w += (i64)gridDim.x * wpb) {
        const i64 t = w / heads;
        const int h = (int)(w - t * heads);
        const bool is_q = h < n_head;
        const int j = is_q ? h : h - n_head;  // the k / v head
        float* xr = qkv + t * row_stride + (i64)h * head_dim;
        const i64 slot = slots[t];
        const bool store = !is_q && slot >= 0 && slot < n_slots;
        T* kd = k_cache + (store ? (slot * n_kv + j) * head_dim : 0);
        const float* nw = is_q ? q_norm : k_norm;
        const bool norm = (flags & (is_q ? QR_Q_NORM : QR_K_NORM)) != 0;
        // the head's RMS scale (the warp's branch: norm is uniform across the warp)
        const float inv = norm ? kvs_warp_inv_rms(xr, head_dim, eps, lane) : 1.0f;
        const float* cr = cos_t + t * half;
        const float* sr = sin_t + t * half;
        for (int i = lane; i < half; i += KVS_WARP) {
            const int ia = style == 0 ? i : 2 * i;
            const int ib = style == 0 ? i + half : 2 * i + 1;
            float a = xr[ia], b = xr[ib];
            if (norm) {
                a = a * inv * nw[ia];
                b = b * inv * nw[ib];
            }
            const float c = cr[i], s = sr[i];
            const float ra = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
            const float rb = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
            if (is_q) {
                xr[ia] = ra;
                xr[ib] = rb;
            } else if (store) {
                kvs_store(kd + ia, ra);
                kvs_store(kd + ib, rb);
            }
        }
        for (int i = n_rot + lane; i < head_dim; i += KVS_WARP) {
            float a = xr[i];
            if (norm) a = a * inv * nw[i];
            if (is_q) xr[i] = a;
            else if (store) kvs_store(kd + i, a);
        }
        if (store) {  // v head j, as it is
            const float* vr = qkv + t * row_stride + (i64)(n_head + n_kv + j) * head_dim;
            T* vd = v_cache + (slot * n_kv + j) * head_dim;
            for (int i = lane; i < head_dim; i += KVS_WARP) kvs_store(vd + i, vr[i]);
        }
    }
}

// No __launch_bounds__(128): with it, ptxas of CUDA 12.9 held sm_90 to 64 registers and
// spilled 8 bytes; without, 70 (sm_90) / 72 (sm_80) registers and no spills.
#define QR_PARAMS(T)                                                                         \
    float* __restrict__ qkv, i64 row_stride, const float* __restrict__ cos_t,                \
    const float* __restrict__ sin_t, const float* __restrict__ q_norm,                       \
    const float* __restrict__ k_norm, int flags, float eps, T* __restrict__ k_cache,         \
    T* __restrict__ v_cache, const i64* __restrict__ slots, i64 n_slots, int n_tok,          \
    int n_head, int n_kv, int head_dim, int half, int style
#define QR_ARGS qkv, row_stride, cos_t, sin_t, q_norm, k_norm, flags, eps, k_cache, v_cache,   \
    slots, n_slots, n_tok, n_head, n_kv, head_dim, half, style

extern "C" __global__ void qkv_rope_write_f16(QR_PARAMS(f16_t)) { qkv_rope_write_impl<f16_t>(QR_ARGS); }
extern "C" __global__ void qkv_rope_write_f32(QR_PARAMS(float)) { qkv_rope_write_impl<float>(QR_ARGS); }
