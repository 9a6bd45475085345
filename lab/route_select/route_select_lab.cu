// The route's selection of one token's experts (softmax router, 128 experts, top 8, the shape of
// Qwen3-30B-A3B), timed alone on idle SMs with the SM clock, against a CPU reference.
//   v1: select_experts (route_select.cuh): one warp scores, eight rounds of warp reductions pick.
//   v2: the same warp scores; the block's threads rank every expert against all others at once
//       (rank = experts ordered before it), the expert of rank r < k is the r-th choice.
// Also timed: the pieces of v1 (scores only, top-k only) and block_rms_norm over 2048 floats, the
// norm every product tile of the persistent step starts with (docs/PERF.md v34's open question:
// is a phase's cost in the step its code, or the SM's state around it).
// Measured (H200, 132 blocks, warm / first call): v1 2344 / 2531 cycles (1.18 us warm), of which
// the scores 890 and warp_top_k 1329; v2 2958 cycles (1.49 us): slower than v1, not taken;
// block_rms_norm 1521 cycles (0.77 us) warm, 0.90-0.97 us first. Inside the persistent step the
// same norm takes 2.7-3.2 us and the selection 6.5 (docs/PERF.md v35).
// Usage: route_select_lab [blocks]   (one block per SM by default: 132 on an H200)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "backend/cuda/reduce.cuh"
#include "backend/cuda/route_select.cuh"

using namespace kestrel::cuda;

constexpr int kE = 128, kK = 8, kThreads = 256, kReps = 16, kHidden = 2048;
enum Phase { kV1, kV1Scores, kV1TopK, kV2, kNorm, kPhases };
const char* kNames[kPhases] = {"v1 select_experts (one warp)", "  v1 scores only", "  v1 warp_top_k only",
                               "v2 warp scores + block ranks", "block_rms_norm 2048"};

// v2's pick: the key of choice[e] orders like the float (NaN first, as warp_top_k's); an expert's
// rank is how many keys are larger, or equal at a lower index, so the ranks are a permutation.
__device__ __forceinline__ uint32_t order_key(float v) {
  const uint32_t b = __float_as_uint(v + 0.0f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ void block_rank_top_k(const float* choice, uint32_t* keys, int n, int k, int* sel) {
  for (int e = threadIdx.x; e < n; e += blockDim.x) keys[e] = order_key(choice[e]);
  __syncthreads();
  for (int e = threadIdx.x; e < n; e += blockDim.x) {
    const uint32_t me = keys[e];
    int r0 = 0, r1 = 0, r2 = 0, r3 = 0;
    int j = 0;
    for (; j + 4 <= n; j += 4) {
      const uint4 q = *reinterpret_cast<const uint4*>(keys + j);
      r0 += (q.x > me) | (q.x == me && j < e);
      r1 += (q.y > me) | (q.y == me && j + 1 < e);
      r2 += (q.z > me) | (q.z == me && j + 2 < e);
      r3 += (q.w > me) | (q.w == me && j + 3 < e);
    }
    for (; j < n; ++j) r0 += (keys[j] > me) | (keys[j] == me && j < e);
    const int r = r0 + r1 + r2 + r3;
    if (r < k) sel[r] = e;
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads, 1) lab_kernel(const float* logits, const float* x, const float* w, int* out_sel,
                                                          float* out_w, long long* cycles) {
  __shared__ float s_logit[kE], choice[kE], gscore[32], red[32];
  __shared__ __align__(16) uint32_t keys[kE];
  __shared__ int sel[32];
  __shared__ __align__(16) float xn[kHidden];
  __shared__ int32_t e_out[kK];
  __shared__ float w_out[kK];
  DRouter r{};
  r.experts = kE, r.top_k = kK, r.sigmoid = 0, r.norm_topk = 1, r.scaling = 1.0f;
  for (int e = threadIdx.x; e < kE; e += blockDim.x) s_logit[e] = logits[e];
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int ph = 0; ph < kPhases; ++ph)
    for (int rep = 0; rep < kReps; ++rep) {
      __syncthreads();
      const long long t0 = clock64();
      switch (ph) {
        case kV1:
          if (warp == 0) select_experts<true>(r, s_logit, choice, gscore, sel, e_out, w_out, lane);
          break;
        case kV1Scores:
          if (warp == 0) {
            float mx = -FLT_MAX;
            for (int e = lane; e < kE; e += 32) mx = fmaxf(mx, choice[e] = s_logit[e]);
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            float sum = 0.0f;
            for (int e = lane; e < kE; e += 32) sum += (choice[e] = expf(choice[e] - mx));
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            const float inv = 1.0f / sum;
            for (int e = lane; e < kE; e += 32) choice[e] *= inv;
          }
          break;
        case kV1TopK:
          if (warp == 0) warp_top_k<4>(choice, kE, kK, sel, lane);
          break;
        case kV2: {
          float mx = -FLT_MAX, inv = 0.0f;
          if (warp == 0) {
            for (int e = lane; e < kE; e += 32) mx = fmaxf(mx, choice[e] = s_logit[e]);
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            float sum = 0.0f;
            for (int e = lane; e < kE; e += 32) sum += (choice[e] = expf(choice[e] - mx));
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            inv = 1.0f / sum;
            for (int e = lane; e < kE; e += 32) choice[e] *= inv;
          }
          __syncthreads();
          block_rank_top_k(choice, keys, kE, kK, sel);
          if (warp == 0) {
            float wv = lane < kK ? expf(s_logit[sel[lane]] - mx) * inv : 0.0f;
            float sum = 0.0f;
            for (int j = 0; j < kK; ++j) sum += __shfl_sync(0xffffffffu, wv, j);
            if (lane < kK) e_out[lane] = sel[lane], w_out[lane] = wv / sum;
          }
          break;
        }
        case kNorm: {
          float4 g[kRowNormPer];
          row_norm_weights(w, kHidden, g);
          block_rms_norm(x, g, kHidden, 1e-6f, xn, red);
          break;
        }
      }
      __syncthreads();
      const long long t1 = clock64();
      if (threadIdx.x == 0) cycles[(size_t(blockIdx.x) * kPhases + ph) * kReps + rep] = t1 - t0;
      if (threadIdx.x < kK && blockIdx.x == 0 && rep == kReps - 1 && (ph == kV1 || ph == kV2)) {
        out_sel[(ph == kV2) * kK + threadIdx.x] = e_out[threadIdx.x];
        out_w[(ph == kV2) * kK + threadIdx.x] = w_out[threadIdx.x];
      }
    }
  if (threadIdx.x == 0 && xn[5] == 12345.0f) cycles[0] = 0;  // keeps the norm's result live
}

#define CHECK(x)                                                                  \
  do {                                                                            \
    cudaError_t e_ = (x);                                                         \
    if (e_ != cudaSuccess) {                                                      \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));               \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

int main(int argc, char** argv) {
  int sms = 0, clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  const int blocks = argc > 1 ? std::atoi(argv[1]) : sms;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> logits(kE), x(kHidden), w(kHidden);
  for (float& v : logits) v = 2.0f * nd(rng);
  for (float& v : x) v = nd(rng);
  for (float& v : w) v = 1.0f + 0.1f * nd(rng);
  // The CPU's choice: softmax, the k largest (ties: lowest index), renormalized.
  std::vector<int> order(kE);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  float *d_logits, *d_x, *d_w, *d_w_out;
  int* d_sel;
  long long* d_cycles;
  CHECK(cudaMalloc(&d_logits, kE * 4));
  CHECK(cudaMalloc(&d_x, kHidden * 4));
  CHECK(cudaMalloc(&d_w, kHidden * 4));
  CHECK(cudaMalloc(&d_sel, 2 * kK * 4));
  CHECK(cudaMalloc(&d_w_out, 2 * kK * 4));
  CHECK(cudaMalloc(&d_cycles, size_t(blocks) * kPhases * kReps * 8));
  CHECK(cudaMemcpy(d_logits, logits.data(), kE * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_x, x.data(), kHidden * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_w, w.data(), kHidden * 4, cudaMemcpyHostToDevice));
  lab_kernel<<<blocks, kThreads>>>(d_logits, d_x, d_w, d_sel, d_w_out, d_cycles);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  std::vector<int> sel(2 * kK);
  std::vector<float> wo(2 * kK);
  std::vector<long long> cyc(size_t(blocks) * kPhases * kReps);
  CHECK(cudaMemcpy(sel.data(), d_sel, sel.size() * 4, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(wo.data(), d_w_out, wo.size() * 4, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(cyc.data(), d_cycles, cyc.size() * 8, cudaMemcpyDeviceToHost));
  // Renormalized over the chosen experts, the softmax's weights are exp(l - max) over their sum.
  std::vector<double> cpu_w(kK);
  double cpu_sum = 0.0;
  for (int j = 0; j < kK; ++j) cpu_sum += cpu_w[j] = std::exp(double(logits[order[j]]) - logits[order[0]]);
  bool ok = true;
  for (int v = 0; v < 2; ++v)
    for (int j = 0; j < kK; ++j)
      if (sel[v * kK + j] != order[j] || std::fabs(wo[v * kK + j] - cpu_w[j] / cpu_sum) > 1e-5) ok = false;
  std::printf("selection: v1 and v2 %s the CPU's top %d and weights (first %d, %d, %d)\n", ok ? "equal" : "DIFFER from", kK, order[0],
              order[1], order[2]);
  std::printf("%d blocks of %d threads, SM clock %.0f MHz; cycles per call (first call / median of the rest, over blocks)\n",
              blocks, kThreads, clock_khz / 1e3);
  for (int ph = 0; ph < kPhases; ++ph) {
    std::vector<long long> first, rest;
    for (int b = 0; b < blocks; ++b) {
      const long long* c = cyc.data() + (size_t(b) * kPhases + ph) * kReps;
      first.push_back(c[0]);
      for (int i = 1; i < kReps; ++i) rest.push_back(c[i]);
    }
    std::sort(first.begin(), first.end());
    std::sort(rest.begin(), rest.end());
    const double mf = double(first[first.size() / 2]), mr = double(rest[rest.size() / 2]);
    std::printf("  %-32s %7.0f / %7.0f cycles  (%.2f / %.2f us)\n", kNames[ph], mf, mr, mf / (clock_khz / 1e3),
                mr / (clock_khz / 1e3));
  }
  return ok ? 0 : 1;
}
