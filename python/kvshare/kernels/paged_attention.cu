// Paged attention over a block-table KV cache: one kernel for prefill chunks and decode tokens
// of several sequences in one launch (the GPU twin of kvshare.ops.attention.paged_attention).
//
// Cache of one layer: k_cache, v_cache `[n_blocks, block_size, n_kv, head_dim]`, C-contiguous,
// f16 (raw bits) or f32. Position p of sequence s lives in block
// block_tables[s * bt_width + p / block_size], row p % block_size.
//
// Mask (llama.cpp's standard sliding window): a query at position qp sees the key at kp iff
// kp <= qp and, with window W > 0, qp - kp < W.
//
// Work split: the host cuts every sequence's query rows into tiles of at most `tile_tokens`
// consecutive tokens (`tiles`, 4 ints each: seq, first row, n rows, position of the first
// row). A CTA (PA_NW warps) takes one tile, one KV head and a chunk of that KV head's query
// heads (GQA: the K/V tile in shared memory serves every query head of the group), i.e. up to
// PA_ROWS (token, head) rows, PA_RPW per warp. It walks the tile's key range in tiles of
// PA_BN = 32 keys: the keys' rows are gathered through the block table into shared memory (K
// transposed, so that lane j reads key j conflict-free), lane j computes the scores of key j
// for the warp's rows, the softmax is updated online (running max m and sum l per row, scores
// in the log2 domain: q is pre-multiplied by scale * log2(e), so exp2f applies), and the lanes
// then accumulate P.V with lane l owning output dims l, l + 32, ...
//
// Split-KV (flash-decoding): with few CTAs (decode of a few sequences) the key range of each
// tile is cut into `n_splits` chunks along grid.z; each writes an unnormalised partial output
// and its (m, l) and `paged_attn_combine` merges them. With one split the kernel writes `out`
// directly, unless `out` is null: then it writes its one partial for `paged_attn_combine` too
// (what the host does for attention sinks, below).
// A CUDA graph captures one grid for every replay, while the split count follows the
// context length: a captured step passes `n_splits_dev` (device int) with `n_splits` = grid.z =
// the largest count it may need; the CTAs past the step's count return at once and the rest
// cut the key range by that count, so each replay computes what a launch with that count
// computes (a count of 1 still goes through the partial and `paged_attn_combine`, whose merge
// of one partial is exactly the direct write: exp2f(0) = 1). `n_splits_dev` null: `n_splits`
// is the count.
//
// Sinks (gpt-oss): one learned logit per query head joins the softmax's denominator and no
// value, as llama.cpp's ggml_soft_max_add_sinks: out = sum_j e^(s_j - m) v_j / (sum_j
// e^(s_j - m) + e^(sink - m)), m the max of the scores and the sink. `paged_attn_combine` adds
// it (`sinks` non-null: float32 [n_head], in the scaled-score domain), once per row, after
// merging the partials' (m, l); a launch with sinks therefore always writes partials, and the
// attention kernels themselves have no sink term (models without sinks pay nothing for it).
//
// Accumulation is float32 throughout (f16 K/V are widened on load). A key whose block-table
// entry is negative or out of range is treated as masked (never read); a row that sees no key
// at all gets zeros (the host validates block tables first, so this is a guard, not a path).

#define PA_NW 4                    // warps per CTA
#define PA_THREADS (PA_NW * KVS_WARP)
#define PA_RPW 4                   // (token, head) rows per warp
#define PA_ROWS (PA_NW * PA_RPW)   // rows per CTA
#define PA_BN 32                   // keys per tile: one per lane
#define PA_MAXD 512                // largest head_dim of the generic (runtime head_dim) kernels
#define PA_LOG2E 1.4426950408889634f  // sinks are natural-log logits; scores are in the log2 domain

template <typename T> struct PaKtPad { static constexpr int v = 1; };   // f32: 33-word rows
template <> struct PaKtPad<f16_t> { static constexpr int v = 2; };      // f16: 17-word rows

__device__ __forceinline__ int pa_align16(int b) { return (b + 15) & ~15; }

// Dynamic shared memory layout; the host (kvshare.ops.gpu._pa_smem_bytes) computes the same sum.
//   Qs   float [PA_ROWS][hd]            scaled queries of the CTA's rows
//   Ps   float [PA_ROWS][PA_BN]         probabilities of the current key tile
//   koff i64   [PA_BN]                  element offset of each key's row in the cache, or -1
//   Kt   T     [hd][PA_BN + pad]        K tile, transposed
//   Vs   T     [PA_BN][hd]              V tile
template <typename T, int HD>
__device__ __forceinline__ void paged_attn_impl(
    const float* __restrict__ q, i64 q_row_stride, i64 q_head_stride,
    const T* __restrict__ k_cache, const T* __restrict__ v_cache,
    const int* __restrict__ block_tables, int bt_width,
    const int* __restrict__ tiles,
    float* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml,
    int n_tok, int n_head, int n_kv, int hd_rt, int block_size, int n_blocks,
    int group_chunk, float qk_scale_log2, int window, int n_splits,
    const int* __restrict__ n_splits_dev)
{
    int ns = n_splits;                          // the count the key range is cut by
    if (n_splits_dev != nullptr) {
        ns = *n_splits_dev;
        if ((int)blockIdx.z >= ns) return;      // the whole CTA: before any barrier
    }
    constexpr int KPAD = PaKtPad<T>::v;
    constexpr int KT_LD = PA_BN + KPAD;
    constexpr int ND = (HD > 0 ? HD : PA_MAXD) / KVS_WARP;     // output dims per lane
    // vector width of the global K/V loads (16 bytes) where the head size allows it
    constexpr int VEC = (HD > 0 && (HD % (16 / (int)sizeof(T))) == 0) ? 16 / (int)sizeof(T) : 1;
    const int hd = HD > 0 ? HD : hd_rt;

    extern __shared__ float4 pa_smem4[];
    unsigned char* smem = reinterpret_cast<unsigned char*>(pa_smem4);
    float* Qs = reinterpret_cast<float*>(smem);
    int off_b = pa_align16(PA_ROWS * hd * 4);
    float* Ps = reinterpret_cast<float*>(smem + off_b);
    off_b += pa_align16(PA_ROWS * PA_BN * 4);
    i64* koff = reinterpret_cast<i64*>(smem + off_b);
    off_b += pa_align16(PA_BN * 8);
    T* Kt = reinterpret_cast<T*>(smem + off_b);
    off_b += pa_align16(hd * KT_LD * (int)sizeof(T));
    T* Vs = reinterpret_cast<T*>(smem + off_b);

    const int tid = threadIdx.x;
    const int lane = tid & (KVS_WARP - 1);
    const int warp = tid >> 5;

    // ---- which rows and keys this CTA owns -------------------------------------------------
    const KvsAttnTile tile = kvs_attn_tile(tiles, n_head, n_kv, group_chunk);
    const int seq = tile.seq, row0 = tile.row0, nr = tile.nr, pos0 = tile.pos0;
    const int G = tile.G, kvh = tile.kvh, g0 = tile.g0, gc = tile.gc;
    const int n_rows = nr * gc;                // active rows: r = token * gc + (g - g0)

    const int ke = pos0 + nr;                  // one past the last key any row may see
    const int kb = window > 0 ? max(0, pos0 - window + 1) : 0;
    int chunk = (ke - kb + ns - 1) / ns;
    chunk = (chunk + PA_BN - 1) / PA_BN * PA_BN;
    const int ks = kb + (int)blockIdx.z * chunk;
    const int kend = min(ke, ks + chunk);

    // rows of this warp: r_k = warp + PA_NW * k, active for k < n_act (a prefix)
    const int n_act = n_rows > warp ? min(PA_RPW, (n_rows - warp + PA_NW - 1) / PA_NW) : 0;

    if (ks >= kend) {
        // empty split (only when n_splits > 1): an all-masked partial
        for (int k = 0; k < n_act; ++k) {
            const int r = warp + PA_NW * k;
            const int row = row0 + r / gc;
            const int h = kvh * G + g0 + r % gc;
            const i64 pr = ((i64)blockIdx.z * n_tok + row) * n_head + h;
            for (int d = lane; d < hd; d += KVS_WARP) part_o[pr * hd + d] = 0.f;
            if (lane == 0) { part_ml[2 * pr] = kvs_neg_inf(); part_ml[2 * pr + 1] = 0.f; }
        }
        return;
    }

    // ---- queries into shared memory, scaled into the log2 domain ---------------------------
    for (int idx = tid; idx < PA_ROWS * hd; idx += PA_THREADS) {
        const int r = idx / hd, d = idx - r * hd;
        float v = 0.f;
        if (r < n_rows) {
            const int row = row0 + r / gc;
            const int h = kvh * G + g0 + r % gc;
            v = q[(i64)row * q_row_stride + (i64)h * q_head_stride + d] * qk_scale_log2;
        }
        Qs[idx] = v;
    }

    int qpos[PA_RPW];
#pragma unroll
    for (int k = 0; k < PA_RPW; ++k) qpos[k] = pos0 + (warp + PA_NW * k) / max(gc, 1);

    float m_run[PA_RPW], l_run[PA_RPW], acc[PA_RPW][ND];
#pragma unroll
    for (int k = 0; k < PA_RPW; ++k) {
        m_run[k] = kvs_neg_inf();
        l_run[k] = 0.f;                         // lane-partial sum, reduced at the end
#pragma unroll
        for (int i = 0; i < ND; ++i) acc[k][i] = 0.f;
    }

    const int* bt = block_tables + (i64)seq * bt_width;

    for (int kt0 = ks; kt0 < kend; kt0 += PA_BN) {
        __syncthreads();   // previous tile fully consumed (and, first time, Qs written)
        if (tid < PA_BN) {
            const int p = kt0 + tid;
            i64 o = -1;
            if (p < kend) {
                const int bi = p / block_size;
                if (bi < bt_width) {
                    const int blk = bt[bi];
                    if (blk >= 0 && blk < n_blocks)
                        o = (((i64)blk * block_size + (p - bi * block_size)) * n_kv + kvh) * hd;
                }
            }
            koff[tid] = o;
        }
        __syncthreads();

        // ---- gather the K/V rows of this key tile ------------------------------------------
        const int nvec = hd / VEC;
        for (int idx = tid; idx < PA_BN * nvec; idx += PA_THREADS) {
            const int j = idx / nvec;
            const int d0 = (idx - j * nvec) * VEC;
            const i64 o = koff[j];
            if (VEC > 1) {
                // 16-byte loads; the host only picks these kernels for 16-byte aligned caches
                union { float4 v; T e[VEC]; } kk, vv;
                if (o >= 0) {
                    kk.v = *reinterpret_cast<const float4*>(k_cache + o + d0);
                    vv.v = *reinterpret_cast<const float4*>(v_cache + o + d0);
                } else {
                    kk.v = make_float4(0.f, 0.f, 0.f, 0.f);
                    vv.v = kk.v;
                }
                *reinterpret_cast<float4*>(Vs + j * hd + d0) = vv.v;
#pragma unroll
                for (int u = 0; u < VEC; ++u) Kt[(d0 + u) * KT_LD + j] = kk.e[u];
            } else {
                T kv_k, kv_v;
                if (o >= 0) { kv_k = k_cache[o + d0]; kv_v = v_cache[o + d0]; }
                else { kv_k = (T)0; kv_v = (T)0; }
                Vs[j * hd + d0] = kv_v;
                Kt[d0 * KT_LD + j] = kv_k;
            }
        }
        __syncthreads();

        if (n_act > 0) {
            // ---- scores: lane = key --------------------------------------------------------
            float s[PA_RPW];
#pragma unroll
            for (int k = 0; k < PA_RPW; ++k) s[k] = 0.f;
            if (HD > 0 && (HD % 4) == 0) {
#pragma unroll 4
                for (int d = 0; d < hd; d += 4) {
                    const float k0 = kvs_to_f32(Kt[(d + 0) * KT_LD + lane]);
                    const float k1 = kvs_to_f32(Kt[(d + 1) * KT_LD + lane]);
                    const float k2 = kvs_to_f32(Kt[(d + 2) * KT_LD + lane]);
                    const float k3 = kvs_to_f32(Kt[(d + 3) * KT_LD + lane]);
#pragma unroll
                    for (int k = 0; k < PA_RPW; ++k) {
                        if (k < n_act) {
                            const float4 qv = *reinterpret_cast<const float4*>(
                                Qs + (warp + PA_NW * k) * hd + d);
                            s[k] += qv.x * k0 + qv.y * k1 + qv.z * k2 + qv.w * k3;
                        }
                    }
                }
            } else {
                for (int d = 0; d < hd; ++d) {
                    const float kf = kvs_to_f32(Kt[d * KT_LD + lane]);
#pragma unroll
                    for (int k = 0; k < PA_RPW; ++k)
                        if (k < n_act) s[k] += Qs[(warp + PA_NW * k) * hd + d] * kf;
                }
            }

            // ---- mask and online softmax ---------------------------------------------------
            const int p = kt0 + lane;
            const bool kvalid = koff[lane] >= 0;    // implies p < kend
#pragma unroll
            for (int k = 0; k < PA_RPW; ++k) {
                if (k < n_act) {
                    const int qp = qpos[k];
                    const bool ok = kvalid && p <= qp && (window <= 0 || qp - p < window);
                    const float sk = ok ? s[k] : kvs_neg_inf();
                    const float mt = kvs_warp_max(sk);
                    const float mn = fmaxf(m_run[k], mt);
                    float pj = 0.f;
                    if (mn != kvs_neg_inf()) {      // warp-uniform
                        const float alpha = exp2f(m_run[k] - mn);   // 0 when m_run = -inf
                        pj = exp2f(sk - mn);                        // 0 when masked
                        l_run[k] = l_run[k] * alpha + pj;
#pragma unroll
                        for (int i = 0; i < ND; ++i) acc[k][i] *= alpha;
                        m_run[k] = mn;
                    }
                    Ps[(warp * PA_RPW + k) * PA_BN + lane] = pj;
                }
            }
            __syncwarp();

            // ---- P.V: lane = output dims lane, lane + 32, ... -----------------------------
            const int jmax = min(PA_BN, kend - kt0);
            for (int j = 0; j < jmax; ++j) {
                float pv[PA_RPW];
#pragma unroll
                for (int k = 0; k < PA_RPW; ++k)
                    pv[k] = k < n_act ? Ps[(warp * PA_RPW + k) * PA_BN + j] : 0.f;
#pragma unroll
                for (int i = 0; i < ND; ++i) {
                    const int d = lane + i * KVS_WARP;
                    if (HD > 0 || d < hd) {
                        const float vf = kvs_to_f32(Vs[j * hd + d]);
#pragma unroll
                        for (int k = 0; k < PA_RPW; ++k)
                            if (k < n_act) acc[k][i] += pv[k] * vf;
                    }
                }
            }
        }
    }

    // ---- write the rows ----------------------------------------------------------------------
#pragma unroll
    for (int k = 0; k < PA_RPW; ++k) {
        if (k < n_act) {
            const int r = warp + PA_NW * k;
            const int row = row0 + r / gc;
            const int h = kvh * G + g0 + r % gc;
            const float lt = kvs_warp_sum(l_run[k]);
            if (out != nullptr) {                // one split, written directly
                const float inv = lt > 0.f ? 1.f / lt : 0.f;
                float* o = out + ((i64)row * n_head + h) * hd;
#pragma unroll
                for (int i = 0; i < ND; ++i) {
                    const int d = lane + i * KVS_WARP;
                    if (HD > 0 || d < hd) o[d] = acc[k][i] * inv;
                }
            } else {
                const i64 pr = ((i64)blockIdx.z * n_tok + row) * n_head + h;
                float* o = part_o + pr * hd;
#pragma unroll
                for (int i = 0; i < ND; ++i) {
                    const int d = lane + i * KVS_WARP;
                    if (HD > 0 || d < hd) o[d] = acc[k][i];
                }
                if (lane == 0) { part_ml[2 * pr] = m_run[k]; part_ml[2 * pr + 1] = lt; }
            }
        }
    }
}

#define PA_PARAMS(T)                                                                         \
    const float* __restrict__ q, i64 q_row_stride, i64 q_head_stride,                        \
    const T* __restrict__ k_cache, const T* __restrict__ v_cache,                            \
    const int* __restrict__ block_tables, int bt_width, const int* __restrict__ tiles,       \
    float* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml,        \
    int n_tok, int n_head, int n_kv, int head_dim, int block_size, int n_blocks,             \
    int group_chunk, float qk_scale_log2, int window, int n_splits,                         \
    const int* __restrict__ n_splits_dev
#define PA_ARGS                                                                              \
    q, q_row_stride, q_head_stride, k_cache, v_cache, block_tables, bt_width, tiles, out,    \
    part_o, part_ml, n_tok, n_head, n_kv, head_dim, block_size, n_blocks, group_chunk,       \
    qk_scale_log2, window, n_splits, n_splits_dev

// Entry points: f16 / f32 cache x head_dim 64, 128, 256 (compile-time) or any head_dim up to
// PA_MAXD (runtime; "hdx"). kvshare.ops.gpu.ENTRY_POINTS lists these names.
extern "C" __global__ void __launch_bounds__(PA_THREADS) paged_attn_f16_hd64(PA_PARAMS(f16_t)) { paged_attn_impl<f16_t, 64>(PA_ARGS); }
extern "C" __global__ void __launch_bounds__(PA_THREADS) paged_attn_f16_hd128(PA_PARAMS(f16_t)) { paged_attn_impl<f16_t, 128>(PA_ARGS); }
extern "C" __global__ void __launch_bounds__(PA_THREADS) paged_attn_f16_hd256(PA_PARAMS(f16_t)) { paged_attn_impl<f16_t, 256>(PA_ARGS); }
extern "C" __global__ void __launch_bounds__(PA_THREADS) paged_attn_f16_hdx(PA_PARAMS(f16_t)) { paged_attn_impl<f16_t, 0>(PA_ARGS); }
extern "C" __global__ void __launch_bounds__(PA_THREADS) paged_attn_f32_hd64(PA_PARAMS(float)) { paged_attn_impl<float, 64>(PA_ARGS); }
extern "C" __global__ void __launch_bounds__(PA_THREADS) paged_attn_f32_hd128(PA_PARAMS(float)) { paged_attn_impl<float, 128>(PA_ARGS); }
extern "C" __global__ void __launch_bounds__(PA_THREADS) paged_attn_f32_hd256(PA_PARAMS(float)) { paged_attn_impl<float, 256>(PA_ARGS); }
extern "C" __global__ void __launch_bounds__(PA_THREADS) paged_attn_f32_hdx(PA_PARAMS(float)) { paged_attn_impl<float, 0>(PA_ARGS); }

// Merge the n_splits partial results of every (token, head) row: grid.x = n_tok * n_head.
// part_o [n_splits, n_rows, hd] (unnormalised), part_ml [n_splits, n_rows, 2] (max in the log2
// domain, sum); out [n_rows, hd]. `n_splits_dev` (non-null): the count, on the device.
// `sinks` (non-null): float32 [n_head] sink logits, row r's head r % n_head, added to the
// merged denominator (a row that saw no key gets zeros, as without sinks).
extern "C" __global__ void __launch_bounds__(128) paged_attn_combine(
    const float* __restrict__ part_o, const float* __restrict__ part_ml, float* __restrict__ out,
    int n_rows, int head_dim, int n_splits, const int* __restrict__ n_splits_dev,
    int n_head, const float* __restrict__ sinks)
{
    const i64 row = blockIdx.x;
    if (row >= n_rows) return;
    if (n_splits_dev != nullptr) n_splits = *n_splits_dev;
    const float sk = sinks != nullptr ? sinks[row % n_head] * PA_LOG2E : kvs_neg_inf();
    float M = sk;
    for (int z = 0; z < n_splits; ++z) M = fmaxf(M, part_ml[2 * ((i64)z * n_rows + row)]);
    float L = 0.f;
    if (M != kvs_neg_inf()) {
        for (int z = 0; z < n_splits; ++z) {
            const float mz = part_ml[2 * ((i64)z * n_rows + row)];
            if (mz != kvs_neg_inf()) L += part_ml[2 * ((i64)z * n_rows + row) + 1] * exp2f(mz - M);
        }
        if (sinks != nullptr) L += exp2f(sk - M);
    }
    const float inv = L > 0.f ? 1.f / L : 0.f;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float a = 0.f;
        if (L > 0.f) {
            for (int z = 0; z < n_splits; ++z) {
                const float mz = part_ml[2 * ((i64)z * n_rows + row)];
                if (mz != kvs_neg_inf())
                    a += part_o[((i64)z * n_rows + row) * head_dim + d] * exp2f(mz - M);
            }
        }
        out[row * head_dim + d] = a * inv;
    }
}
