// The attention ops of the persistent step, a block each: one split of the positions of one KV
// head (its queries' QK norm and rotary, the last split's key and value into the cache, partial
// softmax: max, sum, weighted values); one KV head's combine. The same arithmetic as
// cpu::run_step_plan.
#pragma once
#include <cuda_bf16.h>

#include "backend/cuda/kv_paged.cuh"
#include "backend/cuda/persistent/op_rows.cuh"
#include "backend/cuda/persistent/program.h"
#include "backend/cuda/persistent/weights.cuh"
#include "backend/cuda/reduce.cuh"

namespace kestrel::cuda {

// A query head's or the key's hd values of one token, by one warp: QK norm (when the model has
// it) and rotary at position pos, from src (global) into dst (shared).
__device__ inline void rope_row(const PProgram& P, const float* src, const float* norm, int pos, float* dst, int lane) {
  const int hd = P.head_dim;
  float ss = 0.0f;
  for (int i = lane; i < hd; i += 32) {
    const float x = src[i];
    dst[i] = x;
    ss += x * x;
  }
  if (norm) {
    const float inv = rsqrtf(warp_sum(ss) / float(hd) + P.eps);
    for (int i = lane; i < hd; i += 32) dst[i] = norm[i] * (dst[i] * inv);
  }
  __syncwarp();
  float out[kMaxHeadDim / 32];
  #pragma unroll
  for (int k = 0; k < kMaxHeadDim / 32; ++k) {
    const int i = lane + 32 * k;
    if (i < hd)
      out[k] = i < P.rope.rotary_dim
                   ? rotated(dst, i, pos, P.rope.inv_freq, P.rope.scaling, P.rope.rotary_dim, P.rope.interleaved)
                   : dst[i];
  }
  __syncwarp();  // every lane has read dst
  #pragma unroll
  for (int k = 0; k < kMaxHeadDim / 32; ++k)
    if (lane + 32 * k < hd) dst[lane + 32 * k] = out[k];
  __syncwarp();
}

// Split in's cached rows (every position before the step's: they do not depend on it) into the
// L2, by one warp, a lane per position, while the block still runs the instruction before it.
template <class T>
__device__ void attn_split_prefetch(const PProgram& P, const PInstr& in, int lane) {
  const KvLayer& kv = P.kv[in.layer];
  const int g = in.a, s = in.b, hd = P.head_dim;
  const uint32_t bytes = uint32_t(hd) * uint32_t(sizeof(T));
  for (int b = 0; b < P.batch; ++b) {
    const int pos = P.pos[b], len = pos + 1;
    const int j0 = int(int64_t(s) * len / P.splits), j1 = int(int64_t(s + 1) * len / P.splits);
    for (int j = j0 + lane; j < j1 && j < pos; j += 32) {
      const size_t at = kv_offset(kv, b, j) + size_t(g) * hd;
      bulk_prefetch_l2(kv_rows<T>(kv.k) + at, bytes);
      bulk_prefetch_l2(kv_rows<T>(kv.v) + at, bytes);
    }
  }
}

// The split's shared memory in floats: the group's queries, the step's key, the scores, the
// positions' rows and the values' partial sums (attn_split).
__host__ __device__ constexpr size_t split_scratch_floats(int G, int hd, int chunk_max) {
  return size_t(G) * size_t(hd) + size_t(hd) + size_t(G + 1) * size_t(chunk_max) + size_t(kPersistentThreads) * size_t(G);
}

// Split s of KV head g: for each token, its group's queries after QK norm and rotary (each split
// makes its own copy), then for each query head over positions [s * len / splits, (s + 1) * len /
// splits) of its len = pos + 1: the largest score m, the sum of exp(score - m) and the values
// weighted by it, into part[(b, g, s, h)] = {m, sum, values}. The last split, whose positions
// end at the step's, first rotates the key and stores it and the value in the cache.
template <class T>
__device__ void attn_split(const PProgram& P, const PInstr& in, float* smem) {
  const DLayer& L = P.layers[in.layer];
  const KvLayer& kv = P.kv[in.layer];
  const int g = in.a, s = in.b, hd = P.head_dim, G = P.heads / P.kv_heads, qr = P.heads * hd, kr = P.kv_heads * hd;
  const bool last = s + 1 == P.splits;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x / 32;
  constexpr int D = kMaxHeadDim / 32;  // a lane's dimensions of a row: lane, lane + 32, ...
  float* q = smem;                     // [G, hd]
  float* kn = q + G * hd;              // [hd]
  float* score = kn + hd;              // [G, chunk_max]
  int* off = reinterpret_cast<int*>(score + G * P.chunk_max);  // [chunk_max]: each position's row / hd
  float* red = reinterpret_cast<float*>(off + P.chunk_max);    // [ways, G, hd]
  const T* keys = kv_rows<T>(kv.k);
  const T* vals = kv_rows<T>(kv.v);
  const int ways = int(blockDim.x) / hd;  // threads per dimension in the values' sum
  for (int b = 0; b < P.batch; ++b) {
    const int pos = P.pos[b], len = pos + 1;
    const int j0 = int(int64_t(s) * len / P.splits), j1 = int(int64_t(s + 1) * len / P.splits), n = j1 - j0;
    const float* row = P.qkv + size_t(b) * P.qkv_rows;
    for (int t = warp; t < G + (last ? 1 : 0); t += warps) {
      if (t < G) {
        rope_row(P, row + size_t(g * G + t) * hd, L.q_norm, pos, q + size_t(t) * hd, lane);
      } else {
        rope_row(P, row + qr + size_t(g) * hd, L.k_norm, pos, kn, lane);
        const size_t at = kv_offset(kv, b, pos) + size_t(g) * hd;
        T* kd = kv_rows<T>(kv.k) + at;
        T* vd = kv_rows<T>(kv.v) + at;
        for (int i = lane; i < hd; i += 32) {
          kd[i] = kv_value<T>(kn[i]);
          vd[i] = kv_value<T>(row[qr + kr + g * hd + i]);
        }
      }
    }
    trace_mark(P, 0);
    // The positions' rows, looked up in the block table once (the values' loop reads them again).
    for (int j = threadIdx.x; j < n; j += blockDim.x) off[j] = int((kv_offset(kv, b, j0 + j) + size_t(g) * hd) / size_t(hd));
    // The block's own stores of the key and value are visible to all its threads past the barrier.
    __syncthreads();
    trace_mark(P, 1);
    // Scores: a warp per position, two positions' keys loaded before either is used; each key's
    // D values per lane once for all G heads.
    for (int j = warp; j < n; j += 2 * warps) {
      const int j2 = j + warps;
      float k1[D], k2[D];
      const T* r1 = keys + size_t(off[j]) * hd;
      const T* r2 = keys + size_t(off[j2 < n ? j2 : j]) * hd;
      #pragma unroll
      for (int d = 0; d < D; ++d) {
        const int i = lane + 32 * d;
        k1[d] = i < hd ? kv_float(r1[i]) : 0.0f;
        k2[d] = i < hd ? kv_float(r2[i]) : 0.0f;
      }
      for (int h = 0; h < G; ++h) {
        float d1 = 0.0f, d2 = 0.0f;
        #pragma unroll
        for (int d = 0; d < D; ++d) {
          const int i = lane + 32 * d;
          if (i < hd) {
            d1 += q[h * hd + i] * k1[d];
            d2 += q[h * hd + i] * k2[d];
          }
        }
        d1 = warp_sum(d1);
        d2 = warp_sum(d2);
        if (lane == 0) {
          score[h * P.chunk_max + j] = d1 * P.scale;
          if (j2 < n) score[h * P.chunk_max + j2] = d2 * P.scale;
        }
      }
    }
    __syncthreads();
    trace_mark(P, 2);
    // A warp per head: its maximum and weights.
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
    trace_mark(P, 3);
    // The weighted values: `ways` threads per dimension, each over every ways-th position, each
    // value loaded once for eight heads at a time; then the ways' sums in order.
    const int d = int(threadIdx.x) % hd, w = int(threadIdx.x) / hd;
    if (w < ways)
      for (int h0 = 0; h0 < G; h0 += 8) {
        float acc[8];
        #pragma unroll
        for (int h = 0; h < 8; ++h) acc[h] = 0.0f;
        #pragma unroll 4
        for (int j = w; j < n; j += ways) {
          const float v = kv_float(vals[size_t(off[j]) * hd + d]);
          #pragma unroll
          for (int h = 0; h < 8; ++h)
            if (h0 + h < G) acc[h] += score[(h0 + h) * P.chunk_max + j] * v;
        }
        #pragma unroll
        for (int h = 0; h < 8; ++h)
          if (h0 + h < G) red[(size_t(w) * G + h0 + h) * hd + d] = acc[h];
      }
    __syncthreads();
    for (int i = threadIdx.x; i < G * hd; i += blockDim.x) {
      float acc = 0.0f;
      for (int k = 0; k < ways; ++k) acc += red[size_t(k) * G * hd + i];
      const int h = i / hd;
      P.part[((size_t(b) * P.kv_heads + g) * P.splits + s) * G * (hd + 2) + size_t(h) * (hd + 2) + 2 + (i % hd)] = acc;
    }
    __syncthreads();  // q, scores and sums are rewritten for the next token
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
