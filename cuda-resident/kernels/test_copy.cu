// Standalone check of copy_descriptors for compute-sanitizer: random descriptors with every
// alignment and length from 0 to 20000 bytes, disjoint destinations, poisoned output, every
// byte compared. Build and run where nvcc is:
//   nvcc -O2 -arch=sm_90 -o /tmp/test_copy kernels/test_copy.cu && /tmp/test_copy
//   compute-sanitizer --tool memcheck /tmp/test_copy; compute-sanitizer --tool racecheck /tmp/test_copy
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include "copy.cu"

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

static unsigned long long rng_state = 0x9E3779B97F4A7C15ull;
static unsigned long long next_rand() {
    rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17; return rng_state;
}

int main(int argc, char** argv) {
    const int rounds = argc > 1 ? atoi(argv[1]) : 20;
    for (int round = 0; round < rounds; round++) {
        const size_t count = 1 + next_rand() % 3000;
        std::vector<CopyDescriptor> d(count);
        std::vector<size_t> src_off(count), dst_off(count), len(count);
        size_t src_total = 0, dst_total = 0;
        for (size_t i = 0; i < count; i++) {
            size_t l = next_rand() % 8 == 0 ? next_rand() % 20000 : next_rand() % 600;
            src_total += next_rand() % 32; src_off[i] = src_total; src_total += l;
            dst_total += next_rand() % 32; dst_off[i] = dst_total; dst_total += l;
            len[i] = l;
        }
        std::vector<unsigned char> src(src_total + 64), expect(dst_total + 64, 0xA5), got(dst_total + 64);
        for (auto& b : src) b = (unsigned char)next_rand();
        unsigned char *dsrc, *ddst; CopyDescriptor* ddesc;
        CHECK(cudaMalloc(&dsrc, src.size()));
        CHECK(cudaMalloc(&ddst, expect.size()));
        CHECK(cudaMalloc(&ddesc, count * sizeof(CopyDescriptor)));
        CHECK(cudaMemcpy(dsrc, src.data(), src.size(), cudaMemcpyHostToDevice));
        CHECK(cudaMemset(ddst, 0xA5, expect.size()));
        for (size_t i = 0; i < count; i++) {
            d[i] = CopyDescriptor{(u64)(dsrc + src_off[i]), (u64)(ddst + dst_off[i]), (u64)len[i]};
            memcpy(&expect[dst_off[i]], &src[src_off[i]], len[i]);
        }
        CHECK(cudaMemcpy(ddesc, d.data(), count * sizeof(CopyDescriptor), cudaMemcpyHostToDevice));
        unsigned blocks = (unsigned)((count * 32 + 255) / 256);
        if (round % 2) blocks = 1 + blocks / 7;  // exercise the grid-stride loop
        copy_descriptors<<<blocks, 256>>>(ddesc, count);
        CHECK(cudaGetLastError());
        CHECK(cudaDeviceSynchronize());
        CHECK(cudaMemcpy(got.data(), ddst, got.size(), cudaMemcpyDeviceToHost));
        if (memcmp(got.data(), expect.data(), got.size()) != 0) {
            for (size_t j = 0; j < got.size(); j++)
                if (got[j] != expect[j]) { printf("round %d: byte %zu differs (%u vs %u)\n", round, j, got[j], expect[j]); break; }
            return 1;
        }
        cudaFree(dsrc); cudaFree(ddst); cudaFree(ddesc);
    }
    printf("copy_descriptors: %d rounds, all bytes match\n", rounds);
    return 0;
}
