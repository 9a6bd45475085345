// What one dependent load costs while other SMs stream weights: the persistent step's short
// phases are chains of a few dependent L2 round trips (a counter, a residual row, the logits, the
// slots' experts) issued while the other SMs' bulk copies stream HBM. A pointer chase by thread 0
// of a few blocks, over a buffer that stays in the L2 (and one that does not), timed with the SM
// clock, alone and beside blocks on every other SM that read a large buffer as fast as they can.
// Usage: l2_latency_lab [chasers]   (4 by default; one 256-thread block per SM)
//
// Measured (H200, SM clock 1980 MHz, 2026-12-05): a dependent hop through a 1 MB buffer that stays
// in the L2 costs 389 cycles (0.20 us) with nothing else running and 322-380 cycles with 16, 64
// or 128 SMs streaming at 0.79, 2.82 and 4.10 TB/s; through 1 GB (mostly HBM) 662 cycles idle and
// 377-381 under load. Streaming does not make the L2 slower to reach (docs/PERF.md v35).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#define CHECK(x)                                                                  \
  do {                                                                            \
    cudaError_t e_ = (x);                                                         \
    if (e_ != cudaSuccess) {                                                      \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));               \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

constexpr int kThreads = 256, kHops = 2000, kSmem = 160 * 1024;

// Blocks [0, chasers) chase next[] (a single cycle) once the streamers run; blocks from `chasers`
// on read `stream` in 16-byte loads until every chaser is done, counting what they read.
__global__ void __launch_bounds__(kThreads, 1)
    lab_kernel(const int* next, int chasers, int streamers, const int4* stream, size_t stream_n, volatile int* running,
               volatile int* done, long long* chase_cycles, unsigned long long* streamed, long long* stream_cycles) {
  if (int(blockIdx.x) < chasers) {
    if (threadIdx.x != 0) return;
    while (*running < streamers) {
    }
    int at = int(blockIdx.x) * 97;
    for (int i = 0; i < 64; ++i) at = __ldcg(next + at);  // warm the TLB and the chase's start
    const long long t0 = clock64();
    for (int i = 0; i < kHops; ++i) at = __ldcg(next + at);
    const long long t1 = clock64();
    chase_cycles[blockIdx.x] = (t1 - t0) / kHops + (at == -1);  // `at` live
    atomicAdd(const_cast<int*>(done), 1);
    return;
  }
  const int s = int(blockIdx.x) - chasers;
  if (s >= streamers) return;
  __shared__ int stop;
  if (threadIdx.x == 0) atomicAdd(const_cast<int*>(running), 1), stop = 0;
  __syncthreads();
  const long long t0 = clock64();
  int4 acc = make_int4(0, 0, 0, 0);
  unsigned long long n = 0;
  const size_t per = stream_n / size_t(streamers), base = size_t(s) * per;
  for (size_t off = 0; !stop; off += size_t(kThreads) * 8) {
    if (off + size_t(kThreads) * 8 > per) off = 0;
    #pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int4 v = __ldcs(stream + base + off + size_t(u) * kThreads + threadIdx.x);
      acc.x ^= v.x, acc.y ^= v.y, acc.z ^= v.z, acc.w ^= v.w;
    }
    n += 8;
    if (threadIdx.x == 0 && *done >= chasers) stop = 1;
    __syncthreads();
  }
  if (acc.x == 0x12345678 && acc.y == 7) n = 0;  // the loads live
  atomicAdd(streamed, n * 16);
  if (threadIdx.x == 0) stream_cycles[s] = clock64() - t0;
}

int main(int argc, char** argv) {
  int sms = 0, clock_khz = 0, l2 = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
  const int chasers = argc > 1 ? std::atoi(argv[1]) : 4;
  // Two chases: 1 MB (stays in the L2) and 1 GB (almost every hop from HBM), each one random cycle.
  const size_t sizes[2] = {size_t(1) << 18, size_t(1) << 28};
  const size_t stream_bytes = size_t(4) << 30;
  int4* stream;
  CHECK(cudaMalloc(&stream, stream_bytes));
  CHECK(cudaMemset(stream, 1, stream_bytes));
  int *running, *done;
  long long *chase_cycles, *stream_cycles;
  unsigned long long* streamed;
  CHECK(cudaMalloc(&running, 4));
  CHECK(cudaMalloc(&done, 4));
  CHECK(cudaMalloc(&chase_cycles, size_t(sms) * 8));
  CHECK(cudaMalloc(&stream_cycles, size_t(sms) * 8));
  CHECK(cudaMalloc(&streamed, 8));
  std::printf("%d SMs, SM clock %.0f MHz, L2 %d MB; %d chasers (thread 0 of a block each), %d hops\n", sms,
              clock_khz / 1e3, l2 >> 20, chasers, kHops);
  // More than half an SM's shared memory per block: one block per SM.
  CHECK(cudaFuncSetAttribute(lab_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  std::mt19937 rng(11);
  for (size_t n : sizes) {
    std::vector<int> perm(n), next(n);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (size_t i = 0; i < n; ++i) next[perm[i]] = perm[(i + 1) % n];
    int* d_next;
    CHECK(cudaMalloc(&d_next, n * 4));
    CHECK(cudaMemcpy(d_next, next.data(), n * 4, cudaMemcpyHostToDevice));
    for (int streamers : {0, 16, 64, sms - chasers}) {
      CHECK(cudaMemset(running, 0, 4));
      CHECK(cudaMemset(done, 0, 4));
      CHECK(cudaMemset(streamed, 0, 8));
      CHECK(cudaMemset(stream_cycles, 0, size_t(sms) * 8));
      cudaEvent_t e0, e1;
      cudaEventCreate(&e0), cudaEventCreate(&e1);
      cudaEventRecord(e0);
      lab_kernel<<<chasers + streamers, kThreads, kSmem>>>(d_next, chasers, streamers, stream, stream_bytes / 16, running,
                                                   done, chase_cycles, streamed, stream_cycles);
      cudaEventRecord(e1);
      CHECK(cudaGetLastError());
      CHECK(cudaDeviceSynchronize());
      std::vector<long long> cc(chasers), sc(std::max(streamers, 1));
      unsigned long long bytes = 0;
      CHECK(cudaMemcpy(cc.data(), chase_cycles, size_t(chasers) * 8, cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(sc.data(), stream_cycles, sc.size() * 8, cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(&bytes, streamed, 8, cudaMemcpyDeviceToHost));
      std::sort(cc.begin(), cc.end());
      const double med = double(cc[cc.size() / 2]);
      const double secs = streamers ? double(*std::max_element(sc.begin(), sc.end())) / (clock_khz * 1e3) : 0.0;
      std::printf("  chase %5zu KB, %3d SMs streaming: %6.0f cycles per hop (%.2f us)%s", n * 4 >> 10, streamers, med,
                  med / (clock_khz / 1e3), streamers ? "" : "\n");
      if (streamers) std::printf(", streamed %.0f MB at %.2f TB/s\n", bytes / 1e6, bytes / secs / 1e12);
      cudaEventDestroy(e0), cudaEventDestroy(e1);
    }
    CHECK(cudaFree(d_next));
  }
  return 0;
}
