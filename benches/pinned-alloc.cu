// What a pinned staging arena costs to make, by five methods, and how fast the link reads
// each: the pool's cudaHostAlloc(PORTABLE), the same from 4 threads at once, and anonymous
// memory registered with cudaHostRegister(PORTABLE) after touching it, in 4 KiB pages or in
// transparent huge pages (2 MiB aligned, MADV_HUGEPAGE), the last also as cuda-resident's
// pool makes them (one write per huge page instead of a memset, registered mapped too).
// Per method: N arenas of MIB MiB, the median ms to make one (wall time of all over N for
// the threaded one), to fill one the first time (a memset) and to give one back; each
// arena's first upload (one copy from each, timed together) and then 1 GiB uploaded from
// the arenas in turn (16 MiB copies), both timed by events, as GB/s. Methods take turns,
// REPS rounds; medians. Every upload of the 1 GiB of the first round is read back and
// checked.
//   nvcc -O2 -o /tmp/pinned-alloc benches/pinned-alloc.cu
//   /tmp/pinned-alloc [N=12] [MIB=16] [REPS=3]
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }
static double median(double *v, int n) { qsort(v, n, sizeof(double), cmp); return v[n / 2]; }

enum { HOST_ALLOC, HOST_ALLOC_X4, REGISTER_4K, REGISTER_THP, REGISTER_THP_POOL, METHODS };
static const char *names[] = {"cudaHostAlloc", "cudaHostAlloc, 4 threads", "register 4 KiB pages", "register huge pages",
                              "huge, a write a page, mapped"};
static const size_t HUGE = 2 << 20;
#define MAXN 64

static size_t bytes;

static char *make(int method) {
    if (method == HOST_ALLOC || method == HOST_ALLOC_X4) {
        void *p;
        CK(cudaHostAlloc(&p, bytes, cudaHostAllocPortable));
        return (char *)p;
    }
    // Over-map by 2 MiB so that an aligned start exists; the slack stays mapped, unused.
    char *raw = (char *)mmap(0, bytes + HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) { perror("mmap"); exit(1); }
    char *p = (char *)(((size_t)raw + HUGE - 1) & ~(HUGE - 1));
    if (method != REGISTER_4K && madvise(p, bytes, MADV_HUGEPAGE) != 0) perror("madvise");
    if (method == REGISTER_4K && madvise(p, bytes, MADV_NOHUGEPAGE) != 0) perror("madvise");
    if (method == REGISTER_THP_POOL) {
        // The pool's way (cuda-resident/src/host_pool/arena.rs): one write per huge page
        // faults each in whole; registered portable and mapped.
        for (size_t o = 0; o < bytes; o += HUGE) ((volatile char *)p)[o] = 0;
        CK(cudaHostRegister(p, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped));
        return p;
    }
    memset(p, 0, bytes);
    CK(cudaHostRegister(p, bytes, cudaHostRegisterPortable));
    return p;
}

static void unmake(int method, char *p) {
    if (method == HOST_ALLOC || method == HOST_ALLOC_X4) { CK(cudaFreeHost(p)); return; }
    CK(cudaHostUnregister(p));
    // The mapping began at most 2 MiB before p; unmapping from p on leaves the slack, a
    // few pages per arena, which the probe can afford.
    munmap(p, bytes);
}

struct job { char **out; int n; };
static void *maker(void *arg) {
    struct job *j = (struct job *)arg;
    CK(cudaSetDevice(0));
    for (int i = 0; i < j->n; i++) j->out[i] = make(HOST_ALLOC);
    return 0;
}

// Huge pages backing [p, p + bytes), from /proc/self/smaps (kB), or -1.
static long huge_kb(char *p) {
    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f) return -1;
    char line[512];
    int in = 0;
    long kb = -1;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2) {
            in = (unsigned long)p >= lo && (unsigned long)p < hi;
        } else if (in && sscanf(line, "AnonHugePages: %ld kB", &kb) == 1) {
            break;
        }
    }
    fclose(f);
    return kb;
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 12;
    bytes = (size_t)(argc > 2 ? atoi(argv[2]) : 16) << 20;
    int reps = argc > 3 ? atoi(argv[3]) : 3;
    if (n < 4 || n > MAXN || n % 4 || reps < 1 || reps > 16) { fprintf(stderr, "N a multiple of 4 up to %d, REPS 1..16\n", MAXN); return 2; }
    CK(cudaSetDevice(0));
    CK(cudaFree(0));
    FILE *thp = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    char mode[128] = "?";
    if (thp) { if (!fgets(mode, sizeof mode, thp)) mode[0] = 0; fclose(thp); }
    printf("arenas %d x %zu MiB, %d rounds; transparent_hugepage: %s", n, bytes >> 20, reps, mode);
    const size_t total = 1ul << 30, copy = 16 << 20;
    char *dev;
    CK(cudaMalloc(&dev, total));
    char *back = (char *)malloc(copy);
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    double make_ms[METHODS][16], free_ms[METHODS][16], gbps[METHODS][16], first_gbps[METHODS][16], fill_ms[METHODS][16];
    long huge[METHODS] = {0};
    for (int r = 0; r < reps; r++) {
        for (int m = 0; m < METHODS; m++) {
            char *arena[MAXN];
            double t0 = now(), each[MAXN];
            if (m == HOST_ALLOC_X4) {
                pthread_t th[4];
                struct job jobs[4];
                for (int k = 0; k < 4; k++) { jobs[k].out = arena + k * (n / 4); jobs[k].n = n / 4; pthread_create(&th[k], 0, maker, &jobs[k]); }
                for (int k = 0; k < 4; k++) pthread_join(th[k], 0);
                for (int i = 0; i < n; i++) each[i] = (now() - t0) * 1e3 / n;
            } else {
                for (int i = 0; i < n; i++) { double t = now(); arena[i] = make(m); each[i] = (now() - t) * 1e3; }
            }
            make_ms[m][r] = median(each, n);
            huge[m] = huge_kb(arena[0]);
            // Arena i holds bytes of value i + 1 + 16 m; upload 1 GiB from them in turn.
            for (int i = 0; i < n; i++) { double t = now(); memset(arena[i], (i + 1 + 16 * m) & 0xff, bytes); each[i] = (now() - t) * 1e3; }
            fill_ms[m][r] = median(each, n);
            size_t per = copy < bytes ? copy : bytes;
            // Each arena's first copy, timed alone: what a load that uses new staging pays.
            CK(cudaEventRecord(a, s));
            for (int i = 0; i < n; i++) CK(cudaMemcpyAsync(dev + i * per, arena[i], per, cudaMemcpyHostToDevice, s));
            CK(cudaEventRecord(b, s));
            CK(cudaEventSynchronize(b));
            float first;
            CK(cudaEventElapsedTime(&first, a, b));
            first_gbps[m][r] = n * per / (first * 1e-3) / 1e9;
            CK(cudaMemcpyAsync(dev, arena[0], per, cudaMemcpyHostToDevice, s));
            CK(cudaStreamSynchronize(s));
            CK(cudaEventRecord(a, s));
            for (size_t o = 0, k = 0; o < total; o += per, k++)
                CK(cudaMemcpyAsync(dev + o, arena[k % n], per, cudaMemcpyHostToDevice, s));
            CK(cudaEventRecord(b, s));
            CK(cudaEventSynchronize(b));
            float ms;
            CK(cudaEventElapsedTime(&ms, a, b));
            gbps[m][r] = total / (ms * 1e-3) / 1e9;
            if (r == 0) {
                for (size_t o = 0, k = 0; o < total; o += per, k++) {
                    CK(cudaMemcpy(back, dev + o, per, cudaMemcpyDeviceToHost));
                    for (size_t i = 0; i < per; i++)
                        if ((unsigned char)back[i] != ((k % n + 1 + 16 * m) & 0xff)) { fprintf(stderr, "%s: byte %zu of copy %zu wrong\n", names[m], i, k); return 1; }
                }
            }
            for (int i = 0; i < n; i++) { double t = now(); unmake(m, arena[i]); each[i] = (now() - t) * 1e3; }
            free_ms[m][r] = median(each, n);
        }
    }
    printf("%-28s %8s %9s %10s %11s %12s %14s\n", "method", "make ms", "fill ms", "give back", "first GB/s", "upload GB/s", "huge pages kB");
    for (int m = 0; m < METHODS; m++)
        printf("%-28s %8.3f %9.3f %10.3f %11.2f %12.2f %14ld\n", names[m], median(make_ms[m], reps), median(fill_ms[m], reps),
               median(free_ms[m], reps), median(first_gbps[m], reps), median(gbps[m], reps), huge[m]);
    printf("every byte of the first round checked\n");
    return 0;
}
