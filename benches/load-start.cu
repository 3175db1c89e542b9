// How the first chunks of a load move after the GPU has idled, without the engine: a cached
// file (touched beforehand: no page faults) moves to the GPU through a ring of RING pinned
// chunks, each packed by T threads (OpenMP) in 256 KiB pieces and moved by one
// cudaMemcpyAsync, as in load-design.cu. Before each timed load the GPU idles IDLE_MS, then
// one of these runs untimed right before the load:
//   none       nothing;
//   h2d-4k     one 4 KiB pinned upload, synchronized;
//   kernel     a 256 MiB memset on the device, synchronized;
//   h2d-64m    a 64 MiB pinned upload, synchronized;
//   busy       no idle at all: a 256 MiB memset right before, as load-design.cu does;
//   wake-4k    a 4 KiB pinned upload enqueued as the load starts (timed, not waited for):
//              what a load could do while it maps and allocates;
//   fresh-dev  as busy, but the destination is freed and allocated again right before the
//              load, as a load's buffers are when the last checkpoint was just dropped; with
//              KEEP_OLD=1 in the environment the old destination is kept (not freed), so the
//              new one is memory this process did not just give back.
// Every chunk's DMA is timed by events, its packing by the host clock. Printed per variant:
// the load's GB/s, and for chunks 0..SHOW-1 and the median later chunk: packing ms, DMA ms
// (GB/s), and the gap the link waited before the chunk (DMA start after the previous end).
// Variants take turns, REPS rounds; medians. Every byte of the first round is checked.
//   nvcc -O2 -Xcompiler -fopenmp -o /tmp/load-start benches/load-start.cu
//   /tmp/load-start FILE GIB [IDLE_MS=300] [REPS=5] [THREADS=16] [CHUNK_MIB=16] [RING=4] [SHOW=12]
#include "probe-file.h"
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static double median(double *v, int n) { qsort(v, n, sizeof(double), cmp); return v[n / 2]; }

enum { NONE, H2D_4K, KERNEL, H2D_64M, BUSY, WAKE_4K, FRESH_DEV, VARIANTS };
static const char *names[] = {"none", "h2d-4k", "kernel", "h2d-64m", "busy", "wake-4k", "fresh-dev"};
static const size_t PIECE = 256 << 10;
#define MAXREPS 16

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: %s FILE GIB [IDLE_MS] [REPS] [THREADS] [CHUNK_MIB] [RING] [SHOW]\n", argv[0]); return 2; }
    const char *path = argv[1];
    size_t size = (size_t)(atof(argv[2]) * (1ul << 30));
    int idle_ms = argc > 3 ? atoi(argv[3]) : 300;
    int reps = argc > 4 ? atoi(argv[4]) : 5;
    int threads = argc > 5 ? atoi(argv[5]) : 16;
    size_t chunk = (size_t)(argc > 6 ? atoi(argv[6]) : 16) << 20;
    int ring = argc > 7 ? atoi(argv[7]) : 4;
    int show = argc > 8 ? atoi(argv[8]) : 12;
    if (reps < 1 || reps > MAXREPS || ring < 1 || ring > 64) { fprintf(stderr, "1 <= REPS <= 16, 1 <= RING <= 64\n"); return 2; }
    char *map;
    probe_file(path, size, &map);
    const int keep_old = getenv("KEEP_OLD") != 0;
    size_t chunks = (size + chunk - 1) / chunk;
    if (show > (int)chunks) show = (int)chunks;
    char *dev, *scratch, *ring_buf[64], *back, *warm;
    CK(cudaMalloc(&dev, size));
    CK(cudaMalloc(&scratch, 256 << 20));
    for (int r = 0; r < ring; r++) CK(cudaHostAlloc((void **)&ring_buf[r], chunk, cudaHostAllocPortable));
    CK(cudaMallocHost((void **)&back, size));
    CK(cudaMallocHost((void **)&warm, 64 << 20));
    memset(warm, 0x33, 64 << 20);
    cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaEvent_t *start = (cudaEvent_t *)malloc(chunks * sizeof(cudaEvent_t)), *end = (cudaEvent_t *)malloc(chunks * sizeof(cudaEvent_t));
    for (size_t k = 0; k < chunks; k++) { CK(cudaEventCreate(&start[k])); CK(cudaEventCreate(&end[k])); }
    omp_set_num_threads(threads);
    printf("file %s, %.2f GiB, %d threads, chunk %zu MiB, ring %d, idle %d ms, %d rounds\n", path, size / 1073741824.0, threads, chunk >> 20, ring, idle_ms, reps);
    // [variant][rep]: the load's seconds; [variant][chunk][rep]: pack ms, dma ms, gap ms.
    static double total[VARIANTS][MAXREPS];
    double *pack = (double *)calloc(VARIANTS * chunks * MAXREPS, sizeof(double));
    double *dma = (double *)calloc(VARIANTS * chunks * MAXREPS, sizeof(double));
    double *gap = (double *)calloc(VARIANTS * chunks * MAXREPS, sizeof(double));
#define AT(a, v, k, r) a[((size_t)(v) * chunks + (k)) * MAXREPS + (r)]
    for (int rep = 0; rep < reps; rep++)
        for (int v = 0; v < VARIANTS; v++) {
            CK(cudaMemsetAsync(dev, 0x5a, size, s)); CK(cudaStreamSynchronize(s));
            if (v == FRESH_DEV) { if (!keep_old) CK(cudaFree(dev)); CK(cudaMalloc(&dev, size)); }
            if (v != BUSY && v != FRESH_DEV && idle_ms) usleep(idle_ms * 1000);
            if (v == H2D_4K) CK(cudaMemcpyAsync(scratch, warm, 4096, cudaMemcpyHostToDevice, s));
            if (v == KERNEL || v == BUSY || v == FRESH_DEV) CK(cudaMemsetAsync(scratch, 0x11, 256 << 20, s));
            if (v == H2D_64M) CK(cudaMemcpyAsync(scratch, warm, 64 << 20, cudaMemcpyHostToDevice, s));
            CK(cudaStreamSynchronize(s));
            double t0 = now();
            if (v == WAKE_4K) CK(cudaMemcpyAsync(scratch, warm, 4096, cudaMemcpyHostToDevice, s));
            for (size_t k = 0; k < chunks; k++) {
                int slot = (int)(k % ring);
                if (k >= (size_t)ring) CK(cudaEventSynchronize(end[k - ring]));
                size_t off = k * chunk, n = size - off < chunk ? size - off : chunk;
                long pieces = (long)((n + PIECE - 1) / PIECE);
                char *dst = ring_buf[slot];
                double p0 = now();
#pragma omp parallel for schedule(dynamic, 1)
                for (long p = 0; p < pieces; p++) {
                    size_t o = p * PIECE, len = n - o < PIECE ? n - o : PIECE;
                    memcpy(dst + o, map + off + o, len);
                }
                AT(pack, v, k, rep) = (now() - p0) * 1e3;
                CK(cudaEventRecord(start[k], s));
                CK(cudaMemcpyAsync(dev + off, dst, n, cudaMemcpyHostToDevice, s));
                CK(cudaEventRecord(end[k], s));
            }
            CK(cudaStreamSynchronize(s));
            total[v][rep] = now() - t0;
            for (size_t k = 0; k < chunks; k++) {
                float ms;
                CK(cudaEventElapsedTime(&ms, start[k], end[k]));
                AT(dma, v, k, rep) = ms;
                if (k > 0) { CK(cudaEventElapsedTime(&ms, end[k - 1], start[k])); AT(gap, v, k, rep) = ms; }
            }
            if (rep == 0) {
                CK(cudaMemcpy(back, dev, size, cudaMemcpyDeviceToHost));
                if (memcmp(back, map, size) != 0) { printf("%s: bytes differ\n", names[v]); return 1; }
            }
        }
    for (int v = 0; v < VARIANTS; v++) {
        double t[MAXREPS];
        memcpy(t, total[v], sizeof(double) * reps);
        printf("%-8s load %6.2f GB/s (median of %d)\n", names[v], size / median(t, reps) / 1e9, reps);
        double sum_dma = 0, sum_gap = 0, later_dma[4096], later_pack[4096];
        int later = 0;
        for (size_t k = 0; k < chunks; k++) {
            double p[MAXREPS], d[MAXREPS], g[MAXREPS];
            for (int r = 0; r < reps; r++) { p[r] = AT(pack, v, k, r); d[r] = AT(dma, v, k, r); g[r] = AT(gap, v, k, r); }
            double pm = median(p, reps), dm = median(d, reps), gm = median(g, reps);
            sum_dma += dm; sum_gap += gm;
            if ((int)k < show)
                printf("  chunk %3zu: pack %.3f ms, dma %.3f ms (%5.2f GB/s), link idle before %.3f ms\n", k, pm, dm, chunk / dm / 1e6, gm);
            else if (later < 4096) { later_dma[later] = dm; later_pack[later++] = pm; }
        }
        if (later) {
            double dm = median(later_dma, later), pm = median(later_pack, later);
            printf("  later %d chunks, median: pack %.3f ms, dma %.3f ms (%5.2f GB/s)\n", later, pm, dm, chunk / dm / 1e6);
        }
        printf("  sum of medians: dma %.2f ms, link idle %.2f ms\n", sum_dma, sum_gap);
    }
    return 0;
}
