// KV write into paged slots (the GPU twin of kvshare.ops.attention.write_kv):
//   k_cache.reshape(-1, n_kv, hd)[slots[i]] = k[i]   (and the same for v)
// k, v: float32 `[n_tok, n_kv, hd]` views (row and head strides in elements, unit stride
// along hd); caches C-contiguous `[n_blocks, block_size, n_kv, hd]` of f16 (raw bits, rounded
// to nearest even) or f32. A slot outside [0, n_slots) is skipped (the host validates slots
// first; this only keeps a bad slot from writing out of bounds).
// One thread per (token, kv head, dim) element; grid-stride loop.

template <typename T>
__device__ __forceinline__ void kv_write_impl(
    T* __restrict__ k_cache, T* __restrict__ v_cache, const i64* __restrict__ slots,
    const float* __restrict__ k, i64 k_row_stride, i64 k_head_stride,
    const float* __restrict__ v, i64 v_row_stride, i64 v_head_stride,
    int n_tok, int n_kv, int head_dim, i64 n_slots)
{
    const i64 per_tok = (i64)n_kv * head_dim;
    const i64 total = (i64)n_tok * per_tok;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (i64)gridDim.x * blockDim.x) {
        const i64 t = idx / per_tok;
        const i64 rem = idx - t * per_tok;
        const i64 h = rem / head_dim;
        const i64 d = rem - h * head_dim;
        const i64 slot = slots[t];
        if (slot < 0 || slot >= n_slots) continue;
        const i64 dst = (slot * n_kv + h) * head_dim + d;
        kvs_store(k_cache + dst, k[t * k_row_stride + h * k_head_stride + d]);
        kvs_store(v_cache + dst, v[t * v_row_stride + h * v_head_stride + d]);
    }
}

#define KVW_PARAMS(T)                                                                        \
    T* __restrict__ k_cache, T* __restrict__ v_cache, const i64* __restrict__ slots,         \
    const float* __restrict__ k, i64 k_row_stride, i64 k_head_stride,                        \
    const float* __restrict__ v, i64 v_row_stride, i64 v_head_stride,                        \
    int n_tok, int n_kv, int head_dim, i64 n_slots
#define KVW_ARGS                                                                             \
    k_cache, v_cache, slots, k, k_row_stride, k_head_stride, v, v_row_stride, v_head_stride, \
    n_tok, n_kv, head_dim, n_slots

extern "C" __global__ void kv_write_f16(KVW_PARAMS(f16_t)) { kv_write_impl<f16_t>(KVW_ARGS); }
extern "C" __global__ void kv_write_f32(KVW_PARAMS(float)) { kv_write_impl<float>(KVW_ARGS); }
