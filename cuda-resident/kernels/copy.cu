// Scatter and gather for fused copies: one launch moves many small copies.
//
// A descriptor is (src, dst, len) with absolute (unified) addresses. For an upload, src lies
// in staging (the packed bytes: in device staging after one DMA, or in pinned host memory,
// read over the bus) and dst in a resident buffer: a scatter. For a readback it is the other
// way round: a gather into device staging or straight into pinned host memory. Peer batches
// read another GPU's memory. One kernel serves them all.
//
// One warp per descriptor (grid-stride over descriptors). The host splits long copies into
// descriptors of a few KiB so that every launch has enough warps in flight. Each warp copies
// byte-wise until dst is 16-byte aligned, then with 16-byte (or 4-byte) accesses when src is
// aligned alike, then the tail byte-wise: correct for any length and alignment.
//
// Regenerate the committed PTX with kernels/build-ptx.sh (needs nvcc).

typedef unsigned long long u64;

struct CopyDescriptor {
    u64 src;
    u64 dst;
    u64 len;
};

static __device__ __forceinline__ void warp_copy(unsigned char* dst, const unsigned char* src, u64 len,
                                                 unsigned lane) {
    u64 head = (16 - ((u64)dst & 15)) & 15;
    if (head > len) head = len;
    if (lane < head) dst[lane] = src[lane];
    dst += head;
    src += head;
    len -= head;

    u64 body = 0;
    if (((u64)src & 15) == 0) {
        const u64 n = len >> 4;
        const uint4* s = (const uint4*)src;
        uint4* d = (uint4*)dst;
        u64 i = lane;
        for (; i + 96 < n; i += 128) {
            const uint4 a = s[i], b = s[i + 32], c = s[i + 64], e = s[i + 96];
            d[i] = a;
            d[i + 32] = b;
            d[i + 64] = c;
            d[i + 96] = e;
        }
        for (; i < n; i += 32) d[i] = s[i];
        body = n << 4;
    } else if (((u64)src & 3) == 0) {
        const u64 n = len >> 2;
        const unsigned* s = (const unsigned*)src;
        unsigned* d = (unsigned*)dst;
        u64 i = lane;
        for (; i + 96 < n; i += 128) {
            const unsigned a = s[i], b = s[i + 32], c = s[i + 64], e = s[i + 96];
            d[i] = a;
            d[i + 32] = b;
            d[i + 64] = c;
            d[i + 96] = e;
        }
        for (; i < n; i += 32) d[i] = s[i];
        body = n << 2;
    }
    for (u64 j = body + lane; j < len; j += 32) dst[j] = src[j];
}

extern "C" __global__ void __launch_bounds__(256) copy_descriptors(const CopyDescriptor* __restrict__ descriptors,
                                                                   u64 count) {
    const unsigned lane = threadIdx.x & 31;
    const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    for (u64 w = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; w < count; w += warps) {
        const CopyDescriptor d = descriptors[w];
        warp_copy((unsigned char*)d.dst, (const unsigned char*)d.src, d.len, lane);
    }
}
