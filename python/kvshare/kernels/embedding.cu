// Token embedding lookup (the GPU twin of kvshare.ops.embedding.embedding):
//   out[t, :] = float32(table[tokens[t], :]) * scale
// table: C-contiguous `[vocab, d]` f16 (raw bits) or f32; out: float32 `[n_tok, d]`. An id
// outside [0, vocab) never reads the table: its row becomes NaN, so a bad id cannot pass
// silently (the host validates ids it can see first).

template <typename T>
__device__ __forceinline__ void embedding_impl(
    const T* __restrict__ table, const int* __restrict__ tokens, float* __restrict__ out,
    int n_tok, int d, int vocab, float scale)
{
    const i64 total = (i64)n_tok * d;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (i64)gridDim.x * blockDim.x) {
        const i64 t = idx / d, c = idx - t * d;
        const int id = tokens[t];
        out[idx] = (id >= 0 && id < vocab) ? kvs_load(table + (i64)id * d + c) * scale : kvs_nan();
    }
}

extern "C" __global__ void embedding_f16(const f16_t* __restrict__ table,
                                         const int* __restrict__ tokens, float* __restrict__ out,
                                         int n_tok, int d, int vocab, float scale)
{ embedding_impl<f16_t>(table, tokens, out, n_tok, d, vocab, scale); }

extern "C" __global__ void embedding_f32(const float* __restrict__ table,
                                         const int* __restrict__ tokens, float* __restrict__ out,
                                         int n_tok, int d, int vocab, float scale)
{ embedding_impl<float>(table, tokens, out, n_tok, d, vocab, scale); }

// Rows of a float32 matrix gathered by index: out[i, :] = src[idx[i] * row_stride + (0 .. d)]
// (a captured step's last layer keeps only the rows whose logits are wanted; the source may
// be a strided view, such as q inside the fused Q/K/V product). `idx` comes from the host,
// which built it from the step's own rows.
extern "C" __global__ void gather_rows_f32(const float* __restrict__ src, i64 row_stride,
                                           const int* __restrict__ idx, float* __restrict__ out,
                                           int n, int d)
{
    const i64 total = (i64)n * d;
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < total;
         k += (i64)gridDim.x * blockDim.x) {
        const i64 i = k / d, c = k - i * d;
        out[k] = src[(i64)idx[i] * row_stride + c];
    }
}
