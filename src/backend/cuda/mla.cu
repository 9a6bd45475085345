#include <cuda_bf16.h>

#include <cfloat>
#include <cub/block/block_scan.cuh>

#include "backend/cuda/check.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/mla.h"
#include "backend/cuda/reduce.cuh"

namespace kestrel::cuda {
namespace {

__device__ __forceinline__ float bf16_at(const uint8_t* data, size_t i) {
  return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(data)[i]);
}

// One block per sequence row.
__global__ void mla_latent_store_kernel(const float* __restrict__ kv, MlaShape m, const float* __restrict__ norm,
                                        float eps, RopeArgs rope, const int32_t* __restrict__ positions,
                                        KvLayer cache) {
  extern __shared__ float row[];  // latent floats
  __shared__ float red[32];
  const int b = blockIdx.x, lat = m.latent();
  pdl_enter();
  const int pos = positions[b];
  float ss = 0.0f;
  for (int i = threadIdx.x; i < lat; i += blockDim.x) {
    row[i] = kv[size_t(b) * lat + i];
    if (i < m.rank) ss += row[i] * row[i];
  }
  const float inv = rsqrtf(block_sum(ss, red) / float(m.rank) + eps);  // also synchronizes
  float* dst = cache.k + size_t(b) * cache.seq_stride + size_t(pos) * lat;
  for (int i = threadIdx.x; i < lat; i += blockDim.x)
    dst[i] = i < m.rank ? norm[i] * (row[i] * inv)
                        : rotated(row + m.rank, i - m.rank, pos, rope.inv_freq, rope.scaling, m.rope, rope.interleaved);
}

// One block per (head, row): W_UK_h^T q_nope (threads over the rank, reading rows of kv_b
// coalesced), then the rotated rope part.
__global__ void mla_query_kernel(const float* __restrict__ q, MlaShape m, DLinear kv_b, RopeArgs rope,
                                 const int32_t* __restrict__ positions, float* __restrict__ q_latent) {
  extern __shared__ float qh[];  // nope + rope floats
  const int h = blockIdx.x, b = blockIdx.y, qk = m.nope + m.rope;
  pdl_enter();
  for (int i = threadIdx.x; i < qk; i += blockDim.x) qh[i] = q[(size_t(b) * m.heads + h) * qk + i];
  __syncthreads();
  const int pos = positions[b];
  float* out = q_latent + (size_t(b) * m.heads + h) * m.latent();
  const size_t w0 = size_t(h) * (m.nope + m.v) * m.rank;
  for (int c = threadIdx.x; c < m.rank; c += blockDim.x) {
    float acc = 0.0f;
    for (int i = 0; i < m.nope; ++i) acc = fmaf(qh[i], bf16_at(kv_b.data, w0 + size_t(i) * m.rank + c), acc);
    out[c] = acc;
  }
  for (int i = threadIdx.x; i < m.rope; i += blockDim.x)
    out[m.rank + i] = rotated(qh + m.nope, i, pos, rope.inv_freq, rope.scaling, m.rope, rope.interleaved);
}

constexpr int kOutWarps = 8;

// One warp per (row of W_UV, sequence row).
__global__ void __launch_bounds__(kOutWarps * 32) mla_output_kernel(const float* __restrict__ att, MlaShape m,
                                                                    DLinear kv_b, float* __restrict__ out) {
  const int lane = threadIdx.x & 31, n = blockIdx.x * kOutWarps + (threadIdx.x >> 5), b = blockIdx.y;
  pdl_enter();
  if (n >= m.heads * m.v) return;
  const int h = n / m.v, e = n % m.v;
  const float* a = att + (size_t(b) * m.heads + h) * m.latent();
  const size_t w0 = (size_t(h) * (m.nope + m.v) + m.nope + e) * m.rank;
  float acc = 0.0f;
  for (int c = lane; c < m.rank; c += 32) acc = fmaf(a[c], bf16_at(kv_b.data, w0 + c), acc);
  acc = warp_sum(acc);
  if (lane == 0) out[size_t(b) * m.heads * m.v + n] = acc;
}

// Blocks (row, head) for heads < x.heads rotate the indexer queries; block (row, x.heads)
// normalizes, rotates and stores the indexer key.
__global__ void index_prep_kernel(float* __restrict__ iq, const float* __restrict__ ik, IndexerShape x,
                                  const float* __restrict__ norm_w, const float* __restrict__ norm_b, RopeArgs rope,
                                  const int32_t* __restrict__ positions, KvLayer cache) {
  extern __shared__ float v[];  // dim floats
  __shared__ float red[32];
  const int b = blockIdx.x, h = blockIdx.y;
  pdl_enter();
  const int pos = positions[b];
  if (h < x.heads) {
    float* row = iq + (size_t(b) * x.heads + h) * x.dim;
    for (int i = threadIdx.x; i < x.rope; i += blockDim.x) v[i] = row[i];
    __syncthreads();
    for (int i = threadIdx.x; i < x.rope; i += blockDim.x)
      row[i] = rotated(v, i, pos, rope.inv_freq, rope.scaling, x.rope, rope.interleaved);
    return;
  }
  float sum = 0.0f;
  for (int i = threadIdx.x; i < x.dim; i += blockDim.x) {
    v[i] = ik[size_t(b) * x.dim + i];
    sum += v[i];
  }
  const float mean = block_sum(sum, red) / float(x.dim);
  float ss = 0.0f;
  for (int i = threadIdx.x; i < x.dim; i += blockDim.x) ss += (v[i] - mean) * (v[i] - mean);
  const float inv = rsqrtf(block_sum(ss, red) / float(x.dim) + 1e-6f);
  for (int i = threadIdx.x; i < x.dim; i += blockDim.x) v[i] = (v[i] - mean) * inv * norm_w[i] + norm_b[i];
  __syncthreads();
  float* dst = cache.k + size_t(b) * cache.seq_stride + size_t(pos) * x.dim;
  for (int i = threadIdx.x; i < x.dim; i += blockDim.x)
    dst[i] = i < x.rope ? rotated(v, i, pos, rope.inv_freq, rope.scaling, x.rope, rope.interleaved) : v[i];
}

constexpr int kScoreWarps = 8, kMaxIndexPer = 8;  // index_head_dim up to 256

// One warp per cached position; the row's queries and head weights sit in shared memory.
__global__ void __launch_bounds__(kScoreWarps * 32) index_scores_kernel(const float* __restrict__ iq,
                                                                        const float* __restrict__ iw, IndexerShape x,
                                                                        const int32_t* __restrict__ positions,
                                                                        KvLayer cache, int max_context,
                                                                        float* __restrict__ scores) {
  extern __shared__ float sm[];  // heads * dim queries, then heads weights
  const int b = blockIdx.y, lane = threadIdx.x & 31;
  const int j = blockIdx.x * kScoreWarps + (threadIdx.x >> 5);
  pdl_enter();
  float* qs = sm;
  float* ws = sm + x.heads * x.dim;
  for (int i = threadIdx.x; i < x.heads * x.dim; i += blockDim.x) qs[i] = iq[size_t(b) * x.heads * x.dim + i];
  const float head_weight = rsqrtf(float(x.heads)), scale = rsqrtf(float(x.dim));
  for (int i = threadIdx.x; i < x.heads; i += blockDim.x) ws[i] = iw[size_t(b) * x.heads + i] * head_weight;
  __syncthreads();
  if (j > positions[b]) return;
  const float* key = cache.k + size_t(b) * cache.seq_stride + size_t(j) * x.dim;
  float kr[kMaxIndexPer];
  #pragma unroll
  for (int i = 0; i < kMaxIndexPer; ++i) kr[i] = lane + 32 * i < x.dim ? key[lane + 32 * i] : 0.0f;
  float s = 0.0f;
  for (int h = 0; h < x.heads; ++h) {
    float d = 0.0f;
    #pragma unroll
    for (int i = 0; i < kMaxIndexPer; ++i)
      if (lane + 32 * i < x.dim) d = fmaf(qs[h * x.dim + lane + 32 * i], kr[i], d);
    d = warp_sum(d);
    s = fmaf(ws[h], fmaxf(d * scale, 0.0f), s);
  }
  if (lane == 0) scores[size_t(b) * max_context + j] = s;
}

constexpr int kSelectThreads = 1024;

// Larger float -> larger unsigned key.
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// One block per row: a radix select (4 passes of 8 bits) finds the key of the topk-th best score
// and how many positions with exactly that key are still wanted; then every thread walks its
// own contiguous range of positions and writes the chosen ones at offsets from block-wide scans,
// so the output is in position order and ties go to the earlier positions.
__global__ void __launch_bounds__(kSelectThreads) topk_select_kernel(const float* __restrict__ scores,
                                                                     int max_context, int topk,
                                                                     const int32_t* __restrict__ positions,
                                                                     int32_t* __restrict__ select,
                                                                     int32_t* __restrict__ count) {
  using Scan = cub::BlockScan<int, kSelectThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int hist[256];
  __shared__ int s_bin, s_want;
  const int b = blockIdx.x, tid = threadIdx.x;
  pdl_enter();
  const int len = positions[b] + 1;
  int32_t* out = select + size_t(b) * topk;
  if (len <= topk) {
    for (int i = tid; i < len; i += blockDim.x) out[i] = i;
    if (tid == 0) count[b] = len;
    return;
  }
  const float* sc = scores + size_t(b) * max_context;
  uint32_t prefix = 0, mask = 0;
  int want = topk;  // how many of the positions matching prefix/mask are still to be taken
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < 256; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    for (int j = tid; j < len; j += blockDim.x) {
      const uint32_t k = order_key(sc[j]);
      if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255u], 1);
    }
    __syncthreads();
    if (tid == 0) {
      int above = 0, bin = 255;
      for (; bin > 0 && above + hist[bin] < want; --bin) above += hist[bin];
      s_bin = bin;
      s_want = want - above;
    }
    __syncthreads();
    prefix |= uint32_t(s_bin) << shift;
    mask |= 255u << shift;
    want = s_want;
  }
  // prefix is now the exact key of the topk-th best; `want` positions with that key are taken.
  const int per = (len + kSelectThreads - 1) / kSelectThreads, lo = min(len, tid * per), hi = min(len, lo + per);
  int greater = 0, equal = 0;
  for (int j = lo; j < hi; ++j) {
    const uint32_t k = order_key(sc[j]);
    greater += k > prefix;
    equal += k == prefix;
  }
  int greater_before, equal_before;
  Scan(scan_tmp).ExclusiveSum(greater, greater_before);
  __syncthreads();
  Scan(scan_tmp).ExclusiveSum(equal, equal_before);
  int at = greater_before + min(equal_before, want);
  for (int j = lo; j < hi; ++j) {
    const uint32_t k = order_key(sc[j]);
    if (k > prefix || (k == prefix && equal_before++ < want)) out[at++] = j;
  }
  if (tid == 0) count[b] = topk;
}

}  // namespace

void launch_mla_latent_store(const float* kv, int batch, const MlaShape& m, const float* norm, float eps,
                             const RopeArgs& rope, const int32_t* positions, KvLayer cache, cudaStream_t s) {
  launch(mla_latent_store_kernel, dim3(unsigned(batch)), dim3(256), size_t(m.latent()) * sizeof(float), s, kv, m,
         norm, eps, rope, positions, cache);
  KESTREL_CUDA_LAUNCHED();
}

void launch_mla_query(const float* q, int batch, const MlaShape& m, const DLinear& kv_b, const RopeArgs& rope,
                      const int32_t* positions, float* q_latent, cudaStream_t s) {
  launch(mla_query_kernel, dim3(unsigned(m.heads), unsigned(batch)), dim3(256),
         size_t(m.nope + m.rope) * sizeof(float), s, q, m, kv_b, rope, positions, q_latent);
  KESTREL_CUDA_LAUNCHED();
}

void launch_mla_output(const float* att, int batch, const MlaShape& m, const DLinear& kv_b, float* out, cudaStream_t s) {
  const unsigned rows = unsigned(m.heads * m.v);
  launch(mla_output_kernel, dim3((rows + kOutWarps - 1) / kOutWarps, unsigned(batch)), dim3(kOutWarps * 32), 0, s, att,
         m, kv_b, out);
  KESTREL_CUDA_LAUNCHED();
}

void launch_index_prep(float* iq, const float* ik, int batch, const IndexerShape& x, const float* norm_w,
                       const float* norm_b, const RopeArgs& rope, const int32_t* positions, KvLayer index_cache,
                       cudaStream_t s) {
  launch(index_prep_kernel, dim3(unsigned(batch), unsigned(x.heads + 1)), dim3(128), size_t(x.dim) * sizeof(float), s,
         iq, ik, x, norm_w, norm_b, rope, positions, index_cache);
  KESTREL_CUDA_LAUNCHED();
}

void launch_index_scores(const float* iq, const float* iw, int batch, const IndexerShape& x,
                         const int32_t* positions, KvLayer index_cache, int max_context, float* scores,
                         cudaStream_t s) {
  if (x.dim > 32 * kMaxIndexPer) fail("CUDA indexer supports index_head_dim up to ", 32 * kMaxIndexPer, ", got ", x.dim);
  const size_t smem = size_t(x.heads * x.dim + x.heads) * sizeof(float);
  if (smem > 48 * 1024) fail("CUDA indexer: ", x.heads, " heads of ", x.dim, " need more than 48 KiB of shared memory");
  launch(index_scores_kernel, dim3(unsigned((max_context + kScoreWarps - 1) / kScoreWarps), unsigned(batch)),
         dim3(kScoreWarps * 32), smem, s, iq, iw, x, positions, index_cache, max_context, scores);
  KESTREL_CUDA_LAUNCHED();
}

void launch_topk_select(const float* scores, int batch, int max_context, int topk, const int32_t* positions,
                        int32_t* select, int32_t* count, cudaStream_t s) {
  launch(topk_select_kernel, dim3(unsigned(batch)), dim3(kSelectThreads), 0, s, scores, max_context, topk, positions,
         select, count);
  KESTREL_CUDA_LAUNCHED();
}

}  // namespace kestrel::cuda
