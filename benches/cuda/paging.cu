// The device's ceilings for the paging suite, without cuda-resident: how fast a KV-cache swap
// (256 MiB of random blocks of an 8 GiB pool out into a pinned host cache, 256 MiB of other
// blocks in from it, each way alone and both at once) can move by
//   - one DMA per block (what serving stacks do; on one stream, or alternating over two),
//   - the pipeline cuda-resident's `Device::scope` uses for host-contiguous runs: one DMA per
//     chunk into or out of a device staging slot, and a scatter (in) or gather (out) launch of
//     the project's copy kernel on a second stream, for chunk sizes, slot counts and launch
//     sizes given below,
//   - the copy kernel alone over the bus (the pool's blocks read or written straight from or
//     into pinned memory, one launch),
//   - and, as the link's own ceiling, the same bytes as plain DMAs between the cache and a
//     contiguous device region.
// Times: wall clock from the first enqueue to the end of every stream, median of 7 after two
// warm-ups; GB/s counts the bytes of both directions where both move.
//
//   nvcc -O3 -arch=sm_90 -o paging benches/cuda/paging.cu
//   ./paging            # every block size;  ./paging 16384  # one
#include <cstring>
#include <random>

#include "../../cuda-resident/kernels/copy.cu"
#include "harness.h"

static const size_t STEP = 256ull << 20;
static const size_t POOL = 8ull << 30;
static int sms;

struct Dir {
    bool up;
    unsigned char* host;           // the cache region (pinned, mapped)
    std::vector<size_t> blocks;    // pool block indices, in slot order
    cudaStream_t main, side;
    unsigned char* stage;          // device staging, `slots` slots of `chunk` bytes
    CopyDescriptor* table_dev;     // per-chunk descriptors, on the device (scatter/gather)
    CopyDescriptor* table_host;    // the same in mapped pinned memory
    CopyDescriptor* bus_table;     // block <-> host slot, mapped pinned (over the bus)
    cudaEvent_t dma[8], freed[8];
};

static unsigned char* pool;

static int grid_for(size_t count, int cap) {
    size_t b = (count + 7) / 8;
    if (b < 1) b = 1;
    if (b > (size_t)cap) b = cap;
    return (int)b;
}

// Fills `d`'s per-chunk tables for chunks of `chunk` bytes over `slots` slots (descriptors of
// at most 16 KiB, as the crate cuts them).
static size_t build_tables(Dir& d, size_t block, size_t chunk, int slots, std::vector<size_t>& first) {
    size_t n = 0;
    first.clear();
    size_t nchunks = STEP / chunk;
    for (size_t k = 0; k < nchunks; k++) {
        first.push_back(n);
        unsigned char* slot = d.stage + (k % slots) * chunk;
        for (size_t off = 0; off < chunk; off += 16384) {
            size_t at = k * chunk + off;  // byte of the step
            size_t b = at / block, inb = at % block;
            unsigned char* dev = pool + d.blocks[b] * block + inb;
            size_t len = std::min<size_t>(16384, block - inb);
            len = std::min(len, chunk - off);
            CopyDescriptor c = d.up ? CopyDescriptor{(u64)(slot + off), (u64)dev, len}
                                    : CopyDescriptor{(u64)dev, (u64)(slot + off), len};
            d.table_host[n++] = c;
        }
    }
    first.push_back(n);
    CK(cudaMemcpy(d.table_dev, d.table_host, n * sizeof(CopyDescriptor), cudaMemcpyHostToDevice));
    return n;
}

enum Mode { RAW1, RAW2, CHUNKS, BUS, PLAIN };

struct Cfg {
    Mode mode;
    size_t chunk = 16 << 20;
    int slots = 2;
    int cap = 8;          // launch size cap, blocks per SM
    bool table_on_device = true;  // gather's table: device memory or pinned over the bus
};

struct Plan {
    Dir* d;
    Cfg c;
    size_t block;
    std::vector<size_t> first;
};

// Enqueues step `k` of `p` (one block, one chunk, or everything for one launch); false when done.
static bool enqueue(Plan& p, size_t k) {
    Dir& d = *p.d;
    size_t n = STEP / p.block;
    switch (p.c.mode) {
        case RAW1:
        case RAW2: {
            if (k >= n) return false;
            cudaStream_t s = (p.c.mode == RAW2 && (k & 1)) ? d.side : d.main;
            unsigned char* dev = pool + d.blocks[k] * p.block;
            unsigned char* h = d.host + k * p.block;
            if (d.up) CK(cudaMemcpyAsync(dev, h, p.block, cudaMemcpyHostToDevice, s));
            else CK(cudaMemcpyAsync(h, dev, p.block, cudaMemcpyDeviceToHost, s));
            return true;
        }
        case PLAIN: {
            size_t chunks = STEP / p.c.chunk;
            if (k >= chunks) return false;
            unsigned char* dev = pool + (d.up ? 0 : STEP) + k * p.c.chunk;
            unsigned char* h = d.host + k * p.c.chunk;
            if (d.up) CK(cudaMemcpyAsync(dev, h, p.c.chunk, cudaMemcpyHostToDevice, d.main));
            else CK(cudaMemcpyAsync(h, dev, p.c.chunk, cudaMemcpyDeviceToHost, d.main));
            return true;
        }
        case BUS: {
            if (k >= 1) return false;
            copy_descriptors<<<sms * p.c.cap, 256, 0, d.main>>>(d.bus_table, n * (p.block / std::min<size_t>(p.block, 16384)));
            CK(cudaGetLastError());
            return true;
        }
        case CHUNKS: {
            size_t chunks = STEP / p.c.chunk;
            if (k >= chunks) return false;
            int slot = (int)(k % p.c.slots);
            unsigned char* at = d.stage + slot * p.c.chunk;
            size_t f = p.first[k], cnt = p.first[k + 1] - f;
            const CopyDescriptor* t = (d.up || p.c.table_on_device) ? d.table_dev + f : d.table_host + f;
            int grid = grid_for(cnt, sms * p.c.cap);
            if (d.up) {
                CK(cudaStreamWaitEvent(d.main, d.freed[slot], 0));
                CK(cudaMemcpyAsync(at, d.host + k * p.c.chunk, p.c.chunk, cudaMemcpyHostToDevice, d.main));
                CK(cudaEventRecord(d.dma[slot], d.main));
                CK(cudaStreamWaitEvent(d.side, d.dma[slot], 0));
                copy_descriptors<<<grid, 256, 0, d.side>>>(t, cnt);
                CK(cudaEventRecord(d.freed[slot], d.side));
            } else {
                CK(cudaStreamWaitEvent(d.main, d.freed[slot], 0));
                copy_descriptors<<<grid, 256, 0, d.main>>>(t, cnt);
                CK(cudaEventRecord(d.dma[slot], d.main));
                CK(cudaStreamWaitEvent(d.side, d.dma[slot], 0));
                CK(cudaMemcpyAsync(d.host + k * p.c.chunk, at, p.c.chunk, cudaMemcpyDeviceToHost, d.side));
                CK(cudaEventRecord(d.freed[slot], d.side));
            }
            return true;
        }
    }
    return false;
}

static Dir dirs[2];

static void sync_all() { CK(cudaDeviceSynchronize()); }

static double time_plans(std::vector<Plan*> plans) {
    using clk = std::chrono::steady_clock;
    std::vector<double> t;
    for (int r = 0; r < 9; r++) {
        sync_all();
        auto a = clk::now();
        // Interleaved, as two threads released together would enqueue.
        bool any = true;
        for (size_t k = 0; any; k++) {
            any = false;
            for (Plan* p : plans) any |= enqueue(*p, k);
        }
        sync_all();
        double us = std::chrono::duration<double, std::micro>(clk::now() - a).count();
        if (r >= 2) t.push_back(us);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

static const char* mode_name(const Cfg& c, char* buf, size_t n) {
    switch (c.mode) {
        case RAW1: return "one DMA a block, one stream";
        case RAW2: return "one DMA a block, two streams";
        case BUS: snprintf(buf, n, "copy kernel over the bus, %d blocks/SM", c.cap); return buf;
        case PLAIN: snprintf(buf, n, "plain DMAs of %zu MiB (link ceiling)", c.chunk >> 20); return buf;
        case CHUNKS:
            snprintf(buf, n, "chunks %2zu MiB, %d slots, <=%d blocks/SM, gather table %s", c.chunk >> 20, c.slots,
                     c.cap, c.table_on_device ? "device" : "pinned");
            return buf;
    }
    return "?";
}

static void run(size_t block, const Cfg& c) {
    char buf[160], name[200];
    const char* what = mode_name(c, buf, sizeof buf);
    Plan p[2];
    for (int i = 0; i < 2; i++) {
        p[i].d = &dirs[i];
        p[i].c = c;
        p[i].block = block;
        if (c.mode == CHUNKS) build_tables(dirs[i], block, c.chunk, c.slots, p[i].first);
    }
    const char* dn[3] = {"in", "out", "both"};
    double us[3];
    us[0] = time_plans({&p[0]});
    us[1] = time_plans({&p[1]});
    us[2] = time_plans({&p[0], &p[1]});
    for (int i = 0; i < 3; i++) {
        snprintf(name, sizeof name, "%4zu KiB %-4s %s", block >> 10, dn[i], what);
        row(name, i == 2 ? 2 * STEP : STEP, us[i]);
    }
}

int main(int argc, char** argv) {
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaMalloc(&pool, POOL));
    CK(cudaMemset(pool, 7, POOL));
    for (int i = 0; i < 2; i++) {
        Dir& d = dirs[i];
        d.up = i == 0;
        CK(cudaHostAlloc((void**)&d.host, STEP, cudaHostAllocPortable | cudaHostAllocMapped));
        memset(d.host, 3 + i, STEP);
        CK(cudaStreamCreateWithFlags(&d.main, cudaStreamNonBlocking));
        CK(cudaStreamCreateWithFlags(&d.side, cudaStreamNonBlocking));
        CK(cudaMalloc(&d.stage, 4 * (32 << 20)));
        size_t most = STEP / 1024 + 64;  // 1 KiB descriptors at most
        CK(cudaMalloc(&d.table_dev, most * sizeof(CopyDescriptor)));
        CK(cudaHostAlloc((void**)&d.table_host, most * sizeof(CopyDescriptor), cudaHostAllocPortable | cudaHostAllocMapped));
        CK(cudaHostAlloc((void**)&d.bus_table, most * sizeof(CopyDescriptor), cudaHostAllocPortable | cudaHostAllocMapped));
        for (int ev = 0; ev < 8; ev++) {
            CK(cudaEventCreateWithFlags(&d.dma[ev], cudaEventDisableTiming));
            CK(cudaEventCreateWithFlags(&d.freed[ev], cudaEventDisableTiming));
        }
    }
    std::vector<size_t> sizes = {16384, 262144, 2097152};
    if (argc > 1) sizes = {(size_t)atoll(argv[1])};
    std::mt19937_64 rng(42);
    for (size_t block : sizes) {
        // Distinct random blocks of the pool, past the two contiguous regions PLAIN uses.
        size_t reserved = 2 * STEP / block, total = POOL / block, n = STEP / block;
        std::vector<size_t> perm(total - reserved);
        for (size_t i = 0; i < perm.size(); i++) perm[i] = reserved + i;
        std::shuffle(perm.begin(), perm.end(), rng);
        for (int i = 0; i < 2; i++) {
            Dir& d = dirs[i];
            d.blocks.assign(perm.begin() + i * n, perm.begin() + (i + 1) * n);
            size_t m = 0;
            for (size_t b = 0; b < n; b++) {
                for (size_t off = 0; off < block; off += 16384) {
                    size_t len = std::min<size_t>(16384, block - off);
                    u64 h = (u64)(d.host + b * block + off), dv = (u64)(pool + d.blocks[b] * block + off);
                    d.bus_table[m++] = d.up ? CopyDescriptor{h, dv, len} : CopyDescriptor{dv, h, len};
                }
            }
        }
        run(block, {PLAIN, 16 << 20});
        run(block, {RAW1});
        run(block, {RAW2});
        for (int cap : {1, 8}) run(block, {BUS, 0, 0, cap});
        for (size_t chunk : {4 << 20, 8 << 20, 16 << 20, 32 << 20})
            for (int slots : {2, 3, 4})
                for (int cap : {2, 8}) run(block, {CHUNKS, chunk, slots, cap, true});
        run(block, {CHUNKS, 16 << 20, 2, 8, false});
        fflush(stdout);
    }
    return 0;
}
