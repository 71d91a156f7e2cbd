// CPU emulation shim for kvshare's CUDA kernels: every CUDA thread of a block is a ucontext
// fiber, run by a round-robin scheduler in one OS thread; __syncthreads / __syncwarp /
// shuffles are barriers that yield to the scheduler. Deadlocks (a barrier some threads never
// reach) abort. Blocks run one after another.
#include <ucontext.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <cstdint>
#include <vector>
#include <string>
#include <map>
#include <functional>
#include <utility>
#include <type_traits>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
// static __shared__ arrays: a function-local static is one object for all the fibers (threads)
// of a block, as shared memory is; fakecupy follows each declaration with
// emu_poison_shared(), which fills the object with 0xFF bytes (NaN in f16 and f32) when the
// first thread of a block reaches it, as the dynamic shared memory is before each block: a
// kernel that reads shared memory it did not write in this block reads NaN, not the previous
// block's values nor a static's zeros
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct uint3_ { unsigned x = 0, y = 0, z = 0; };
struct dim3_ { unsigned x = 1, y = 1, z = 1; };
static uint3_ threadIdx, blockIdx;
static dim3_ blockDim, gridDim;
static unsigned char* emu_smem_ptr = nullptr;

struct alignas(16) float4 { float x, y, z, w; };   // CUDA's float4 is 16-byte aligned too
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
struct alignas(16) uint4 { unsigned x, y, z, w; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }

static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
// atomics: fibers switch only at barriers, so a plain read-modify-write is atomic
static inline int atomicAdd(int* p, int v) { int o = *p; *p = o + v; return o; }
static inline unsigned atomicAdd(unsigned* p, unsigned v) { unsigned o = *p; *p = o + v; return o; }
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline double __dmul_rn(double a, double b) { volatile double r = a * b; return r; }
static inline double __dadd_rn(double a, double b) { volatile double r = a + b; return r; }
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
// SIMD integer intrinsics, with the CUDA Math API's semantics. __dp4a: c + the sum of the
// products of the 4 signed bytes of a and b.
static inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; ++i) c += (int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i));
    return c;
}
// __vsub4: per-byte a - b, modulo 256 (no saturation).
static inline unsigned __vsub4(unsigned a, unsigned b) {
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (((a >> (8 * i)) - (b >> (8 * i))) & 0xffu) << (8 * i);
    return r;
}
// __byte_perm: result byte n = byte s<4n+2:4n> of the 8 bytes y:x (x the low ones); the 4th
// bit of each selector nibble and the upper 16 bits of s are ignored.
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long v = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int n = 0; n < 4; ++n) r |= (unsigned)((v >> (8 * ((s >> (4 * n)) & 7u))) & 0xffu) << (8 * n);
    return r;
}
static inline float emu_h2f(unsigned short h) { _Float16 f; std::memcpy(&f, &h, 2); return (float)f; }
static inline unsigned short emu_f2h(float x) { _Float16 f = (_Float16)x; unsigned short h; std::memcpy(&h, &f, 2); return h; }

// ---- fibers ------------------------------------------------------------------------------
struct EmuFiber {
    ucontext_t ctx;
    std::vector<char> stack;
    int tid = 0;
    bool done = false;
    int wait_kind = 0;   // 0 running, 1 block barrier, 2 warp barrier
    long wait_gen = 0;
};
static std::vector<EmuFiber> emu_fibers;
static ucontext_t emu_sched;
static int emu_cur = -1;
static int emu_nthreads = 0;
static int emu_block_count = 0; static long emu_block_gen = 0;
static int emu_warp_count[32]; static long emu_warp_gen[32];
static float emu_warp_slots[1024];
static std::function<void()> emu_body;

static void emu_yield_wait(int kind) {
    EmuFiber& f = emu_fibers[emu_cur];
    int w = f.tid >> 5;
    if (kind == 1) {
        f.wait_gen = emu_block_gen;
        if (++emu_block_count == emu_nthreads) { emu_block_count = 0; ++emu_block_gen; }
    } else {
        f.wait_gen = emu_warp_gen[w];
        int lanes = std::min(32, emu_nthreads - (w << 5));
        if (++emu_warp_count[w] == lanes) { emu_warp_count[w] = 0; ++emu_warp_gen[w]; }
    }
    f.wait_kind = kind;
    swapcontext(&f.ctx, &emu_sched);
}
static inline void __syncthreads() { emu_yield_wait(1); }
static inline void __syncwarp(unsigned = 0xffffffffu) { emu_yield_wait(2); }
static inline float __shfl_xor_sync(unsigned, float v, int o) {
    int t = threadIdx.x;
    emu_warp_slots[t] = v;
    emu_yield_wait(2);
    float r = emu_warp_slots[(t & ~31) | ((t & 31) ^ o)];
    emu_yield_wait(2);
    return r;
}
// the other shuffles (any type of up to 8 bytes): every lane posts its value, then reads lane src's
static unsigned long long emu_warp_slots64[1024];
template <typename T> static inline T emu_shfl_from(T v, int src) {
    static_assert(sizeof(T) <= 8, "a shuffled value is at most 8 bytes");
    int t = threadIdx.x;
    unsigned long long b = 0;
    std::memcpy(&b, &v, sizeof(T));
    emu_warp_slots64[t] = b;
    emu_yield_wait(2);
    unsigned long long r = emu_warp_slots64[(t & ~31) | (src & 31)];
    emu_yield_wait(2);
    T out;
    std::memcpy(&out, &r, sizeof(T));
    return out;
}
static inline int __shfl_xor_sync(unsigned, int v, int o) { return emu_shfl_from(v, (threadIdx.x & 31) ^ o); }
static inline double __shfl_xor_sync(unsigned, double v, int o) { return emu_shfl_from(v, (threadIdx.x & 31) ^ o); }
template <typename T> static inline T __shfl_sync(unsigned, T v, int src) { return emu_shfl_from(v, src); }

// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 of one warp (kvs_mma_16816 in
// kernels/paged_attention_mma.cu, whose comment gives the fragment layout): every lane posts
// its fragments, then computes its four outputs from the posted A and B elements (products of
// f16 values are exact in float32; the sum over k is float32 in k order).
static unsigned emu_mma_a[1024][4], emu_mma_b[1024][2];
static inline void kvs_mma_16816(float* c, const unsigned* a, const unsigned* b) {
    const int t = threadIdx.x, w0 = t & ~31, lane = t & 31, g = lane >> 2, tq = lane & 3;
    for (int i = 0; i < 4; ++i) emu_mma_a[t][i] = a[i];
    emu_mma_b[t][0] = b[0]; emu_mma_b[t][1] = b[1];
    emu_yield_wait(2);
    auto half = [](unsigned w, int k) { return emu_h2f((unsigned short)((k & 1) ? w >> 16 : w & 0xffffu)); };
    auto A = [&](int r, int k) {   // A[r][k]: lane 4 (r % 8) + (k % 8) / 2, word (r / 8) + 2 (k / 8)
        return half(emu_mma_a[w0 + 4 * (r & 7) + ((k & 7) >> 1)][(r >> 3) + 2 * (k >> 3)], k);
    };
    auto B = [&](int k, int n) {   // B[k][n]: lane 4 n + (k % 8) / 2, word k / 8
        return half(emu_mma_b[w0 + 4 * n + ((k & 7) >> 1)][k >> 3], k);
    };
    float r[4];
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i >> 1), col = 2 * tq + (i & 1);
        float s = 0.f;
        for (int k = 0; k < 16; ++k) s += A(row, k) * B(k, col);
        r[i] = c[i] + s;
    }
    emu_yield_wait(2);   // every lane has read the posted fragments before any posts again
    for (int i = 0; i < 4; ++i) c[i] = r[i];
}

static long emu_block_serial = 0;   // blocks run so far, this one included
static std::map<void*, long> emu_poisoned;   // static shared object -> the block that poisoned it
static inline void emu_poison_shared(void* p, std::size_t n) {
    long& s = emu_poisoned[p];
    if (s != emu_block_serial) { std::memset(p, 0xFF, n); s = emu_block_serial; }
}

static void emu_fiber_entry() {
    emu_body();
    emu_fibers[emu_cur].done = true;
    // returning resumes uc_link (the scheduler)
}

// The order the scheduler resumes the runnable fibers in, each pass (KVSHARE_EMU_ORDER, read
// at every launch): 0 thread order; 1 reverse; 2 a new pseudo-random permutation each pass
// (KVSHARE_EMU_SEED). A kernel whose threads read what another thread wrote without a
// barrier between (a missing __syncthreads / __syncwarp) sees the other thread's old value
// in one of the orders, where a GPU may too: running its tests in thread order and in
// reverse catches a dependence in either direction.
static int emu_order_mode = 0;
static unsigned long long emu_order_rng = 0x9e3779b97f4a7c15ull;
static std::vector<int> emu_order;
static void emu_next_order(int nthreads) {
    emu_order.resize(nthreads);
    for (int i = 0; i < nthreads; ++i) emu_order[i] = emu_order_mode == 1 ? nthreads - 1 - i : i;
    if (emu_order_mode == 2) {
        for (int i = nthreads - 1; i > 0; --i) {
            emu_order_rng = emu_order_rng * 6364136223846793005ull + 1442695040888963407ull;
            const int j = (int)((emu_order_rng >> 33) % (unsigned long long)(i + 1));
            std::swap(emu_order[i], emu_order[j]);
        }
    }
}

static void emu_run_block(int nthreads) {
    ++emu_block_serial;
    emu_nthreads = nthreads;
    emu_block_count = 0; emu_block_gen = 0;
    for (int w = 0; w < 32; ++w) { emu_warp_count[w] = 0; emu_warp_gen[w] = 0; }
    if ((int)emu_fibers.size() < nthreads) emu_fibers.resize(nthreads);
    for (int t = 0; t < nthreads; ++t) {
        EmuFiber& f = emu_fibers[t];
        if (f.stack.empty()) f.stack.resize(256 * 1024);
        f.tid = t; f.done = false; f.wait_kind = 0; f.wait_gen = 0;
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack.data();
        f.ctx.uc_stack.ss_size = f.stack.size();
        f.ctx.uc_link = &emu_sched;
        makecontext(&f.ctx, emu_fiber_entry, 0);
    }
    int alive = nthreads;
    emu_next_order(nthreads);
    while (alive > 0) {
        bool progress = false;
        if (emu_order_mode == 2) emu_next_order(nthreads);
        for (int i = 0; i < nthreads; ++i) {
            const int t = emu_order[i];
            EmuFiber& f = emu_fibers[t];
            if (f.done) continue;
            if (f.wait_kind == 1 && !(emu_block_gen > f.wait_gen)) continue;
            if (f.wait_kind == 2 && !(emu_warp_gen[t >> 5] > f.wait_gen)) continue;
            f.wait_kind = 0;
            emu_cur = t;
            threadIdx.x = t; threadIdx.y = 0; threadIdx.z = 0;
            swapcontext(&emu_sched, &f.ctx);
            progress = true;
            if (f.done) --alive;
        }
        if (!progress) {
            std::fprintf(stderr, "EMU DEADLOCK: block (%u,%u,%u), %d threads alive\n",
                         blockIdx.x, blockIdx.y, blockIdx.z, alive);
            std::abort();
        }
    }
}

template <typename... A, std::size_t... I>
static void emu_call_impl(void (*f)(A...), void** argv, std::index_sequence<I...>) {
    f(*reinterpret_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(argv[I])...);
}
template <typename... A>
static void emu_call(void (*f)(A...), void** argv) {
    emu_call_impl(f, argv, std::index_sequence_for<A...>{});
}
