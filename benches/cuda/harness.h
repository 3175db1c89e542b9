// What the link harnesses (ceilings.cu, in-place.cu) share: error checks, two streams, and
// timing by the wall clock from the first enqueue to both streams' end, median of 15 runs
// after two warm-ups.
#pragma once
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>

#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e = (x);                                                                       \
        if (e != cudaSuccess) {                                                                    \
            printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e));                       \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static cudaStream_t st[2];

static void make_streams() {
    CK(cudaStreamCreateWithFlags(&st[0], cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&st[1], cudaStreamNonBlocking));
}

// Median time of `f` in microseconds; `prep` runs before each run, off the clock.
template <class P, class F> static double med(P prep, F f) {
    using clk = std::chrono::steady_clock;
    std::vector<double> t;
    for (int r = 0; r < 17; r++) {
        prep();
        auto a = clk::now();
        f();
        CK(cudaStreamSynchronize(st[0]));
        CK(cudaStreamSynchronize(st[1]));
        double us = std::chrono::duration<double, std::micro>(clk::now() - a).count();
        if (r >= 2) t.push_back(us);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

template <class F> static double med(F f) {
    return med([] {}, f);
}

static void row(const char* what, size_t bytes, double us) {
    printf("%-70s %8.0f us %6.2f GB/s\n", what, us, bytes / us / 1e3);
}
