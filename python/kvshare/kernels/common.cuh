// Shared prelude of every kvshare kernel source. `kvshare.kernels.source(name)` prepends this
// text to `<name>.cu` (NVRTC gets one self-contained string: no include paths, no CUDA
// headers), so nothing here may depend on cuda_fp16.h or the C++ standard library.
//
// Half precision: values are carried as raw IEEE binary16 bits in `unsigned short` and
// converted with the PTX `cvt` instructions (round-to-nearest-even on the way down), which is
// what cuda_fp16.h's __half2float / __float2half_rn do.

typedef unsigned short f16_t;
typedef long long i64;

#define KVS_WARP 32
#define KVS_FULL_MASK 0xffffffffu

__device__ __forceinline__ float kvs_h2f(f16_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ f16_t kvs_f2h(float f) {
    f16_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Load/store of a storage type as float32.
__device__ __forceinline__ float kvs_load(const float* p) { return *p; }
__device__ __forceinline__ float kvs_load(const f16_t* p) { return kvs_h2f(*p); }
__device__ __forceinline__ float kvs_to_f32(float v) { return v; }
__device__ __forceinline__ float kvs_to_f32(f16_t v) { return kvs_h2f(v); }
__device__ __forceinline__ void kvs_store(float* p, float v) { *p = v; }
__device__ __forceinline__ void kvs_store(f16_t* p, float v) { *p = kvs_f2h(v); }

__device__ __forceinline__ float kvs_warp_max(float v) {
#pragma unroll
    for (int o = KVS_WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(KVS_FULL_MASK, v, o));
    return v;
}

__device__ __forceinline__ float kvs_warp_sum(float v) {
#pragma unroll
    for (int o = KVS_WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(KVS_FULL_MASK, v, o);
    return v;
}

// 1 / sqrt(mean(x^2) + eps) of the d floats at xr, one warp (every lane gets it): RMSNorm's
// scale, float32 sums per lane (lane-strided), then across the warp. rms_norm.cu and
// qkv_rope.cu use it, so their norms round alike.
__device__ __forceinline__ float kvs_warp_inv_rms(const float* xr, int d, float eps, int lane) {
    float ss = 0.f;
    for (int i = lane; i < d; i += KVS_WARP) {
        const float v = xr[i];
        ss += v * v;
    }
    ss = kvs_warp_sum(ss);
    const float ms = ss * (1.0f / (float)d) + eps;
    return 1.0f / sqrtf(ms);
}

// The work tile of a paged-attention CTA (paged_attention.cu, paged_attention_mma.cu): the
// host's tile row blockIdx.x (kvshare.ops.gpu.pa_tiles: sequence, first query row, tokens,
// position of the first token) and, from blockIdx.y, the KV head and the chunk of its G query
// heads, starting at g0, gc of them (rows r = token * gc + (g - g0)).
struct KvsAttnTile { int seq, row0, nr, pos0, G, kvh, g0, gc; };

__device__ __forceinline__ KvsAttnTile kvs_attn_tile(const int* tiles, int n_head, int n_kv,
                                                     int group_chunk) {
    KvsAttnTile t;
    t.seq = tiles[4 * blockIdx.x + 0];
    t.row0 = tiles[4 * blockIdx.x + 1];
    t.nr = tiles[4 * blockIdx.x + 2];
    t.pos0 = tiles[4 * blockIdx.x + 3];
    t.G = n_head / n_kv;
    const int n_gchunks = (t.G + group_chunk - 1) / group_chunk;
    t.kvh = blockIdx.y / n_gchunks;
    t.g0 = (blockIdx.y % n_gchunks) * group_chunk;
    t.gc = min(group_chunk, t.G - t.g0);
    return t;
}

// -inf and NaN without <cmath>/<limits>.
__device__ __forceinline__ float kvs_neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float kvs_nan() { return __int_as_float(0x7fc00000); }
