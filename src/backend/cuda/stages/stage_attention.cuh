// Attention in two stages. Split: item (token, KV head, split) takes a share of the token's
// positions; its block normalizes (QK norm) and rotates the group's queries, and the block whose
// share holds the new position also the new key, which it stores in the cache with the value and
// attends to from shared memory. It scores kStageTile positions at a time (a warp per position,
// its lanes over the head dimension), keeps an online softmax per head, and writes its max, sum
// and weighted values. Combine: a warp per (token, head, 32 dimensions) merges the splits.
#pragma once
#include <cfloat>

#include "backend/cuda/kv_paged.cuh"
#include "backend/cuda/reduce.cuh"
#include "backend/cuda/stages/stage_rows.cuh"

namespace kestrel::cuda {

// Shared memory of a split (floats): queries [G][hd], key, value, scores [G][tile], per head max,
// sum and correction, the tile's cache offsets, the rotation's cosines and sines, then the tile's
// keys and values [tile][hd] each.
inline int stage_attention_floats(int group, int hd) {
  return group * hd + 2 * hd + group * kStageTile + 3 * group + 1 + 2 * kStageTile + hd + 2 * kStageTile * hd;
}

// The vectors' QK norm (w may be null) by one warp per vector: v[i] rows of hd floats in place.
__device__ __forceinline__ void qk_norm_rows(float* v, int n, int hd, const float* w, float eps) {
  if (!w) return;
  for (int h = stage_warp(); h < n; h += kStageWarps) {
    float* row = v + h * hd;
    float ss = 0.0f;
    for (int d = stage_lane(); d < hd; d += 32) ss += row[d] * row[d];
    const float inv = rsqrtf(warp_sum(ss) / float(hd) + eps);
    for (int d = stage_lane(); d < hd; d += 32) row[d] = w[d] * (row[d] * inv);
  }
}

// Item (token x head, 32 dimensions) of the splits' merge, by one warp. The parts come from other
// blocks and are read once: loads through the L2 (.cg).
__device__ __forceinline__ void combine_item(const SArgs& a, int bh, int d, bool frag) {
  const int hd = a.head_dim, splits = a.splits;
  constexpr int kRegs = kStageMaxSplits / 32;
  const float* ml = a.part_ml + size_t(bh) * splits * 2;
  float m[kRegs], l[kRegs], mx = -FLT_MAX;
  #pragma unroll
  for (int r = 0; r < kRegs; ++r) {
    const int s = r * 32 + stage_lane();
    m[r] = s < splits ? __ldcg(ml + 2 * s) : -FLT_MAX;
    l[r] = s < splits ? __ldcg(ml + 2 * s + 1) : 0.0f;
    mx = fmaxf(mx, m[r]);
  }
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float total = 0.0f;
  #pragma unroll
  for (int r = 0; r < kRegs; ++r) {
    m[r] = l[r] > 0.0f ? __expf(m[r] - mx) : 0.0f;  // each split's share
    total += l[r] * m[r];
  }
  total = warp_sum(total);
  const float* pv = a.part + size_t(bh) * splits * hd;
  float o = 0.0f;
  // Eight splits' values loaded before the first is used; split s's share is lane s % 32's
  // m[s / 32] (the eight lie in one register of the array).
  for (int s0 = 0; s0 < splits; s0 += 8) {
    float v[8];
    #pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = s0 + j < splits && d < hd ? __ldcg(pv + size_t(s0 + j) * hd + d) : 0.0f;
    float mr = m[0];
    #pragma unroll
    for (int r = 1; r < kRegs; ++r)
      if (r == s0 / 32) mr = m[r];
    #pragma unroll
    for (int j = 0; j < 8; ++j) o += __shfl_sync(0xffffffffu, mr, (s0 + j) & 31) * v[j];
  }
  if (d >= hd) return;
  if (frag) {  // o's input as fragment rows (stage_mma.cuh): row b, element h hd + d
    const int row = a.heads * hd, b = bh / a.heads;
    frag_store(reinterpret_cast<uint32_t*>(a.att) + size_t(b) * row, (bh % a.heads) * hd + d, o / total);
  } else {
    a.att[size_t(bh) * hd + d] = o / total;
  }
}

template <int B, class T>
__device__ __noinline__ void stage_attention_split(const SArgs& a, const DLayer& L, const KvLayer& kv, float* sm) {
  const int hd = a.head_dim, nq = a.heads, nkv = a.kv_heads, G = nq / nkv, half = a.rope.rotary_dim / 2;
  const int qkv_row = (nq + 2 * nkv) * hd, splits = a.splits;
  float* s_q = sm;                    // [G][hd], then the key [hd] and the value [hd]
  float* s_k = s_q + G * hd;
  float* s_v = s_k + hd;
  float* s_s = s_v + hd;              // [G][kStageTile]
  float* s_m = s_s + G * kStageTile;  // [G] running max, sum, this tile's correction
  float* s_l = s_m + G;
  float* s_c = s_l + G;
  size_t* s_off = reinterpret_cast<size_t*>(s_c + G + (G & 1));  // [kStageTile] (8-byte aligned: see floats)
  float* s_cs = reinterpret_cast<float*>(s_off + kStageTile);    // [half] cosines, [half] sines
  float* s_kt = s_cs + hd;                                         // [kStageTile][hd] the tile's keys
  float* s_vt = s_kt + kStageTile * hd;                            // and values
  constexpr int kPer = kStageMaxHeadDim * 16 / kStageThreads;    // (head, dimension) pairs per thread
  constexpr int kLoads = kStageTile * kStageMaxHeadDim / kStageThreads;  // a tile's values per thread
  const int items = a.batch * nkv * splits;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int b = item / (nkv * splits), kvh = (item / splits) % nkv, split = item % splits;
    const int pos = a.pos[b], len = pos + 1, chunk = (len + splits - 1) / splits;
    const int begin = min(len, split * chunk), end = min(len, begin + chunk);
    const bool has_new = begin <= pos && pos < end;
    const float* src = a.qkv + size_t(b) * qkv_row;
    // The queries (and the new key and value) into shared memory, normalized and rotated.
    for (int i = threadIdx.x; i < G * hd; i += blockDim.x) s_q[i] = src[kvh * G * hd + i];
    if (has_new)
      for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        s_k[d] = src[nq * hd + kvh * hd + d];
        s_v[d] = src[(nq + nkv) * hd + kvh * hd + d];
      }
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
      const float f = float(pos) * a.rope.inv_freq[j];
      s_cs[j] = cosf(f) * a.rope.scaling;
      s_cs[half + j] = sinf(f) * a.rope.scaling;
    }
    if (threadIdx.x < G) s_m[threadIdx.x] = -FLT_MAX, s_l[threadIdx.x] = 0.0f;
    __syncthreads();
    qk_norm_rows(s_q, G, hd, L.q_norm, a.eps);
    if (has_new) qk_norm_rows(s_k, 1, hd, L.k_norm, a.eps);
    __syncthreads();
    const int nv = G + (has_new ? 1 : 0);  // the key follows the queries
    for (int t = threadIdx.x; t < nv * half; t += blockDim.x) {
      const int h = t / half, j = t % half;
      const int i0 = a.rope.interleaved ? 2 * j : j, i1 = a.rope.interleaved ? 2 * j + 1 : j + half;
      float* row = s_q + h * hd;  // h == G: s_k
      const float x0 = row[i0], x1 = row[i1], c = s_cs[j], s = s_cs[half + j];
      row[i0] = x0 * c - x1 * s;
      row[i1] = x1 * c + x0 * s;
    }
    __syncthreads();
    if (has_new) {  // the cache keeps what later steps will read: attend to the same rounded values
      const size_t at = kv_offset(kv, b, pos) + size_t(kvh) * hd;
      for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        const T k = kv_value<T>(s_k[d]), v = kv_value<T>(s_v[d]);
        kv_rows<T>(kv.k)[at + d] = k;
        kv_rows<T>(kv.v)[at + d] = v;
        s_k[d] = kv_float(k), s_v[d] = kv_float(v);
      }
    }
    float acc[kPer];
    #pragma unroll
    for (int i = 0; i < kPer; ++i) acc[i] = 0.0f;
    const T* kbase = kv_rows<T>(kv.k) + size_t(kvh) * hd;
    const T* vbase = kv_rows<T>(kv.v) + size_t(kvh) * hd;
    for (int t0 = begin; t0 < end; t0 += kStageTile) {
      const int n = min(kStageTile, end - t0);
      if (threadIdx.x < n) s_off[threadIdx.x] = t0 + int(threadIdx.x) == pos ? 0 : kv_offset(kv, b, t0 + threadIdx.x);
      __syncthreads();  // s_off, and (first tile) the stored key
      // The tile's keys and values into shared memory, every thread's loads in flight at once.
      {
        float kt[kLoads], vt[kLoads];
        #pragma unroll
        for (int i = 0; i < kLoads; ++i) {
          const int e = threadIdx.x + i * kStageThreads, p = e / hd, d = e % hd;
          const bool ok = e < n * hd && t0 + p != pos;
          kt[i] = kv_load(kbase, ok ? s_off[p] + d : 0, ok);
          vt[i] = kv_load(vbase, ok ? s_off[p] + d : 0, ok);
        }
        #pragma unroll
        for (int i = 0; i < kLoads; ++i) {
          const int e = threadIdx.x + i * kStageThreads, p = e / hd, d = e % hd;
          if (e < n * hd) {
            const bool fresh = t0 + p == pos;
            s_kt[e] = fresh ? s_k[d] : kt[i];
            s_vt[e] = fresh ? s_v[d] : vt[i];
          }
        }
      }
      __syncthreads();
      // Scores: a warp per position, its lanes over the dimensions, every query head at once.
      for (int p = stage_warp(); p < kStageTile; p += kStageWarps) {
        const bool live = p < n;
        for (int h = 0; h < G; ++h) {
          float dot = 0.0f;
          if (live)
            for (int d = stage_lane(); d < hd; d += 32) dot += s_q[h * hd + d] * s_kt[p * hd + d];
          dot = warp_sum(dot);
          if (stage_lane() == 0) s_s[h * kStageTile + p] = live ? dot * a.scale : -FLT_MAX;
        }
      }
      __syncthreads();
      // The online softmax: a warp per head, a lane per position.
      for (int h = stage_warp(); h < G; h += kStageWarps) {
        const float v = s_s[h * kStageTile + stage_lane()];
        float mt = v;
        for (int o = 16; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
        const float m_old = s_m[h], m_new = fmaxf(m_old, mt);
        const float p = stage_lane() < n ? __expf(v - m_new) : 0.0f;
        const float sum = warp_sum(p);
        s_s[h * kStageTile + stage_lane()] = p;
        __syncwarp();
        if (stage_lane() == 0) {
          const float c = __expf(m_old - m_new);
          s_c[h] = c, s_m[h] = m_new, s_l[h] = s_l[h] * c + sum;
        }
      }
      __syncthreads();
      // Values: a thread per (head, dimension) pair.
      #pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int e = threadIdx.x + i * kStageThreads;
        if (e < G * hd) {
          const int h = e / hd, d = e % hd;
          float v = acc[i] * s_c[h];
          for (int p = 0; p < n; ++p) v += s_s[h * kStageTile + p] * s_vt[p * hd + d];
          acc[i] = v;
        }
      }
      __syncthreads();  // s_s, s_off and the rows are the next tile's
    }
    // This split's part of every query head of the group.
    const size_t base = (size_t(b) * nq + size_t(kvh) * G) * splits + split;  // + h * splits
    #pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = threadIdx.x + i * kStageThreads;
      if (e < G * hd) {
        const int h = e / hd, d = e % hd;
        a.part[(base + size_t(h) * splits) * hd + d] = acc[i];
      }
    }
    if (threadIdx.x < G) {
      a.part_ml[(base + size_t(threadIdx.x) * splits) * 2] = s_m[threadIdx.x];
      a.part_ml[(base + size_t(threadIdx.x) * splits) * 2 + 1] = s_l[threadIdx.x];
    }
    __syncthreads();  // shared memory is the next item's
  }
}

// The splits merged: a warp per (token, head, 32 dimensions) over the grid; frag: as fragment rows.
__device__ __noinline__ void stage_attention_combine(const SArgs& a, bool frag) {
  const int chunks = (a.head_dim + 31) / 32;
  const int warps = int(gridDim.x) * kStageWarps, items = a.batch * a.heads * chunks;
  for (int item = int(blockIdx.x) * kStageWarps + stage_warp(); item < items; item += warps)
    combine_item(a, item / chunks, (item % chunks) * 32 + stage_lane(), frag);
}

}  // namespace kestrel::cuda
