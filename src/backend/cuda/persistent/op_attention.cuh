// The attention ops of the persistent step, a block each: one KV head's QK norm, rotary and
// cache store; one split of the positions of one KV head (partial softmax: max, sum, weighted
// values); one KV head's combine. The same arithmetic as cpu::run_step_plan.
#pragma once
#include <cuda_bf16.h>

#include "backend/cuda/kv_paged.cuh"
#include "backend/cuda/persistent/program.h"
#include "backend/cuda/reduce.cuh"

namespace kestrel::cuda {

// Normalizes (when `norm`) and rotates the hd values of v in place, by the whole block; buf is hd
// floats of shared memory. Ends with a barrier.
__device__ __forceinline__ void norm_rotate(float* v, const float* norm, const PProgram& P, int pos, float* buf) {
  __shared__ float red[32];
  const int hd = P.head_dim;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < hd; i += blockDim.x) {
    buf[i] = v[i];
    ss += buf[i] * buf[i];
  }
  const float total = block_sum(ss, red);  // also the barrier after the loads into buf
  if (norm) {
    const float inv = rsqrtf(total / float(hd) + P.eps);
    __syncthreads();
    for (int i = threadIdx.x; i < hd; i += blockDim.x) buf[i] = norm[i] * (buf[i] * inv);
    __syncthreads();
  }
  for (int i = threadIdx.x; i < hd; i += blockDim.x)
    v[i] = i < P.rope.rotary_dim
               ? rotated(buf, i, pos, P.rope.inv_freq, P.rope.scaling, P.rope.rotary_dim, P.rope.interleaved)
               : buf[i];
  __syncthreads();
}

template <class T>
__device__ void qk_rope_store(const PProgram& P, const PInstr& in, float* smem) {
  const DLayer& L = P.layers[in.layer];
  const KvLayer& kv = P.kv[in.layer];
  const int g = in.a, hd = P.head_dim, G = P.heads / P.kv_heads, qr = P.heads * hd, kr = P.kv_heads * hd;
  float* key = smem + hd;  // buf, then the key's hd values
  for (int b = 0; b < P.batch; ++b) {
    float* row = P.qkv + size_t(b) * P.qkv_rows;
    const int pos = P.pos[b];
    for (int h = g * G; h < (g + 1) * G; ++h) norm_rotate(row + h * hd, L.q_norm, P, pos, smem);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) key[i] = row[qr + g * hd + i];
    __syncthreads();
    norm_rotate(key, L.k_norm, P, pos, smem);
    const size_t at = kv_offset(kv, b, pos) + size_t(g) * hd;
    T* kd = kv_rows<T>(kv.k) + at;
    T* vd = kv_rows<T>(kv.v) + at;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
      kd[i] = kv_value<T>(key[i]);
      vd[i] = kv_value<T>(row[qr + kr + g * hd + i]);
    }
    __syncthreads();
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
  const T* keys = kv_rows<T>(kv.k);
  const T* vals = kv_rows<T>(kv.v);
  for (int b = 0; b < P.batch; ++b) {
    const int len = P.pos[b] + 1, j0 = int(int64_t(s) * len / P.splits), j1 = int(int64_t(s + 1) * len / P.splits);
    const int n = j1 - j0;
    for (int i = threadIdx.x; i < G * hd; i += blockDim.x) q[i] = P.qkv[size_t(b) * P.qkv_rows + size_t(g) * G * hd + i];
    __syncthreads();
    // Scores: a warp per position, its lanes over the head dimension.
    for (int j = warp; j < n; j += warps) {
      const T* k = keys + kv_offset(kv, b, j0 + j) + size_t(g) * hd;
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
      for (int j = 0; j < n; ++j) acc += score[h * P.chunk_max + j] * kv_float(vals[kv_offset(kv, b, j0 + j) + size_t(g) * hd + d]);
      P.part[((size_t(b) * P.kv_heads + g) * P.splits + s) * G * (hd + 2) + size_t(h) * (hd + 2) + 2 + d] = acc;
    }
    __syncthreads();
  }
}

__device__ inline void attn_combine(const PProgram& P, const PInstr& in) {
  const int g = in.a, hd = P.head_dim, G = P.heads / P.kv_heads;
  for (int b = 0; b < P.batch; ++b)
    for (int i = threadIdx.x; i < G * hd; i += blockDim.x) {
      const int h = i / hd, d = i % hd;
      const float* part = P.part + (size_t(b) * P.kv_heads + g) * P.splits * G * (hd + 2) + size_t(h) * (hd + 2);
      const size_t stride = size_t(G) * (hd + 2);
      float m = -INFINITY;
      for (int s = 0; s < P.splits; ++s)
        if (part[s * stride + 1] > 0.0f) m = fmaxf(m, part[s * stride]);
      float sum = 0.0f, acc = 0.0f;
      for (int s = 0; s < P.splits; ++s) {
        const float* p = part + s * stride;
        if (p[1] <= 0.0f) continue;
        const float f = expf(p[0] - m);
        sum += f * p[1];
        acc += f * p[2 + d];
      }
      P.att[size_t(b) * P.heads * hd + size_t(g * G + h) * hd + d] = acc / sum;
    }
}

}  // namespace kestrel::cuda
