// Peer-memory collectives: one-shot and two-shot all-reduce and all-gather
// over staging arenas that every member of a device set can address (peer
// access inside one process, CUDA IPC across processes).
//
// Compiled by NVRTC with a preamble that defines
//   ELEM_T     the storage type of one element,
//   ELEM_U     its unsigned counterpart (integers wrap through it),
//   ELEM_KIND  0 integer, 1 float/double, 2 f16, 3 bf16;
// the operator is an argument (0 sum, 1 prod, 2 max, 3 min, 4 avg).
//
// Arena of each rank: a header of FLAGS_BYTES, then two staging slots of
// `slot_bytes` (calls alternate between them): the first half of a slot
// receives the caller's input, the second half holds a two-shot call's
// reduced chunk. The header holds the flags (u32 flags[MAX_BLOCKS][MAX_RANKS]
// at 0: rank r writes slot [b][r] of every peer's arena when its block b
// reaches a barrier) and, at COUNTERS, this rank's own counters: the last
// barrier value used, the calls so far, and the blocks of the running call
// that finished. The kernel reads and advances the counters itself (the last
// block of a call does), so a call captured in a CUDA graph takes fresh
// values at every replay; flag values only grow, so nothing is ever reset.
//
// Reductions fold the ranks in rank order, rounding after each step like the
// host reference, so every rank gets the same bits.

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;

#define MAX_RANKS 8
#define MAX_BLOCKS 128
#define FLAGS_BYTES 16384
#define THREADS 512
#define COUNTERS 8192

struct PeerArgs {
    u64 arenas[MAX_RANKS];
    u64 input;
    u64 output;
    u64 count;       // elements (bytes for all-gather)
    u64 error;       // device address of a host-mapped u32: 0 while all is well
    u64 timeout_ns;  // how long a barrier waits for a peer
    u64 slot_bytes;
    u32 rank;
    u32 ranks;
    u32 op;          // 0 sum, 1 prod, 2 max, 3 min, 4 avg
    u32 barriers;    // barriers this call uses
    // Filled in by `begin` on the device, from the rank's counters:
    u32 epoch;       // the first barrier's flag value
    u32 parity;      // the staging slot of this call
};

__device__ __forceinline__ u32* counters(const PeerArgs& a) {
    return (u32*)((unsigned char*)a.arenas[a.rank] + COUNTERS);
}

// Every block reads the rank's counters before any block can advance them:
// the last block of the call advances them after every block arrived here.
__device__ __forceinline__ void begin(PeerArgs& a) {
    __shared__ u32 epoch, parity;
    if (threadIdx.x == 0) {
        volatile u32* c = counters(a);
        epoch = c[0] + 1;
        parity = c[1] & 1;
    }
    __syncthreads();
    a.epoch = epoch;
    a.parity = parity;
}

__device__ __forceinline__ void end(const PeerArgs& a) {
    __syncthreads();
    if (threadIdx.x == 0) {
        u32* c = counters(a);
        __threadfence();
        if (atomicAdd(&c[2], 1u) == gridDim.x - 1) {
            c[2] = 0;
            c[0] += a.barriers;
            c[1] += 1;
            __threadfence();
        }
    }
}

__device__ __forceinline__ void store_release(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ u32 load_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ u64 now_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Block-level barrier of all ranks: thread t < ranks tells rank t that this
// block arrived, then waits until rank t's same block arrived. Gives up after
// the timeout (writing 1 + the missing rank into *error) or when the host
// wrote *error (another member failed); returns whether every rank arrived.
__device__ bool meet(const PeerArgs& a, u32 value) {
    __shared__ int gave_up;
    if (threadIdx.x == 0) gave_up = 0;
    __syncthreads();
    if (threadIdx.x < a.ranks) {
        u32 peer = threadIdx.x;
        // The block's writes (ordered before this thread by the barrier)
        // become visible to the peers before the flag does.
        __threadfence_system();
        u32* theirs = (u32*)a.arenas[peer] + blockIdx.x * MAX_RANKS + a.rank;
        store_release(theirs, value);
        const u32* mine = (const u32*)a.arenas[a.rank] + blockIdx.x * MAX_RANKS + peer;
        volatile u32* error = (volatile u32*)a.error;
        u64 start = now_ns();
        u32 spins = 0;
        while ((int)(load_acquire(mine) - value) < 0) {
            if ((++spins & 1023) == 0) {
                if (*error != 0) {
                    gave_up = 1;
                    break;
                }
                if (now_ns() - start > a.timeout_ns) {
                    atomicCAS((u32*)a.error, 0u, peer + 1);
                    gave_up = 1;
                    break;
                }
            }
        }
    }
    __syncthreads();
    return gave_up == 0;
}

// ---- element arithmetic, matching the host reference step for step ----

#if ELEM_KIND == 2
__device__ __forceinline__ float to_f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 from_f(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#elif ELEM_KIND == 3
__device__ __forceinline__ float to_f(u16 h) { return __uint_as_float(((u32)h) << 16); }
__device__ __forceinline__ u16 from_f(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif

__device__ __forceinline__ ELEM_T combine(ELEM_T a, ELEM_T b, u32 op) {
#if ELEM_KIND == 0
    switch (op) {
    case 1: return (ELEM_T)((ELEM_U)a * (ELEM_U)b);
    case 2: return b > a ? b : a;
    case 3: return b < a ? b : a;
    default: return (ELEM_T)((ELEM_U)a + (ELEM_U)b);
    }
#elif ELEM_KIND == 1
    switch (op) {
    case 1: return a * b;
    case 2: return b > a ? b : a;
    case 3: return b < a ? b : a;
    default: return a + b;
    }
#else
    switch (op) {
    case 1: return from_f(to_f(a) * to_f(b));
    case 2: return to_f(b) > to_f(a) ? b : a;
    case 3: return to_f(b) < to_f(a) ? b : a;
    default: return from_f(to_f(a) + to_f(b));
    }
#endif
}

// The last step: avg divides the sum by the member count.
__device__ __forceinline__ ELEM_T finish(ELEM_T a, u32 ranks, u32 op) {
    if (op != 4) return a;
#if ELEM_KIND == 0 || ELEM_KIND == 1
    return (ELEM_T)(a / (ELEM_T)ranks);
#else
    return from_f(to_f(a) / (float)ranks);
#endif
}

// ---- packs: P elements moved as one load or store ----

template <int BYTES> struct Raw;
template <> struct Raw<16> { typedef uint4 T; };
template <> struct Raw<8> { typedef uint2 T; };
template <> struct Raw<4> { typedef unsigned int T; };
template <> struct Raw<2> { typedef unsigned short T; };
template <> struct Raw<1> { typedef unsigned char T; };

template <typename E, int P> union Pack {
    typename Raw<P * sizeof(E)>::T raw;
    E v[P];
};

// A load that skips L1: peers rewrite the staging slots between calls.
template <typename R> __device__ __forceinline__ R load_cg(const R* p) { return __ldcg(p); }

// Pack i of the caller's input or output. The pack layout (and so which
// block handles which bytes) follows from the size alone, the same on every
// member; a caller's pointer that is not aligned to the pack (any byte
// offset, even one inside an element) is read and written byte by byte
// inside the same pack. The staging arenas are always 16-byte aligned.
template <typename R> __device__ __forceinline__ R load_user(const void* base, u64 i) {
    if (((u64)base & (sizeof(R) - 1)) == 0) return ((const R*)base)[i];
    union {
        R r;
        unsigned char b[sizeof(R)];
    } u;
    const unsigned char* p = (const unsigned char*)base + i * sizeof(R);
#pragma unroll
    for (int k = 0; k < (int)sizeof(R); k++) u.b[k] = p[k];
    return u.r;
}

template <typename R> __device__ __forceinline__ void store_user(void* base, u64 i, R v) {
    if (((u64)base & (sizeof(R) - 1)) == 0) {
        ((R*)base)[i] = v;
        return;
    }
    union {
        R r;
        unsigned char b[sizeof(R)];
    } u;
    u.r = v;
    unsigned char* p = (unsigned char*)base + i * sizeof(R);
#pragma unroll
    for (int k = 0; k < (int)sizeof(R); k++) p[k] = u.b[k];
}

__device__ __forceinline__ unsigned char* staging(const PeerArgs& a, u32 r) {
    return (unsigned char*)a.arenas[r] + FLAGS_BYTES + (u64)a.parity * a.slot_bytes;
}

__device__ __forceinline__ unsigned char* reduced(const PeerArgs& a, u32 r) {
    return staging(a, r) + a.slot_bytes / 2;
}

// Every peer's pack i, folded in rank order.
template <int P> __device__ __forceinline__ Pack<ELEM_T, P> fold(const PeerArgs& a, u64 i) {
    typedef Pack<ELEM_T, P> V;
    typedef typename Raw<P * sizeof(ELEM_T)>::T R;
    V parts[MAX_RANKS];
#pragma unroll
    for (int r = 0; r < MAX_RANKS; r++) {
        if (r < a.ranks) parts[r].raw = load_cg((const R*)staging(a, r) + i);
    }
    V acc = parts[0];
#pragma unroll
    for (int r = 1; r < MAX_RANKS; r++) {
        if (r < a.ranks) {
#pragma unroll
            for (int k = 0; k < P; k++) acc.v[k] = combine(acc.v[k], parts[r].v[k], a.op);
        }
    }
#pragma unroll
    for (int k = 0; k < P; k++) acc.v[k] = finish(acc.v[k], a.ranks, a.op);
    return acc;
}

template <int P> __device__ void one_shot(const PeerArgs& a) {
    typedef typename Raw<P * sizeof(ELEM_T)>::T R;
    u64 packs = a.count / P;
    u64 stride = (u64)gridDim.x * blockDim.x;
    u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    R* mine = (R*)staging(a, a.rank);
    const void* in = (const void*)a.input;
    for (u64 i = first; i < packs; i += stride) mine[i] = load_user<R>(in, i);
    if (!meet(a, a.epoch)) return;
    void* out = (void*)a.output;
    for (u64 i = first; i < packs; i += stride) store_user<R>(out, i, fold<P>(a, i).raw);
}

template <int P> __device__ void two_shot(const PeerArgs& a) {
    typedef typename Raw<P * sizeof(ELEM_T)>::T R;
    u64 packs = a.count / P;
    u64 chunk = (packs + a.ranks - 1) / a.ranks;
    u64 stride = (u64)gridDim.x * blockDim.x;
    u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const void* in = (const void*)a.input;
    void* out = (void*)a.output;
    // Chunk by chunk, so block b copies the same positions of every chunk
    // that it reduces and gathers below (barriers are per block).
    R* mine = (R*)staging(a, a.rank);
    for (u32 c = 0; c < a.ranks; c++) {
        u64 lo = c * chunk, hi = min(packs, lo + chunk);
        for (u64 i = lo + first; i < hi; i += stride) mine[i] = load_user<R>(in, i);
    }
    if (!meet(a, a.epoch)) return;
    {
        u64 lo = a.rank * chunk, hi = min(packs, lo + chunk);
        R* result = (R*)reduced(a, a.rank);
        for (u64 i = lo + first; i < hi; i += stride) result[i] = fold<P>(a, i).raw;
    }
    // The caller's output is written only after the second barrier: a
    // kernel that gives up (or that the host stopped) writes nothing there.
    if (!meet(a, a.epoch + 1)) return;
    for (u32 c = 0; c < a.ranks; c++) {
        u64 lo = c * chunk, hi = min(packs, lo + chunk);
        const R* theirs = (const R*)reduced(a, c);
        for (u64 i = lo + first; i < hi; i += stride) store_user<R>(out, i, load_cg(theirs + i));
    }
}

// All-gather of `count` bytes per rank, P bytes at a time. The caller's
// output (its own block included) is written only after the barrier.
template <int P> __device__ void gather(const PeerArgs& a) {
    typedef typename Raw<P>::T R;
    u64 packs = a.count / P;
    u64 stride = (u64)gridDim.x * blockDim.x;
    u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const void* in = (const void*)a.input;
    R* mine = (R*)staging(a, a.rank);
    unsigned char* out = (unsigned char*)a.output;
    for (u64 i = first; i < packs; i += stride) mine[i] = load_user<R>(in, i);
    if (!meet(a, a.epoch)) return;
    for (u32 c = 0; c < a.ranks; c++) {
        const R* theirs = (const R*)staging(a, c);
        void* block = out + c * a.count;
        for (u64 i = first; i < packs; i += stride) store_user<R>(block, i, load_cg(theirs + i));
    }
}

#define WIDE (16 / sizeof(ELEM_T))

#define KERNEL(name, body) \
    extern "C" __global__ void __launch_bounds__(THREADS) name(PeerArgs a) { begin(a); body; end(a); }

KERNEL(cohort_peer_one_shot_wide, one_shot<WIDE>(a))
KERNEL(cohort_peer_one_shot_narrow, one_shot<1>(a))
KERNEL(cohort_peer_two_shot_wide, two_shot<WIDE>(a))
KERNEL(cohort_peer_two_shot_narrow, two_shot<1>(a))
KERNEL(cohort_peer_gather_wide, gather<16>(a))
KERNEL(cohort_peer_gather_narrow, gather<1>(a))
