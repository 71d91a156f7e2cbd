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
