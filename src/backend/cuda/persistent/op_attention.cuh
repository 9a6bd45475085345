// The attention ops of the persistent step, a block each: one KV head's QK norm, rotary and
// cache store; one split of the positions of one KV head (partial softmax: max, sum, weighted
// values); one KV head's combine. The same arithmetic as cpu::run_step_plan.
#pragma once
#include <cuda_bf16.h>

#include "backend/cuda/kv_paged.cuh"
#include "backend/cuda/persistent/program.h"
#include "backend/cuda/reduce.cuh"

namespace kestrel::cuda {

// KV head g's query heads and key for every token, a warp each: QK norm (when the model has it)
// and rotary through the warp's hd floats of shared memory; the queries in place, the key and
// the value into the cache at the token's position.
template <class T>
__device__ void qk_rope_store(const PProgram& P, const PInstr& in, float* smem) {
  const DLayer& L = P.layers[in.layer];
  const KvLayer& kv = P.kv[in.layer];
  const int g = in.a, hd = P.head_dim, G = P.heads / P.kv_heads, qr = P.heads * hd, kr = P.kv_heads * hd;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x / 32;
  float* buf = smem + size_t(warp) * hd;
  for (int task = warp; task < P.batch * (G + 1); task += warps) {
    const int b = task / (G + 1), t = task % (G + 1);  // t < G: query head g G + t; t = G: the key
    float* row = P.qkv + size_t(b) * P.qkv_rows;
    float* v = t < G ? row + size_t(g * G + t) * hd : row + qr + size_t(g) * hd;
    const float* norm = t < G ? L.q_norm : L.k_norm;
    const int pos = P.pos[b];
    float ss = 0.0f;
    for (int i = lane; i < hd; i += 32) {
      const float x = v[i];
      buf[i] = x;
      ss += x * x;
    }
    if (norm) {
      const float inv = rsqrtf(warp_sum(ss) / float(hd) + P.eps);
      for (int i = lane; i < hd; i += 32) buf[i] = norm[i] * (buf[i] * inv);
    }
    __syncwarp();
    float out[kMaxHeadDim / 32];
    #pragma unroll
    for (int k = 0; k < kMaxHeadDim / 32; ++k) {
      const int i = lane + 32 * k;
      if (i < hd)
        out[k] = i < P.rope.rotary_dim
                     ? rotated(buf, i, pos, P.rope.inv_freq, P.rope.scaling, P.rope.rotary_dim, P.rope.interleaved)
                     : buf[i];
    }
    __syncwarp();  // buf is read; the next task overwrites it
    if (t < G) {
      #pragma unroll
      for (int k = 0; k < kMaxHeadDim / 32; ++k)
        if (lane + 32 * k < hd) v[lane + 32 * k] = out[k];
    } else {
      const size_t at = kv_offset(kv, b, pos) + size_t(g) * hd;
      T* kd = kv_rows<T>(kv.k) + at;
      T* vd = kv_rows<T>(kv.v) + at;
      #pragma unroll
      for (int k = 0; k < kMaxHeadDim / 32; ++k) {
        const int i = lane + 32 * k;
        if (i < hd) {
          kd[i] = kv_value<T>(out[k]);
          vd[i] = kv_value<T>(row[qr + kr + g * hd + i]);
        }
      }
    }
  }
}

// Split s of KV head g: for each token and each of the group's query heads, over positions
// [s * len / splits, (s + 1) * len / splits) of its len = pos + 1: the largest score m, the sum
// of exp(score - m) and the values weighted by it, into part[(b, g, s, h)] = {m, sum, values}.
template <class T>
__device__ void attn_split(const PProgram& P, const PInstr& in, float* smem) {
  const KvLayer& kv = P.kv[in.layer];
  const int g = in.a, s = in.b, hd = P.head_dim, G = P.heads / P.kv_heads;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x / 32;
  float* q = smem;                   // [G, hd]
  float* score = smem + G * hd;      // [G, chunk_max]
  int* off = reinterpret_cast<int*>(score + G * P.chunk_max);  // [chunk_max]: each position's row / hd
  const T* keys = kv_rows<T>(kv.k);
  const T* vals = kv_rows<T>(kv.v);
  for (int b = 0; b < P.batch; ++b) {
    const int len = P.pos[b] + 1, j0 = int(int64_t(s) * len / P.splits), j1 = int(int64_t(s + 1) * len / P.splits);
    const int n = j1 - j0;
    for (int i = threadIdx.x; i < G * hd; i += blockDim.x) q[i] = P.qkv[size_t(b) * P.qkv_rows + size_t(g) * G * hd + i];
    // The positions' rows, looked up in the block table once (the values' loop reads them G hd times).
    for (int j = threadIdx.x; j < n; j += blockDim.x) off[j] = int((kv_offset(kv, b, j0 + j) + size_t(g) * hd) / size_t(hd));
    __syncthreads();
    // Scores: a warp per position, its lanes over the head dimension.
    for (int j = warp; j < n; j += warps) {
      const T* k = keys + size_t(off[j]) * hd;
      for (int h = 0; h < G; ++h) {
        float d = 0.0f;
        for (int i = lane; i < hd; i += 32) d += q[h * hd + i] * kv_float(k[i]);
        for (int o = 16; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
        if (lane == 0) score[h * P.chunk_max + j] = d * P.scale;
      }
    }
    __syncthreads();
    // A warp per head: its maximum and weights; then the weighted values, a thread per dimension.
    for (int h = warp; h < G; h += warps) {
      float m = -INFINITY;
      for (int j = lane; j < n; j += 32) m = fmaxf(m, score[h * P.chunk_max + j]);
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      float sum = 0.0f;
      for (int j = lane; j < n; j += 32) sum += (score[h * P.chunk_max + j] = expf(score[h * P.chunk_max + j] - m));
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      float* out = P.part + ((size_t(b) * P.kv_heads + g) * P.splits + s) * G * (hd + 2) + size_t(h) * (hd + 2);
      if (lane == 0) out[0] = m, out[1] = sum;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * hd; i += blockDim.x) {
      const int h = i / hd, d = i % hd;
      float acc = 0.0f;
      #pragma unroll 8
      for (int j = 0; j < n; ++j) acc += score[h * P.chunk_max + j] * kv_float(vals[size_t(off[j]) * hd + d]);
      P.part[((size_t(b) * P.kv_heads + g) * P.splits + s) * G * (hd + 2) + size_t(h) * (hd + 2) + 2 + d] = acc;
    }
    __syncthreads();
  }
}

// KV head g's splits combined, for every token: each split's share of a head (its largest
// score against the head's largest, times its sum, over the head's total) computed once into
// shared memory, then a thread per (head, dimension) adds the splits' weighted values.
__device__ inline void attn_combine(const PProgram& P, const PInstr& in, float* smem) {
  const int g = in.a, hd = P.head_dim, G = P.heads / P.kv_heads, S = P.splits;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x / 32;
  const size_t stride = size_t(G) * (hd + 2);  // one split's heads
  float* share = smem;                          // [G, S]
  for (int b = 0; b < P.batch; ++b) {
    const float* part = P.part + (size_t(b) * P.kv_heads + g) * S * stride;
    for (int h = warp; h < G; h += warps) {
      float m = -INFINITY;
      for (int s = lane; s < S; s += 32)
        if (part[s * stride + h * (hd + 2) + 1] > 0.0f) m = fmaxf(m, part[s * stride + h * (hd + 2)]);
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      float total = 0.0f;
      for (int s = lane; s < S; s += 32) {
        const float* p = part + s * stride + h * (hd + 2);
        const float f = p[1] > 0.0f ? expf(p[0] - m) : 0.0f;
        share[h * S + s] = f;
        total += f * p[1];
      }
      total = warp_sum(total);
      const float inv = 1.0f / total;
      for (int s = lane; s < S; s += 32) share[h * S + s] *= inv;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * hd; i += blockDim.x) {
      const int h = i / hd, d = i % hd;
      const float* p = part + size_t(h) * (hd + 2) + 2 + d;
      float acc = 0.0f;
      #pragma unroll 8
      for (int s = 0; s < S; ++s) acc += share[h * S + s] * p[s * stride];
      P.att[size_t(b) * P.heads * hd + size_t(g * G + h) * hd + d] = acc;
    }
    __syncthreads();  // share is rewritten for the next token
  }
}

}  // namespace kestrel::cuda
