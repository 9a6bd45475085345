#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "backend/cuda/check.h"
#include "backend/cuda/expert_sort.h"
#include "backend/cuda/route_select.cuh"

namespace kestrel::cuda {
namespace {

constexpr int kSelectWarps = 4;
constexpr int kSortThreads = 256;

// Shared memory per warp: choice [experts], gscore [32] floats, sel [32] ints.
__global__ void select_kernel(DRouter r, const float* __restrict__ logits, int tokens, int32_t* __restrict__ experts,
                              float* __restrict__ weights) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = blockIdx.x * kSelectWarps + warp;
  if (t >= tokens) return;  // whole warps leave together
  float* choice = smem + size_t(warp) * size_t(r.experts + 64);
  float* gscore = choice + r.experts;
  int* sel = reinterpret_cast<int*>(gscore + 32);
  select_experts<false>(r, logits + size_t(t) * size_t(r.experts), choice, gscore, sel, experts + size_t(t) * r.top_k,
                        weights + size_t(t) * r.top_k, lane);
}

// counts[e] for e = blockIdx.x.
__global__ void count_kernel(const int32_t* __restrict__ experts, int pairs, int32_t* __restrict__ counts) {
  using Reduce = cub::BlockReduce<int, kSortThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const int e = blockIdx.x;
  int n = 0;
  for (int i = threadIdx.x; i < pairs; i += kSortThreads) n += experts[i] == e;
  const int total = Reduce(tmp).Sum(n);
  if (threadIdx.x == 0) counts[e] = total;
}

// Expert e = blockIdx.x places its pairs in pair order after the rows of experts 0 .. e - 1:
// each thread takes a contiguous segment of pairs, and a block scan of the segments' counts
// gives each its first row.
__global__ void place_kernel(const int32_t* __restrict__ experts, int pairs, const int32_t* __restrict__ counts,
                             int32_t* __restrict__ row_pair, int32_t* __restrict__ pair_row) {
  using Reduce = cub::BlockReduce<int, kSortThreads>;
  using Scan = cub::BlockScan<int, kSortThreads>;
  __shared__ union {
    typename Reduce::TempStorage reduce;
    typename Scan::TempStorage scan;
  } tmp;
  __shared__ int first_row;
  const int e = blockIdx.x;
  int before = 0;
  for (int i = threadIdx.x; i < e; i += kSortThreads) before += counts[i];
  before = Reduce(tmp.reduce).Sum(before);
  if (threadIdx.x == 0) first_row = before;
  __syncthreads();
  const int seg = (pairs + kSortThreads - 1) / kSortThreads;
  const int begin = min(pairs, int(threadIdx.x) * seg), end = min(pairs, begin + seg);
  int mine = 0;
  for (int i = begin; i < end; ++i) mine += experts[i] == e;
  int at = 0;
  Scan(tmp.scan).ExclusiveSum(mine, at);
  at += first_row;
  for (int i = begin; i < end; ++i)
    if (experts[i] == e) {
      row_pair[at] = i;
      pair_row[i] = at;
      ++at;
    }
}

__global__ void gather_kernel(const __nv_bfloat16* __restrict__ x, int width, const int32_t* __restrict__ row_pair,
                              int top_k, bool mma_order, __nv_bfloat16* __restrict__ xs) {
  const int r = blockIdx.x, t = row_pair[r] / top_k;
  const __nv_bfloat16* src = x + size_t(t) * size_t(width);
  __nv_bfloat16* dst = xs + size_t(r) * size_t(width);
  if (mma_order) {  // one 16-value block per thread, 4x4 transposed (width % 16 == 0: 32-byte aligned rows)
    for (int b = threadIdx.x; b < width / 16; b += blockDim.x) {
      const uint4* in = reinterpret_cast<const uint4*>(src) + 2 * b;
      __align__(16) uint16_t v[16], p[16];
      reinterpret_cast<uint4*>(v)[0] = in[0];
      reinterpret_cast<uint4*>(v)[1] = in[1];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) p[4 * i + j] = v[4 * j + i];
      uint4* out = reinterpret_cast<uint4*>(dst) + 2 * b;
      out[0] = reinterpret_cast<const uint4*>(p)[0];
      out[1] = reinterpret_cast<const uint4*>(p)[1];
    }
  } else if (width % 8 == 0) {  // 16-byte copies (rows of a multiple of 8 values stay 16-byte aligned)
    for (int c = threadIdx.x; c < width / 8; c += blockDim.x)
      reinterpret_cast<uint4*>(dst)[c] = reinterpret_cast<const uint4*>(src)[c];
  } else {
    for (int c = threadIdx.x; c < width; c += blockDim.x) dst[c] = src[c];
  }
}

__global__ void combine_kernel(const float* __restrict__ ys, int width, const int32_t* __restrict__ pair_row,
                               const float* __restrict__ weights, int top_k, float* __restrict__ residual) {
  const int t = blockIdx.x;
  float* out = residual + size_t(t) * size_t(width);
  for (int c = threadIdx.x; c < width; c += blockDim.x) {
    float sum = 0.0f;
    for (int j = 0; j < top_k; ++j) {
      const int p = t * top_k + j;
      sum += weights[p] * ys[size_t(pair_row[p]) * size_t(width) + c];
    }
    out[c] += sum;
  }
}

}  // namespace

void launch_select_experts(const DRouter& r, const float* logits, int tokens, int32_t* experts, float* weights,
                           cudaStream_t s) {
  if (tokens <= 0) return;
  if (r.experts > kMaxExperts || r.top_k > 32 || r.n_group > 32)
    fail("internal: routing of ", r.experts, " experts, top ", r.top_k, ", ", r.n_group, " groups");
  const size_t smem = size_t(kSelectWarps) * size_t(r.experts + 64) * sizeof(float);
  if (smem > 48 * 1024) KESTREL_CUDA_CHECK(cudaFuncSetAttribute(select_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  select_kernel<<<unsigned((tokens + kSelectWarps - 1) / kSelectWarps), 32 * kSelectWarps, smem, s>>>(r, logits, tokens,
                                                                                                       experts, weights);
  KESTREL_CUDA_LAUNCHED();
}

void launch_expert_sort(const int32_t* experts, int pairs, int num_experts, const ExpertSort& out, cudaStream_t s) {
  count_kernel<<<unsigned(num_experts), kSortThreads, 0, s>>>(experts, pairs, out.counts);
  KESTREL_CUDA_LAUNCHED();
  place_kernel<<<unsigned(num_experts), kSortThreads, 0, s>>>(experts, pairs, out.counts, out.row_pair, out.pair_row);
  KESTREL_CUDA_LAUNCHED();
}

void launch_gather_rows(const __nv_bfloat16* x, int width, const int32_t* row_pair, int pairs, int top_k,
                        bool mma_order, __nv_bfloat16* xs, cudaStream_t s) {
  if (pairs <= 0) return;
  if (mma_order && width % 16 != 0) fail("internal: rows of ", width, " values gathered in the MMA order");
  gather_kernel<<<unsigned(pairs), 128, 0, s>>>(x, width, row_pair, top_k, mma_order, xs);
  KESTREL_CUDA_LAUNCHED();
}

void launch_combine_experts(const float* ys, int width, const int32_t* pair_row, const float* weights, int tokens,
                            int top_k, float* residual, cudaStream_t s) {
  if (tokens <= 0) return;
  combine_kernel<<<unsigned(tokens), 256, 0, s>>>(ys, width, pair_row, weights, top_k, residual);
  KESTREL_CUDA_LAUNCHED();
}

}  // namespace kestrel::cuda
