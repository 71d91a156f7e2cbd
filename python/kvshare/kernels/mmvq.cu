// Decode mat-vec on 8-bit activations (kvshare.ops.gpu_mmvq), llama.cpp's mmvq design
// (ggml-cuda/mmvq.cu, vecdotq.cuh, quantize.cu) beside blocks.cu's f32-activation bmv:
//
//   quantize_q8_1     float32 rows x[r, :k] -> ggml's block_q8_1 rows (per 32 elements:
//                     f16 d = amax / 127, f16 s = sum of the 32 float32 inputs, 32 int8
//                     q = roundf(x / d); 36 bytes), each row padded with zeros to a multiple of
//                     MQ_ROW_PAD elements as llama.cpp pads them (MATRIX_ROW_PADDING); one
//                     thread per element, one warp per block (warp max and sum).
//   mmvq_<type>_m<M>  y[r * y_stride + col0 + i] = sum_j xq[r, j] * W[i, j] (+ bias[col0 + i])
//                     for r < m <= M (M = 1, 2, 4, 8); flags bit 0: add the bias, bit 1: add
//                     into y (y +=) instead of writing it. The weight quants are read as 32-bit
//                     words and multiplied with the activations' int8 quants by __dp4a; the
//                     block scales are applied per 32 (or 16) elements in float32.
//
// Launch (llama.cpp's MMVQ_PARAMETERS_GENERIC, what it picks for Ampere and Hopper): MQ_NW(M)
// warps per CTA (4 for M <= 4, 2 for M = 8), MQ_RPB(M) weight rows per CTA (1 for M = 1, else
// 2); thread t of the CTA takes weight block t / (QI / VDR) of each row and its ints
// VDR * (t % (QI / VDR)) .. + VDR, then strides by VDR * 32 * NW / QI blocks; the warps'
// partial sums meet in shared memory and warp 0 reduces them. Grid-stride over row groups.
//
// Numerics (as llama.cpp's): the integer dot products are exact; Q4_0 / Q5_0 subtract their
// offset (8, 16) and Q4_1 / Q5_1 add their min through the q8_1 block's s (the f16-rounded sum of
// the float32 activations), the K-quants and IQ4 through the int8 quants themselves. Where
// llama.cpp multiplies the two f16 scales of Q4_1 / Q5_1 in f16 (__hmul2 with FAST_FP16), this
// does it in float32.
//
// Alignment: GGUF rows are whole blocks packed without padding, and some block sizes are not
// multiples of 4 bytes (Q4_0, IQ4_NL 18, Q5_0 22, Q8_0 34, Q3_K 110, Q6_K 210): their quants are
// read with two 16-bit loads per word (mq_b2, llama.cpp's get_int_b2), the others with one
// 32-bit load (mq_b4). Every block size is even and the device buffers are 256-byte aligned.
// block_q8_1 rows are 36-byte blocks from a 256-byte-aligned buffer: 4-byte loads.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

#define MQ_Q8_1_BYTES 36   // sizeof(block_q8_1): half2 ds + int8 qs[32]
#define MQ_ROW_PAD 512     // llama.cpp's MATRIX_ROW_PADDING (kvshare.ops.gpu_mmvq.ROW_PAD)
#define MQ_QUANTIZE_THREADS 256  // CUDA_QUANTIZE_BLOCK_SIZE

__device__ __forceinline__ int mq_b2(const u8* p, int i32) {  // 2-byte aligned p
    const u16* q = reinterpret_cast<const u16*>(p);
    return (int)((u32)q[2 * i32] | ((u32)q[2 * i32 + 1] << 16));
}
__device__ __forceinline__ int mq_b4(const u8* p, int i32) {  // 4-byte aligned p
    return reinterpret_cast<const int*>(p)[i32];
}
__device__ __forceinline__ float mq_f16(const u8* p) {
    return kvs_h2f(*reinterpret_cast<const f16_t*>(p));
}
// a block_q8_1: d at 0, s at 2, qs at 4
__device__ __forceinline__ float mq_d8(const u8* yb) { return mq_f16(yb); }
__device__ __forceinline__ float mq_s8(const u8* yb) { return mq_f16(yb + 2); }
__device__ __forceinline__ int mq_u(const u8* yb, int i32) { return mq_b4(yb + 4, i32); }

// IQ4 4-bit indices -> int8 values of ggml's kvalues_iq4nl, 4 at a time (llama.cpp's
// get_int_from_table_16): .x the values of the low nibbles of q4's bytes, .y of the high
// ones. The table is 4 constant words (no memory); __byte_perm uses the low 3 bits of each
// selector nibble, the 4th picks the table half.
struct mq_int2 { int x, y; };
__device__ __forceinline__ mq_int2 mq_iq4_values(int q4) {
    const u32 t0 = 0xBFAD9881u, t1 = 0xF6EADDCFu, t2 = 0x26190D01u, t3 = 0x71594535u;
    const u32 q = (u32)q4;
    const u32 sel = 0x32103210u | ((q & 0x88888888u) >> 1);
    u32 tmp[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const u32 sh = 16 * i;
        const u32 lo = __byte_perm(t0, t1, q >> sh);
        const u32 hi = __byte_perm(t2, t3, q >> sh);
        tmp[i] = __byte_perm(lo, hi, sel >> sh);
    }
    mq_int2 r;
    r.x = (int)__byte_perm(tmp[0], tmp[1], 0x6420);
    r.y = (int)__byte_perm(tmp[0], tmp[1], 0x7531);
    return r;
}

// --- the formats: QK elements and BYTES bytes per block, QI 32-bit words of quants per block
// (as llama.cpp counts them), VDR words per thread and call; dot(b, y, iqs): the partial dot
// product of block b's words iqs .. with the q8_1 blocks from y (the one aligned with b first).

struct MqQ4_0 {  // d f16, qs[16]
    static constexpr int QK = 32, BYTES = 18, QI = 4, VDR = 2;
    static __device__ __forceinline__ float dot(const u8* b, const u8* y, int iqs) {
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < VDR; ++i) {
            const int v = mq_b2(b + 2, iqs + i);
            sumi = __dp4a((v >> 0) & 0x0F0F0F0F, mq_u(y, iqs + i), sumi);
            sumi = __dp4a((v >> 4) & 0x0F0F0F0F, mq_u(y, iqs + i + QI), sumi);
        }
        // the offset 8 through s: each of the QI / VDR threads of the block subtracts its share
        return mq_f16(b) * ((float)sumi * mq_d8(y) - (float)(8 * VDR / QI) * mq_s8(y));
    }
};

struct MqQ4_1 {  // d, m f16, qs[16]
    static constexpr int QK = 32, BYTES = 20, QI = 4, VDR = 2;
    static __device__ __forceinline__ float dot(const u8* b, const u8* y, int iqs) {
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < VDR; ++i) {
            const int v = mq_b4(b + 4, iqs + i);
            sumi = __dp4a((v >> 0) & 0x0F0F0F0F, mq_u(y, iqs + i), sumi);
            sumi = __dp4a((v >> 4) & 0x0F0F0F0F, mq_u(y, iqs + i + QI), sumi);
        }
        const float d4d8 = mq_f16(b) * mq_d8(y), m4s8 = mq_f16(b + 2) * mq_s8(y);
        return (float)sumi * d4d8 + m4s8 / (float)(8 / (VDR * 2));  // QI8_1 / (VDR * QR4_1)
    }
};

// the 5th bits of 4 elements (vh bits 0..3 -> bit 4 of bytes 0..3, bits 16..19 for the high
// nibbles), llama.cpp's vec_dot_q5_{0,1}_q8_1_impl
__device__ __forceinline__ int mq_q5_lo(int vl, int vh) {
    int v = (vl >> 0) & 0x0F0F0F0F;
    v |= (vh << 4) & 0x00000010;
    v |= (vh << 11) & 0x00001000;
    v |= (vh << 18) & 0x00100000;
    v |= (vh << 25) & 0x10000000;
    return v;
}
__device__ __forceinline__ int mq_q5_hi(int vl, int vh) {
    int v = (vl >> 4) & 0x0F0F0F0F;
    v |= (vh >> 12) & 0x00000010;
    v |= (vh >> 5) & 0x00001000;
    v |= (vh << 2) & 0x00100000;
    v |= (vh << 9) & 0x10000000;
    return v;
}

struct MqQ5_0 {  // d f16, qh[4], qs[16]
    static constexpr int QK = 32, BYTES = 22, QI = 4, VDR = 2;
    static __device__ __forceinline__ float dot(const u8* b, const u8* y, int iqs) {
        int sumi = 0;
        const int qh = mq_b2(b + 2, 0);
#pragma unroll
        for (int i = 0; i < VDR; ++i) {
            const int vl = mq_b2(b + 6, iqs + i), vh = qh >> (4 * (iqs + i));
            sumi = __dp4a(mq_q5_lo(vl, vh), mq_u(y, iqs + i), sumi);
            sumi = __dp4a(mq_q5_hi(vl, vh), mq_u(y, iqs + i + QI), sumi);
        }
        return mq_f16(b) * ((float)sumi * mq_d8(y) - (float)(16 * VDR / QI) * mq_s8(y));
    }
};

struct MqQ5_1 {  // d, m f16, qh[4], qs[16]
    static constexpr int QK = 32, BYTES = 24, QI = 4, VDR = 2;
    static __device__ __forceinline__ float dot(const u8* b, const u8* y, int iqs) {
        int sumi = 0;
        const int qh = mq_b4(b + 4, 0);
#pragma unroll
        for (int i = 0; i < VDR; ++i) {
            const int vl = mq_b4(b + 8, iqs + i), vh = qh >> (4 * (iqs + i));
            sumi = __dp4a(mq_q5_lo(vl, vh), mq_u(y, iqs + i), sumi);
            sumi = __dp4a(mq_q5_hi(vl, vh), mq_u(y, iqs + i + QI), sumi);
        }
        const float d5d8 = mq_f16(b) * mq_d8(y), m5s8 = mq_f16(b + 2) * mq_s8(y);
        return (float)sumi * d5d8 + m5s8 / (float)(QI / VDR);
    }
};

struct MqQ8_0 {  // d f16, qs i8[32]
    static constexpr int QK = 32, BYTES = 34, QI = 8, VDR = 2;
    static __device__ __forceinline__ float dot(const u8* b, const u8* y, int iqs) {
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < VDR; ++i) sumi = __dp4a(mq_b2(b + 2, iqs + i), mq_u(y, iqs + i), sumi);
        return mq_f16(b) * mq_d8(y) * (float)sumi;
    }
};

struct MqQ2_K {  // scales[16] (low nibble scale, high nibble min), qs[64], d, dmin f16
    static constexpr int QK = 256, BYTES = 84, QI = 16, VDR = 1;
    static __device__ __forceinline__ float dot(const u8* b, const u8* y, int iqs) {
        const int bq8_offset = 4 * (iqs / 8);  // QR2_K * (iqs / QI8_1)
        const int scale_offset = iqs - iqs % 8 + (iqs % 8) / 4;
        const u8* scales = b + scale_offset;
        const int v = mq_b4(b + 16, iqs);
        float sumf_d = 0.f, sumf_m = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u8* yb = y + (bq8_offset + i) * MQ_Q8_1_BYTES;
            const int u = mq_u(yb, iqs % 8);
            const float d8 = mq_d8(yb);
            const int sc = scales[2 * i];
            const int vi = (v >> (2 * i)) & 0x03030303;
            sumf_d += d8 * (float)(__dp4a(vi, u, 0) * (sc & 0xF));
            int mm = sc >> 4;  // the min, 4 times: times the sum of the int8 quants
            mm |= mm << 8;
            mm |= mm << 16;
            sumf_m += d8 * (float)__dp4a(mm, u, 0);
        }
        return mq_f16(b + 80) * sumf_d - mq_f16(b + 82) * sumf_m;
    }
};

struct MqQ3_K {  // hmask[32], qs[64], scales[12] (16 6-bit values, -32), d f16
    static constexpr int QK = 256, BYTES = 110, QI = 16, VDR = 1;
    static __device__ __forceinline__ float dot(const u8* b, const u8* y, int iqs) {
        const int bq8_offset = 4 * (iqs / 8);  // QR3_K * (iqs / (QI3_K / 2))
        const int scale_offset = iqs - iqs % 8 + (iqs % 8) / 4;
        const int vl = mq_b2(b + 32, iqs);
        // inverted so that a clear hmask bit subtracts 4 and a set one nothing
        const int vh = ~mq_b2(b, iqs % 8) >> bq8_offset;
        const u8* scales = b + 96;
        float sumf = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u8* yb = y + (bq8_offset + i) * MQ_Q8_1_BYTES;
            const int isc = scale_offset + 2 * i;
            const int sc_low = (scales[isc % 8] >> (4 * (isc / 8))) & 0xF;
            const int sc_high = ((scales[8 + isc % 4] >> (2 * (isc / 4))) & 3) << 4;
            const int sc = (sc_low | sc_high) - 32;
            const int vil = (vl >> (2 * i)) & 0x03030303;
            const int vih = ((vh >> i) << 2) & 0x04040404;
            const int vi = (int)__vsub4((u32)vil, (u32)vih);
            sumf += mq_d8(yb) * (float)(__dp4a(vi, mq_u(yb, iqs % 8), 0) * sc);
        }
        return mq_f16(b + 108) * sumf;
    }
};

// the 6-bit scale and min of sub-blocks 2j, 2j + 1 (j = bq8_offset / 2) of Q4_K / Q5_K, from the
// 12 scale bytes read as u16 (llama.cpp's branchless form): sc[0..1], m[0..1]
__device__ __forceinline__ void mq_k4_scales(const u8* s12, int bq8_offset, int* sc, int* m) {
    const u16* scales = reinterpret_cast<const u16*>(s12);
    const int j = bq8_offset / 2, jm = j & 1;
    const u32 s0 = scales[jm + 0], s2 = scales[jm + 2], s4 = scales[jm + 4];
    const u32 hi = (u32) - (int)(j >= 2);
    const u32 a0 = ((s0 & 0x3f3fu) & ~hi) | ((((s4 >> 0) & 0x0f0fu) | ((s0 & 0xc0c0u) >> 2)) & hi);
    const u32 a1 = ((s2 & 0x3f3fu) & ~hi) | ((((s4 >> 4) & 0x0f0fu) | ((s2 & 0xc0c0u) >> 2)) & hi);
    sc[0] = (int)(a0 & 0xffu);
    sc[1] = (int)((a0 >> 8) & 0xffu);
    m[0] = (int)(a1 & 0xffu);
    m[1] = (int)((a1 >> 8) & 0xffu);
}

struct MqQ4_K {  // d, dmin f16, scales[12], qs[128]
    static constexpr int QK = 256, BYTES = 144, QI = 32, VDR = 2;
    static __device__ __forceinline__ float dot(const u8* b, const u8* y, int iqs) {
        const int bq8_offset = 2 * ((iqs / 2) / 4);  // QR4_K * ((iqs / 2) / (QI8_1 / 2))
        const int w = (iqs / 2) % 4;
        const int* q4 = reinterpret_cast<const int*>(b + 16 + 16 * bq8_offset + 4 * w);
        const int v0 = q4[0], v1 = q4[4];
        int sc[2], m[2];
        mq_k4_scales(b + 4, bq8_offset, sc, m);
        float sumf_d = 0.f, sumf_m = 0.f;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const u8* yb = y + (bq8_offset + i) * MQ_Q8_1_BYTES;
            const int u0 = mq_u(yb, w), u1 = mq_u(yb, w + 4);
            const float d8 = mq_d8(yb);
            const int v0i = (v0 >> (4 * i)) & 0x0F0F0F0F, v1i = (v1 >> (4 * i)) & 0x0F0F0F0F;
            const int dot1 = __dp4a(v1i, u1, __dp4a(v0i, u0, 0));
            const int dot2 = __dp4a(0x01010101, u1, __dp4a(0x01010101, u0, 0));  // sum of u
            sumf_d += d8 * (float)(dot1 * sc[i]);
            sumf_m += d8 * (float)(dot2 * m[i]);
        }
        return mq_f16(b) * sumf_d - mq_f16(b + 2) * sumf_m;
    }
};

struct MqQ5_K {  // d, dmin f16, scales[12], qh[32], qs[128]
    static constexpr int QK = 256, BYTES = 176, QI = 32, VDR = 2;
    static __device__ __forceinline__ float dot(const u8* b, const u8* y, int iqs) {
        const int bq8_offset = 2 * ((iqs / 2) / 4);
        const int w = (iqs / 2) % 4;
        const int* ql = reinterpret_cast<const int*>(b + 48 + 16 * bq8_offset + 4 * w);
        const int* qh = reinterpret_cast<const int*>(b + 16 + 4 * w);
        const int vl0 = ql[0], vl1 = ql[4];
        const int vh0 = qh[0] >> bq8_offset, vh1 = qh[4] >> bq8_offset;
        int sc[2], m[2];
        mq_k4_scales(b + 4, bq8_offset, sc, m);
        float sumf_d = 0.f, sumf_m = 0.f;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const u8* yb = y + (bq8_offset + i) * MQ_Q8_1_BYTES;
            const int u0 = mq_u(yb, w), u1 = mq_u(yb, w + 4);
            const float d8 = mq_d8(yb);
            const int v0i = ((vl0 >> (4 * i)) & 0x0F0F0F0F) | (((vh0 >> i) << 4) & 0x10101010);
            const int v1i = ((vl1 >> (4 * i)) & 0x0F0F0F0F) | (((vh1 >> i) << 4) & 0x10101010);
            const int dot1 = __dp4a(v0i, u0, __dp4a(v1i, u1, 0));
            const int dot2 = __dp4a(0x01010101, u0, __dp4a(0x01010101, u1, 0));
            sumf_d += d8 * (float)(dot1 * sc[i]);
            sumf_m += d8 * (float)(dot2 * m[i]);
        }
        return mq_f16(b) * sumf_d - mq_f16(b + 2) * sumf_m;
    }
};

struct MqQ6_K {  // ql[128], qh[64], scales i8[16], d f16
    static constexpr int QK = 256, BYTES = 210, QI = 32, VDR = 1;
    static __device__ __forceinline__ float dot(const u8* b, const u8* y, int iqs) {
        const int bq8_offset = 4 * (iqs / 16) + (iqs % 16) / 8;  // 2 QR6_K (iqs / (QI6_K / 2)) + ..
        const int scale_offset = 8 * (iqs / 16) + (iqs % 16) / 4;
        const int vh_shift = 2 * ((iqs % 16) / 8);
        const int vl = mq_b2(b, iqs);
        const int vh = mq_b2(b + 128, 8 * (iqs / 16) + iqs % 8) >> vh_shift;
        const signed char* scales = reinterpret_cast<const signed char*>(b + 192) + scale_offset;
        float sumf = 0.f;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const u8* yb = y + (bq8_offset + 2 * i) * MQ_Q8_1_BYTES;
            const int sc = scales[4 * i];
            const int vil = (vl >> (4 * i)) & 0x0F0F0F0F;
            const int vih = ((vh >> (4 * i)) << 4) & 0x30303030;
            const int vi = (int)__vsub4((u32)(vil | vih), 0x20202020u);  // q - 32 per byte
            sumf += mq_d8(yb) * (float)(__dp4a(vi, mq_u(yb, iqs % 8), 0) * sc);
        }
        return mq_f16(b + 208) * sumf;
    }
};

struct MqIQ4_NL {  // d f16, qs[16] (Q4_0's layout), values from kvalues_iq4nl
    static constexpr int QK = 32, BYTES = 18, QI = 4, VDR = 2;
    static __device__ __forceinline__ float dot(const u8* b, const u8* y, int iqs) {
        int sumi = 0;
#pragma unroll
        for (int l = 0; l < VDR; ++l) {
            const mq_int2 v = mq_iq4_values(mq_b2(b + 2, iqs + l));
            sumi = __dp4a(v.x, mq_u(y, iqs + l), sumi);
            sumi = __dp4a(v.y, mq_u(y, iqs + l + 4), sumi);
        }
        return mq_f16(b) * mq_d8(y) * (float)sumi;
    }
};

struct MqIQ4_XS {  // d f16, scales_h u16, scales_l[4], qs[128]
    static constexpr int QK = 256, BYTES = 136, QI = 32, VDR = 4;
    static __device__ __forceinline__ float dot(const u8* b, const u8* y, int iqs) {
        const u8* yb = y + (iqs / 4) * MQ_Q8_1_BYTES;
        int sumi = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const mq_int2 v = mq_iq4_values(mq_b4(b + 8, iqs + j));
            sumi = __dp4a(v.x, mq_u(yb, j), sumi);
            sumi = __dp4a(v.y, mq_u(yb, j + 4), sumi);
        }
        const u32 sh = *reinterpret_cast<const u16*>(b + 2);
        const int ls = ((b[4 + iqs / 8] >> (iqs & 4)) & 0x0F) | (int)(((sh >> (iqs / 2)) & 3u) << 4);
        return mq_f16(b) * mq_d8(yb) * (float)(sumi * (ls - 32));
    }
};

// --- kernels ---------------------------------------------------------------------------------

// x: float32 rows (row stride x_stride elements, unit column stride) of k elements; xq: rows of
// k_pad / 32 block_q8_1 (k_pad a multiple of MQ_ROW_PAD, xq_stride bytes apart); elements
// k .. k_pad quantize as zeros. Grid (k_pad / 256, m), 256 threads: lanes of a warp share a
// block (k_pad is a multiple of 32, so no warp is cut).
extern "C" __global__ void __launch_bounds__(256) quantize_q8_1(
    const float* __restrict__ x, i64 x_stride, int k, int k_pad, u8* __restrict__ xq, i64 xq_stride)
{
    const int i0 = blockIdx.x * blockDim.x + threadIdx.x;
    if (i0 >= k_pad) return;  // whole warps (k_pad % 32 == 0)
    const i64 r = blockIdx.y;
    const float xi = i0 < k ? x[r * x_stride + i0] : 0.f;
    const float amax = kvs_warp_max(fabsf(xi));
    const float sum = kvs_warp_sum(xi);
    const float d = amax / 127.f;
    const int q = amax == 0.f ? 0 : (int)roundf(xi / d);
    u8* yb = xq + r * xq_stride + (i64)(i0 >> 5) * MQ_Q8_1_BYTES;
    yb[4 + (i0 & 31)] = (u8)(signed char)q;
    if ((i0 & 31) == 0) {
        f16_t* ds = reinterpret_cast<f16_t*>(yb);
        ds[0] = kvs_f2h(d);
        ds[1] = kvs_f2h(sum);
    }
}

template <int M> struct MqLaunch {  // llama.cpp's calc_nwarps / calc_rows_per_block (generic)
    static constexpr int NW = M <= 4 ? 4 : 2;
    static constexpr int RPB = M == 1 ? 1 : 2;
};

// w: the part's rows (row_bytes apart); xq: m rows of q8_1 blocks (xq_stride bytes apart; rows
// m .. M - 1 are computed from row m - 1 and dropped, so the inner loop has no branch).
template <typename T, int M>
__device__ __forceinline__ void mmvq_impl(
    const u8* __restrict__ w, i64 row_bytes, int n_rows, int k, const u8* __restrict__ xq,
    i64 xq_stride, int m, float* __restrict__ y, i64 y_stride, i64 col0,
    const float* __restrict__ bias, int flags)
{
    constexpr int NW = MqLaunch<M>::NW, RPB = MqLaunch<M>::RPB;
    constexpr int TPB = T::QI / T::VDR;              // threads per weight block
    constexpr int BPI = T::VDR * NW * KVS_WARP / T::QI;  // weight blocks per iteration
    static_assert(TPB * BPI == NW * KVS_WARP, "threads must tile the blocks");
    __shared__ float part[NW - 1][M][RPB][KVS_WARP];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & (KVS_WARP - 1);
    const int nb = k / T::QK;
    const int kqs = T::VDR * (tid % TPB);
    for (i64 row0 = (i64)blockIdx.x * RPB; row0 < n_rows; row0 += (i64)gridDim.x * RPB) {
        const u8* wr[RPB];
#pragma unroll
        for (int i = 0; i < RPB; ++i)  // rows past the end read the last row (results dropped)
            wr[i] = w + (row0 + i < n_rows ? row0 + i : (i64)n_rows - 1) * row_bytes;
        float acc[M][RPB];
#pragma unroll
        for (int j = 0; j < M; ++j)
#pragma unroll
            for (int i = 0; i < RPB; ++i) acc[j][i] = 0.f;
        for (int kbx = tid / TPB; kbx < nb; kbx += BPI) {
            // the q8_1 block aligned with weight block kbx (row pointers formed here, not held
            // in registers across the loop: M = 8 spilled them on sm_80)
            const u8* yk = xq + (i64)kbx * (T::QK / 32) * MQ_Q8_1_BYTES;
#pragma unroll
            for (int j = 0; j < M; ++j) {
                const u8* yb = yk + (i64)(j < m ? j : m - 1) * xq_stride;
#pragma unroll
                for (int i = 0; i < RPB; ++i) acc[j][i] += T::dot(wr[i] + (i64)kbx * T::BYTES, yb, kqs);
            }
        }
        if (warp > 0) {
#pragma unroll
            for (int j = 0; j < M; ++j)
#pragma unroll
                for (int i = 0; i < RPB; ++i) part[warp - 1][j][i][lane] = acc[j][i];
        }
        __syncthreads();
        if (warp == 0) {
#pragma unroll
            for (int j = 0; j < M; ++j) {
#pragma unroll
                for (int i = 0; i < RPB; ++i) {
                    float s = acc[j][i];
#pragma unroll
                    for (int l = 0; l < NW - 1; ++l) s += part[l][j][i][lane];
                    s = kvs_warp_sum(s);
                    const i64 row = row0 + i;
                    if (lane == i && j < m && row < n_rows) {
                        float* o = y + j * y_stride + col0 + row;
                        const float v = s + ((flags & 1) ? bias[col0 + row] : 0.f);
                        *o = (flags & 2) ? *o + v : v;
                    }
                }
            }
        }
        __syncthreads();  // part is rewritten by the next row group
    }
}

// The entry points, written out (kvshare.kernels.entry_points and the compile test read the
// `extern "C"` declarations from this text): mmvq_<type>_m{1,2,4,8}.
// Each type's kernels are one line each, so the module compiles in parts, one per block
// type, at the part's first launch (kvshare.kernels.parts):
// parts by type: mmvq
#define MQ_ARGS const u8* __restrict__ w, i64 row_bytes, int n_rows, int k,                        \
    const u8* __restrict__ xq, i64 xq_stride, int m, float* __restrict__ y, i64 y_stride,         \
    i64 col0, const float* __restrict__ bias, int flags
#define MQ(T, M) mmvq_impl<T, M>(w, row_bytes, n_rows, k, xq, xq_stride, m, y, y_stride, col0, bias, flags)

// q4_0
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q4_0_m1(MQ_ARGS) { MQ(MqQ4_0, 1); }
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q4_0_m2(MQ_ARGS) { MQ(MqQ4_0, 2); }
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q4_0_m4(MQ_ARGS) { MQ(MqQ4_0, 4); }
extern "C" __global__ void __launch_bounds__(64, 1) mmvq_q4_0_m8(MQ_ARGS) { MQ(MqQ4_0, 8); }

// q4_1
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q4_1_m1(MQ_ARGS) { MQ(MqQ4_1, 1); }
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q4_1_m2(MQ_ARGS) { MQ(MqQ4_1, 2); }
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q4_1_m4(MQ_ARGS) { MQ(MqQ4_1, 4); }
extern "C" __global__ void __launch_bounds__(64, 1) mmvq_q4_1_m8(MQ_ARGS) { MQ(MqQ4_1, 8); }

// q5_0
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q5_0_m1(MQ_ARGS) { MQ(MqQ5_0, 1); }
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q5_0_m2(MQ_ARGS) { MQ(MqQ5_0, 2); }
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q5_0_m4(MQ_ARGS) { MQ(MqQ5_0, 4); }
extern "C" __global__ void __launch_bounds__(64, 1) mmvq_q5_0_m8(MQ_ARGS) { MQ(MqQ5_0, 8); }

// q5_1
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q5_1_m1(MQ_ARGS) { MQ(MqQ5_1, 1); }
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q5_1_m2(MQ_ARGS) { MQ(MqQ5_1, 2); }
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q5_1_m4(MQ_ARGS) { MQ(MqQ5_1, 4); }
extern "C" __global__ void __launch_bounds__(64, 1) mmvq_q5_1_m8(MQ_ARGS) { MQ(MqQ5_1, 8); }

// q8_0
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q8_0_m1(MQ_ARGS) { MQ(MqQ8_0, 1); }
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q8_0_m2(MQ_ARGS) { MQ(MqQ8_0, 2); }
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q8_0_m4(MQ_ARGS) { MQ(MqQ8_0, 4); }
extern "C" __global__ void __launch_bounds__(64, 1) mmvq_q8_0_m8(MQ_ARGS) { MQ(MqQ8_0, 8); }

// q2_k
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q2_k_m1(MQ_ARGS) { MQ(MqQ2_K, 1); }
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q2_k_m2(MQ_ARGS) { MQ(MqQ2_K, 2); }
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q2_k_m4(MQ_ARGS) { MQ(MqQ2_K, 4); }
extern "C" __global__ void __launch_bounds__(64, 1) mmvq_q2_k_m8(MQ_ARGS) { MQ(MqQ2_K, 8); }

// q3_k
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q3_k_m1(MQ_ARGS) { MQ(MqQ3_K, 1); }
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q3_k_m2(MQ_ARGS) { MQ(MqQ3_K, 2); }
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q3_k_m4(MQ_ARGS) { MQ(MqQ3_K, 4); }
extern "C" __global__ void __launch_bounds__(64, 1) mmvq_q3_k_m8(MQ_ARGS) { MQ(MqQ3_K, 8); }

// q4_k
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q4_k_m1(MQ_ARGS) { MQ(MqQ4_K, 1); }
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q4_k_m2(MQ_ARGS) { MQ(MqQ4_K, 2); }
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q4_k_m4(MQ_ARGS) { MQ(MqQ4_K, 4); }
extern "C" __global__ void __launch_bounds__(64, 1) mmvq_q4_k_m8(MQ_ARGS) { MQ(MqQ4_K, 8); }

// q5_k
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q5_k_m1(MQ_ARGS) { MQ(MqQ5_K, 1); }
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q5_k_m2(MQ_ARGS) { MQ(MqQ5_K, 2); }
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q5_k_m4(MQ_ARGS) { MQ(MqQ5_K, 4); }
extern "C" __global__ void __launch_bounds__(64, 1) mmvq_q5_k_m8(MQ_ARGS) { MQ(MqQ5_K, 8); }

// q6_k
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q6_k_m1(MQ_ARGS) { MQ(MqQ6_K, 1); }
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q6_k_m2(MQ_ARGS) { MQ(MqQ6_K, 2); }
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_q6_k_m4(MQ_ARGS) { MQ(MqQ6_K, 4); }
extern "C" __global__ void __launch_bounds__(64, 1) mmvq_q6_k_m8(MQ_ARGS) { MQ(MqQ6_K, 8); }

// iq4_nl
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_iq4_nl_m1(MQ_ARGS) { MQ(MqIQ4_NL, 1); }
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_iq4_nl_m2(MQ_ARGS) { MQ(MqIQ4_NL, 2); }
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_iq4_nl_m4(MQ_ARGS) { MQ(MqIQ4_NL, 4); }
extern "C" __global__ void __launch_bounds__(64, 1) mmvq_iq4_nl_m8(MQ_ARGS) { MQ(MqIQ4_NL, 8); }

// iq4_xs
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_iq4_xs_m1(MQ_ARGS) { MQ(MqIQ4_XS, 1); }
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_iq4_xs_m2(MQ_ARGS) { MQ(MqIQ4_XS, 2); }
extern "C" __global__ void __launch_bounds__(128, 1) mmvq_iq4_xs_m4(MQ_ARGS) { MQ(MqIQ4_XS, 4); }
extern "C" __global__ void __launch_bounds__(64, 1) mmvq_iq4_xs_m8(MQ_ARGS) { MQ(MqIQ4_XS, 8); }
