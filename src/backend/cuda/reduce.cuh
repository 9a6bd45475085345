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

// A row normalization by one block of kRowNormThreads threads, in registers: rows of up to
// kRowNormMax floats (a multiple of 4), each thread holding kRowNormPer float4 of x and of the
// weights. The weights are loaded first (row_norm_weights), before the kernel waits on its
// predecessor; then all of x's loads are in flight at once, so the norm costs one memory latency
// and the block's reduction.
constexpr int kRowNormThreads = 256, kRowNormPer = 8, kRowNormMax = 4 * kRowNormThreads * kRowNormPer;

__device__ __forceinline__ void row_norm_weights(const float* w, int n, float4 (&g)[kRowNormPer]) {
  #pragma unroll
  for (int i = 0; i < kRowNormPer; ++i) {
    const int j = threadIdx.x + i * kRowNormThreads;
    g[i] = j < n / 4 ? __ldg(reinterpret_cast<const float4*>(w) + j) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
}

// out[i] = w[i] * (x[i] * rsqrt(mean(x^2) + eps)) for the n floats of one row (x and out 16-byte
// aligned; out in shared or global memory), g from row_norm_weights. Ends with a barrier, so out
// is ready for every thread of the block. `red` holds 32 floats of shared memory.
__device__ __forceinline__ void block_rms_norm(const float* x, const float4 (&g)[kRowNormPer], int n, float eps,
                                               float* out, float* red) {
  float4 xv[kRowNormPer];
  float ss = 0.0f;
  #pragma unroll
  for (int i = 0; i < kRowNormPer; ++i) {
    const int j = threadIdx.x + i * kRowNormThreads;
    xv[i] = j < n / 4 ? reinterpret_cast<const float4*>(x)[j] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    ss += xv[i].x * xv[i].x + xv[i].y * xv[i].y + xv[i].z * xv[i].z + xv[i].w * xv[i].w;
  }
  const float inv = rsqrtf(block_sum(ss, red) / float(n) + eps);
  #pragma unroll
  for (int i = 0; i < kRowNormPer; ++i) {
    const int j = threadIdx.x + i * kRowNormThreads;
    if (j < n / 4)
      reinterpret_cast<float4*>(out)[j] = make_float4(g[i].x * (xv[i].x * inv), g[i].y * (xv[i].y * inv),
                                                      g[i].z * (xv[i].z * inv), g[i].w * (xv[i].w * inv));
  }
  __syncthreads();
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
