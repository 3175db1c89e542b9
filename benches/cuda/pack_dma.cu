// The host's ceiling for many small uploads from ordinary memory, without cuda-resident: 8192
// pageable sources (malloc'd one by one, like Vec<u8>s) packed by OpenMP threads into pinned
// chunks and moved by cudaMemcpyAsync, with no scatter kernel. Times in microseconds, median
// of 9 after one warm-up. BENCHMARKS.md compares it with xfer-bench's rows.
//
//   nvcc -O2 -Xcompiler -fopenmp -o pack_dma benches/cuda/pack_dma.cu -lgomp
//   ./pack_dma [bytes per copy = 4096] [chunks = 4] [threads = 16]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
#include <chrono>
#include <omp.h>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)
using clk = std::chrono::steady_clock;
static double us(clk::time_point a, clk::time_point b) { return std::chrono::duration<double, std::micro>(b - a).count(); }
int main(int argc, char** argv) {
  const int N = 8192; const size_t S = argc > 1 ? atoi(argv[1]) : 4096; const int CH = argc > 2 ? atoi(argv[2]) : 4;
  const int T = argc > 3 ? atoi(argv[3]) : 16;
  omp_set_num_threads(T);
  std::vector<unsigned char*> src(N);
  for (int i = 0; i < N; i++) { src[i] = (unsigned char*)malloc(S); for (size_t j = 0; j < S; j++) src[i][j] = (unsigned char)(i * 7 + j); }
  const size_t total = N * S, per = total / CH;
  const int reps = 9;
  std::vector<unsigned char*> pin(CH);
  for (int k = 0; k < CH; k++) CK(cudaHostAlloc((void**)&pin[k], per, cudaHostAllocPortable));
  unsigned char* dev; CK(cudaMalloc(&dev, total));
  cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const int perN = N / CH;
  auto pack = [&](int k) {
    #pragma omp parallel for schedule(static)
    for (int i = 0; i < perN; i++) memcpy(pin[k] + i * S, src[k * perN + i], S);
  };
  auto dma = [&](int k) { CK(cudaMemcpyAsync(dev + k * per, pin[k], per, cudaMemcpyHostToDevice, st)); };
  auto med = [&](auto f) { std::vector<double> t; for (int r = 0; r < reps + 1; r++) { auto a = clk::now(); f(); CK(cudaStreamSynchronize(st)); auto b = clk::now(); if (r) t.push_back(us(a, b)); } std::sort(t.begin(), t.end()); return t[t.size() / 2]; };
  double pk = med([&] { for (int k = 0; k < CH; k++) pack(k); });
  double dm = med([&] { for (int k = 0; k < CH; k++) dma(k); });
  double ser = med([&] { for (int k = 0; k < CH; k++) pack(k); for (int k = 0; k < CH; k++) dma(k); });
  double pip = med([&] { for (int k = 0; k < CH; k++) { pack(k); dma(k); } });
  // DMA of memory just written by the threads, alone.
  std::vector<double> fresh;
  for (int r = 0; r < reps; r++) { for (int k = 0; k < CH; k++) pack(k); auto a = clk::now(); for (int k = 0; k < CH; k++) dma(k); CK(cudaStreamSynchronize(st)); fresh.push_back(us(a, clk::now())); }
  std::sort(fresh.begin(), fresh.end());
  double gb = total / 1e3;
  printf("%d x %zu B, %d chunks, %d threads: pack %.0f us (%.1f GB/s), dma %.0f us (%.1f), dma right after packing %.0f us (%.1f), pack then dma %.0f us (%.1f), pipelined %.0f us (%.1f GB/s)\n",
    N, S, CH, T, pk, gb / pk, dm, gb / dm, fresh[reps / 2], gb / fresh[reps / 2], ser, gb / ser, pip, gb / pip);
  return 0;
}
