// Block- and warp-wide reductions shared by the kernels.
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

// log2 of warp_spread_sums' N: its totals sit in lanes n << (5 - spread_bits(N)) and up.
__host__ __device__ constexpr int spread_bits(int n) { return n >= 32 ? 5 : n >= 16 ? 4 : n >= 8 ? 3 : n >= 4 ? 2 : n >= 2 ? 1 : 0; }

// Stage S of warp_spread_sums: N >> S values to half as many. The widths are template constants
// so that every loop unrolls and v stays in registers (a loop bound from an unrolled outer loop
// left the array in local memory).
template <int N, int S>
__device__ __forceinline__ void spread_stage(float (&v)[N], int lane) {
  if constexpr ((N >> S) >= 2) {
    constexpr int n = N >> S, o = 16 >> S;
    const bool hi = lane & o;
    #pragma unroll
    for (int i = 0; i < n / 2; ++i) {
      const float send = hi ? v[i] : v[i + n / 2], keep = hi ? v[i + n / 2] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
    }
    spread_stage<N, S + 1>(v, lane);
  }
}

// Sums each of v[0..N) over the warp (N a power of two, at most 32) and returns one total per
// lane: value n's in the lanes whose top log2(N) bits spell n (lane >> (5 - log2 N) == n).
// Halving butterfly: each stage a lane keeps half of its values and adds its partner's half of
// the same ones, so N totals take N - 1 exchanges of shrinking width plus 5 - log2(N) full ones,
// instead of 5 N.
template <int N>
__device__ __forceinline__ float warp_spread_sums(float (&v)[N], int lane) {
  constexpr int kStages = spread_bits(N);
  static_assert((1 << kStages) == N, "a power of two, at most 32");
  spread_stage<N, 0>(v, lane);
  #pragma unroll
  for (int o = 16 >> kStages; o > 0; o >>= 1) v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
  return v[0];
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
