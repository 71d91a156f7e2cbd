// GGUF block formats read in place on the GPU (kvshare.ops.gpu_blocks): weights stay on the
// device as the file's raw blocks (`[n, row_bytes]` bytes per tensor), and every kernel here
// dequantizes them in registers.
//
//   bmv_<type>_m<M>   y[r, col0 + i] = sum_j x[r, j] * W[i, j] (+ bias[col0 + i]) for r < m <= M
//                     (M = 1, 4, 16; m > M is the host's large-batch path, bdq + cuBLAS), or
//                     `+=` that (flags: BMV_BIAS, BMV_ACCUMULATE: a residual add fused in):
//                     one 128-thread CTA per R output rows (R = 2 for M = 1, else 4;
//                     grid-stride), its 4 warps splitting each row's length; each lane
//                     decodes 8 consecutive weights of each row at a time (a "chunk") and
//                     applies them to all m activation rows, so every weight byte is read
//                     once per call; float32 accumulation, a warp-shuffle reduction, then
//                     the 4 warps' sums added in shared memory.
//   bmvglu_<type>_m<M> y[r, i] = act(sum_j x[r, j] G[i, j], sum_j x[r, j] U[i, j]): a fused
//                     gate|up projection and its gated activation in one pass (G, U: the gate
//                     and up tensors, same type and shape); each CTA takes 2 gate rows and
//                     the 2 matching up rows; the [m, 2 n] products are never written.
//   bdq_<type>        f16 out[i, :] = W[r0 + i, :] for i < n_rows (the tile that the large-batch
//                     path hands to the cuBLAS f16 GEMM); one thread per chunk, grid-stride.
//   bemb_<type>       float32 out[t, :] = W[tokens[t], :] * scale (embedding rows; an id
//                     outside [0, vocab) gives a NaN row); one thread per chunk, grid-stride.
//
// Every format decodes a chunk of 8 elements as value_j = d * q_j - mn, with q_j an integer
// (held in a float) and d, mn shared by the chunk: each format's scale groups are 16, 32 or
// 256 elements long and start at multiples of 8. bdq/bemb evaluate d * q - mn with
// __fmul_rn / __fsub_rn (no contraction into an FMA), the same float32 operations in the same
// order as ggml's dequantize_row_* (so an embedding row equals gguf.quants.dequantize's row
// exactly); bmv folds the scales out of the inner sum (d * sum q x - mn * sum x).
//
// Alignment: raw rows are whole blocks, and every block size in bytes is even (18, 20, 22, 24,
// 34, 84, 110, 136, 144, 176, 210), so 16-bit loads are always aligned; types whose block size
// is a multiple of 4 use 32-bit loads (the device buffer itself is 256-byte aligned).

typedef unsigned char u8;
typedef unsigned int u32;
typedef unsigned short u16;


// 8 consecutive bytes at p as two little-endian words: A = 4 (32-bit loads) or 2 (16-bit).
template <int A>
__device__ __forceinline__ void bk_ld8(const u8* p, u32& lo, u32& hi) {
    if constexpr (A >= 4) {
        const u32* q = reinterpret_cast<const u32*>(p);
        lo = q[0];
        hi = q[1];
    } else {
        const u16* q = reinterpret_cast<const u16*>(p);
        lo = (u32)q[0] | ((u32)q[1] << 16);
        hi = (u32)q[2] | ((u32)q[3] << 16);
    }
}

__device__ __forceinline__ float bk_f16(const u8* p) {
    return kvs_h2f(*reinterpret_cast<const f16_t*>(p));
}

__device__ __forceinline__ u32 bk_byte(u32 lo, u32 hi, int j) {
    return ((j < 4 ? lo : hi) >> (8 * (j & 3))) & 0xffu;
}

// Small integers to float without the (quarter-rate) int-to-float conversion: for u < 2^23 the
// bits 0x4B000000 | u are the float 2^23 + u, so bk_uf(u, BK_MAGIC + c) = u - c exactly.
#define BK_MAGIC 8388608.f
__device__ __forceinline__ float bk_uf(u32 u, float magic_plus_c) {
    return __int_as_float((int)(0x4B000000u | u)) - magic_plus_c;
}

// 4-bit indices of the IQ4 formats -> ggml's kvalues_iq4nl (no tables in memory: two 64-bit
// constants hold the 16 values + 128 as bytes).
__device__ __forceinline__ float bk_iq4(u32 i) {
    const unsigned long long lo = 0x766A5D4F3F2D1801ull;  // -127 -104 -83 -65 -49 -35 -22 -10
    const unsigned long long hi = 0xF1D9C5B5A6998D81ull;  //    1   13  25  38  53  69  89 113
    const unsigned long long w = i < 8 ? lo : hi;
    return bk_uf((u32)(w >> (8 * (i & 7))) & 0xffu, BK_MAGIC + 128.f);
}

// --- the formats -----------------------------------------------------------------------------
// QK: elements per block; BYTES: bytes per block; HAS_MIN: mn may be non-zero.
// dec(b, e, q, d, mn): the chunk of elements [e, e + 8) of the block at b (e % 8 == 0).

struct BkQ4_0 {  // d f16, qs[16]: element j < 16 is the low nibble of qs[j], j >= 16 the high
    static constexpr int QK = 32, BYTES = 18;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void dec(const u8* b, int e, float* q, float& d, float& mn) {
        d = bk_f16(b);
        mn = 0.f;
        u32 lo, hi;
        bk_ld8<2>(b + 2 + (e & 15), lo, hi);
        const int s = (e >> 4) * 4;
#pragma unroll
        for (int j = 0; j < 8; ++j) q[j] = bk_uf((bk_byte(lo, hi, j) >> s) & 15u, BK_MAGIC + 8.f);
    }
};

struct BkQ4_1 {  // d f16, m f16, qs[16]; value = q * d + m
    static constexpr int QK = 32, BYTES = 20;
    static constexpr bool HAS_MIN = true;
    static __device__ __forceinline__ void dec(const u8* b, int e, float* q, float& d, float& mn) {
        d = bk_f16(b);
        mn = -bk_f16(b + 2);
        u32 lo, hi;
        bk_ld8<4>(b + 4 + (e & 15), lo, hi);
        const int s = (e >> 4) * 4;
#pragma unroll
        for (int j = 0; j < 8; ++j) q[j] = bk_uf((bk_byte(lo, hi, j) >> s) & 15u, BK_MAGIC);
    }
};

struct BkQ5_0 {  // d f16, qh u32 (bit j: 5th bit of element j), qs[16]; q - 16
    static constexpr int QK = 32, BYTES = 22;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void dec(const u8* b, int e, float* q, float& d, float& mn) {
        d = bk_f16(b);
        mn = 0.f;
        const u16* h = reinterpret_cast<const u16*>(b + 2);
        const u32 qh = ((u32)h[0] | ((u32)h[1] << 16)) >> e;
        u32 lo, hi;
        bk_ld8<2>(b + 6 + (e & 15), lo, hi);
        const int s = (e >> 4) * 4;
#pragma unroll
        for (int j = 0; j < 8; ++j)
            q[j] = bk_uf(((bk_byte(lo, hi, j) >> s) & 15u) | (((qh >> j) & 1u) << 4), BK_MAGIC + 16.f);
    }
};

struct BkQ5_1 {  // d f16, m f16, qh u32, qs[16]; value = q * d + m
    static constexpr int QK = 32, BYTES = 24;
    static constexpr bool HAS_MIN = true;
    static __device__ __forceinline__ void dec(const u8* b, int e, float* q, float& d, float& mn) {
        d = bk_f16(b);
        mn = -bk_f16(b + 2);
        const u32 qh = *reinterpret_cast<const u32*>(b + 4) >> e;
        u32 lo, hi;
        bk_ld8<4>(b + 8 + (e & 15), lo, hi);
        const int s = (e >> 4) * 4;
#pragma unroll
        for (int j = 0; j < 8; ++j)
            q[j] = bk_uf(((bk_byte(lo, hi, j) >> s) & 15u) | (((qh >> j) & 1u) << 4), BK_MAGIC);
    }
};

struct BkQ8_0 {  // d f16, qs i8[32]
    static constexpr int QK = 32, BYTES = 34;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void dec(const u8* b, int e, float* q, float& d, float& mn) {
        d = bk_f16(b);
        mn = 0.f;
        u32 lo, hi;
        bk_ld8<2>(b + 2 + e, lo, hi);
#pragma unroll
        for (int j = 0; j < 8; ++j) q[j] = bk_uf(bk_byte(lo, hi, j) ^ 0x80u, BK_MAGIC + 128.f);
    }
};

// ggml's get_scale_min_k4: 6-bit scale and min of sub-block `is` (0..7) from 12 bytes.
__device__ __forceinline__ void bk_scale_min_k4(const u8* s, int is, u32& sc, u32& m) {
    if (is < 4) {
        sc = s[is] & 63u;
        m = s[is + 4] & 63u;
    } else {
        sc = (s[is + 4] & 15u) | ((u32)(s[is - 4] >> 6) << 4);
        m = (s[is + 4] >> 4) | ((u32)(s[is] >> 6) << 4);
    }
}

struct BkQ4_K {  // d, dmin f16, scales[12], qs[128]; sub-block 2j: low nibbles of qs[32j..],
                 // 2j + 1: high nibbles; value = d * sc * q - dmin * m
    static constexpr int QK = 256, BYTES = 144;
    static constexpr bool HAS_MIN = true;
    static __device__ __forceinline__ void dec(const u8* b, int e, float* q, float& d, float& mn) {
        const int is = e >> 5, j = e >> 6, l = e & 31;
        u32 sc, m;
        bk_scale_min_k4(b + 4, is, sc, m);
        d = __fmul_rn(bk_f16(b), (float)sc);
        mn = __fmul_rn(bk_f16(b + 2), (float)m);
        u32 lo, hi;
        bk_ld8<4>(b + 16 + 32 * j + l, lo, hi);
        const int s = (is & 1) * 4;
#pragma unroll
        for (int t = 0; t < 8; ++t) q[t] = bk_uf((bk_byte(lo, hi, t) >> s) & 15u, BK_MAGIC);
    }
};

struct BkQ5_K {  // d, dmin, scales[12], qh[32], qs[128]; sub-block is takes bit is of qh[l]
    static constexpr int QK = 256, BYTES = 176;
    static constexpr bool HAS_MIN = true;
    static __device__ __forceinline__ void dec(const u8* b, int e, float* q, float& d, float& mn) {
        const int is = e >> 5, j = e >> 6, l = e & 31;
        u32 sc, m;
        bk_scale_min_k4(b + 4, is, sc, m);
        d = __fmul_rn(bk_f16(b), (float)sc);
        mn = __fmul_rn(bk_f16(b + 2), (float)m);
        u32 lo, hi, hlo, hhi;
        bk_ld8<4>(b + 48 + 32 * j + l, lo, hi);
        bk_ld8<4>(b + 16 + l, hlo, hhi);
        const int s = (is & 1) * 4;
#pragma unroll
        for (int t = 0; t < 8; ++t)
            q[t] = bk_uf(((bk_byte(lo, hi, t) >> s) & 15u) | (((bk_byte(hlo, hhi, t) >> is) & 1u) << 4), BK_MAGIC);
    }
};

struct BkQ6_K {  // ql[128], qh[64], scales i8[16], d f16; halves n of 128: group g (32 each)
                 // takes nibble g >> 1 of ql[64n + 32(g & 1) + l] and bits 2g of qh[32n + l]
    static constexpr int QK = 256, BYTES = 210;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void dec(const u8* b, int e, float* q, float& d, float& mn) {
        const int n = e >> 7, g = (e >> 5) & 3, l = e & 31;
        d = __fmul_rn(bk_f16(b + 208), (float)(signed char)b[192 + 8 * n + 2 * g + (l >> 4)]);
        mn = 0.f;
        u32 lo, hi, hlo, hhi;
        bk_ld8<2>(b + 64 * n + 32 * (g & 1) + l, lo, hi);
        bk_ld8<2>(b + 128 + 32 * n + l, hlo, hhi);
        const int s = (g >> 1) * 4, hs = 2 * g;
#pragma unroll
        for (int t = 0; t < 8; ++t)
            q[t] = bk_uf(((bk_byte(lo, hi, t) >> s) & 15u) | (((bk_byte(hlo, hhi, t) >> hs) & 3u) << 4), BK_MAGIC + 32.f);
    }
};

struct BkQ2_K {  // scales[16] (low nibble scale, high nibble min), qs[64], d, dmin f16;
                 // halves n of 128: group j (32 each) takes bits 2j of qs[32n + l]
    static constexpr int QK = 256, BYTES = 84;
    static constexpr bool HAS_MIN = true;
    static __device__ __forceinline__ void dec(const u8* b, int e, float* q, float& d, float& mn) {
        const int n = e >> 7, j = (e >> 5) & 3, l = e & 31;
        const u32 sc = b[8 * n + 2 * j + (l >> 4)];
        d = __fmul_rn(bk_f16(b + 80), (float)(sc & 15u));
        mn = __fmul_rn(bk_f16(b + 82), (float)(sc >> 4));
        u32 lo, hi;
        bk_ld8<4>(b + 16 + 32 * n + l, lo, hi);
#pragma unroll
        for (int t = 0; t < 8; ++t) q[t] = bk_uf((bk_byte(lo, hi, t) >> (2 * j)) & 3u, BK_MAGIC);
    }
};

struct BkQ3_K {  // hmask[32], qs[64], scales[12] (16 6-bit values, -32), d f16; group j of
                 // half n: bits 2j of qs[32n + l], minus 4 where bit 4n + j of hmask[l] is 0
    static constexpr int QK = 256, BYTES = 110;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void dec(const u8* b, int e, float* q, float& d, float& mn) {
        const int n = e >> 7, j = (e >> 5) & 3, l = e & 31;
        const int is = 8 * n + 2 * j + (l >> 4);
        const u8* s = b + 96;
        const u32 lo4 = is < 8 ? (s[is] & 15u) : (u32)(s[is - 8] >> 4);
        const u32 hi2 = (s[8 + (is & 3)] >> (2 * (is >> 2))) & 3u;
        d = __fmul_rn(bk_f16(b + 108), (float)((int)(lo4 | (hi2 << 4)) - 32));
        mn = 0.f;
        u32 lo, hi, hlo, hhi;
        bk_ld8<2>(b + 32 + 32 * n + l, lo, hi);
        bk_ld8<2>(b + l, hlo, hhi);
        const int hb = 4 * n + j;
#pragma unroll
        for (int t = 0; t < 8; ++t)
            q[t] = bk_uf(((bk_byte(lo, hi, t) >> (2 * j)) & 3u) + (((bk_byte(hlo, hhi, t) >> hb) & 1u) << 2),
                         BK_MAGIC + 4.f);
    }
};

struct BkIQ4_NL {  // d f16, qs[16] (Q4_0's layout), values from kvalues_iq4nl
    static constexpr int QK = 32, BYTES = 18;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void dec(const u8* b, int e, float* q, float& d, float& mn) {
        d = bk_f16(b);
        mn = 0.f;
        u32 lo, hi;
        bk_ld8<2>(b + 2 + (e & 15), lo, hi);
        const int s = (e >> 4) * 4;
#pragma unroll
        for (int j = 0; j < 8; ++j) q[j] = bk_iq4((bk_byte(lo, hi, j) >> s) & 15u);
    }
};

struct BkIQ4_XS {  // d f16, scales_h u16, scales_l[4], qs[128]; 8 sub-blocks of 32 in
                   // IQ4_NL's nibble layout, 6-bit scales (-32)
    static constexpr int QK = 256, BYTES = 136;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void dec(const u8* b, int e, float* q, float& d, float& mn) {
        const int ib = e >> 5, jj = e & 31;
        const u32 sh = *reinterpret_cast<const u16*>(b + 2);
        const u32 ls = ((b[4 + (ib >> 1)] >> (4 * (ib & 1))) & 15u) | (((sh >> (2 * ib)) & 3u) << 4);
        d = __fmul_rn(bk_f16(b), (float)((int)ls - 32));
        mn = 0.f;
        u32 lo, hi;
        bk_ld8<4>(b + 8 + 16 * ib + (jj & 15), lo, hi);
        const int s = (jj >> 4) * 4;
#pragma unroll
        for (int j = 0; j < 8; ++j) q[j] = bk_iq4((bk_byte(lo, hi, j) >> s) & 15u);
    }
};

// Plain formats as 8-element "blocks" (rows of k % 8 == 0 elements, 16/32-byte chunks).
struct BkF32 {
    static constexpr int QK = 8, BYTES = 32;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void dec(const u8* b, int e, float* q, float& d, float& mn) {
        d = 1.f;
        mn = 0.f;
        const float* p = reinterpret_cast<const float*>(b);
#pragma unroll
        for (int j = 0; j < 8; ++j) q[j] = p[j];
    }
};

struct BkF16 {
    static constexpr int QK = 8, BYTES = 16;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void dec(const u8* b, int e, float* q, float& d, float& mn) {
        d = 1.f;
        mn = 0.f;
        const f16_t* p = reinterpret_cast<const f16_t*>(b);
#pragma unroll
        for (int j = 0; j < 8; ++j) q[j] = kvs_h2f(p[j]);
    }
};

struct BkBF16 {
    static constexpr int QK = 8, BYTES = 16;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void dec(const u8* b, int e, float* q, float& d, float& mn) {
        d = 1.f;
        mn = 0.f;
        const u16* p = reinterpret_cast<const u16*>(b);
#pragma unroll
        for (int j = 0; j < 8; ++j) q[j] = __int_as_float((int)((u32)p[j] << 16));
    }
};

// --- kernels ---------------------------------------------------------------------------------

// Output rows per CTA of bmv_<type>_m<M> (kvshare.ops.gpu_blocks.BMV_ROWS_PER_CTA): each
// lane applies the 8 activations it loads to R weight rows, so the activation traffic (from L1)
// per weight is 4 * m / R bytes instead of 4 * m. bmvglu (NW = 2) takes 2 gate rows and the 2
// matching up rows: 4 weight rows and the accumulators of bmv's R = 4.
template <int M, int NW> struct BkRows { static constexpr int R = (M == 1 || NW == 2) ? 2 : 4; };

// Warps per bmv CTA (kvshare.ops.gpu_blocks.BMV_WARPS; launched with 32 * BK_MV_WARPS
// threads). They share the CTA's R rows and split each row's chunks between them: a decode
// mat-vec has few rows (a 2,048-wide projection: 1,024 to 6,144) and a load of a block takes
// the device's memory latency, so a warp that walked a whole row alone would keep only R
// blocks in flight per pass; split 4 ways, 4 times as many warps read 4 times fewer blocks
// each, all at once.
#define BK_MV_WARPS 4

// bmv's flags word (kvshare.ops.gpu_blocks.BMV_BIAS / BMV_ACCUMULATE)
#define BMV_BIAS 1        // add bias[col0 + row]
#define BMV_ACCUMULATE 2  // y += W x (+ bias) instead of y = W x (+ bias)

// The gated activation of a gate|up pair (act 0: SwiGLU, ops.activation.swiglu; 1: GEGLU with
// tanh GELU, geglu_tanh, activation.cu's float32 roundings; 2: gpt-oss's swiglu_oai: the gate
// clamped to <= 7, the up value to [-7, 7], x sigmoid(1.702 x) (y + 1)). bmvglu and
// moe_blocks.cu's gmvglu / moe_glu_f32 share it.
#define BK_OAI_ALPHA 1.702f
#define BK_OAI_LIMIT 7.0f
#define BK_GELU_C1 ((float)(-2.0 * 0.7978845608028654 * 0.044715))
#define BK_GELU_C2 ((float)(2.0 * 0.7978845608028654))
__device__ __forceinline__ float bk_act(float g, float u, int act) {
    if (act == 0) return g / (1.0f + expf(-g)) * u;
    if (act == 1) {
        float t = __fmul_rn(g, g);
        t = __fsub_rn(__fmul_rn(t, BK_GELU_C1), BK_GELU_C2);
        t = __fmul_rn(t, g);  // t = -2 z
        return g / (1.0f + expf(t)) * u;
    }
    const float x = fminf(g, BK_OAI_LIMIT);
    const float y = fminf(fmaxf(u, -BK_OAI_LIMIT), BK_OAI_LIMIT);
    return x / (1.0f + expf(BK_OAI_ALPHA * -x)) * (y + 1.0f);
}

// The M per-lane sums of acc across the warp, a reduce-scatter: each halving step trades half
// of the remaining sums with the lane `o` away (M - 1 shuffles in all), then plain sums; lane
// L ends with the total of row L >> (5 - log2 M) in acc[0] (returned). Every lane must call it.
template <int M>
__device__ __forceinline__ float bk_reduce(float (&acc)[M], int lane) {
    int cnt = M;
#pragma unroll
    for (int o = KVS_WARP / 2; o > 0; o >>= 1) {
        if (cnt > 1) {
            const int half = cnt >> 1;
            const bool upper = (lane & o) != 0;
#pragma unroll
            for (int j = 0; j < half; ++j) {
                const float send = upper ? acc[j] : acc[j + half];
                const float keep = upper ? acc[j + half] : acc[j];
                acc[j] = keep + __shfl_xor_sync(KVS_FULL_MASK, send, o);
            }
            cnt = half;
        } else {
            acc[0] += __shfl_xor_sync(KVS_FULL_MASK, acc[0], o);
        }
    }
    return acc[0];
}

// A CTA's row sums when its W warps split the rows' chunks (bmv, moe_blocks.cu's gmv): each
// warp reduces its lanes' sums acc[h][i][.] (bk_reduce) into part[warp][h][i][activation
// row], then the barrier; `bk_cta_sums` adds a row's W warp sums in warp order (a fixed order:
// the same bits every run). Every thread of the CTA must call `bk_warp_sums`.
template <int M, int NW, int R, int W>
__device__ __forceinline__ void bk_warp_sums(float (&acc)[NW][R][M], float (&part)[W][NW][R][M],
                                             int lane, int wid) {
    constexpr int SH = M >= 32 ? 0 : (M >= 16 ? 1 : (M >= 8 ? 2 : (M >= 4 ? 3 : (M >= 2 ? 4 : 5))));
    const bool writer = (lane & ((1 << SH) - 1)) == 0;  // lane L: activation row L >> SH
#pragma unroll
    for (int h = 0; h < NW; ++h)
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const float v = bk_reduce<M>(acc[h][i], lane);  // (every lane shuffles)
            if (writer) part[wid][h][i][lane >> SH] = v;
        }
    __syncthreads();
}

template <int M, int NW, int R, int W>
__device__ __forceinline__ void bk_cta_sums(const float (&part)[W][NW][R][M], int i, int r,
                                            float (&s)[NW]) {
#pragma unroll
    for (int h = 0; h < NW; ++h) {
        s[h] = part[0][h][i][r];
#pragma unroll
        for (int v = 1; v < W; ++v) s[h] += part[v][h][i][r];
    }
}

// One block of R output rows for a CTA of W warps (bmv, moe_blocks.cu's gmv): rows row0 + i
// (i < R) of the NW weights at wbase[h] (rows of row_bytes bytes; rows past n_rows read the
// last row, their results dropped) times the activation rows xrow(r), r < m (m >= 1; xrow
// returns a float32 row, 16-byte aligned). Warp v takes chunks v * 32 + lane, stepping by 32 W;
// each lane decodes 8 consecutive weights of each row at a time and applies them to the m
// activation rows, so the weights are read once. Ends with bk_warp_sums: the warps' row sums
// in `part`, after the barrier.
template <typename B, int M, int NW, int R, int W, typename XRow>
__device__ __forceinline__ void bk_block_sums(const u8* const (&wbase)[NW], i64 row_bytes,
                                              i64 row0, int n_rows, int k, XRow xrow, int m,
                                              int lane, int wid, float (&part)[W][NW][R][M]) {
    const int n_chunks = k >> 3;
    const u8* wr[NW][R];
#pragma unroll
    for (int h = 0; h < NW; ++h)
#pragma unroll
        for (int i = 0; i < R; ++i)
            wr[h][i] = wbase[h] + (row0 + i < n_rows ? row0 + i : (i64)n_rows - 1) * row_bytes;
    float acc[NW][R][M];
#pragma unroll
    for (int h = 0; h < NW; ++h)
#pragma unroll
        for (int i = 0; i < R; ++i)
#pragma unroll
            for (int r = 0; r < M; ++r) acc[h][i][r] = 0.f;
#pragma unroll (M == 1 ? 2 : 1)
    for (int c = wid * KVS_WARP + lane; c < n_chunks; c += W * KVS_WARP) {
        const int e = c << 3;
        const int blk = e / B::QK;
        // M = 1: the activations first, so that their loads and the weights' are all in
        // flight together (m >= 1, so row 0 needs no check)
        float4 a1, b1;
        if constexpr (M == 1) {
            const float4* xp = reinterpret_cast<const float4*>(xrow(0) + e);
            a1 = xp[0];
            b1 = xp[1];
        }
        float q[NW][R][8], d[NW][R], mn[NW][R];
#pragma unroll
        for (int h = 0; h < NW; ++h)
#pragma unroll
            for (int i = 0; i < R; ++i)
                B::dec(wr[h][i] + (i64)blk * B::BYTES, e - blk * B::QK, q[h][i], d[h][i], mn[h][i]);
#pragma unroll
        for (int r = 0; r < M; ++r) {
            if (M == 1 || r < m) {
                float4 a, b;
                if constexpr (M == 1) {
                    a = a1;
                    b = b1;
                } else {
                    const float4* xp = reinterpret_cast<const float4*>(xrow(r) + e);
                    a = xp[0];
                    b = xp[1];
                }
                float sx = 0.f;
                if constexpr (B::HAS_MIN) sx = (a.x + a.y) + (a.z + a.w) + (b.x + b.y) + (b.z + b.w);
#pragma unroll
                for (int h = 0; h < NW; ++h)
#pragma unroll
                    for (int i = 0; i < R; ++i) {
                        const float* qq = q[h][i];
                        const float sq = qq[0] * a.x + qq[1] * a.y + qq[2] * a.z + qq[3] * a.w
                                       + qq[4] * b.x + qq[5] * b.y + qq[6] * b.z + qq[7] * b.w;
                        if constexpr (B::HAS_MIN) acc[h][i][r] += d[h][i] * sq - mn[h][i] * sx;
                        else acc[h][i][r] += d[h][i] * sq;
                    }
            }
        }
    }
    bk_warp_sums(acc, part, lane, wid);
}

// NW = 1 (bmv): y[r, col0 + i] (+)= sum_j x[r, j] W[i, j] (+ bias[col0 + i]) per `flags`.
// NW = 2 (bmvglu): y[r, i] = bk_act(sum_j x[r, j] G[i, j], sum_j x[r, j] U[i, j], act), with G
// the rows of w and U those of w_up (same type and shape); flags, bias and col0 unused.
// x: float32 rows (row stride x_stride, a multiple of 4; x 16-byte aligned: the host copies
// otherwise); y: float32 rows of stride y_stride. CTA b of the grid takes output rows
// [R b, R b + R), then grid-strides; its warp v takes chunks v * 32 + lane, stepping by
// 32 * BK_MV_WARPS. Each warp's sums are reduced across its lanes, then added over the warps
// in warp order (a fixed order: the result is the same bits every run).
template <typename B, int M, int NW>
__device__ __forceinline__ void bmv_impl(
    const u8* __restrict__ w, const u8* __restrict__ w_up, i64 row_bytes, int n_rows, int k,
    const float* __restrict__ x, i64 x_stride, int m, float* __restrict__ y, i64 y_stride,
    i64 col0, const float* __restrict__ bias, int flags, int act)
{
    constexpr int R = BkRows<M, NW>::R;
    // each warp's row sums: [warp][h][i][activation row]
    __shared__ float part[BK_MV_WARPS][NW][R][M];
    const int lane = threadIdx.x & (KVS_WARP - 1);
    const int wid = threadIdx.x >> 5;
    const u8* wb[NW];
    wb[0] = w;
    if constexpr (NW == 2) wb[1] = w_up;
    const auto xrow = [=](int r) { return x + r * x_stride; };
    for (i64 row0 = (i64)blockIdx.x * R; row0 < n_rows; row0 += (i64)gridDim.x * R) {
        bk_block_sums<B, M, NW, R, BK_MV_WARPS>(wb, row_bytes, row0, n_rows, k, xrow, m, lane,
                                                wid, part);
        for (int t = threadIdx.x; t < R * M; t += blockDim.x) {
            const int i = t / M, r = t % M;
            const i64 row = row0 + i;
            if (r < m && row < n_rows) {
                float s[NW];
                bk_cta_sums(part, i, r, s);
                if constexpr (NW == 2) {
                    y[r * y_stride + row] = bk_act(s[0], s[1], act);
                } else {
                    // the NumPy op's order: (W x + bias), then added to y
                    float v = s[0];
                    if (flags & BMV_BIAS) v += bias[col0 + row];
                    float* yp = y + r * y_stride + col0 + row;
                    *yp = (flags & BMV_ACCUMULATE) ? *yp + v : v;
                }
            }
        }
        __syncthreads();  // `part` is written again for the next rows
    }
}

// out: C-contiguous f16 [n_rows, k], rows r0 .. r0 + n_rows of the weight.
template <typename B>
__device__ __forceinline__ void bdq_impl(const u8* __restrict__ w, i64 row_bytes, i64 r0,
                                         i64 n_rows, int k, f16_t* __restrict__ out)
{
    const int cpr = k >> 3;
    const i64 total = n_rows * cpr;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (i64)gridDim.x * blockDim.x) {
        const i64 i = idx / cpr;
        const int e = (int)(idx - i * cpr) << 3;
        const int blk = e / B::QK;
        float q[8], d, mn;
        B::dec(w + (r0 + i) * row_bytes + (i64)blk * B::BYTES, e - blk * B::QK, q, d, mn);
        u32 h[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
            h[j] = (u32)kvs_f2h(__fsub_rn(__fmul_rn(d, q[2 * j]), mn))
                 | ((u32)kvs_f2h(__fsub_rn(__fmul_rn(d, q[2 * j + 1]), mn)) << 16);
        // 16 bytes at an f16 offset that is a multiple of 8 (k % 8 == 0; out 16-byte aligned),
        // as one 16-byte store of four 32-bit words. Not as two 64-bit words: for bdq_q2_k,
        // ptxas of CUDA 13.0 (sm_90) packed elements 2 and 3 into a register other than the
        // one it stored, so they came out as (h3, 0) on the device (PTX and the emulator
        // right; docs/gpu.md, "Known issues").
        *reinterpret_cast<float4*>(out + i * k + e) =
            make_float4(__int_as_float((int)h[0]), __int_as_float((int)h[1]),
                        __int_as_float((int)h[2]), __int_as_float((int)h[3]));
    }
}

// out: C-contiguous float32 [n_tok, k].
template <typename B>
__device__ __forceinline__ void bemb_impl(const u8* __restrict__ w, i64 row_bytes, int vocab,
                                          int k, const int* __restrict__ tokens, int n_tok,
                                          float scale, float* __restrict__ out)
{
    const int cpr = k >> 3;
    const i64 total = (i64)n_tok * cpr;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (i64)gridDim.x * blockDim.x) {
        const i64 t = idx / cpr;
        const int e = (int)(idx - t * cpr) << 3;
        const int id = tokens[t];
        float4* o = reinterpret_cast<float4*>(out + t * k + e);  // 32-byte aligned
        if (id < 0 || id >= vocab) {
            const float nan = kvs_nan();
            o[0] = make_float4(nan, nan, nan, nan);
            o[1] = o[0];
            continue;
        }
        const int blk = e / B::QK;
        float q[8], d, mn;
        B::dec(w + (i64)id * row_bytes + (i64)blk * B::BYTES, e - blk * B::QK, q, d, mn);
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = __fmul_rn(__fsub_rn(__fmul_rn(d, q[j]), mn), scale);
        o[0] = make_float4(v[0], v[1], v[2], v[3]);
        o[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
}

// The entry points, written out (kvshare.kernels.entry_points and the compile test read the
// `extern "C"` declarations from this text): bmv_<type>_m{1,4,16}, bmvglu_<type>_m{1,4,16},
// bdq_<type>, bemb_<type>.
// Each type's kernels are one line each, so the module compiles in parts, one per block
// type, at the part's first launch (kvshare.kernels.parts):
// parts by type: bmv bmvglu bdq bemb
#define BMV_ARGS const u8* __restrict__ w, i64 row_bytes, int n_rows, int k,                       \
    const float* __restrict__ x, i64 x_stride, int m, float* __restrict__ y, i64 y_stride,       \
    i64 col0, const float* __restrict__ bias, int flags
#define BMV(B, M) bmv_impl<B, M, 1>(w, w, row_bytes, n_rows, k, x, x_stride, m, y, y_stride, col0, \
    bias, flags, 0)
#define BMVGLU_ARGS const u8* __restrict__ w_gate, const u8* __restrict__ w_up, i64 row_bytes,    \
    int n_rows, int k, const float* __restrict__ x, i64 x_stride, int m, float* __restrict__ y,  \
    i64 y_stride, int act
#define BMVGLU(B, M) bmv_impl<B, M, 2>(w_gate, w_up, row_bytes, n_rows, k, x, x_stride, m, y,     \
    y_stride, 0, x, 0, act)
#define BDQ_ARGS const u8* __restrict__ w, i64 row_bytes, i64 r0, i64 n_rows, int k,               \
    f16_t* __restrict__ out
#define BEMB_ARGS const u8* __restrict__ w, i64 row_bytes, int vocab, int k,                       \
    const int* __restrict__ tokens, int n_tok, float scale, float* __restrict__ out

// q4_0
extern "C" __global__ void bmv_q4_0_m1(BMV_ARGS) { BMV(BkQ4_0, 1); }
extern "C" __global__ void bmv_q4_0_m4(BMV_ARGS) { BMV(BkQ4_0, 4); }
extern "C" __global__ void bmv_q4_0_m16(BMV_ARGS) { BMV(BkQ4_0, 16); }
extern "C" __global__ void bmvglu_q4_0_m1(BMVGLU_ARGS) { BMVGLU(BkQ4_0, 1); }
extern "C" __global__ void bmvglu_q4_0_m4(BMVGLU_ARGS) { BMVGLU(BkQ4_0, 4); }
extern "C" __global__ void bmvglu_q4_0_m16(BMVGLU_ARGS) { BMVGLU(BkQ4_0, 16); }
extern "C" __global__ void bdq_q4_0(BDQ_ARGS) { bdq_impl<BkQ4_0>(w, row_bytes, r0, n_rows, k, out); }
extern "C" __global__ void bemb_q4_0(BEMB_ARGS) { bemb_impl<BkQ4_0>(w, row_bytes, vocab, k, tokens, n_tok, scale, out); }

// q4_1
extern "C" __global__ void bmv_q4_1_m1(BMV_ARGS) { BMV(BkQ4_1, 1); }
extern "C" __global__ void bmv_q4_1_m4(BMV_ARGS) { BMV(BkQ4_1, 4); }
extern "C" __global__ void bmv_q4_1_m16(BMV_ARGS) { BMV(BkQ4_1, 16); }
extern "C" __global__ void bmvglu_q4_1_m1(BMVGLU_ARGS) { BMVGLU(BkQ4_1, 1); }
extern "C" __global__ void bmvglu_q4_1_m4(BMVGLU_ARGS) { BMVGLU(BkQ4_1, 4); }
extern "C" __global__ void bmvglu_q4_1_m16(BMVGLU_ARGS) { BMVGLU(BkQ4_1, 16); }
extern "C" __global__ void bdq_q4_1(BDQ_ARGS) { bdq_impl<BkQ4_1>(w, row_bytes, r0, n_rows, k, out); }
extern "C" __global__ void bemb_q4_1(BEMB_ARGS) { bemb_impl<BkQ4_1>(w, row_bytes, vocab, k, tokens, n_tok, scale, out); }

// q5_0
extern "C" __global__ void bmv_q5_0_m1(BMV_ARGS) { BMV(BkQ5_0, 1); }
extern "C" __global__ void bmv_q5_0_m4(BMV_ARGS) { BMV(BkQ5_0, 4); }
extern "C" __global__ void bmv_q5_0_m16(BMV_ARGS) { BMV(BkQ5_0, 16); }
extern "C" __global__ void bmvglu_q5_0_m1(BMVGLU_ARGS) { BMVGLU(BkQ5_0, 1); }
extern "C" __global__ void bmvglu_q5_0_m4(BMVGLU_ARGS) { BMVGLU(BkQ5_0, 4); }
extern "C" __global__ void bmvglu_q5_0_m16(BMVGLU_ARGS) { BMVGLU(BkQ5_0, 16); }
extern "C" __global__ void bdq_q5_0(BDQ_ARGS) { bdq_impl<BkQ5_0>(w, row_bytes, r0, n_rows, k, out); }
extern "C" __global__ void bemb_q5_0(BEMB_ARGS) { bemb_impl<BkQ5_0>(w, row_bytes, vocab, k, tokens, n_tok, scale, out); }

// q5_1
extern "C" __global__ void bmv_q5_1_m1(BMV_ARGS) { BMV(BkQ5_1, 1); }
extern "C" __global__ void bmv_q5_1_m4(BMV_ARGS) { BMV(BkQ5_1, 4); }
extern "C" __global__ void bmv_q5_1_m16(BMV_ARGS) { BMV(BkQ5_1, 16); }
extern "C" __global__ void bmvglu_q5_1_m1(BMVGLU_ARGS) { BMVGLU(BkQ5_1, 1); }
extern "C" __global__ void bmvglu_q5_1_m4(BMVGLU_ARGS) { BMVGLU(BkQ5_1, 4); }
extern "C" __global__ void bmvglu_q5_1_m16(BMVGLU_ARGS) { BMVGLU(BkQ5_1, 16); }
extern "C" __global__ void bdq_q5_1(BDQ_ARGS) { bdq_impl<BkQ5_1>(w, row_bytes, r0, n_rows, k, out); }
extern "C" __global__ void bemb_q5_1(BEMB_ARGS) { bemb_impl<BkQ5_1>(w, row_bytes, vocab, k, tokens, n_tok, scale, out); }

// q8_0
extern "C" __global__ void bmv_q8_0_m1(BMV_ARGS) { BMV(BkQ8_0, 1); }
extern "C" __global__ void bmv_q8_0_m4(BMV_ARGS) { BMV(BkQ8_0, 4); }
extern "C" __global__ void bmv_q8_0_m16(BMV_ARGS) { BMV(BkQ8_0, 16); }
extern "C" __global__ void bmvglu_q8_0_m1(BMVGLU_ARGS) { BMVGLU(BkQ8_0, 1); }
extern "C" __global__ void bmvglu_q8_0_m4(BMVGLU_ARGS) { BMVGLU(BkQ8_0, 4); }
extern "C" __global__ void bmvglu_q8_0_m16(BMVGLU_ARGS) { BMVGLU(BkQ8_0, 16); }
extern "C" __global__ void bdq_q8_0(BDQ_ARGS) { bdq_impl<BkQ8_0>(w, row_bytes, r0, n_rows, k, out); }
extern "C" __global__ void bemb_q8_0(BEMB_ARGS) { bemb_impl<BkQ8_0>(w, row_bytes, vocab, k, tokens, n_tok, scale, out); }

// q2_k
extern "C" __global__ void bmv_q2_k_m1(BMV_ARGS) { BMV(BkQ2_K, 1); }
extern "C" __global__ void bmv_q2_k_m4(BMV_ARGS) { BMV(BkQ2_K, 4); }
extern "C" __global__ void bmv_q2_k_m16(BMV_ARGS) { BMV(BkQ2_K, 16); }
extern "C" __global__ void bmvglu_q2_k_m1(BMVGLU_ARGS) { BMVGLU(BkQ2_K, 1); }
extern "C" __global__ void bmvglu_q2_k_m4(BMVGLU_ARGS) { BMVGLU(BkQ2_K, 4); }
extern "C" __global__ void bmvglu_q2_k_m16(BMVGLU_ARGS) { BMVGLU(BkQ2_K, 16); }
extern "C" __global__ void bdq_q2_k(BDQ_ARGS) { bdq_impl<BkQ2_K>(w, row_bytes, r0, n_rows, k, out); }
extern "C" __global__ void bemb_q2_k(BEMB_ARGS) { bemb_impl<BkQ2_K>(w, row_bytes, vocab, k, tokens, n_tok, scale, out); }

// q3_k
extern "C" __global__ void bmv_q3_k_m1(BMV_ARGS) { BMV(BkQ3_K, 1); }
extern "C" __global__ void bmv_q3_k_m4(BMV_ARGS) { BMV(BkQ3_K, 4); }
extern "C" __global__ void bmv_q3_k_m16(BMV_ARGS) { BMV(BkQ3_K, 16); }
extern "C" __global__ void bmvglu_q3_k_m1(BMVGLU_ARGS) { BMVGLU(BkQ3_K, 1); }
extern "C" __global__ void bmvglu_q3_k_m4(BMVGLU_ARGS) { BMVGLU(BkQ3_K, 4); }
extern "C" __global__ void bmvglu_q3_k_m16(BMVGLU_ARGS) { BMVGLU(BkQ3_K, 16); }
extern "C" __global__ void bdq_q3_k(BDQ_ARGS) { bdq_impl<BkQ3_K>(w, row_bytes, r0, n_rows, k, out); }
extern "C" __global__ void bemb_q3_k(BEMB_ARGS) { bemb_impl<BkQ3_K>(w, row_bytes, vocab, k, tokens, n_tok, scale, out); }

// q4_k
extern "C" __global__ void bmv_q4_k_m1(BMV_ARGS) { BMV(BkQ4_K, 1); }
extern "C" __global__ void bmv_q4_k_m4(BMV_ARGS) { BMV(BkQ4_K, 4); }
extern "C" __global__ void bmv_q4_k_m16(BMV_ARGS) { BMV(BkQ4_K, 16); }
extern "C" __global__ void bmvglu_q4_k_m1(BMVGLU_ARGS) { BMVGLU(BkQ4_K, 1); }
extern "C" __global__ void bmvglu_q4_k_m4(BMVGLU_ARGS) { BMVGLU(BkQ4_K, 4); }
extern "C" __global__ void bmvglu_q4_k_m16(BMVGLU_ARGS) { BMVGLU(BkQ4_K, 16); }
extern "C" __global__ void bdq_q4_k(BDQ_ARGS) { bdq_impl<BkQ4_K>(w, row_bytes, r0, n_rows, k, out); }
extern "C" __global__ void bemb_q4_k(BEMB_ARGS) { bemb_impl<BkQ4_K>(w, row_bytes, vocab, k, tokens, n_tok, scale, out); }

// q5_k
extern "C" __global__ void bmv_q5_k_m1(BMV_ARGS) { BMV(BkQ5_K, 1); }
extern "C" __global__ void bmv_q5_k_m4(BMV_ARGS) { BMV(BkQ5_K, 4); }
extern "C" __global__ void bmv_q5_k_m16(BMV_ARGS) { BMV(BkQ5_K, 16); }
extern "C" __global__ void bmvglu_q5_k_m1(BMVGLU_ARGS) { BMVGLU(BkQ5_K, 1); }
extern "C" __global__ void bmvglu_q5_k_m4(BMVGLU_ARGS) { BMVGLU(BkQ5_K, 4); }
extern "C" __global__ void bmvglu_q5_k_m16(BMVGLU_ARGS) { BMVGLU(BkQ5_K, 16); }
extern "C" __global__ void bdq_q5_k(BDQ_ARGS) { bdq_impl<BkQ5_K>(w, row_bytes, r0, n_rows, k, out); }
extern "C" __global__ void bemb_q5_k(BEMB_ARGS) { bemb_impl<BkQ5_K>(w, row_bytes, vocab, k, tokens, n_tok, scale, out); }

// q6_k
extern "C" __global__ void bmv_q6_k_m1(BMV_ARGS) { BMV(BkQ6_K, 1); }
extern "C" __global__ void bmv_q6_k_m4(BMV_ARGS) { BMV(BkQ6_K, 4); }
extern "C" __global__ void bmv_q6_k_m16(BMV_ARGS) { BMV(BkQ6_K, 16); }
extern "C" __global__ void bmvglu_q6_k_m1(BMVGLU_ARGS) { BMVGLU(BkQ6_K, 1); }
extern "C" __global__ void bmvglu_q6_k_m4(BMVGLU_ARGS) { BMVGLU(BkQ6_K, 4); }
extern "C" __global__ void bmvglu_q6_k_m16(BMVGLU_ARGS) { BMVGLU(BkQ6_K, 16); }
extern "C" __global__ void bdq_q6_k(BDQ_ARGS) { bdq_impl<BkQ6_K>(w, row_bytes, r0, n_rows, k, out); }
extern "C" __global__ void bemb_q6_k(BEMB_ARGS) { bemb_impl<BkQ6_K>(w, row_bytes, vocab, k, tokens, n_tok, scale, out); }

// iq4_nl
extern "C" __global__ void bmv_iq4_nl_m1(BMV_ARGS) { BMV(BkIQ4_NL, 1); }
extern "C" __global__ void bmv_iq4_nl_m4(BMV_ARGS) { BMV(BkIQ4_NL, 4); }
extern "C" __global__ void bmv_iq4_nl_m16(BMV_ARGS) { BMV(BkIQ4_NL, 16); }
extern "C" __global__ void bmvglu_iq4_nl_m1(BMVGLU_ARGS) { BMVGLU(BkIQ4_NL, 1); }
extern "C" __global__ void bmvglu_iq4_nl_m4(BMVGLU_ARGS) { BMVGLU(BkIQ4_NL, 4); }
extern "C" __global__ void bmvglu_iq4_nl_m16(BMVGLU_ARGS) { BMVGLU(BkIQ4_NL, 16); }
extern "C" __global__ void bdq_iq4_nl(BDQ_ARGS) { bdq_impl<BkIQ4_NL>(w, row_bytes, r0, n_rows, k, out); }
extern "C" __global__ void bemb_iq4_nl(BEMB_ARGS) { bemb_impl<BkIQ4_NL>(w, row_bytes, vocab, k, tokens, n_tok, scale, out); }

// iq4_xs
extern "C" __global__ void bmv_iq4_xs_m1(BMV_ARGS) { BMV(BkIQ4_XS, 1); }
extern "C" __global__ void bmv_iq4_xs_m4(BMV_ARGS) { BMV(BkIQ4_XS, 4); }
extern "C" __global__ void bmv_iq4_xs_m16(BMV_ARGS) { BMV(BkIQ4_XS, 16); }
extern "C" __global__ void bmvglu_iq4_xs_m1(BMVGLU_ARGS) { BMVGLU(BkIQ4_XS, 1); }
extern "C" __global__ void bmvglu_iq4_xs_m4(BMVGLU_ARGS) { BMVGLU(BkIQ4_XS, 4); }
extern "C" __global__ void bmvglu_iq4_xs_m16(BMVGLU_ARGS) { BMVGLU(BkIQ4_XS, 16); }
extern "C" __global__ void bdq_iq4_xs(BDQ_ARGS) { bdq_impl<BkIQ4_XS>(w, row_bytes, r0, n_rows, k, out); }
extern "C" __global__ void bemb_iq4_xs(BEMB_ARGS) { bemb_impl<BkIQ4_XS>(w, row_bytes, vocab, k, tokens, n_tok, scale, out); }

// f32
extern "C" __global__ void bmv_f32_m1(BMV_ARGS) { BMV(BkF32, 1); }
extern "C" __global__ void bmv_f32_m4(BMV_ARGS) { BMV(BkF32, 4); }
extern "C" __global__ void bmv_f32_m16(BMV_ARGS) { BMV(BkF32, 16); }
extern "C" __global__ void bmvglu_f32_m1(BMVGLU_ARGS) { BMVGLU(BkF32, 1); }
extern "C" __global__ void bmvglu_f32_m4(BMVGLU_ARGS) { BMVGLU(BkF32, 4); }
extern "C" __global__ void bmvglu_f32_m16(BMVGLU_ARGS) { BMVGLU(BkF32, 16); }
extern "C" __global__ void bdq_f32(BDQ_ARGS) { bdq_impl<BkF32>(w, row_bytes, r0, n_rows, k, out); }
extern "C" __global__ void bemb_f32(BEMB_ARGS) { bemb_impl<BkF32>(w, row_bytes, vocab, k, tokens, n_tok, scale, out); }

// f16
extern "C" __global__ void bmv_f16_m1(BMV_ARGS) { BMV(BkF16, 1); }
extern "C" __global__ void bmv_f16_m4(BMV_ARGS) { BMV(BkF16, 4); }
extern "C" __global__ void bmv_f16_m16(BMV_ARGS) { BMV(BkF16, 16); }
extern "C" __global__ void bmvglu_f16_m1(BMVGLU_ARGS) { BMVGLU(BkF16, 1); }
extern "C" __global__ void bmvglu_f16_m4(BMVGLU_ARGS) { BMVGLU(BkF16, 4); }
extern "C" __global__ void bmvglu_f16_m16(BMVGLU_ARGS) { BMVGLU(BkF16, 16); }
extern "C" __global__ void bdq_f16(BDQ_ARGS) { bdq_impl<BkF16>(w, row_bytes, r0, n_rows, k, out); }
extern "C" __global__ void bemb_f16(BEMB_ARGS) { bemb_impl<BkF16>(w, row_bytes, vocab, k, tokens, n_tok, scale, out); }

// bf16
extern "C" __global__ void bmv_bf16_m1(BMV_ARGS) { BMV(BkBF16, 1); }
extern "C" __global__ void bmv_bf16_m4(BMV_ARGS) { BMV(BkBF16, 4); }
extern "C" __global__ void bmv_bf16_m16(BMV_ARGS) { BMV(BkBF16, 16); }
extern "C" __global__ void bmvglu_bf16_m1(BMVGLU_ARGS) { BMVGLU(BkBF16, 1); }
extern "C" __global__ void bmvglu_bf16_m4(BMVGLU_ARGS) { BMVGLU(BkBF16, 4); }
extern "C" __global__ void bmvglu_bf16_m16(BMVGLU_ARGS) { BMVGLU(BkBF16, 16); }
extern "C" __global__ void bdq_bf16(BDQ_ARGS) { bdq_impl<BkBF16>(w, row_bytes, r0, n_rows, k, out); }
extern "C" __global__ void bemb_bf16(BEMB_ARGS) { bemb_impl<BkBF16>(w, row_bytes, vocab, k, tokens, n_tok, scale, out); }
