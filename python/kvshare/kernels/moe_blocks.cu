// uses: blocks.cu
// Grouped mixture-of-experts products on GGUF blocks (kvshare.ops.gpu_moe): every expert's
// matrix of a layer stays on the device as the file's stacked tensor (`[n_expert * rows,
// row_bytes]` raw blocks, decoded by blocks.cu's Bk* formats), and one launch computes one
// matrix product for every (token, slot) pair of the batch, whatever expert it was routed to.
//
// The pairs (index t * k + j) are sorted by expert into `pairs` and each expert's run is cut
// into tiles of at most M pairs (on the host, or on the device: moe_sort_pairs below): tile
// i is tiles[3 i .. 3 i + 2] = (expert, first position in `pairs`, count); an idle expert has
// no tile, and a tile of count 0 (past the last) does nothing. Grid: (n_tiles, row blocks); a 128-thread CTA
// (4 warps) takes one tile and the output rows [R b, R b + R) of row block b, then
// grid-strides along y. As in bmv_<type>_m<M>, the 4 warps split each row's chunks (warp v
// takes chunks v * 32 + lane, stepping by 128: an expert has few rows, so a warp walking a
// whole row alone would keep few loads in flight), each lane decodes 8 consecutive weights of
// each row at a time and applies them to the tile's m activation rows, so an expert's weights
// are read once per tile; float32 accumulation, a warp reduce-scatter, then the 4 warps' sums
// added in shared memory in warp order.
//
//   gmv_<type>_m<M>     y[p, col0 + i] = (sum_j x[p / x_div, j] W_e[row_off + i, j]
//                       + bias[e, i]) * pw[p] (bias, pw optional), for the pairs p of each
//                       tile of expert e: the down products (x = the activations, one row per
//                       pair, weighted by the pair's routing weight), or one part of gate|up
//                       when gate and up have different types (x = the tokens' rows, x_div = k).
//   gmvglu_<type>_m<M>  a[p, i] = act(g + bg[e, i], u + bu[e, i]) with g and u the products
//                       of the gate and up rows i of expert e (two tensors, or two row ranges
//                       of one fused tensor, of the same type): gate|up and the activation in
//                       one pass, nothing of the [pairs, 2 n_ff] products written.
//   moe_glu_f32         a[p, i] = act(gu[p, i], gu[p, n_ff + i]) (after two gmv launches).
//   moe_combine_f32     out[t, c] = sum over slots j, in slot order, of y[t * k + j, c].
//
// act: blocks.cu's bk_act: 0 SwiGLU (ops.activation.swiglu), 1 GEGLU with tanh GELU
// (geglu_tanh), 2 gpt-oss's swiglu_oai (the gate clamped to <= 7, the up value to [-7, 7],
// x sigmoid(1.702 x) (y + 1)). A row block's sums are blocks.cu's bk_block_sums and
// bk_cta_sums (bmv's).

#define GM_WARPS 4
// MXFP4 (gpt-oss's experts; a format of these kernels only, blocks.cu has no decoder for it):
// e u8 (E8M0 exponent), qs[16] in Q4_0's nibble layout; value = kvalues_mxfp4[q] (the E2M1
// values doubled: 0 1 2 3 4 6 8 12, then the same negated) * 2^(e - 128) (ggml's
// GGML_E8M0_TO_FP32_HALF, denormal for e < 2). 17-byte blocks start at any byte: byte loads.
__device__ __forceinline__ float gm_mxfp4(u32 i) {
    const unsigned long long lo = 0x8C88868483828180ull;  //  0   1   2   3   4   6   8  12 (+128)
    const unsigned long long hi = 0x74787A7C7D7E7F80ull;  //  0  -1  -2  -3  -4  -6  -8 -12 (+128)
    const unsigned long long w = i < 8 ? lo : hi;
    return bk_uf((u32)(w >> (8 * (i & 7))) & 0xffu, BK_MAGIC + 128.f);
}

struct BkMXFP4 {
    static constexpr int QK = 32, BYTES = 17;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void dec(const u8* b, int e, float* q, float& d, float& mn) {
        const u32 x = b[0];
        d = __int_as_float((int)(x < 2u ? 0x00200000u << x : (x - 1u) << 23));
        mn = 0.f;
        const u8* qs = b + 1 + (e & 15);
        const int s = (e >> 4) * 4;
#pragma unroll
        for (int j = 0; j < 8; ++j) q[j] = gm_mxfp4(((u32)qs[j] >> s) & 15u);
    }
};

// Output rows per CTA: gmv as bmv (2 for M = 1, else 4); gmvglu 2 (each is a gate and an up
// row, so 4 weight rows either way but M = 1).
template <int M, int NW> struct GmRows { static constexpr int R = (NW == 2 || M == 1) ? 2 : 4; };

// NW = 1: gmv (weights w0 rows row_off0 + i of each expert's `expert_rows` rows);
// NW = 2: gmvglu (gate from w0 / row_off0, up from w1 / row_off1).
// x: float32 rows (x 16-byte aligned, x_stride a multiple of 4: the host copies otherwise).
template <typename B, int M, int NW>
__device__ __forceinline__ void gm_impl(
    const u8* __restrict__ w0, const u8* __restrict__ w1, i64 row_bytes, i64 expert_rows,
    i64 row_off0, i64 row_off1, int n_rows, int k,
    const float* __restrict__ x, i64 x_stride, int x_div,
    const int* __restrict__ pairs, const int* __restrict__ tiles,
    float* __restrict__ y, i64 y_stride, i64 col0,
    const float* __restrict__ bias0, const float* __restrict__ bias1, i64 bias_stride,
    int has_bias, const float* __restrict__ pw, int has_pw, int act)
{
    constexpr int R = GmRows<M, NW>::R;
    __shared__ float part[GM_WARPS][NW][R][M];  // each warp's row sums
    const int lane = threadIdx.x & (KVS_WARP - 1);
    const int wid = threadIdx.x >> 5;
    const int e = tiles[3 * blockIdx.x];
    const int p0 = tiles[3 * blockIdx.x + 1];
    const int m = tiles[3 * blockIdx.x + 2];
    if (m == 0) return;  // a tile past the last (moe_sort_pairs): the whole CTA leaves
    // the tile's activation rows (rows past m point at the first one; their sums are dropped)
    const float* xr[M];
#pragma unroll
    for (int r = 0; r < M; ++r)
        xr[r] = x + (i64)(pairs[p0 + (r < m ? r : 0)] / x_div) * x_stride;
    const u8* we[NW];
    we[0] = w0 + ((i64)e * expert_rows + row_off0) * row_bytes;
    if constexpr (NW == 2) we[1] = w1 + ((i64)e * expert_rows + row_off1) * row_bytes;
    const auto xrow = [&](int r) { return xr[r]; };
    for (i64 row0 = (i64)blockIdx.y * R; row0 < n_rows; row0 += (i64)gridDim.y * R) {
        bk_block_sums<B, M, NW, R, GM_WARPS>(we, row_bytes, row0, n_rows, k, xrow, m, lane, wid,
                                             part);
        for (int t = threadIdx.x; t < R * M; t += blockDim.x) {
            const int i = t / M, r = t % M;
            const i64 row = row0 + i;
            if (r < m && row < n_rows) {
                float s[NW];
                bk_cta_sums(part, i, r, s);
                const int p = pairs[p0 + r];
                if constexpr (NW == 2) {
                    const float g = s[0] + (has_bias ? bias0[(i64)e * bias_stride + row] : 0.f);
                    const float u = s[1] + (has_bias ? bias1[(i64)e * bias_stride + row] : 0.f);
                    y[(i64)p * y_stride + col0 + row] = bk_act(g, u, act);
                } else {
                    float v = s[0] + (has_bias ? bias0[(i64)e * bias_stride + row] : 0.f);
                    if (has_pw) v *= pw[p];
                    y[(i64)p * y_stride + col0 + row] = v;
                }
            }
        }
        __syncthreads();  // `part` is written again for the next rows
    }
}

// gu: [n_pairs, 2 n_ff] C-contiguous (gate columns, then up); a: [n_pairs, n_ff].
extern "C" __global__ void moe_glu_f32(const float* __restrict__ gu, float* __restrict__ a,
                                       i64 n_pairs, i64 n_ff, int act)
{
    const i64 total = n_pairs * n_ff;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (i64)gridDim.x * blockDim.x) {
        const i64 p = idx / n_ff, i = idx - p * n_ff;
        a[idx] = bk_act(gu[p * 2 * n_ff + i], gu[p * 2 * n_ff + n_ff + i], act);
    }
}

// y: [n_tok * k_slots, d] C-contiguous; out: [n_tok, d] C-contiguous. Slots are added in slot
// order, as ops.moe.moe_ffn adds them.
extern "C" __global__ void moe_combine_f32(const float* __restrict__ y, float* __restrict__ out,
                                           i64 n_tok, int k_slots, i64 d)
{
    const i64 total = n_tok * d;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (i64)gridDim.x * blockDim.x) {
        const i64 t = idx / d, c = idx - t * d;
        const float* yp = y + t * k_slots * d + c;
        float s = yp[0];
        for (int j = 1; j < k_slots; ++j) s += yp[j * d];
        out[idx] = s;
    }
}

// The entry points, written out (kvshare.kernels.entry_points and the compile test read the
// `extern "C"` declarations from this text): gmv_<type>_m{1,4,16}, gmvglu_<type>_m{1,4,16}.
// Each type's kernels are one line each, so the module compiles in parts, one per block
// type, at the part's first launch (kvshare.kernels.parts):
// parts by type: gmv gmvglu
#define GM_ARGS const u8* __restrict__ w0, const u8* __restrict__ w1, i64 row_bytes,             \
    i64 expert_rows, i64 row_off0, i64 row_off1, int n_rows, int k,                              \
    const float* __restrict__ x, i64 x_stride, int x_div, const int* __restrict__ pairs,         \
    const int* __restrict__ tiles, float* __restrict__ y, i64 y_stride, i64 col0,                \
    const float* __restrict__ bias0, const float* __restrict__ bias1, i64 bias_stride,           \
    int has_bias, const float* __restrict__ pw, int has_pw, int act
#define GM(B, M, NW) gm_impl<B, M, NW>(w0, w1, row_bytes, expert_rows, row_off0, row_off1,       \
    n_rows, k, x, x_stride, x_div, pairs, tiles, y, y_stride, col0, bias0, bias1, bias_stride,   \
    has_bias, pw, has_pw, act)
// q4_0
extern "C" __global__ void gmv_q4_0_m1(GM_ARGS) { GM(BkQ4_0, 1, 1); }
extern "C" __global__ void gmv_q4_0_m4(GM_ARGS) { GM(BkQ4_0, 4, 1); }
extern "C" __global__ void gmv_q4_0_m16(GM_ARGS) { GM(BkQ4_0, 16, 1); }
extern "C" __global__ void gmvglu_q4_0_m1(GM_ARGS) { GM(BkQ4_0, 1, 2); }
extern "C" __global__ void gmvglu_q4_0_m4(GM_ARGS) { GM(BkQ4_0, 4, 2); }
extern "C" __global__ void gmvglu_q4_0_m16(GM_ARGS) { GM(BkQ4_0, 16, 2); }

// q4_1
extern "C" __global__ void gmv_q4_1_m1(GM_ARGS) { GM(BkQ4_1, 1, 1); }
extern "C" __global__ void gmv_q4_1_m4(GM_ARGS) { GM(BkQ4_1, 4, 1); }
extern "C" __global__ void gmv_q4_1_m16(GM_ARGS) { GM(BkQ4_1, 16, 1); }
extern "C" __global__ void gmvglu_q4_1_m1(GM_ARGS) { GM(BkQ4_1, 1, 2); }
extern "C" __global__ void gmvglu_q4_1_m4(GM_ARGS) { GM(BkQ4_1, 4, 2); }
extern "C" __global__ void gmvglu_q4_1_m16(GM_ARGS) { GM(BkQ4_1, 16, 2); }

// q5_0
extern "C" __global__ void gmv_q5_0_m1(GM_ARGS) { GM(BkQ5_0, 1, 1); }
extern "C" __global__ void gmv_q5_0_m4(GM_ARGS) { GM(BkQ5_0, 4, 1); }
extern "C" __global__ void gmv_q5_0_m16(GM_ARGS) { GM(BkQ5_0, 16, 1); }
extern "C" __global__ void gmvglu_q5_0_m1(GM_ARGS) { GM(BkQ5_0, 1, 2); }
extern "C" __global__ void gmvglu_q5_0_m4(GM_ARGS) { GM(BkQ5_0, 4, 2); }
extern "C" __global__ void gmvglu_q5_0_m16(GM_ARGS) { GM(BkQ5_0, 16, 2); }

// q5_1
extern "C" __global__ void gmv_q5_1_m1(GM_ARGS) { GM(BkQ5_1, 1, 1); }
extern "C" __global__ void gmv_q5_1_m4(GM_ARGS) { GM(BkQ5_1, 4, 1); }
extern "C" __global__ void gmv_q5_1_m16(GM_ARGS) { GM(BkQ5_1, 16, 1); }
extern "C" __global__ void gmvglu_q5_1_m1(GM_ARGS) { GM(BkQ5_1, 1, 2); }
extern "C" __global__ void gmvglu_q5_1_m4(GM_ARGS) { GM(BkQ5_1, 4, 2); }
extern "C" __global__ void gmvglu_q5_1_m16(GM_ARGS) { GM(BkQ5_1, 16, 2); }

// q8_0
extern "C" __global__ void gmv_q8_0_m1(GM_ARGS) { GM(BkQ8_0, 1, 1); }
extern "C" __global__ void gmv_q8_0_m4(GM_ARGS) { GM(BkQ8_0, 4, 1); }
extern "C" __global__ void gmv_q8_0_m16(GM_ARGS) { GM(BkQ8_0, 16, 1); }
extern "C" __global__ void gmvglu_q8_0_m1(GM_ARGS) { GM(BkQ8_0, 1, 2); }
extern "C" __global__ void gmvglu_q8_0_m4(GM_ARGS) { GM(BkQ8_0, 4, 2); }
extern "C" __global__ void gmvglu_q8_0_m16(GM_ARGS) { GM(BkQ8_0, 16, 2); }

// q2_k
extern "C" __global__ void gmv_q2_k_m1(GM_ARGS) { GM(BkQ2_K, 1, 1); }
extern "C" __global__ void gmv_q2_k_m4(GM_ARGS) { GM(BkQ2_K, 4, 1); }
extern "C" __global__ void gmv_q2_k_m16(GM_ARGS) { GM(BkQ2_K, 16, 1); }
extern "C" __global__ void gmvglu_q2_k_m1(GM_ARGS) { GM(BkQ2_K, 1, 2); }
extern "C" __global__ void gmvglu_q2_k_m4(GM_ARGS) { GM(BkQ2_K, 4, 2); }
extern "C" __global__ void gmvglu_q2_k_m16(GM_ARGS) { GM(BkQ2_K, 16, 2); }

// q3_k
extern "C" __global__ void gmv_q3_k_m1(GM_ARGS) { GM(BkQ3_K, 1, 1); }
extern "C" __global__ void gmv_q3_k_m4(GM_ARGS) { GM(BkQ3_K, 4, 1); }
extern "C" __global__ void gmv_q3_k_m16(GM_ARGS) { GM(BkQ3_K, 16, 1); }
extern "C" __global__ void gmvglu_q3_k_m1(GM_ARGS) { GM(BkQ3_K, 1, 2); }
extern "C" __global__ void gmvglu_q3_k_m4(GM_ARGS) { GM(BkQ3_K, 4, 2); }
extern "C" __global__ void gmvglu_q3_k_m16(GM_ARGS) { GM(BkQ3_K, 16, 2); }

// q4_k
extern "C" __global__ void gmv_q4_k_m1(GM_ARGS) { GM(BkQ4_K, 1, 1); }
extern "C" __global__ void gmv_q4_k_m4(GM_ARGS) { GM(BkQ4_K, 4, 1); }
extern "C" __global__ void gmv_q4_k_m16(GM_ARGS) { GM(BkQ4_K, 16, 1); }
extern "C" __global__ void gmvglu_q4_k_m1(GM_ARGS) { GM(BkQ4_K, 1, 2); }
extern "C" __global__ void gmvglu_q4_k_m4(GM_ARGS) { GM(BkQ4_K, 4, 2); }
extern "C" __global__ void gmvglu_q4_k_m16(GM_ARGS) { GM(BkQ4_K, 16, 2); }

// q5_k
extern "C" __global__ void gmv_q5_k_m1(GM_ARGS) { GM(BkQ5_K, 1, 1); }
extern "C" __global__ void gmv_q5_k_m4(GM_ARGS) { GM(BkQ5_K, 4, 1); }
extern "C" __global__ void gmv_q5_k_m16(GM_ARGS) { GM(BkQ5_K, 16, 1); }
extern "C" __global__ void gmvglu_q5_k_m1(GM_ARGS) { GM(BkQ5_K, 1, 2); }
extern "C" __global__ void gmvglu_q5_k_m4(GM_ARGS) { GM(BkQ5_K, 4, 2); }
extern "C" __global__ void gmvglu_q5_k_m16(GM_ARGS) { GM(BkQ5_K, 16, 2); }

// q6_k
extern "C" __global__ void gmv_q6_k_m1(GM_ARGS) { GM(BkQ6_K, 1, 1); }
extern "C" __global__ void gmv_q6_k_m4(GM_ARGS) { GM(BkQ6_K, 4, 1); }
extern "C" __global__ void gmv_q6_k_m16(GM_ARGS) { GM(BkQ6_K, 16, 1); }
extern "C" __global__ void gmvglu_q6_k_m1(GM_ARGS) { GM(BkQ6_K, 1, 2); }
extern "C" __global__ void gmvglu_q6_k_m4(GM_ARGS) { GM(BkQ6_K, 4, 2); }
extern "C" __global__ void gmvglu_q6_k_m16(GM_ARGS) { GM(BkQ6_K, 16, 2); }

// iq4_nl
extern "C" __global__ void gmv_iq4_nl_m1(GM_ARGS) { GM(BkIQ4_NL, 1, 1); }
extern "C" __global__ void gmv_iq4_nl_m4(GM_ARGS) { GM(BkIQ4_NL, 4, 1); }
extern "C" __global__ void gmv_iq4_nl_m16(GM_ARGS) { GM(BkIQ4_NL, 16, 1); }
extern "C" __global__ void gmvglu_iq4_nl_m1(GM_ARGS) { GM(BkIQ4_NL, 1, 2); }
extern "C" __global__ void gmvglu_iq4_nl_m4(GM_ARGS) { GM(BkIQ4_NL, 4, 2); }
extern "C" __global__ void gmvglu_iq4_nl_m16(GM_ARGS) { GM(BkIQ4_NL, 16, 2); }

// iq4_xs
extern "C" __global__ void gmv_iq4_xs_m1(GM_ARGS) { GM(BkIQ4_XS, 1, 1); }
extern "C" __global__ void gmv_iq4_xs_m4(GM_ARGS) { GM(BkIQ4_XS, 4, 1); }
extern "C" __global__ void gmv_iq4_xs_m16(GM_ARGS) { GM(BkIQ4_XS, 16, 1); }
extern "C" __global__ void gmvglu_iq4_xs_m1(GM_ARGS) { GM(BkIQ4_XS, 1, 2); }
extern "C" __global__ void gmvglu_iq4_xs_m4(GM_ARGS) { GM(BkIQ4_XS, 4, 2); }
extern "C" __global__ void gmvglu_iq4_xs_m16(GM_ARGS) { GM(BkIQ4_XS, 16, 2); }

// f32
extern "C" __global__ void gmv_f32_m1(GM_ARGS) { GM(BkF32, 1, 1); }
extern "C" __global__ void gmv_f32_m4(GM_ARGS) { GM(BkF32, 4, 1); }
extern "C" __global__ void gmv_f32_m16(GM_ARGS) { GM(BkF32, 16, 1); }
extern "C" __global__ void gmvglu_f32_m1(GM_ARGS) { GM(BkF32, 1, 2); }
extern "C" __global__ void gmvglu_f32_m4(GM_ARGS) { GM(BkF32, 4, 2); }
extern "C" __global__ void gmvglu_f32_m16(GM_ARGS) { GM(BkF32, 16, 2); }

// f16
extern "C" __global__ void gmv_f16_m1(GM_ARGS) { GM(BkF16, 1, 1); }
extern "C" __global__ void gmv_f16_m4(GM_ARGS) { GM(BkF16, 4, 1); }
extern "C" __global__ void gmv_f16_m16(GM_ARGS) { GM(BkF16, 16, 1); }
extern "C" __global__ void gmvglu_f16_m1(GM_ARGS) { GM(BkF16, 1, 2); }
extern "C" __global__ void gmvglu_f16_m4(GM_ARGS) { GM(BkF16, 4, 2); }
extern "C" __global__ void gmvglu_f16_m16(GM_ARGS) { GM(BkF16, 16, 2); }

// bf16
extern "C" __global__ void gmv_bf16_m1(GM_ARGS) { GM(BkBF16, 1, 1); }
extern "C" __global__ void gmv_bf16_m4(GM_ARGS) { GM(BkBF16, 4, 1); }
extern "C" __global__ void gmv_bf16_m16(GM_ARGS) { GM(BkBF16, 16, 1); }
extern "C" __global__ void gmvglu_bf16_m1(GM_ARGS) { GM(BkBF16, 1, 2); }
extern "C" __global__ void gmvglu_bf16_m4(GM_ARGS) { GM(BkBF16, 4, 2); }
extern "C" __global__ void gmvglu_bf16_m16(GM_ARGS) { GM(BkBF16, 16, 2); }

// mxfp4
extern "C" __global__ void gmv_mxfp4_m1(GM_ARGS) { GM(BkMXFP4, 1, 1); }
extern "C" __global__ void gmv_mxfp4_m4(GM_ARGS) { GM(BkMXFP4, 4, 1); }
extern "C" __global__ void gmv_mxfp4_m16(GM_ARGS) { GM(BkMXFP4, 16, 1); }
extern "C" __global__ void gmvglu_mxfp4_m1(GM_ARGS) { GM(BkMXFP4, 1, 2); }
extern "C" __global__ void gmvglu_mxfp4_m4(GM_ARGS) { GM(BkMXFP4, 4, 2); }
extern "C" __global__ void gmvglu_mxfp4_m16(GM_ARGS) { GM(BkMXFP4, 16, 2); }

// ---- routing and the pairs' order on the device ------------------------------------------
// A step captured as a CUDA graph cannot bring the router's logits back to the host, so the
// routing (ops.moe_routing.route) and the sort of the pairs by expert (gpu_moe.plan) also run
// here, into the `pairs` and `tiles` the products above read.
//
//   moe_route_f32   ids[t, j], w[t, j] (slot j = the j-th most probable expert) of each token t
//                   from its router logits, as `route`: probabilities by `gating` (0 softmax:
//                   exp(x - max) times float32(1 / the float64 sum); 1 sigmoid; 2 the logits,
//                   softmax of the selected after), plus the selection bias to pick, the k
//                   largest (ties: the lower expert; NaN ranks as -inf), the unbiased
//                   probabilities as weights, divided by max(float32(their float64 sum),
//                   2^-14) when `norm`, times `scale` unless it is 0 or 1. One warp a token;
//                   lane l holds experts l, l + 32, ... (at most MOE_MAX_EXPERTS).
//   moe_sort_pairs  pairs = the pair indices t k + j sorted by expert, token order kept, and
//                   tiles (expert, first position, count <= mt) over each active expert's run,
//                   in expert order; the tiles past the last, up to max_tiles, get count 0 (the
//                   products launch max_tiles CTAs, the count is only known on the device, and
//                   an empty tile returns at once). One CTA.

#define MOE_MAX_EXPERTS 512
#define MOE_ROUTE_WARPS 4
#define MOE_SORT_THREADS 256

__device__ __forceinline__ double moe_warp_sum_f64(double v) {
#pragma unroll
    for (int o = KVS_WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(KVS_FULL_MASK, v, o);
    return v;
}

extern "C" __global__ void moe_route_f32(
    const float* __restrict__ logits, i64 n, int n_expert, int k, int gating, int norm,
    float scale, const float* __restrict__ sel, int has_sel, int* __restrict__ ids,
    float* __restrict__ w)
{
    constexpr int PER = MOE_MAX_EXPERTS / KVS_WARP;
    const float NEG_INF = __int_as_float((int)0xff800000u);
    const int lane = threadIdx.x & (KVS_WARP - 1);
    const i64 t = (i64)blockIdx.x * MOE_ROUTE_WARPS + (threadIdx.x >> 5);
    if (t >= n) return;  // whole warps: every lane of a warp has the same t
    const float* row = logits + t * n_expert;
    float p[PER];
    float mx = NEG_INF;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int e = lane + KVS_WARP * j;
        p[j] = e < n_expert ? row[e] : NEG_INF;
        mx = fmaxf(mx, p[j]);
    }
    if (gating == 0) {
        mx = kvs_warp_max(mx);
        double s = 0.0;
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int e = lane + KVS_WARP * j;
            p[j] = e < n_expert ? expf(p[j] - mx) : 0.f;
            s += (double)p[j];
        }
        const float inv = (float)(1.0 / moe_warp_sum_f64(s));
#pragma unroll
        for (int j = 0; j < PER; ++j) p[j] *= inv;
    } else if (gating == 1) {
#pragma unroll
        for (int j = 0; j < PER; ++j) p[j] = 1.0f / (1.0f + expf(-p[j]));
    }
    // the k largest scores: each round every lane offers its best unchosen expert, the warp
    // keeps the largest (the lower expert of equal ones), its lane marks it chosen
    unsigned chosen = 0;
    int my_id = 0;
    float my_w = 0.f;
    for (int r = 0; r < k; ++r) {
        float bv = NEG_INF;
        int bi = -1;
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int e = lane + KVS_WARP * j;
            if (e < n_expert && !((chosen >> j) & 1u)) {
                float v = has_sel ? p[j] + sel[e] : p[j];
                if (v != v) v = NEG_INF;
                if (bi < 0 || v > bv) { bv = v; bi = e; }
            }
        }
#pragma unroll
        for (int o = KVS_WARP / 2; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(KVS_FULL_MASK, bv, o);
            const int oi = __shfl_xor_sync(KVS_FULL_MASK, bi, o);
            if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) { bv = ov; bi = oi; }
        }
        float pv = 0.f;  // the owner lane's probability of bi (a uniform j: no divergence)
#pragma unroll
        for (int j = 0; j < PER; ++j) if (j == (bi >> 5)) pv = p[j];
        pv = __shfl_sync(KVS_FULL_MASK, pv, bi & (KVS_WARP - 1));
        if ((bi & (KVS_WARP - 1)) == lane) chosen |= 1u << (bi >> 5);
        if (lane == r) { my_id = bi; my_w = pv; }
    }
    const bool mine = lane < k;
    if (gating == 2) {  // softmax of the selected logits
        const float m2 = kvs_warp_max(mine ? my_w : NEG_INF);
        my_w = mine ? expf(my_w - m2) : 0.f;
        const float inv = (float)(1.0 / moe_warp_sum_f64((double)my_w));
        my_w *= inv;
    }
    if (norm) {
        float s = (float)moe_warp_sum_f64(mine ? (double)my_w : 0.0);
        s = fmaxf(s, 6.103515625e-5f);
        my_w = my_w / s;
    }
    if (scale != 0.f && scale != 1.f) my_w *= scale;
    if (mine) {
        ids[t * k + lane] = my_id;
        w[t * k + lane] = my_w;
    }
}

extern "C" __global__ void moe_sort_pairs(
    const int* __restrict__ ids, int n_pairs, int n_expert, int mt, int max_tiles,
    int* __restrict__ pairs, int* __restrict__ tiles)
{
    __shared__ int count[MOE_MAX_EXPERTS];
    __shared__ int start[MOE_MAX_EXPERTS];
    __shared__ int tile0[MOE_MAX_EXPERTS + 1];
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) atomicAdd(&count[ids[p]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int s = 0, nt = 0;
        for (int e = 0; e < n_expert; ++e) {
            start[e] = s;
            tile0[e] = nt;
            s += count[e];
            nt += (count[e] + mt - 1) / mt;
        }
        tile0[n_expert] = nt;
    }
    __syncthreads();
    // one thread an expert: its pairs in token order, then its tiles
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
        int c = start[e];
        for (int p = 0; p < n_pairs; ++p)
            if (ids[p] == e) pairs[c++] = p;
        for (int i = 0; i * mt < count[e]; ++i) {
            int* tl = tiles + 3 * (tile0[e] + i);
            tl[0] = e;
            tl[1] = start[e] + i * mt;
            tl[2] = min(mt, count[e] - i * mt);
        }
    }
    for (int i = tile0[n_expert] + threadIdx.x; i < max_tiles; i += blockDim.x) {
        tiles[3 * i] = 0;
        tiles[3 * i + 1] = 0;
        tiles[3 * i + 2] = 0;
    }
}
