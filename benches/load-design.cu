// Designs of a checkpoint load on this machine, without the engine: a cached file moves to
// the GPU through a ring of pinned chunks, each packed by T threads (OpenMP, the calling
// thread among them) in 256 KiB pieces and moved by one cudaMemcpyAsync, as the engine's
// planned route does. What differs is where the packers read the file from:
//   mmap-fresh     a mapping made for the load (the packers take its page faults; munmap
//                  timed), as `Device::load_safetensors` did up to this probe;
//   mmap-touched   a mapping whose pages were all touched before timing: no faults (the
//                  pageable-Vec case of a 1 GiB upload);
//   mmap-populate  a fresh mapping, a helper thread populating it (MADV_POPULATE_READ)
//                  ahead of the packers;
//   pread          pread(2) from the page cache straight into the pinned chunk.
// Each with the DMA (GB/s of the load) and without it (the packers' rate alone). Methods
// take turns, REPS rounds; medians. Every byte of the first round is checked.
//   nvcc -O2 -Xcompiler -fopenmp -o /tmp/load-design benches/load-design.cu
//   /tmp/load-design FILE GIB [THREADS=16] [CHUNK_MIB=16] [REPS=5] [RING=4] [IDLE_MS=0] [POOL=RING]
// RING chunks may be in flight: with a larger ring the packers run ahead of the link. The
// GPU idles IDLE_MS before each timed load. Chunks take POOL pinned buffers in turn (at
// least RING): with more, each buffer is colder when it is reused.
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "probe-file.h"
#include <omp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

enum { FRESH, TOUCHED, POPULATE, PREAD, METHODS };
static const char *names[] = {"mmap-fresh", "mmap-touched", "mmap-populate", "pread"};
static const size_t PIECE = 256 << 10;

typedef struct { char *map; size_t size, step; volatile int stop; } ahead;
static void *populate(void *p) {
    ahead *a = (ahead *)p;
    for (size_t o = 0; o < a->size && !a->stop; o += a->step) {
        size_t n = a->size - o < a->step ? a->size - o : a->step;
        madvise(a->map + o, n, MADV_POPULATE_READ);
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: %s FILE GIB [THREADS] [CHUNK_MIB] [REPS]\n", argv[0]); return 2; }
    const char *path = argv[1];
    size_t size = (size_t)(atof(argv[2]) * (1ul << 30));
    int threads = argc > 3 ? atoi(argv[3]) : 16;
    size_t chunk = (size_t)(argc > 4 ? atoi(argv[4]) : 16) << 20;
    int reps = argc > 5 ? atoi(argv[5]) : 5;
    int ring = argc > 6 ? atoi(argv[6]) : 4;
    int idle_ms = argc > 7 ? atoi(argv[7]) : 0;
    int pool = argc > 8 ? atoi(argv[8]) : ring;
    if (ring < 1 || pool < ring || pool > 256) { fprintf(stderr, "1 <= RING <= POOL <= 256\n"); return 2; }
    char *touched;
    int fd = probe_file(path, size, &touched);
    char *dev, *ring_buf[256], *back;
    CK(cudaMalloc(&dev, size));
    for (int r = 0; r < pool; r++) CK(cudaHostAlloc((void **)&ring_buf[r], chunk, cudaHostAllocPortable));
    CK(cudaMallocHost((void **)&back, size));
    cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaEvent_t ev[256]; for (int r = 0; r < pool; r++) CK(cudaEventCreateWithFlags(&ev[r], cudaEventDisableTiming));
    omp_set_num_threads(threads);
    printf("file %s, %.2f GiB, %d threads, chunk %zu MiB, ring %d, pool %d, idle %d ms, %d rounds\n", path, size / 1073741824.0, threads, chunk >> 20, ring, pool, idle_ms, reps);
    double t[2][METHODS][64];
    for (int rep = 0; rep < reps; rep++)
        for (int dma = 1; dma >= 0; dma--)
            for (int m = 0; m < METHODS; m++) {
                CK(cudaMemsetAsync(dev, 0x5a, size, s)); CK(cudaStreamSynchronize(s));
                if (idle_ms) usleep(idle_ms * 1000);
                double t0 = now();
                char *map = touched;
                ahead a = {0, size, chunk, 0};
                pthread_t helper;
                if (m == FRESH || m == POPULATE) {
                    map = (char *)mmap(0, size, PROT_READ, MAP_SHARED, fd, 0);
                    madvise(map, size, MADV_SEQUENTIAL);
                }
                if (m == POPULATE) { a.map = map; pthread_create(&helper, 0, populate, &a); }
                size_t chunks = (size + chunk - 1) / chunk;
                for (size_t k = 0; k < chunks; k++) {
                    int slot = (int)(k % pool);
                    if (k >= (size_t)ring) CK(cudaEventSynchronize(ev[(k - ring) % pool]));
                    size_t off = k * chunk, n = size - off < chunk ? size - off : chunk;
                    long pieces = (long)((n + PIECE - 1) / PIECE);
                    char *dst = ring_buf[slot];
#pragma omp parallel for schedule(dynamic, 1)
                    for (long p = 0; p < pieces; p++) {
                        size_t o = p * PIECE, len = n - o < PIECE ? n - o : PIECE;
                        if (m == PREAD) {
                            if (pread(fd, dst + o, len, off + o) != (ssize_t)len) perror("pread");
                        } else {
                            memcpy(dst + o, map + off + o, len);
                        }
                    }
                    if (dma) {
                        CK(cudaMemcpyAsync(dev + off, dst, n, cudaMemcpyHostToDevice, s));
                        CK(cudaEventRecord(ev[slot], s));
                    }
                }
                CK(cudaStreamSynchronize(s));
                if (m == POPULATE) { a.stop = 1; pthread_join(helper, 0); }
                if (map != touched) munmap(map, size);
                t[dma][m][rep] = now() - t0;
                if (dma && rep == 0) {
                    CK(cudaMemcpy(back, dev, size, cudaMemcpyDeviceToHost));
                    if (memcmp(back, touched, size) != 0) { printf("%s: bytes differ\n", names[m]); return 1; }
                }
            }
    for (int dma = 1; dma >= 0; dma--)
        for (int m = 0; m < METHODS; m++) {
            qsort(t[dma][m], reps, sizeof(double), cmp);
            printf("%-14s %-9s median %6.2f GB/s  (min %6.2f max %6.2f)\n", names[m], dma ? "load" : "pack only",
                   size / t[dma][m][reps / 2] / 1e9, size / t[dma][m][reps - 1] / 1e9, size / t[dma][m][0] / 1e9);
        }
    return 0;
}
