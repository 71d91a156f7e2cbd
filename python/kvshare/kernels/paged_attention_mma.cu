// Paged attention on tensor cores for prefill chunks: the same contract as paged_attention.cu's
// kernels (the same q, cache, block-table and `tiles` inputs from kvshare.ops.gpu.pa_tiles, the
// same masks; no split-KV arguments) for an f16 KV cache and a head size of 64 to 128
// (multiples of 16) or 256, with Q.K^T and P.V as warp-level `mma.sync` products (f16 inputs,
// float32 accumulators) instead of per-lane FMAs: a long prompt's
// attention is the one part of a prefill that grows with the square of its length.
//
// A CTA takes one tile of the host's work split: PM_ROWS (token, head) rows of one KV head, r =
// token * gc + (g - g0) as in paged_attention.cu, in PM_NW row groups of 16 rows (the M side of
// the products). Up to head size 128 a row group is one warp; at 256 it is DS = 2 warps, each
// computing the group's scores (the same values, so the same softmax) and half of its output
// dims: a warp's output accumulators are then 64 registers, not 128, beside its 64 of q
// (llama.cpp's kernel keeps 8 query columns a warp at that size, to the same end). It walks the
// tile's key range in tiles of BN keys (64; 32 at 256, so that K and V^T stay within 48 KB of
// static shared memory): the keys' K rows and V rows are gathered through the block table into
// shared memory (K as is, V transposed, both padded so that the fragment loads below are free of
// bank conflicts; keys that are masked or whose block is invalid are stored as zeros, never
// read), then each warp computes its 16 x BN scores S = Q K^T, masks them, updates the running
// max and sum of each row (online softmax in the log2 domain, as paged_attention.cu; q is
// pre-multiplied by scale * log2(e) before it is rounded to f16), rounds P to f16 and adds P V to
// its 16 x (HD / DS) output. Differences from paged_attention.cu: q and P are rounded to f16 for
// the products (llama.cpp's CUDA flash attention does the same), and there is no split-KV (a
// prefill chunk has tiles enough to fill the GPU); the host sends the launches that need it
// (decode steps), f32 caches and other head sizes to paged_attention.cu. Sinks (gpt-oss): the
// row's sink logit joins the denominator at the end, as paged_attn_combine adds it (a row that
// saw no key still gets zeros).
//
// Fragment layout of mma.m16n8k16 (.row.col, f16 inputs, f32 accumulators; PTX ISA "Matrix
// Fragments for mma.m16n8k16 with floating point type"), lane = 4 g + t:
//   A (16 x 16): a[0] = A[g][2t, 2t+1], a[1] = A[g+8][2t, 2t+1], a[2] = A[g][2t+8, 2t+9],
//                a[3] = A[g+8][2t+8, 2t+9]            (two f16 per 32-bit word, low half first)
//   B (16 x 8):  b[0] = B[2t, 2t+1][g], b[1] = B[2t+8, 2t+9][g]
//   C (16 x 8):  c[0], c[1] = C[g][2t, 2t+1], c[2], c[3] = C[g+8][2t, 2t+1]
// So the C fragments of two adjacent 8-key score tiles are, once rounded to f16, the A
// fragment of P for those 16 keys (no shuffle between the two products).

#define PM_NW 4                    // row groups per CTA
#define PM_ROWS (PM_NW * 16)       // (token, head) rows per CTA: 16 per row group
#define PM_KPAD 8                  // f16 padding of a shared K row / V^T row
#define PM_LOG2E 1.4426950408889634f  // sinks are natural-log logits; scores are in the log2 domain

// emu: begin device-only (the CPU emulator, tests/gpu_emu, brings its own of these)
// D = A B + D for one warp (the layout above). sm_80 and later: one m16n8k16; sm_75 (Turing):
// the same product as two m16n8k8 over the two K halves (a[0..1] with b[0], a[2..3] with b[1]).
__device__ __forceinline__ void kvs_mma_16816(float* c, const unsigned* a, const unsigned* b) {
#if __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(b[0]));
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[2]), "r"(a[3]), "r"(b[1]));
#endif
}
// emu: end device-only

// Two floats as one word of two f16 (lo in the low half).
__device__ __forceinline__ unsigned pm_pack(float lo, float hi) {
    return (unsigned)kvs_f2h(lo) | ((unsigned)kvs_f2h(hi) << 16);
}

// HD: head size; DS: warps per row group (each takes HD / DS output dims); BN: keys per tile.
template <int HD, int DS, int BN>
__device__ __forceinline__ void paged_attn_mma_impl(
    const float* __restrict__ q, i64 q_row_stride, i64 q_head_stride,
    const f16_t* __restrict__ k_cache, const f16_t* __restrict__ v_cache,
    const int* __restrict__ block_tables, int bt_width,
    const int* __restrict__ tiles, float* __restrict__ out,
    int n_head, int n_kv, int block_size, int n_blocks,
    int group_chunk, float qk_scale_log2, int window, const float* __restrict__ sinks)
{
    constexpr int THREADS = PM_NW * DS * KVS_WARP;
    constexpr int KS = HD / 16;                 // k-steps of Q K^T
    constexpr int NT = BN / 8;                  // 8-key score tiles per key tile
    constexpr int ND = HD / 8 / DS;             // this warp's 8-dim output tiles
    constexpr int K_LD = HD + PM_KPAD;          // f16 per shared K row
    constexpr int V_LD = BN + PM_KPAD;          // f16 per shared V^T row
    constexpr int VEC = 8;                      // f16 per 16-byte global load
    static_assert(HD % (8 * DS) == 0 && BN % 16 == 0 && BN <= THREADS, "mma tile shape");
    __shared__ __align__(16) f16_t Ks[BN * K_LD];
    __shared__ __align__(16) f16_t Vt[HD * V_LD];
    __shared__ i64 koff[BN];

    const int tid = threadIdx.x;
    const int lane = tid & (KVS_WARP - 1);
    const int grp = (tid >> 5) / DS;            // the row group
    const int d0 = ((tid >> 5) % DS) * ND * 8;  // the first of this warp's output dims
    const int g = lane >> 2, t = lane & 3;

    const KvsAttnTile tile = kvs_attn_tile(tiles, n_head, n_kv, group_chunk);
    const int seq = tile.seq, row0 = tile.row0, nr = tile.nr, pos0 = tile.pos0;
    const int G = tile.G, kvh = tile.kvh, g0 = tile.g0, gc = tile.gc;
    const int n_rows = nr * gc;

    const int ke = pos0 + nr;                   // one past the last key any row may see
    const int kb = window > 0 ? max(0, pos0 - window + 1) : 0;

    // this thread's two rows: ra = 16 grp + g, rb = ra + 8
    int rpos[2];
    bool rvalid[2];
    const float* qrow[2];
    for (int i = 0; i < 2; ++i) {
        const int r = 16 * grp + g + 8 * i;
        rvalid[i] = r < n_rows;
        const int rr = rvalid[i] ? r : 0;
        const int tok = rr / gc;
        rpos[i] = pos0 + tok;
        const int h = kvh * G + g0 + rr % gc;
        qrow[i] = q + (i64)(row0 + tok) * q_row_stride + (i64)h * q_head_stride;
    }

    // Q fragments (A of Q K^T), scaled into the log2 domain and rounded to f16
    unsigned qa[KS][4];
#pragma unroll
    for (int s = 0; s < KS; ++s) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int i = j & 1;                        // row: a[0], a[2] -> ra; a[1], a[3] -> rb
            const int d = 16 * s + 2 * t + 8 * (j >> 1);
            float x0 = 0.f, x1 = 0.f;
            if (rvalid[i]) {
                x0 = qrow[i][d] * qk_scale_log2;
                x1 = qrow[i][d + 1] * qk_scale_log2;
            }
            qa[s][j] = pm_pack(x0, x1);
        }
    }

    float o[ND][4];
#pragma unroll
    for (int n = 0; n < ND; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m[2] = {kvs_neg_inf(), kvs_neg_inf()};
    float l[2] = {0.f, 0.f};                    // this thread's part of each row's sum

    const int* bt = block_tables + (i64)seq * bt_width;
    const i64 kv_row = (i64)n_kv * HD;          // elements per cache row (all KV heads)
    for (int kt0 = kb; kt0 < ke; kt0 += BN) {
        __syncthreads();                        // the previous tile's readers are done
        if (tid < BN) {
            const int kp = kt0 + tid;
            i64 off = -1;
            if (kp < ke) {
                const int bi = kp / block_size;
                const int blk = bi < bt_width ? bt[bi] : -1;
                if (blk >= 0 && blk < n_blocks)
                    off = ((i64)blk * block_size + kp % block_size) * kv_row + (i64)kvh * HD;
            }
            koff[tid] = off;
        }
        __syncthreads();
        // consecutive threads take consecutive keys (one 16-byte piece of each): the
        // transposed V stores of a warp then fall in consecutive words
        for (int idx = tid; idx < BN * (HD / VEC); idx += THREADS) {
            const int key = idx % BN;
            const int d = (idx / BN) * VEC;
            const i64 off = koff[key];
            uint4 kw = make_uint4(0u, 0u, 0u, 0u), vw = make_uint4(0u, 0u, 0u, 0u);
            if (off >= 0) {
                kw = *reinterpret_cast<const uint4*>(k_cache + off + d);
                vw = *reinterpret_cast<const uint4*>(v_cache + off + d);
            }
            *reinterpret_cast<uint4*>(&Ks[key * K_LD + d]) = kw;
            const unsigned vv[4] = {vw.x, vw.y, vw.z, vw.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                Vt[(d + 2 * e) * V_LD + key] = (f16_t)(vv[e] & 0xffffu);
                Vt[(d + 2 * e + 1) * V_LD + key] = (f16_t)(vv[e] >> 16);
            }
        }
        __syncthreads();

        // S = Q K^T for this warp's 16 rows and the tile's BN keys
        float sc[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
            const unsigned* krow = reinterpret_cast<const unsigned*>(&Ks[(8 * n + g) * K_LD]);
#pragma unroll
            for (int s = 0; s < KS; ++s) {
                const unsigned b[2] = {krow[8 * s + t], krow[8 * s + 4 + t]};
                kvs_mma_16816(sc[n], qa[s], b);
            }
        }
        // mask (causal, window, keys past the range or without a block), running max
        float mt[2] = {kvs_neg_inf(), kvs_neg_inf()};
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int i = j >> 1;
                const int key = 8 * n + 2 * t + (j & 1);
                const int kp = kt0 + key;
                const bool ok = rvalid[i] && koff[key] >= 0 && kp <= rpos[i]
                                && (window <= 0 || rpos[i] - kp < window);
                sc[n][j] = ok ? sc[n][j] : kvs_neg_inf();
                mt[i] = fmaxf(mt[i], sc[n][j]);
            }
        }
        float alpha[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            mt[i] = fmaxf(mt[i], __shfl_xor_sync(KVS_FULL_MASK, mt[i], 1));
            mt[i] = fmaxf(mt[i], __shfl_xor_sync(KVS_FULL_MASK, mt[i], 2));
            const float mn = fmaxf(m[i], mt[i]);
            alpha[i] = mn == kvs_neg_inf() ? 1.f : exp2f(m[i] - mn);
            m[i] = mn;
            l[i] *= alpha[i];
        }
#pragma unroll
        for (int n = 0; n < ND; ++n) {
            o[n][0] *= alpha[0]; o[n][1] *= alpha[0];
            o[n][2] *= alpha[1]; o[n][3] *= alpha[1];
        }
        // P = exp2(S - m), rounded to f16 as the A fragments of P V (two score tiles each)
        unsigned pa[NT / 2][4];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            float p[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int i = j >> 1;
                p[j] = sc[n][j] == kvs_neg_inf() ? 0.f : exp2f(sc[n][j] - m[i]);
                l[i] += p[j];
            }
            pa[n / 2][2 * (n & 1) + 0] = pm_pack(p[0], p[1]);
            pa[n / 2][2 * (n & 1) + 1] = pm_pack(p[2], p[3]);
        }
        // O += P V
#pragma unroll
        for (int n = 0; n < ND; ++n) {
            const unsigned* vrow = reinterpret_cast<const unsigned*>(&Vt[(d0 + 8 * n + g) * V_LD]);
#pragma unroll
            for (int s = 0; s < NT / 2; ++s) {
                const unsigned b[2] = {vrow[8 * s + t], vrow[8 * s + 4 + t]};
                kvs_mma_16816(o[n], pa[s], b);
            }
        }
    }

    // each row's sum over its four threads, the sink term, then out = O / l (zeros for a row
    // with no key)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(KVS_FULL_MASK, l[i], 1);
        l[i] += __shfl_xor_sync(KVS_FULL_MASK, l[i], 2);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        if (!rvalid[i]) continue;
        const int r = 16 * grp + g + 8 * i;
        const int tok = r / gc;
        const int h = kvh * G + g0 + r % gc;
        float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
        if (sinks != nullptr && l[i] > 0.f) {
            // m and l over the sink too: sum_j e^(s_j - M) + e^(sink - M), M = max(m, sink)
            const float sk = sinks[h] * PM_LOG2E;
            const float mf = fmaxf(m[i], sk);
            const float a = exp2f(m[i] - mf);
            inv = a / (l[i] * a + exp2f(sk - mf));
        }
        float* orow = out + ((i64)(row0 + tok) * n_head + h) * HD;
#pragma unroll
        for (int n = 0; n < ND; ++n) {
            orow[d0 + 8 * n + 2 * t] = o[n][2 * i] * inv;
            orow[d0 + 8 * n + 2 * t + 1] = o[n][2 * i + 1] * inv;
        }
    }
}

#define PM_PARAMS                                                                               \
    const float* __restrict__ q, i64 q_row_stride, i64 q_head_stride,                          \
    const f16_t* __restrict__ k_cache, const f16_t* __restrict__ v_cache,                      \
    const int* __restrict__ block_tables, int bt_width, const int* __restrict__ tiles,         \
    float* __restrict__ out, int n_head, int n_kv, int block_size, int n_blocks,               \
    int group_chunk, float qk_scale_log2, int window, const float* __restrict__ sinks
#define PM_ARGS q, q_row_stride, q_head_stride, k_cache, v_cache, block_tables, bt_width, tiles, \
    out, n_head, n_kv, block_size, n_blocks, group_chunk, qk_scale_log2, window, sinks

// Entry points: f16 cache x head_dim 64 / 80 / 96 / 112 / 128 (any multiple of 16 up to 128:
// the padded shared rows stay 16-byte aligned and conflict-free for each), 128 threads; and
// 256 (Gemma 3's, Qwen3.5's gated attention), 256 threads: two warps a row group.
// kvshare.ops.gpu.ENTRY_POINTS lists these names and gpu.pm_threads their block sizes.
extern "C" __global__ void __launch_bounds__(128) paged_attn_mma_f16_hd64(PM_PARAMS) { paged_attn_mma_impl<64, 1, 64>(PM_ARGS); }
extern "C" __global__ void __launch_bounds__(128) paged_attn_mma_f16_hd80(PM_PARAMS) { paged_attn_mma_impl<80, 1, 64>(PM_ARGS); }
extern "C" __global__ void __launch_bounds__(128) paged_attn_mma_f16_hd96(PM_PARAMS) { paged_attn_mma_impl<96, 1, 64>(PM_ARGS); }
extern "C" __global__ void __launch_bounds__(128) paged_attn_mma_f16_hd112(PM_PARAMS) { paged_attn_mma_impl<112, 1, 64>(PM_ARGS); }
extern "C" __global__ void __launch_bounds__(128) paged_attn_mma_f16_hd128(PM_PARAMS) { paged_attn_mma_impl<128, 1, 64>(PM_ARGS); }
extern "C" __global__ void __launch_bounds__(256) paged_attn_mma_f16_hd256(PM_PARAMS) { paged_attn_mma_impl<256, 2, 32>(PM_ARGS); }
