#include <cfloat>

#include "backend/cuda/check.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/dequant.cuh"
#include "backend/cuda/embed_row.cuh"
#include "backend/cuda/misc.h"

namespace kestrel::cuda {
namespace {

__global__ void embed_kernel(DLinear t, const int32_t* __restrict__ tokens, float* __restrict__ x) {
  pdl_enter();
  const int b = blockIdx.x, row = tokens[b], H = t.in;
  float* o = x + size_t(b) * H;
  for (int k = threadIdx.x; k < H; k += blockDim.x) o[k] = embed_value(t, row, k);
}

constexpr int kArgmaxBlocks = 128, kArgmaxThreads = 256, kArgmaxUnroll = 4;

// Largest (value, index) across the block (ties: lowest index); valid in thread 0.
__device__ void block_argmax(float& best, int& idx) {
  __shared__ float sv[32];
  __shared__ int si[32];
  for (int o = 16; o > 0; o >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
    if (ob > best || (ob == best && oi < idx)) best = ob, idx = oi;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) sv[warp] = best, si[warp] = idx;
  __syncthreads();
  if (threadIdx.x == 0)
    for (int w = 1; w < int(blockDim.x >> 5); ++w)
      if (sv[w] > best || (sv[w] == best && si[w] < idx)) best = sv[w], idx = si[w];
}

// Grid (kArgmaxBlocks, batch): each block reduces one slice of a row, with kArgmaxUnroll loads
// in flight per thread, and writes its best; the block that finishes last reduces the partials
// (no second launch) and resets the row's counter for the next call.
__global__ void __launch_bounds__(kArgmaxThreads) argmax_kernel(const float* __restrict__ logits, int vocab,
                                                                ArgmaxScratch scratch, int32_t* __restrict__ next) {
  __shared__ bool last;
  pdl_enter();
  const int b = blockIdx.y, slice = (vocab + kArgmaxBlocks - 1) / kArgmaxBlocks;
  const int begin = blockIdx.x * slice, end = min(vocab, begin + slice);
  const float* l = logits + size_t(b) * vocab;
  float best = -FLT_MAX;
  int idx = vocab;
  for (int i0 = begin + threadIdx.x; i0 < end; i0 += kArgmaxThreads * kArgmaxUnroll) {
    float v[kArgmaxUnroll];
    #pragma unroll
    for (int u = 0; u < kArgmaxUnroll; ++u) {
      const int i = i0 + u * kArgmaxThreads;
      v[u] = i < end ? l[i] : -FLT_MAX;
    }
    #pragma unroll
    for (int u = 0; u < kArgmaxUnroll; ++u)  // indices ascend with u: strict > keeps the lowest
      if (v[u] > best) best = v[u], idx = i0 + u * kArgmaxThreads;
  }
  block_argmax(best, idx);
  float* pv = scratch.value + size_t(b) * kArgmaxBlocks;
  int32_t* pi = scratch.index + size_t(b) * kArgmaxBlocks;
  if (threadIdx.x == 0) {
    pv[blockIdx.x] = best, pi[blockIdx.x] = idx;
    __threadfence();
    last = atomicAdd(scratch.count + b, 1u) == kArgmaxBlocks - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  best = -FLT_MAX, idx = vocab;
  for (int i = threadIdx.x; i < kArgmaxBlocks; i += kArgmaxThreads) {
    const float v = __ldcg(pv + i);
    const int j = __ldcg(pi + i);
    if (v > best || (v == best && j < idx)) best = v, idx = j;
  }
  block_argmax(best, idx);
  if (threadIdx.x == 0) {
    next[b] = idx;
    scratch.count[b] = 0;
  }
}

}  // namespace

void launch_embed(const DLinear& table, const int32_t* tokens, int batch, float* x, cudaStream_t s) {
  launch(embed_kernel, dim3(unsigned(batch)), dim3(256), 0, s, table, tokens, x);
  KESTREL_CUDA_LAUNCHED();
}

size_t argmax_scratch_bytes(int max_batch) { return size_t(max_batch) * (kArgmaxBlocks * 8 + 4); }

ArgmaxScratch argmax_scratch(void* zeroed, int max_batch) {
  ArgmaxScratch a;
  a.value = static_cast<float*>(zeroed);
  a.index = reinterpret_cast<int32_t*>(a.value + size_t(max_batch) * kArgmaxBlocks);
  a.count = reinterpret_cast<uint32_t*>(a.index + size_t(max_batch) * kArgmaxBlocks);
  return a;
}

void launch_argmax(const float* logits, int batch, int vocab, int32_t* next, const ArgmaxScratch& scratch,
                   cudaStream_t s) {
  launch(argmax_kernel, dim3(kArgmaxBlocks, unsigned(batch)), dim3(kArgmaxThreads), 0, s, logits, vocab, scratch, next);
  KESTREL_CUDA_LAUNCHED();
}

}  // namespace kestrel::cuda
