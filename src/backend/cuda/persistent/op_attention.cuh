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

// The split's shared memory in floats: the group's queries, the step's key, the scores and the
// positions' rows in the cache (when they are not staged).
__host__ __device__ constexpr size_t split_scratch_floats(int G, int hd, int chunk_max) {
  return size_t(G) * size_t(hd) + size_t(hd) + size_t(G + 1) * size_t(chunk_max);
}

// The split's stage: per token, the K rows then the V rows of its positions [j0, j1), a row every
// split_row_stride bytes (≡ 16 mod 128: the 32 lanes of a warp reading 16 bytes of 32 rows meet
// no bank twice per wavefront). The rows before the step's position come by bulk copies before
// the wait; the last split writes the step's own row there itself.
__host__ __device__ inline uint32_t split_row_stride(int hd, int value_bytes) {
  return pad_rows_to(uint32_t(hd * value_bytes), 16);
}
__device__ __forceinline__ void split_range(const PProgram& P, int s, int b, int& j0, int& j1) {
  const int len = P.pos[b] + 1;
  j0 = int(int64_t(s) * len / P.splits), j1 = int(int64_t(s + 1) * len / P.splits);
}

// By warp 0, before the wait: split in's cached rows into the stage when they fit there and every
// row is 16-byte aligned; true (in every lane) if so. Reads P.kv, not s_kv (warp 1 may be
// rewriting it).
template <class T>
__device__ bool stage_split(const PProgram& P, const PInstr& in, uint8_t* stage, uint64_t* bar, int lane) {
  const KvLayer& kv = P.kv[in.layer];
  const int g = in.a, s = in.b, hd = P.head_dim;
  const uint32_t rb = uint32_t(hd) * sizeof(T), rs = split_row_stride(hd, sizeof(T));
  if (rb % 16 || (size_t(kv.row) * sizeof(T)) % 16 || (reinterpret_cast<uintptr_t>(kv.k) | reinterpret_cast<uintptr_t>(kv.v)) % 16)
    return false;
  uint32_t total = 0, copied = 0;
  for (int b = 0; b < P.batch; ++b) {
    int j0, j1;
    split_range(P, s, b, j0, j1);
    total += 2u * uint32_t(j1 - j0) * rs;
    copied += 2u * uint32_t(max(0, min(j1, P.pos[b]) - j0)) * rb;
  }
  if (total > P.stage_bytes) return false;
  if (lane == 0) stage_expect(bar, copied);
  __syncwarp();
  uint32_t at = 0;
  for (int b = 0; b < P.batch; ++b) {
    int j0, j1;
    split_range(P, s, b, j0, j1);
    const uint32_t n = uint32_t(j1 - j0);
    for (int j = j0 + lane; j < j1 && j < P.pos[b]; j += 32) {
      const size_t off = kv_offset(kv, b, j) + size_t(g) * hd;
      bulk_copy(stage + at + uint32_t(j - j0) * rs, kv_rows<T>(kv.k) + off, rb, bar);
      bulk_copy(stage + at + (n + uint32_t(j - j0)) * rs, kv_rows<T>(kv.v) + off, rb, bar);
    }
    at += 2u * n * rs;
  }
  return true;
}

// Eight values of a row from p (16-byte aligned) as floats.
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&f)[8]) {
  const uint4 w = *reinterpret_cast<const uint4*>(p);
  const uint32_t u[4] = {w.x, w.y, w.z, w.w};
  #pragma unroll
  for (int i = 0; i < 4; ++i) f[2 * i] = __uint_as_float(u[i] << 16), f[2 * i + 1] = __uint_as_float(u[i] & 0xFFFF0000u);
}
__device__ __forceinline__ void load8(const float* p, float (&f)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], c = reinterpret_cast<const float4*>(p)[1];
  f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = c.x, f[5] = c.y, f[6] = c.z, f[7] = c.w;
}

// Split s of KV head g: for each token, its group's queries after QK norm and rotary (each split
// makes its own copy), then for each query head over positions [s * len / splits, (s + 1) * len /
// splits) of its len = pos + 1: the largest score m, the sum of exp(score - m) and the values
// weighted by it, into part[(b, g, s, h)] = {m, sum, values}. The last split, whose positions
// end at the step's, first rotates the key and stores it and the value in the cache (and in the
// stage). Scores: a warp per head, a lane per position; values: a warp per head, a lane per
// dimension, so that no sum crosses threads. staged: the rows in the stage (stage_split), else
// read from the cache.
template <class T>
__device__ void attn_split(const PProgram& P, const PInstr& in, float* smem, uint8_t* staged) {
  const DLayer& L = layer_of(P, in.layer);
  const KvLayer& kv = kv_of(P, in.layer);
  const int g = in.a, s = in.b, hd = P.head_dim, G = P.heads / P.kv_heads, qr = P.heads * hd, kr = P.kv_heads * hd;
  const bool last = s + 1 == P.splits;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x / 32, cm = P.chunk_max;
  float* q = smem;       // [G, hd]
  float* kn = q + G * hd;  // [hd]
  float* score = kn + hd;  // [G, chunk_max]
  int* off = reinterpret_cast<int*>(score + G * cm);  // [chunk_max]: each position's row / hd (not staged)
  T* keys = kv_rows<T>(kv.k);
  T* vals = kv_rows<T>(kv.v);
  const uint32_t rs = split_row_stride(hd, sizeof(T));
  const bool vec = hd % 8 == 0;
  uint32_t at = 0;  // token b's rows in the stage
  for (int b = 0; b < P.batch; ++b) {
    const int pos = P.pos[b];
    int j0, j1;
    split_range(P, s, b, j0, j1);
    const int n = j1 - j0;
    T* sk = staged ? reinterpret_cast<T*>(staged + at) : nullptr;
    T* sv = staged ? reinterpret_cast<T*>(staged + at + uint32_t(n) * rs) : nullptr;
    const size_t rsT = rs / sizeof(T);
    const float* row = P.qkv + size_t(b) * P.qkv_rows;
    for (int t = warp; t < G + (last ? 1 : 0); t += warps) {
      if (t < G) {
        rope_row(P, row + size_t(g * G + t) * hd, L.q_norm, pos, q + size_t(t) * hd, lane);
      } else {
        rope_row(P, row + qr + size_t(g) * hd, L.k_norm, pos, kn, lane);
        const size_t o = kv_offset(kv, b, pos) + size_t(g) * hd;
        for (int i = lane; i < hd; i += 32) {
          const T kvk = kv_value<T>(kn[i]), kvv = kv_value<T>(row[qr + kr + g * hd + i]);
          keys[o + i] = kvk;
          vals[o + i] = kvv;
          if (staged) sk[size_t(n - 1) * rsT + i] = kvk, sv[size_t(n - 1) * rsT + i] = kvv;
        }
      }
    }
    trace_mark(P, 0);
    if (!staged)
      for (int j = threadIdx.x; j < n; j += blockDim.x) off[j] = int((kv_offset(kv, b, j0 + j) + size_t(g) * hd) / size_t(hd));
    // The block's own stores of the key and value are visible to all its threads past the barrier.
    __syncthreads();
    trace_mark(P, 1);
    const auto krow = [&](int j) -> const T* { return staged ? sk + size_t(j) * rsT : keys + size_t(off[j]) * hd; };
    const auto vrow = [&](int j) -> const T* { return staged ? sv + size_t(j) * rsT : vals + size_t(off[j]) * hd; };
    for (int h = warp; h < G; h += warps) {
      const float* qh = q + size_t(h) * hd;
      for (int j = lane; j < n; j += 32) {
        const T* kj = krow(j);
        float d = 0.0f;
        if (vec) {
          for (int i = 0; i < hd; i += 8) {
            float k8[8];
            load8(kj + i, k8);
            const float4 qa = *reinterpret_cast<const float4*>(qh + i), qb = *reinterpret_cast<const float4*>(qh + i + 4);
            d += qa.x * k8[0] + qa.y * k8[1] + qa.z * k8[2] + qa.w * k8[3] + qb.x * k8[4] + qb.y * k8[5] + qb.z * k8[6] +
                 qb.w * k8[7];
          }
        } else {
          for (int i = 0; i < hd; ++i) d += qh[i] * kv_float(kj[i]);
        }
        score[h * cm + j] = d * P.scale;
      }
    }
    __syncwarp();
    trace_mark(P, 2);
    // A warp per head (the warp that wrote its scores): its maximum and weights, then its values,
    // a lane per dimension over every position.
    for (int h = warp; h < G; h += warps) {
      float m = -INFINITY;
      for (int j = lane; j < n; j += 32) m = fmaxf(m, score[h * cm + j]);
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      float sum = 0.0f;
      for (int j = lane; j < n; j += 32) sum += (score[h * cm + j] = expf(score[h * cm + j] - m));
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      __syncwarp();  // every lane's weights, for every lane
      float* out = P.part + ((size_t(b) * P.kv_heads + g) * P.splits + s) * G * (hd + 2) + size_t(h) * (hd + 2);
      if (lane == 0) out[0] = m, out[1] = sum;
      constexpr int D = kMaxHeadDim / 32;
      float acc[D];
      #pragma unroll
      for (int k = 0; k < D; ++k) acc[k] = 0.0f;
      #pragma unroll 2
      for (int j = 0; j < n; ++j) {
        const float p = score[h * cm + j];
        const T* vj = vrow(j);
        #pragma unroll
        for (int k = 0; k < D; ++k)
          if (lane + 32 * k < hd) acc[k] += p * kv_float(vj[lane + 32 * k]);
      }
      #pragma unroll
      for (int k = 0; k < D; ++k)
        if (lane + 32 * k < hd) out[2 + lane + 32 * k] = acc[k];
    }
    trace_mark(P, 3);
    __syncthreads();  // q, scores and the rows' offsets are rewritten for the next token
    at += 2u * uint32_t(n) * rs;
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
