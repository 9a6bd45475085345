// What every product stage shares: the RMSNorm of the residual rows into shared memory (each
// block computes it itself: 8-16 KB from the L2, cheaper than a barrier), and a matrix's rows
// shared out over the grid, block b taking a contiguous run of row groups and its warps taking
// them in turn. A warp computes R rows for all B tokens at once (dequant.cuh's row products, the
// launched kernels' own), so each weight is read once per step.
#pragma once
#include "backend/cuda/dequant.cuh"
#include "backend/cuda/persistent/weights.cuh"
#include "backend/cuda/stages/stage_args.h"

namespace kestrel::cuda {

// Rows per warp: each activation value loaded serves R rows.
template <int B>
__host__ __device__ constexpr int stage_rows() {
  return B <= 2 ? 2 : 1;
}

__device__ __forceinline__ int stage_warp() { return int(threadIdx.x) >> 5; }
__device__ __forceinline__ int stage_lane() { return int(threadIdx.x) & 31; }
constexpr int kStageWarps = kStageThreads / 32;

// out[b] = w * x[b] / rms(x[b]) for b < batch, zeros for batch <= b < B (so that the products'
// unused columns stay finite). x: global rows of n floats written by other blocks before the
// barrier; out: shared memory. red: 32 x B floats. Ends with a barrier.
template <int B>
__device__ void stage_norm(const float* x, const float* w, int batch, int n, float eps, float* out, float* red) {
  float ss[B];
  #pragma unroll
  for (int b = 0; b < B; ++b) ss[b] = 0.0f;
  for (int i = threadIdx.x; i < n / 4; i += blockDim.x)
    #pragma unroll
    for (int b = 0; b < B; ++b)
      if (b < batch) {
        const float4 v = reinterpret_cast<const float4*>(x + size_t(b) * n)[i];
        reinterpret_cast<float4*>(out + size_t(b) * n)[i] = v;
        ss[b] += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
      }
  #pragma unroll
  for (int b = 0; b < B; ++b) ss[b] = warp_sum(ss[b]);
  if (stage_lane() == 0)
    #pragma unroll
    for (int b = 0; b < B; ++b) red[stage_warp() * B + b] = ss[b];
  __syncthreads();
  float inv[B];
  #pragma unroll
  for (int b = 0; b < B; ++b) {
    float t = 0.0f;
    for (int k = 0; k < kStageWarps; ++k) t += red[k * B + b];
    inv[b] = rsqrtf(t / float(n) + eps);
  }
  for (int i = threadIdx.x; i < n / 4; i += blockDim.x) {
    const float4 g = reinterpret_cast<const float4*>(w)[i];
    #pragma unroll
    for (int b = 0; b < B; ++b) {
      float4& v = reinterpret_cast<float4*>(out + size_t(b) * n)[i];
      if (b < batch) v = make_float4(g.x * v.x * inv[b], g.y * v.y * inv[b], g.z * v.z * inv[b], g.w * v.w * inv[b]);
      else v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  }
  __syncthreads();
}

// Calls f(g) for the row groups g in [0, groups) that this warp takes: block b the run
// [b per, (b + 1) per), its warps in turn.
template <class F>
__device__ __forceinline__ void for_row_groups(int groups, F&& f) {
  const int per = (groups + int(gridDim.x) - 1) / int(gridDim.x);
  const int g0 = int(blockIdx.x) * per, g1 = min(groups, g0 + per);
  for (int g = g0 + stage_warp(); g < g1; g += kStageWarps) f(g);
}

// This block's rows of W among row groups [0, total) of R rows, W's being [first, first + its
// groups): asked of the L2 (by the calling thread), so that the stage that reads them finds them
// there instead of waiting for HBM after its barrier.
__device__ __forceinline__ void prefetch_row_share(const DLinear& W, int first, int R, int total) {
  if (!W.data) return;
  const int per = (total + int(gridDim.x) - 1) / int(gridDim.x);
  const int g0 = max(int(blockIdx.x) * per, first), g1 = min(min(total, (int(blockIdx.x) + 1) * per), first + (W.out + R - 1) / R);
  if (g0 < g1) bulk_prefetch_rows(W, (g0 - first) * R, min(W.out, (g1 - first) * R));
}

// Rows row0 .. row0 + R - 1 of W (those that exist) for the first `batch` of B tokens of x
// (rows of ldx floats, shared or global memory): y[b * ldy + row] = (accumulate ? y : 0) + W x + bias.
template <int R, int B>
__device__ __forceinline__ void stage_linear_rows(const DLinear& W, int row0, const float* x, int ldx, int batch,
                                                  float* y, int ldy, bool accumulate) {
  float acc[R][B];
  #pragma unroll
  for (int r = 0; r < R; ++r)
    #pragma unroll
    for (int b = 0; b < B; ++b) acc[r][b] = 0.0f;
  rows_dot_partial<R, B>(W, row0, x, ldx, stage_lane(), acc);
  warp_sum<R, B>(acc);
  if (stage_lane() == 0)
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = row0 + r;
      if (row >= W.out) break;
      const float bias = W.bias ? W.bias[row] : 0.0f;
      #pragma unroll
      for (int b = 0; b < B; ++b)
        if (b < batch) {
          float* o = y + size_t(b) * ldy + row;
          *o = (accumulate ? *o : 0.0f) + acc[r][b] + bias;
        }
    }
}

// Every row of W over the grid (see stage_linear_rows).
template <int B>
__device__ __forceinline__ void stage_linear(const DLinear& W, const float* x, int ldx, int batch, float* y, int ldy,
                                             bool accumulate) {
  constexpr int R = stage_rows<B>();
  for_row_groups((W.out + R - 1) / R,
                 [&](int g) { stage_linear_rows<R, B>(W, g * R, x, ldx, batch, y, ldy, accumulate); });
}

// silu(gate . x) * (up . x) for rows row0 .. row0 + R - 1 into y[b * ldy + row], b < batch.
template <int R, int B>
__device__ __forceinline__ void stage_gated_rows(const DLinear& G, const DLinear& U, int row0, const float* x, int ldx,
                                                 int batch, float* y, int ldy) {
  float g[R][B], u[R][B];
  #pragma unroll
  for (int r = 0; r < R; ++r)
    #pragma unroll
    for (int b = 0; b < B; ++b) g[r][b] = u[r][b] = 0.0f;
  gated_rows_dot_partial<R, B>(G, U, row0, x, ldx, stage_lane(), g, u, 0, 32);
  warp_sum<R, B>(g);
  warp_sum<R, B>(u);
  if (stage_lane() == 0)
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = row0 + r;
      if (row >= G.out) break;
      #pragma unroll
      for (int b = 0; b < B; ++b)
        if (b < batch) y[size_t(b) * ldy + row] = g[r][b] / (1.0f + __expf(-g[r][b])) * u[r][b];
    }
}

}  // namespace kestrel::cuda
