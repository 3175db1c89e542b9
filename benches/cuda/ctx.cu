// What binding a context costs on the calling thread: `cuCtxSetCurrent` of the context that is
// already current, against `cuCtxGetCurrent` (a check before a set), each alone, and inside a
// 4 KiB upload's round trip as a lane makes it (`cuMemcpyHtoDAsync` from pinned memory,
// `cuEventRecord`, `cuEventSynchronize`) with no bind, one set, two sets, or a get.
// Per call: the median of 15 batches of 100,000 calls (binds) or 2,000 round trips, after one
// warm-up batch; the round trips alternate the variants batch by batch.
//
//   nvcc -O3 -o ctx benches/cuda/ctx.cu -lcuda && ./ctx
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda.h>

#define CU(x)                                                                                      \
    do {                                                                                           \
        CUresult e = (x);                                                                          \
        if (e != CUDA_SUCCESS) {                                                                   \
            printf("%s:%d error %d\n", __FILE__, __LINE__, (int)e);                                \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

using clk = std::chrono::steady_clock;

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

template <class F> static double per_call_ns(int calls, F f) {
    std::vector<double> t;
    for (int b = 0; b < 16; b++) {
        auto a = clk::now();
        for (int i = 0; i < calls; i++) f();
        double ns = std::chrono::duration<double, std::nano>(clk::now() - a).count() / calls;
        if (b > 0) t.push_back(ns);
    }
    return median(t);
}

int main() {
    CU(cuInit(0));
    CUdevice dev;
    CU(cuDeviceGet(&dev, 0));
    CUcontext ctx;
    CU(cuDevicePrimaryCtxRetain(&ctx, dev));
    CU(cuCtxSetCurrent(ctx));
    printf("cuCtxSetCurrent, already current   %7.1f ns\n",
           per_call_ns(100000, [&] { CU(cuCtxSetCurrent(ctx)); }));
    printf("cuCtxGetCurrent                    %7.1f ns\n", per_call_ns(100000, [&] {
               CUcontext c;
               CU(cuCtxGetCurrent(&c));
               if (c != ctx) exit(2);
           }));

    CUstream s;
    CU(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CUevent ev;
    CU(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
    CUdeviceptr d;
    CU(cuMemAlloc(&d, 4096));
    void* h;
    CU(cuMemHostAlloc(&h, 4096, 0));
    auto trip = [&](int sets, bool get) {
        for (int k = 0; k < sets; k++) CU(cuCtxSetCurrent(ctx));
        if (get) {
            CUcontext c;
            CU(cuCtxGetCurrent(&c));
            if (c != ctx) CU(cuCtxSetCurrent(ctx));
        }
        CU(cuMemcpyHtoDAsync(d, h, 4096, s));
        CU(cuEventRecord(ev, s));
        CU(cuEventSynchronize(ev));
    };
    const char* name[4] = {"4 KiB round trip, no bind", "4 KiB round trip, one set",
                           "4 KiB round trip, two sets", "4 KiB round trip, a get"};
    std::vector<double> t[4];
    for (int b = 0; b < 16; b++) {
        for (int v = 0; v < 4; v++) {
            auto a = clk::now();
            for (int i = 0; i < 2000; i++) trip(v == 3 ? 0 : v, v == 3);
            double ns = std::chrono::duration<double, std::nano>(clk::now() - a).count() / 2000;
            if (b > 0) t[v].push_back(ns);
        }
    }
    for (int v = 0; v < 4; v++) printf("%-34s %7.1f ns\n", name[v], median(t[v]));
    return 0;
}
