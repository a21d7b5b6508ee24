// One batch of up to MAX_REGIONS copies between device ranges, passed by
// value as the kernel's argument. blockIdx.y picks the region; the blocks
// along x stride over its bytes, 16 at a time where both ends and the
// size allow, else 4, else 1.

#define MAX_REGIONS 128

struct CopyTable {
    unsigned long long src[MAX_REGIONS];
    unsigned long long dst[MAX_REGIONS];
    unsigned long long bytes[MAX_REGIONS];
    unsigned int count;
};

extern "C" __global__ void cohort_copy_regions(const CopyTable table) {
    const unsigned int r = blockIdx.y;
    if (r >= table.count) {
        return;
    }
    const unsigned long long s = table.src[r];
    const unsigned long long d = table.dst[r];
    const unsigned long long n = table.bytes[r];
    const unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long done = 0;
    if (((s | d) & 15) == 0) {
        const uint4* from = (const uint4*)s;
        uint4* to = (uint4*)d;
        const unsigned long long words = n / 16;
        for (unsigned long long i = first; i < words; i += stride) {
            to[i] = from[i];
        }
        done = words * 16;
    } else if (((s | d) & 3) == 0) {
        const unsigned int* from = (const unsigned int*)s;
        unsigned int* to = (unsigned int*)d;
        const unsigned long long words = n / 4;
        for (unsigned long long i = first; i < words; i += stride) {
            to[i] = from[i];
        }
        done = words * 4;
    }
    const unsigned char* from = (const unsigned char*)s;
    unsigned char* to = (unsigned char*)d;
    for (unsigned long long i = done + first; i < n; i += stride) {
        to[i] = from[i];
    }
}
