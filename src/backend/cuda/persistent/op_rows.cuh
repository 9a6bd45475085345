// What every product tile of the persistent step shares: the RMSNorm of the batch's residual
// rows into the block's scratch, and rows [r0, r1) of a matrix against the batch's input rows,
// a warp per group of rows (the same rows always to the same warp, so a warp may accumulate a
// row over several matrices without a barrier).
#pragma once
#include "backend/cuda/dequant.cuh"
#include "backend/cuda/persistent/program.h"
#include "backend/cuda/reduce.cuh"

namespace kestrel::cuda {

static_assert(kPersistentThreads == kRowNormThreads, "a persistent block normalizes a row as block_rms_norm does");

// The block's scratch of normalized rows [8, hidden].
__device__ __forceinline__ float* block_xn(const PProgram& P) { return P.xn + size_t(blockIdx.x) * 8 * P.hidden; }

// xn[b] = RMSNorm(x[b]) * w for the batch's rows; ends with a barrier.
__device__ __forceinline__ void norm_rows(const PProgram& P, const float* w, float* xn) {
  __shared__ float red[32];
  float4 g[kRowNormPer];
  row_norm_weights(w, P.hidden, g);
  for (int b = 0; b < P.batch; ++b) block_rms_norm(P.x + size_t(b) * P.hidden, g, P.hidden, P.eps, xn + size_t(b) * P.hidden, red);
}

// For rows [r0, r1) of W: out(row, b, value + bias) for every token b < batch, by the first lane
// of the row's warp. x: B rows of W.in values, ldx apart (rows past the batch are read, unused).
template <int B, class Out>
__device__ __forceinline__ void tile_rows(const DLinear& W, int r0, int r1, const float* x, int ldx, int batch, Out out) {
  constexpr int R = rows_per_warp<B>();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = kPersistentThreads / 32;
  for (int row = r0 + warp * R; row < r1; row += warps * R) {
    float acc[R][B];
    #pragma unroll
    for (int r = 0; r < R; ++r)
      #pragma unroll
      for (int b = 0; b < B; ++b) acc[r][b] = 0.0f;
    rows_dot_partial<R, B>(W, row, x, ldx, lane, acc);
    warp_sum<R, B>(acc);
    if (lane == 0)
      #pragma unroll
      for (int r = 0; r < R; ++r) {
        if (row + r >= r1) break;
        const float bias = W.bias ? W.bias[row + r] : 0.0f;
        #pragma unroll
        for (int b = 0; b < B; ++b)
          if (b < batch) out(row + r, b, acc[r][b] + bias);
      }
  }
}

// The same for gate and up rows of a gated FFN: out(row, b, silu(gate) * up).
template <int B, class Out>
__device__ __forceinline__ void tile_gated_rows(const DLinear& G, const DLinear& U, int r0, int r1, const float* x, int ldx,
                                                int batch, Out out) {
  constexpr int R = rows_per_warp<B>();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = kPersistentThreads / 32;
  for (int row = r0 + warp * R; row < r1; row += warps * R) {
    float g[R][B], u[R][B];
    #pragma unroll
    for (int r = 0; r < R; ++r)
      #pragma unroll
      for (int b = 0; b < B; ++b) g[r][b] = u[r][b] = 0.0f;
    gated_rows_dot_partial<R, B>(G, U, row, x, ldx, lane, g, u, 0, 32);
    warp_sum<R, B>(g);
    warp_sum<R, B>(u);
    if (lane == 0)
      #pragma unroll
      for (int r = 0; r < R; ++r) {
        if (row + r >= r1) break;
        #pragma unroll
        for (int b = 0; b < B; ++b)
          if (b < batch) {
            const float gv = g[r][b] + (G.bias ? G.bias[row + r] : 0.0f), uv = u[r][b] + (U.bias ? U.bias[row + r] : 0.0f);
            out(row + r, b, gv / (1.0f + expf(-gv)) * uv);
          }
      }
  }
}

}  // namespace kestrel::cuda
