// What the load probes (load-design.cu, load-start.cu) share: an error check, the clock and
// a comparison for medians, and the checkpoint-sized file they read, made of random bytes
// (xorshift) where PATH is missing or of another size, then opened, mapped read only and
// touched page by page (so that it is in the page cache).
#pragma once
#include <cuda_runtime.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }

// Returns the file's descriptor and sets *map to a mapping of its SIZE bytes, every page
// touched; exits on an error.
static int probe_file(const char *path, size_t size, char **map) {
    struct stat st;
    if (stat(path, &st) != 0 || (size_t)st.st_size != size) {
        int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0644);
        if (fd < 0) { perror(path); exit(1); }
        size_t block = 64 << 20;
        unsigned long long *buf = (unsigned long long *)malloc(block), x = 0x9e3779b97f4a7c15ull;
        for (size_t o = 0; o < size; o += block) {
            for (size_t i = 0; i < block / 8; i++) { x ^= x << 13; x ^= x >> 7; x ^= x << 17; buf[i] = x; }
            size_t n = size - o < block ? size - o : block;
            if (pwrite(fd, buf, n, o) != (ssize_t)n) { perror("pwrite"); exit(1); }
        }
        free(buf);
        close(fd);
    }
    int fd = open(path, O_RDONLY);
    if (fd < 0) { perror(path); exit(1); }
    *map = (char *)mmap(0, size, PROT_READ, MAP_SHARED, fd, 0);
    if (*map == MAP_FAILED) { perror("mmap"); exit(1); }
    volatile unsigned long long sink = 0;
    for (size_t o = 0; o < size; o += 4096) sink += (*map)[o];
    (void)sink;
    return fd;
}
