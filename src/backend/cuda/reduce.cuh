// Block-wide reductions shared by the small kernels.
#pragma once
#include <cuda_runtime.h>

namespace kestrel::cuda {

// Sum of v over the block (every thread gets it). `red` holds 32 floats of shared memory; the
// call synchronizes the block, so every thread must reach it.
__device__ __forceinline__ float block_sum(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = 0.0f;
  for (int i = 0; i < warps; ++i) t += red[i];
  return t;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Element i (< rotary_dim) of a vector after the rotary embedding at position pos; x holds the
// vector's rotary part. Pairs are (2j, 2j+1) when interleaved, else (j, j + rotary_dim / 2).
__device__ __forceinline__ float rotated(const float* x, int i, int pos, const float* inv_freq, float scaling,
                                         int rotary_dim, bool interleaved) {
  const int half = rotary_dim / 2;
  const int j = interleaved ? i / 2 : (i < half ? i : i - half);
  const int a = interleaved ? 2 * j : j, c = interleaved ? 2 * j + 1 : j + half;
  const float f = float(pos) * inv_freq[j];
  const float cs = cosf(f) * scaling, sn = sinf(f) * scaling;
  return i == a ? x[a] * cs - x[c] * sn : x[c] * cs + x[a] * sn;
}

}  // namespace kestrel::cuda
