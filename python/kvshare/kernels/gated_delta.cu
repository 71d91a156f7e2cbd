// The gated delta rule's decode step (kvshare.ops.gpu_hybrid.gated_delta_step_slots): one token
// for each of B sequences, each sequence's state read and updated in place in the cache's
// state array, at its slot, so nothing is gathered or scattered around the step (a CUDA
// graph can hold it: the slots are a device array). The arithmetic of
// kvshare.ops.gated_delta_xp.step_impl, per row b and value head h (key head h % H_k, as
// `heads()` maps it), S the [Dk, Dv] float32 matrix of (slot, layer, head):
//
//   S     <- S * exp(g[b, h])
//   kv[j]  = sum_i k[i] S[i, j]                   (S^T k)
//   delta  = (v[j] - kv[j]) * beta[b, h]
//   S     <- S + k[i] delta[j]                    (the product rounded, then the sum: no FMA)
//   o[j]   = (sum_i q[i] S[i, j]) * scale         (S^T q, the updated S)
//
// Layouts (strides in elements; the last axis of every array has unit stride):
//   q, k     [B, H_k, Dk]  rows b * x_sb + kh * x_sh
//   v        [B, H, Dv]    rows b * v_sb + h * v_sh
//   g, beta  [B, H]        b * sb + h * sh
//   states   the cache's array for this state kind, [n_slots, n_rec, H, Dk, Dv]
//            (KVArrays.states[SSM]; qwen35's state_shapes()); `states` points at layer
//            rec_index's first slot (the host adds rec_index * its stride), element (i, j) of
//            (slot, h) at slot * st_slot + h * st_h + i * st_k + j
//   slots    int32 [B]: the state slot of row b; slot < 0: a padding row (a CUDA graph's
//            batch padded to its size): o[b] = 0 and no state is read or written. The slots
//            of a launch must be distinct (two rows on one state would race).
//   o        [B, H, Dv]    rows b * o_sb + h * o_sh
//
// Grid: (B * H, ceil(Dv / GD_COLS)); CTA (b * H + h, t) takes columns [GD_COLS t, GD_COLS t +
// GD_COLS) of S with GD_WARPS warps (128 threads): lane l owns column GD_COLS t + l, warp w the
// rows [w R, min(Dk, (w + 1) R)), R = ceil(Dk / GD_WARPS). Every column is independent (the
// sums run over i), so a lane walks its rows of its column: each row of a warp is one 128-byte
// coalesced load and store, q[i] and k[i] one broadcast load. A thread keeps its R decayed
// values in registers between the two passes when R <= GD_REG (Dk <= 128: Qwen3-Next's
// Dk = Dv = 128 gives 4 CTAs of 128 threads a head, each thread 32 values), else it reads S
// again in the second pass and recomputes the decay (the same product, so the same values).
//
// Order of the float32 sums (fixed, whatever the device): each warp sums its rows in
// ascending i, then the GD_WARPS partial sums are added in warp order (0 + 1 + 2 + 3).

#define GD_WARPS 4
#define GD_COLS 32
#define GD_REG 32

// The GD_WARPS warps' partial sums of a lane's column, added in warp order (0 + 1 + 2 + 3).
__device__ __forceinline__ float gd_warps_sum(const float (*part)[GD_COLS], int lane)
{
    float v = part[0][lane];
#pragma unroll
    for (int w = 1; w < GD_WARPS; ++w) v += part[w][lane];
    return v;
}

// A thread's rows i0 .. i0 + n_rows - 1 of column j of S into registers, and back.
__device__ __forceinline__ void gd_reg_load(float (&s)[GD_REG], const float* S, i64 st_k,
                                            int j, int i0, int n_rows)
{
#pragma unroll
    for (int r = 0; r < GD_REG; ++r)
        if (r < n_rows) s[r] = S[(i64)(i0 + r) * st_k + j];
}

__device__ __forceinline__ void gd_reg_store(const float (&s)[GD_REG], float* S, i64 st_k,
                                             int j, int i0, int n_rows)
{
#pragma unroll
    for (int r = 0; r < GD_REG; ++r)
        if (r < n_rows) S[(i64)(i0 + r) * st_k + j] = s[r];
}

// One token on a thread's REG-resident state values s (rows i0 .. i0 + n_rows - 1 of column
// j): both kernels' register path, so that they run the same arithmetic in the same order.
__device__ __forceinline__ void gd_token_reg(
    float (&s)[GD_REG], const float* __restrict__ qr, const float* __restrict__ kr,
    int j, bool col_ok, int i0, int n_rows, float eg, float vj, float bt, float scale,
    float* __restrict__ out, float (*part)[GD_WARPS][GD_COLS], int lane, int wid)
{
    // pass 1: the decayed column and its partial S^T k
    float acc = 0.f;
    if (col_ok) {
#pragma unroll
        for (int r = 0; r < GD_REG; ++r) {
            if (r < n_rows) {
                s[r] = s[r] * eg;
                acc += kr[i0 + r] * s[r];
            }
        }
    }
    part[0][wid][lane] = acc;
    __syncthreads();
    const float delta = (vj - gd_warps_sum(part[0], lane)) * bt;
    // pass 2: the rank-1 update and the partial S^T q of the new column
    acc = 0.f;
    if (col_ok) {
#pragma unroll
        for (int r = 0; r < GD_REG; ++r) {
            if (r < n_rows) {
                s[r] = __fadd_rn(s[r], __fmul_rn(kr[i0 + r], delta));
                acc += qr[i0 + r] * s[r];
            }
        }
    }
    part[1][wid][lane] = acc;
    __syncthreads();
    if (wid == 0 && col_ok) out[j] = gd_warps_sum(part[1], lane) * scale;
}

// One token on S in global memory (Dk above GD_WARPS * GD_REG rows): each pass reads S.
__device__ __forceinline__ void gd_step_global(
    const float* __restrict__ qr, const float* __restrict__ kr, float* S, i64 st_k, int j,
    bool col_ok, int i0, int n_rows, float eg, float vj, float bt, float scale,
    float* __restrict__ out, float (*part)[GD_WARPS][GD_COLS], int lane, int wid)
{
    float acc = 0.f;
    if (col_ok) {
        for (int r = 0; r < n_rows; ++r) {
            const int i = i0 + r;
            const float sd = S[(i64)i * st_k + j] * eg;
            acc += kr[i] * sd;
        }
    }
    part[0][wid][lane] = acc;
    __syncthreads();
    const float delta = (vj - gd_warps_sum(part[0], lane)) * bt;
    acc = 0.f;
    if (col_ok) {
        for (int r = 0; r < n_rows; ++r) {
            const int i = i0 + r;
            float* p = S + (i64)i * st_k + j;
            const float sn = __fadd_rn(*p * eg, __fmul_rn(kr[i], delta));
            *p = sn;
            acc += qr[i] * sn;
        }
    }
    part[1][wid][lane] = acc;
    __syncthreads();
    if (wid == 0 && col_ok) out[j] = gd_warps_sum(part[1], lane) * scale;
}

extern "C" __global__ void __launch_bounds__(128) gated_delta_step_f32(
    const float* __restrict__ q, i64 q_sb, i64 q_sh,
    const float* __restrict__ k, i64 k_sb, i64 k_sh,
    const float* __restrict__ v, i64 v_sb, i64 v_sh,
    const float* __restrict__ g, i64 g_sb, i64 g_sh,
    const float* __restrict__ beta, i64 b_sb, i64 b_sh,
    float* states, i64 st_slot, i64 st_h, i64 st_k,
    const int* __restrict__ slots, int H, int Hk, int Dk, int Dv, float scale,
    float* __restrict__ o, i64 o_sb, i64 o_sh)
{
    __shared__ float part[2][GD_WARPS][GD_COLS];  // the warps' partial sums of each column
    const int lane = threadIdx.x & (KVS_WARP - 1);
    const int wid = threadIdx.x >> 5;
    const int b = blockIdx.x / H, h = blockIdx.x - (blockIdx.x / H) * H;
    const int j = blockIdx.y * GD_COLS + lane;
    const bool col_ok = j < Dv;
    float* orow = o + (i64)b * o_sb + (i64)h * o_sh;
    const int slot = slots[b];
    if (slot < 0) {  // a padding row (the whole CTA leaves before any barrier)
        if (wid == 0 && col_ok) orow[j] = 0.f;
        return;
    }
    const int kh = h % Hk;
    const float* qr = q + (i64)b * q_sb + (i64)kh * q_sh;
    const float* kr = k + (i64)b * k_sb + (i64)kh * k_sh;
    float* S = states + (i64)slot * st_slot + (i64)h * st_h;
    const float eg = expf(g[(i64)b * g_sb + (i64)h * g_sh]);
    const float bt = beta[(i64)b * b_sb + (i64)h * b_sh];
    const float vj = col_ok ? v[(i64)b * v_sb + (i64)h * v_sh + j] : 0.f;
    const int R = (Dk + GD_WARPS - 1) / GD_WARPS;
    const int i0 = min(Dk, wid * R);
    const int n_rows = min(Dk, i0 + R) - i0;
    if (R <= GD_REG) {
        float sr[GD_REG];
        if (col_ok) gd_reg_load(sr, S, st_k, j, i0, n_rows);
        gd_token_reg(sr, qr, kr, j, col_ok, i0, n_rows, eg, vj, bt, scale, orow, part, lane,
                     wid);
        if (col_ok) gd_reg_store(sr, S, st_k, j, i0, n_rows);
    } else {
        gd_step_global(qr, kr, S, st_k, j, col_ok, i0, n_rows, eg, vj, bt, scale, orow, part,
                       lane, wid);
    }
}

// The gated delta rule over whole sequences of rows (kvshare.ops.gpu_hybrid.gated_delta_seq_slots):
// a step's prompt chunks and decode rows in one launch, each sequence's rows in order on its
// state at its slot, read once and written once (a decode row is a sequence of one row). As
// llama.cpp's gated_delta_net_cuda, a sequential scan with the state in registers: the
// chunkwise form's triangular solves and small GEMMs cost a few hundred launches a layer and
// chunk, where a token of the scan costs two barriers. Per token, the arithmetic of
// gated_delta_step_f32 above in its order, so a sequence's outputs and final state are those
// of its rows sent one decode step at a time, bit for bit.
//
// Layouts as gated_delta_step_f32's, with rows r of q, k, v, g, beta, o, and per sequence s:
//   seq_row0 int32 [n_seq]  its first row; its rows are seq_row0[s] .. + seq_len[s] - 1
//   seq_len  int32 [n_seq]  its row count (0: nothing)
//   slots    int32 [n_seq]  its state slot; < 0: a padding sequence, whose rows get zeros and
//                           whose slot is never read or written. Distinct where >= 0.
//
// Grid: (n_seq * H, ceil(Dv / GD_COLS)); the CTA's warps and lanes as gated_delta_step_f32's.
// The rows' q and k (the value head's key head), v (the CTA's columns), exp(g) and beta go
// through shared memory a tile of `tile` tokens at a time (coalesced loads; the per-token
// reads are shared-memory broadcasts). tile * Dk <= GD_QK_TILE (the host picks it).

#define GD_TILE 16
#define GD_QK_TILE 2048

extern "C" __global__ void __launch_bounds__(128) gated_delta_seq_f32(
    const float* __restrict__ q, i64 q_sb, i64 q_sh,
    const float* __restrict__ k, i64 k_sb, i64 k_sh,
    const float* __restrict__ v, i64 v_sb, i64 v_sh,
    const float* __restrict__ g, i64 g_sb, i64 g_sh,
    const float* __restrict__ beta, i64 b_sb, i64 b_sh,
    float* states, i64 st_slot, i64 st_h, i64 st_k,
    const int* __restrict__ seq_row0, const int* __restrict__ seq_len,
    const int* __restrict__ slots, int H, int Hk, int Dk, int Dv, float scale, int tile,
    float* __restrict__ o, i64 o_sb, i64 o_sh)
{
    __shared__ float part[2][GD_WARPS][GD_COLS];
    __shared__ float qs[GD_QK_TILE];
    __shared__ float ks[GD_QK_TILE];
    __shared__ float vs[GD_TILE][GD_COLS];
    __shared__ float egs[GD_TILE];
    __shared__ float bts[GD_TILE];
    const int lane = threadIdx.x & (KVS_WARP - 1);
    const int wid = threadIdx.x >> 5;
    const int s = blockIdx.x / H, h = blockIdx.x - (blockIdx.x / H) * H;
    const int j0 = blockIdx.y * GD_COLS;
    const int j = j0 + lane;
    const bool col_ok = j < Dv;
    const int row0 = seq_row0[s], n = seq_len[s], slot = slots[s];
    if (n <= 0) return;
    if (slot < 0) {  // a padding sequence
        if (wid == 0 && col_ok)
            for (int t = 0; t < n; ++t) o[(i64)(row0 + t) * o_sb + (i64)h * o_sh + j] = 0.f;
        return;
    }
    const int kh = h % Hk;
    float* S = states + (i64)slot * st_slot + (i64)h * st_h;
    const int R = (Dk + GD_WARPS - 1) / GD_WARPS;
    const int i0 = min(Dk, wid * R);
    const int n_rows = min(Dk, i0 + R) - i0;
    const bool reg = R <= GD_REG;
    float sr[GD_REG];  // the thread's rows of its column, across all tokens (when reg)
    if (reg && col_ok) gd_reg_load(sr, S, st_k, j, i0, n_rows);
    for (int t0 = 0; t0 < n; t0 += tile) {
        const int tn = min(tile, n - t0);
        // (every read of the previous tile came before its last token's second barrier,
        // which every thread has passed: the tile may be overwritten)
        for (int idx = threadIdx.x; idx < tn * Dk; idx += blockDim.x) {
            const int t = idx / Dk, i = idx - (idx / Dk) * Dk;
            const i64 row = row0 + t0 + t;
            qs[idx] = q[row * q_sb + (i64)kh * q_sh + i];
            ks[idx] = k[row * k_sb + (i64)kh * k_sh + i];
        }
        for (int idx = threadIdx.x; idx < tn * GD_COLS; idx += blockDim.x) {
            const int t = idx / GD_COLS, c = idx - (idx / GD_COLS) * GD_COLS;
            const i64 row = row0 + t0 + t;
            vs[t][c] = (j0 + c < Dv) ? v[row * v_sb + (i64)h * v_sh + j0 + c] : 0.f;
        }
        if (threadIdx.x < tn) {
            const i64 row = row0 + t0 + threadIdx.x;
            egs[threadIdx.x] = expf(g[row * g_sb + (i64)h * g_sh]);
            bts[threadIdx.x] = beta[row * b_sb + (i64)h * b_sh];
        }
        __syncthreads();
        for (int t = 0; t < tn; ++t) {
            const float* qr = qs + t * Dk;
            const float* kr = ks + t * Dk;
            const float eg = egs[t], bt = bts[t], vj = vs[t][lane];
            float* orow = o + (i64)(row0 + t0 + t) * o_sb + (i64)h * o_sh;
            if (reg)
                gd_token_reg(sr, qr, kr, j, col_ok, i0, n_rows, eg, vj, bt, scale, orow, part,
                             lane, wid);
            else  // S in global memory, as gated_delta_step_f32 without registers
                gd_step_global(qr, kr, S, st_k, j, col_ok, i0, n_rows, eg, vj, bt, scale, orow,
                               part, lane, wid);
        }
    }
    if (reg && col_ok) gd_reg_store(sr, S, st_k, j, i0, n_rows);
}
