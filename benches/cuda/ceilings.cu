// The link's ceilings for the many-small rows, without cuda-resident: how fast 32 MiB moves
// between pinned memory and the device as one DMA or several (on one stream or two), from
// cached or write-combined pinned memory, and by the project's copy kernel reading or
// writing pinned memory over the bus (8192 copies of 4 KiB and of 256 B, a warp each).
// Times in microseconds, wall clock from the first enqueue to the stream's end, median of 15
// after two warm-ups. BENCHMARKS.md compares them with xfer-bench's rows.
//
//   nvcc -O2 -Xcompiler -fopenmp,-mclwb -o ceilings benches/cuda/ceilings.cu -lgomp
//   ./ceilings
#include <cstring>
#include <omp.h>
#include <immintrin.h>

#include "../../cuda-resident/kernels/copy.cu"
#include "harness.h"

int main() {
    const size_t TOTAL = 32 << 20;
    make_streams();
    unsigned char *pin, *wc, *dev, *dev2;
    CK(cudaHostAlloc((void**)&pin, TOTAL, cudaHostAllocPortable | cudaHostAllocMapped));
    CK(cudaHostAlloc((void**)&wc, TOTAL, cudaHostAllocPortable | cudaHostAllocMapped | cudaHostAllocWriteCombined));
    CK(cudaMalloc(&dev, TOTAL * 2));
    CK(cudaMalloc(&dev2, TOTAL * 2));
    for (size_t i = 0; i < TOTAL; i++) pin[i] = wc[i] = (unsigned char)(i * 7 + 3);
    char name[128];

    // DMAs of 32 MiB in `n` pieces, on one stream or alternating over two.
    for (int dir = 0; dir < 2; dir++) {
        for (int mem = 0; mem < 2; mem++) {
            unsigned char* host = mem ? wc : pin;
            for (int n : {1, 2, 4, 8}) {
                for (int streams : {1, 2}) {
                    if (n == 1 && streams == 2) continue;
                    size_t per = TOTAL / n;
                    double us = med([&] {
                        for (int k = 0; k < n; k++) {
                            cudaStream_t s = st[k % streams];
                            if (dir == 0)
                                CK(cudaMemcpyAsync(dev + k * per, host + k * per, per, cudaMemcpyHostToDevice, s));
                            else
                                CK(cudaMemcpyAsync(host + k * per, dev + k * per, per, cudaMemcpyDeviceToHost, s));
                        }
                    });
                    snprintf(name, sizeof name, "%s 32 MiB %s, %d DMA(s), %d stream(s)", dir ? "D2H" : "H2D",
                             mem ? "write-combined" : "pinned", n, streams);
                    row(name, TOTAL, us);
                }
            }
        }
    }

    // The copy kernel over the bus: 8192 copies of `size` bytes, apart (a 64-byte gap).
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int N = 8192;
    CopyDescriptor *table, *table_dev;
    CK(cudaHostAlloc((void**)&table, N * sizeof(CopyDescriptor), cudaHostAllocPortable | cudaHostAllocMapped));
    CK(cudaMalloc(&table_dev, N * sizeof(CopyDescriptor)));
    for (size_t size : {(size_t)4096, (size_t)256}) {
        size_t bytes = N * size;
        for (int dir = 0; dir < 2; dir++) {
            for (int mem = 0; mem < 2; mem++) {
                unsigned char* host = mem ? wc : pin;
                for (int i = 0; i < N; i++) {
                    u64 h = (u64)(host + i * size), d = (u64)(dev + i * (size + 64));
                    table[i] = dir == 0 ? CopyDescriptor{h, d, size} : CopyDescriptor{d, h, size};
                }
                for (int blocks : {sms, 2 * sms, 4 * sms, 8 * sms}) {
                    double us = med([&] { copy_descriptors<<<blocks, 256, 0, st[0]>>>(table, N); });
                    CK(cudaGetLastError());
                    snprintf(name, sizeof name, "%s %d x %zu B kernel over the bus, %s, %d blocks",
                             dir ? "D2H" : "H2D", N, size, mem ? "wc" : "pinned", blocks);
                    row(name, bytes, us);
                }
            }
        }
        // Over the bus with the table in device memory (uploaded once, as a prepared set could).
        for (int dir = 0; dir < 2; dir++) {
            for (int i = 0; i < N; i++) {
                u64 h = (u64)(pin + i * size), d = (u64)(dev + i * (size + 64));
                table[i] = dir == 0 ? CopyDescriptor{h, d, size} : CopyDescriptor{d, h, size};
            }
            CK(cudaMemcpy(table_dev, table, N * sizeof(CopyDescriptor), cudaMemcpyHostToDevice));
            for (int blocks : {sms, 4 * sms}) {
                double us = med([&] { copy_descriptors<<<blocks, 256, 0, st[0]>>>(table_dev, N); });
                snprintf(name, sizeof name, "%s %d x %zu B over the bus, table on the device, %d blocks",
                         dir ? "D2H" : "H2D", N, size, blocks);
                row(name, bytes, us);
            }
        }
        // Through device staging: one DMA of the packed bytes (and table), one launch.
        for (int i = 0; i < N; i++) table[i] = CopyDescriptor{(u64)(dev2 + i * size), (u64)(dev + i * (size + 64)), size};
        double us = med([&] {
            CK(cudaMemcpyAsync(table_dev, table, N * sizeof(CopyDescriptor), cudaMemcpyHostToDevice, st[0]));
            CK(cudaMemcpyAsync(dev2, pin, bytes, cudaMemcpyHostToDevice, st[0]));
            copy_descriptors<<<8 * sms, 256, 0, st[0]>>>(table_dev, N);
        });
        snprintf(name, sizeof name, "H2D %d x %zu B, DMA then scatter", N, size);
        row(name, bytes, us);
        us = med([&] { copy_descriptors<<<8 * sms, 256, 0, st[0]>>>(table_dev, N); });
        snprintf(name, sizeof name, "    %d x %zu B, the scatter alone (device to device)", N, size);
        row(name, bytes, us);
    }

    // Packing 8192 x 4 KiB from malloc'd sources into cached and write-combined pinned memory.
    std::vector<unsigned char*> src(N);
    for (int i = 0; i < N; i++) {
        src[i] = (unsigned char*)malloc(4096);
        memset(src[i], i & 255, 4096);
    }
    for (int mem = 0; mem < 2; mem++) {
        unsigned char* host = mem ? wc : pin;
        double us = med([&] {
#pragma omp parallel for schedule(static) num_threads(16)
            for (int i = 0; i < N; i++) memcpy(host + i * 4096, src[i], 4096);
        });
        snprintf(name, sizeof name, "pack 8192 x 4 KiB into %s, 16 threads", mem ? "write-combined" : "pinned");
        row(name, TOTAL, us);
        us = med([&] {
#pragma omp parallel for schedule(static) num_threads(16)
            for (int i = 0; i < N; i++) memcpy(host + i * 4096, src[i], 4096);
            CK(cudaMemcpyAsync(dev, host, TOTAL, cudaMemcpyHostToDevice, st[0]));
        });
        snprintf(name, sizeof name, "pack then one DMA, %s", mem ? "write-combined" : "pinned");
        row(name, TOTAL, us);
    }
    // Freshly written staging: moved by a DMA or read by the kernel over the bus, after
    // ordinary stores, after ordinary stores and a write-back of every line (clwb, in
    // parallel), and after streaming stores.
    for (int i = 0; i < N; i++) table[i] = CopyDescriptor{(u64)(pin + i * 4096), (u64)(dev + i * 4160), 4096};
    auto pack = [&](int how) {
#pragma omp parallel for schedule(static) num_threads(16)
        for (int i = 0; i < N; i++) {
            unsigned char* d = pin + i * 4096;
            if (how == 2) {
                for (int j = 0; j < 4096; j += 16)
                    _mm_stream_si128((__m128i*)(d + j), _mm_loadu_si128((const __m128i*)(src[i] + j)));
                _mm_sfence();
            } else {
                memcpy(d, src[i], 4096);
                if (how == 1) {
                    for (int j = 0; j < 4096; j += 64) _mm_clwb(d + j);
                    _mm_sfence();
                }
            }
        }
    };
    const char* hows[] = {"ordinary stores", "ordinary stores + clwb", "streaming stores"};
    for (int how = 0; how < 3; how++) {
        double p = med([&] { pack(how); });
        double dma = med([&] {
            pack(how);
            CK(cudaMemcpyAsync(dev2, pin, TOTAL, cudaMemcpyHostToDevice, st[0]));
        });
        double bus = med([&] {
            pack(how);
            copy_descriptors<<<sms, 256, 0, st[0]>>>(table, N);
        });
        snprintf(name, sizeof name, "pack 8192 x 4 KiB, %s", hows[how]);
        row(name, TOTAL, p);
        snprintf(name, sizeof name, "    then one DMA (DMA alone: pack+DMA - pack)");
        row(name, TOTAL, dma - p);
        snprintf(name, sizeof name, "    then the kernel over the bus (alone)");
        row(name, TOTAL, bus - p);
    }
    return 0;
}
