// The causal depthwise convolution's decode step (kvshare.ops.gpu_hybrid.causal_conv1d_step_slots):
// one token for each of B sequences, each sequence's conv state read and updated in place in
// the cache's state array, at its slot, so nothing is gathered or scattered around the step
// (a CUDA graph can hold it: the slots are a device array). The arithmetic of
// kvshare.ops.short_conv_xp.conv_step_impl, per row b and channel c, S the [K-1] column of
// (slot, layer) at channel c (the K-1 previous inputs, oldest first), w the [C, K] weight:
//
//   o     = S[0] w[c, 0]
//   o    += S[j] w[c, j]          j = 1 .. K-2, in that order
//   o    += x[b, c] w[c, K-1]     (each product rounded, then the sum: no FMA, as NumPy)
//   S    <- S[1:] | x[b, c]       (shifted left by one, the new input last)
//
// so the output and the state are NumPy's bit for bit.
//
// Layouts (strides in elements; the channel axis of every array has unit stride):
//   x        [B, C]       row b at b * x_sb (a view of a wider row is read as it is)
//   w        [C, K]       w[c, j] at c * w_sc + j * w_sk
//   states   the cache's array for this state kind, [n_slots, n_rec, K-1, C]
//            (KVArrays.states[CONV]; lfm2's and qwen35's state_shapes()); `states` points at
//            layer rec_index's first slot (the host adds rec_index * its stride), element
//            (j, c) of slot s at s * st_slot + j * st_j + c
//   slots    int32 [B]: the state slot of row b; slot < 0: a padding row (a CUDA graph's
//            batch padded to its size): o[b] = 0 and no state is read or written. The slots
//            of a launch must be distinct (two rows on one state would race).
//   o        [B, C]       row b at b * o_sb
//
// Grid-stride over the B * C (row, channel) pairs, the channel fastest (coalesced loads and
// stores of x, S and o); a thread owns its column of S, so the in-place shift needs no
// barrier: it reads S[j] once, adds its product, and stores it at j - 1.

extern "C" __global__ void causal_conv1d_step_f32(
    const float* __restrict__ x, i64 x_sb,
    const float* __restrict__ w, i64 w_sc, i64 w_sk,
    float* states, i64 st_slot, i64 st_j,
    const int* __restrict__ slots, int B, int C, int K,
    float* __restrict__ o, i64 o_sb)
{
    const i64 total = (i64)B * C;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (i64)gridDim.x * blockDim.x) {
        const int b = (int)(idx / C);
        const int c = (int)(idx - (i64)b * C);
        const int slot = slots[b];
        float* orow = o + (i64)b * o_sb;
        if (slot < 0) {  // a padding row
            orow[c] = 0.f;
            continue;
        }
        const float xv = x[(i64)b * x_sb + c];
        const float* wc = w + (i64)c * w_sc;
        float* S = states + (i64)slot * st_slot + c;
        const float s0 = S[0];
        float acc = __fmul_rn(s0, wc[0]);
        for (int j = 1; j < K - 1; ++j) {
            const float sj = S[(i64)j * st_j];
            acc = __fadd_rn(acc, __fmul_rn(sj, wc[(i64)j * w_sk]));
            S[(i64)(j - 1) * st_j] = sj;
        }
        acc = __fadd_rn(acc, __fmul_rn(xv, wc[(i64)(K - 1) * w_sk]));
        S[(i64)(K - 2) * st_j] = xv;
        orow[c] = acc;
    }
}

// The causal depthwise convolution over whole sequences of rows
// (kvshare.ops.gpu_hybrid.causal_conv1d_seq_slots): a step's prompt chunks and decode rows,
// each sequence's rows after the K-1 inputs its state at its slot holds, in two launches (the
// outputs read the old states, which the second launch then replaces). The arithmetic of
// kvshare.ops.short_conv_xp.conv_impl in its order, per row r and channel c, src(r') the input
// r' rows back in the sequence's stream (its rows, after its state's K-1 columns):
//
//   o[r, c]  = src(r - K + 1) w[c, 0]
//   o[r, c] += src(r - K + 1 + j) w[c, j]    j = 1 .. K-1, in that order
//              (each product rounded, then the sum: no FMA, as NumPy)
//   S       <- the stream's last K-1 inputs
//
// so the outputs and states are NumPy's bit for bit, and a decode row's (a sequence of one
// row) those of causal_conv1d_step_f32.
//
// Layouts as causal_conv1d_step_f32's, with rows r of x and o, and per sequence s:
//   seq_row0, seq_len, slots  int32 [n_seq]: as gated_delta_seq_f32's (slot < 0: a padding
//                             sequence, zeros out, its state untouched)
//   row_seq  int32 [N]         the sequence of row r (< 0: a row of no sequence: zeros)

extern "C" __global__ void causal_conv1d_seq_f32(
    const float* __restrict__ x, i64 x_sb,
    const float* __restrict__ w, i64 w_sc, i64 w_sk,
    const float* __restrict__ states, i64 st_slot, i64 st_j,
    const int* __restrict__ seq_row0, const int* __restrict__ slots,
    const int* __restrict__ row_seq, int N, int C, int K,
    float* __restrict__ o, i64 o_sb)
{
    const i64 total = (i64)N * C;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (i64)gridDim.x * blockDim.x) {
        const int r = (int)(idx / C);
        const int c = (int)(idx - (i64)r * C);
        const int s = row_seq[r];
        const int slot = s < 0 ? -1 : slots[s];
        float* orow = o + (i64)r * o_sb;
        if (slot < 0) {
            orow[c] = 0.f;
            continue;
        }
        const int t = r - seq_row0[s];  // the row's place in its sequence
        const float* wc = w + (i64)c * w_sc;
        const float* S = states + (i64)slot * st_slot + c;
        float acc = 0.f;
        for (int jj = 0; jj < K; ++jj) {
            const int back = t - (K - 1) + jj;  // < 0: the state's column K-1 + back
            const float xv = back >= 0 ? x[(i64)(r - t + back) * x_sb + c]
                                       : S[(i64)(K - 1 + back) * st_j];
            const float p = __fmul_rn(xv, wc[(i64)jj * w_sk]);
            acc = jj == 0 ? p : __fadd_rn(acc, p);
        }
        orow[c] = acc;
    }
}

// The second launch: each sequence's state becomes the last K-1 inputs of its stream. A thread
// per (sequence, channel) writes its column in ascending order, so a sequence shorter than
// K-1 rows reads each old value it keeps before overwriting it.
extern "C" __global__ void causal_conv1d_seq_state_f32(
    const float* __restrict__ x, i64 x_sb,
    float* states, i64 st_slot, i64 st_j,
    const int* __restrict__ seq_row0, const int* __restrict__ seq_len,
    const int* __restrict__ slots, int n_seq, int C, int K)
{
    const i64 total = (i64)n_seq * C;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (i64)gridDim.x * blockDim.x) {
        const int s = (int)(idx / C);
        const int c = (int)(idx - (i64)s * C);
        const int slot = slots[s], n = seq_len[s];
        if (slot < 0 || n <= 0) continue;
        const int row0 = seq_row0[s];
        float* S = states + (i64)slot * st_slot + c;
        for (int jj = 0; jj < K - 1; ++jj) {
            const int src = n - (K - 1) + jj;  // in the stream: < 0 reads state column K-1 + src
            S[(i64)jj * st_j] = src >= 0 ? x[(i64)(row0 + src) * x_sb + c]
                                         : S[(i64)(K - 1 + src) * st_j];
        }
    }
}
