// Writes made in place (`write_with`): how fast 8192 copies, written by one thread into pinned
// leases just before, reach their places in device memory, by each way the library could move
// them. Mirrors xfer-bench's "write_with, move only" row: 8192 writes spread over 64 buffers
// with gaps, 16-byte aligned in leases of 16 MiB. The clock runs from the first enqueue to the
// streams' end (the writes are made before it starts), median of 15 after two warm-ups.
//
//   nvcc -O2 -o in-place benches/cuda/in-place.cu && ./in-place
#include <cstring>

#include "../../cuda-resident/kernels/copy.cu"
#include "harness.h"

// The copy kernel with its descriptors fetched ahead: lane j of a warp loads the warp's j-th
// next descriptor, so a warp waits for one round trip per 32 descriptors instead of one per
// descriptor (which matters when the table is read over the bus).
extern "C" __global__ void __launch_bounds__(256) copy_prefetch(const CopyDescriptor* __restrict__ descriptors,
                                                                u64 count) {
    const unsigned lane = threadIdx.x & 31;
    const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    for (u64 base = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; base < count; base += 32 * warps) {
        const u64 mine = base + lane * warps;
        CopyDescriptor c{0, 0, 0};
        if (mine < count) c = descriptors[mine];
        for (unsigned j = 0; j < 32 && base + j * warps < count; j++) {
            const u64 src = __shfl_sync(0xffffffffu, c.src, j), dst = __shfl_sync(0xffffffffu, c.dst, j),
                      len = __shfl_sync(0xffffffffu, c.len, j);
            warp_copy((unsigned char*)dst, (const unsigned char*)src, len, lane);
        }
    }
}

int main() {
    const int N = 8192;
    const size_t LEASE = 16 << 20;
    make_streams();
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaEvent_t ev[64];  // 0..39 after DMAs, 40 and 41 after a lease's scatters
    for (auto& x : ev) CK(cudaEventCreateWithFlags(&x, cudaEventDisableTiming));
    char name[160];

    for (size_t size : {(size_t)4096, (size_t)1024, (size_t)256}) {
        const size_t bytes = N * size;
        const int per_lease = (int)(LEASE / size);
        const int leases = (N + per_lease - 1) / per_lease;
        std::vector<unsigned char*> src(N);
        for (int i = 0; i < N; i++) {
            src[i] = (unsigned char*)malloc(size);
            for (size_t j = 0; j < size; j++) src[i][j] = (unsigned char)(rand());
        }
        std::vector<unsigned char*> lease(leases);
        for (auto& l : lease) CK(cudaHostAlloc((void**)&l, LEASE, cudaHostAllocPortable | cudaHostAllocMapped));
        // 64 buffers with a 64-byte gap between copies, as xfer-bench's Scatter.
        const size_t stride = size + 64, per_buf = (N + 63) / 64;
        unsigned char* dst;
        CK(cudaMalloc(&dst, 64 * per_buf * stride + 4096));
        auto dst_of = [&](int i) { return dst + (size_t)(i % 64) * per_buf * stride + (size_t)(i / 64) * stride; };
        unsigned char* staging;
        CK(cudaMalloc(&staging, 2 * (LEASE + (1 << 20))));
        // Tables: for the kernel over the bus (src in pinned leases) and for the scatter (src in
        // device staging), in pinned memory, one per lease; the kernel reads them there or after a DMA into device staging.
        std::vector<CopyDescriptor*> bus(leases), scat(leases);
        for (int l = 0; l < leases; l++) {
            CK(cudaHostAlloc((void**)&bus[l], per_lease * sizeof(CopyDescriptor), cudaHostAllocMapped));
            CK(cudaHostAlloc((void**)&scat[l], per_lease * sizeof(CopyDescriptor), cudaHostAllocMapped));
        }
        auto count_of = [&](int l) { return std::min(per_lease, N - l * per_lease); };
        auto fill = [&] {
            for (int i = 0; i < N; i++) memcpy(lease[i / per_lease] + (size_t)(i % per_lease) * size, src[i], size);
        };
        // Descriptor tables, built on the host (as write_with could, write by write).
        auto build = [&](int l, CopyDescriptor* t, bool over_bus, unsigned char* region) {
            for (int k = 0; k < count_of(l); k++) {
                int i = l * per_lease + k;
                u64 s = over_bus ? (u64)(lease[l] + (size_t)k * size) : (u64)(region + (size_t)k * size);
                t[k] = CopyDescriptor{s, (u64)dst_of(i), size};
            }
        };
        auto check = [&](const char* what) {
            std::vector<unsigned char> back(size);
            for (int i = 0; i < N; i += 97) {
                CK(cudaMemcpy(back.data(), dst_of(i), size, cudaMemcpyDeviceToHost));
                if (memcmp(back.data(), src[i], size)) {
                    printf("MISMATCH %s copy %d\n", what, i);
                    exit(1);
                }
            }
        };
        auto poison = [&] { CK(cudaMemset(dst, 0xA5, 64 * per_buf * stride)); CK(cudaDeviceSynchronize()); };

        // Per lease: one DMA into device staging (two regions, alternating), the table built
        // while the bytes are on the wire, then the scatter. `table`: 0 in device staging after
        // a DMA of its own after the bytes, 1 read from pinned memory by the kernel, 2 in device
        // staging after a DMA on the second stream (beside the bytes' DMA). `side`: the scatters on a
        // second stream (lease l+1's DMA overlaps lease l's scatter), `pieces`: DMAs per lease.
        double us;
        auto dma_scatter = [&](bool prefetch, int table, bool side, int pieces) {
            for (int l = 0; l < leases; l++) {
                unsigned char* region = staging + (l & 1) * (LEASE + (1 << 20));
                const int n = count_of(l), per = (n + pieces - 1) / pieces;
                size_t used = (size_t)n * size, tat = (used + 255) / 256 * 256;
                if (side && l >= 2) CK(cudaStreamWaitEvent(st[0], ev[40 + (l & 1)], 0));
                for (int k0 = 0; k0 < n; k0 += per) {
                    const int k1 = std::min(n, k0 + per);
                    CK(cudaMemcpyAsync(region + (size_t)k0 * size, lease[l] + (size_t)k0 * size,
                                       (size_t)(k1 - k0) * size, cudaMemcpyHostToDevice, st[0]));
                    if (k0 == 0) build(l, scat[l], false, region);
                    const CopyDescriptor* t = scat[l] + k0;
                    if (table != 1) t = (const CopyDescriptor*)(region + tat) + k0;
                    if (table == 0) {
                        CK(cudaMemcpyAsync(region + tat + k0 * sizeof(CopyDescriptor), scat[l] + k0,
                                           (k1 - k0) * sizeof(CopyDescriptor), cudaMemcpyHostToDevice, st[0]));
                    }
                    cudaStream_t s = st[0];
                    if (table == 2)  // beside the bytes, on the second stream
                        CK(cudaMemcpyAsync(region + tat + k0 * sizeof(CopyDescriptor), scat[l] + k0,
                                           (k1 - k0) * sizeof(CopyDescriptor), cudaMemcpyHostToDevice, st[1]));
                    if (side) {
                        CK(cudaEventRecord(ev[(l * pieces + k0 / per) % 40], st[0]));
                        CK(cudaStreamWaitEvent(st[1], ev[(l * pieces + k0 / per) % 40], 0));
                        s = st[1];
                    }
                    if (prefetch)
                        copy_prefetch<<<8 * sms, 256, 0, s>>>(t, k1 - k0);
                    else
                        copy_descriptors<<<8 * sms, 256, 0, s>>>(t, k1 - k0);
                }
                if (side) CK(cudaEventRecord(ev[40 + (l & 1)], st[1]));
            }
        };
        struct V { const char* what; bool prefetch; int table; bool side; int pieces; };
        const V vs[] = {
            {"today: table DMA'd, one stream", false, 0, false, 1},
            {"prefetching kernel, table DMA'd, one stream", true, 0, false, 1},
            {"prefetching kernel, table in pinned, one stream", true, 1, false, 1},
            {"prefetching kernel, table in pinned, scatter on a 2nd stream", true, 1, true, 1},
            {"prefetching kernel, table in pinned, 2nd stream, 2 DMAs/lease", true, 1, true, 2},
            {"prefetching kernel, table in pinned, 2nd stream, 4 DMAs/lease", true, 1, true, 4},
            {"kernel, table DMA'd, scatter on a 2nd stream", false, 0, true, 1},
            {"kernel, table DMA'd on the 2nd stream, scatter there", false, 2, true, 1},
            {"kernel, table DMA'd on the 2nd stream, scatter there, 2 DMAs/lease", false, 2, true, 2},
        };
        for (const V& v : vs) {
            poison();
            us = med(fill, [&] { dma_scatter(v.prefetch, v.table, v.side, v.pieces); });
            check(v.what);
            snprintf(name, sizeof name, "%d x %zu B: %s", N, size, v.what);
            row(name, bytes, us);
        }
        // The scatter alone, timed by events: 1 lease, both kernels, table on the device or pinned.
        {
            cudaEvent_t t0, t1;
            CK(cudaEventCreate(&t0));
            CK(cudaEventCreate(&t1));
            const int n = count_of(0);
            size_t tat = ((size_t)n * size + 255) / 256 * 256;
            build(0, scat[0], false, staging);
            CK(cudaMemcpy(staging, lease[0], (size_t)n * size, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(staging + tat, scat[0], n * sizeof(CopyDescriptor), cudaMemcpyHostToDevice));
            for (int which = 0; which < 4; which++) {
                std::vector<float> ms;
                for (int r = 0; r < 9; r++) {
                    const CopyDescriptor* t = which & 1 ? scat[0] : (const CopyDescriptor*)(staging + tat);
                    CK(cudaEventRecord(t0, st[0]));
                    if (which & 2)
                        copy_prefetch<<<8 * sms, 256, 0, st[0]>>>(t, n);
                    else
                        copy_descriptors<<<8 * sms, 256, 0, st[0]>>>(t, n);
                    CK(cudaEventRecord(t1, st[0]));
                    CK(cudaStreamSynchronize(st[0]));
                    float x;
                    CK(cudaEventElapsedTime(&x, t0, t1));
                    ms.push_back(x);
                }
                std::sort(ms.begin(), ms.end());
                printf("    scatter of one lease (%d copies), %s, table %s: %.1f us\n", n,
                       which & 2 ? "prefetching" : "today's kernel", which & 1 ? "pinned" : "on the device",
                       ms[4] * 1e3);
            }
        }
        // Over the bus, tables built before (as write_with could), read from pinned memory.
        for (int l = 0; l < leases; l++) build(l, bus[l], true, nullptr);
        for (int prefetch = 0; prefetch < 2; prefetch++) {
            for (int blocks : {sms, 4 * sms}) {
                poison();
                us = med(fill, [&] {
                    for (int l = 0; l < leases; l++) {
                        if (prefetch)
                            copy_prefetch<<<blocks, 256, 0, st[0]>>>(bus[l], count_of(l));
                        else
                            copy_descriptors<<<blocks, 256, 0, st[0]>>>(bus[l], count_of(l));
                    }
                });
                check("over the bus");
                snprintf(name, sizeof name, "%d x %zu B: over the bus, %s, tables pinned, %d blocks", N, size,
                         prefetch ? "prefetching" : "today's kernel", blocks);
                row(name, bytes, us);
            }
        }
        // Ceiling: the DMAs of the leases' bytes, nothing else.
        us = med(fill, [&] {
            for (int l = 0; l < leases; l++)
                CK(cudaMemcpyAsync(staging + (l & 1) * (LEASE + (1 << 20)), lease[l], (size_t)count_of(l) * size,
                                   cudaMemcpyHostToDevice, st[0]));
        });
        snprintf(name, sizeof name, "%d x %zu B: the DMAs alone (freshly written)", N, size);
        row(name, bytes, us);
        us = med([&] {
            for (int l = 0; l < leases; l++)
                CK(cudaMemcpyAsync(staging + (l & 1) * (LEASE + (1 << 20)), lease[l], (size_t)count_of(l) * size,
                                   cudaMemcpyHostToDevice, st[0]));
        });
        snprintf(name, sizeof name, "%d x %zu B: the DMAs alone (not rewritten)", N, size);
        row(name, bytes, us);
        for (auto p : src) free(p);
        for (auto l : lease) CK(cudaFreeHost(l));
        for (int l = 0; l < leases; l++) {
            CK(cudaFreeHost(bus[l]));
            CK(cudaFreeHost(scat[l]));
        }
        CK(cudaFree(dst));
        CK(cudaFree(staging));
    }
    return 0;
}
