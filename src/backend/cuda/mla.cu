#include <cuda_bf16.h>

#include <cfloat>
#include <cub/block/block_scan.cuh>

#include "backend/cuda/check.h"
#include "backend/cuda/kv_paged.cuh"
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
  float* dst = kv_rows<float>(cache.k) + kv_offset(cache, b, pos);
  for (int i = threadIdx.x; i < lat; i += blockDim.x)
    dst[i] = i < m.rank ? norm[i] * (row[i] * inv)
                        : rotated(row + m.rank, i - m.rank, pos, rope.inv_freq, rope.scaling, m.rope, rope.interleaved);
}

constexpr int kAbsorbWarps = 8, kAbsorbRows = 8;  // warps per block, batch rows per block

// Block (64 rank columns, head, up to 8 batch rows): each warp takes every 8th row of W_UK_h and
// each lane two adjacent columns (one 4-byte load), so a row of the block's slice is one 128-byte
// read shared by all batch rows; the warps' partial sums meet in shared memory. Blocks of the
// first column slice also write the rotated rope part.
__global__ void __launch_bounds__(kAbsorbWarps * 32) mla_query_kernel(const float* __restrict__ q, int batch, MlaShape m,
                                                                      DLinear kv_b, RopeArgs rope,
                                                                      const int32_t* __restrict__ positions,
                                                                      float* __restrict__ q_latent) {
  extern __shared__ float sm[];  // kAbsorbRows * (nope + rope) queries, then kAbsorbWarps * kAbsorbRows * 64 partials
  const int c0 = blockIdx.x * 64, h = blockIdx.y, b0 = blockIdx.z * kAbsorbRows;
  const int nb = min(kAbsorbRows, batch - b0), qk = m.nope + m.rope;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* qs = sm;
  float* part = sm + kAbsorbRows * qk;
  pdl_enter();
  for (int i = threadIdx.x; i < nb * qk; i += blockDim.x)
    qs[i] = q[(size_t(b0 + i / qk) * m.heads + h) * qk + i % qk];
  __syncthreads();
  const int c = c0 + 2 * lane;
  float acc[kAbsorbRows][2] = {};
  if (c < m.rank) {
    const __nv_bfloat162* w = reinterpret_cast<const __nv_bfloat162*>(kv_b.data) +
                              (size_t(h) * (m.nope + m.v) * m.rank + c) / 2;
    #pragma unroll 8
    for (int i = warp; i < m.nope; i += kAbsorbWarps) {
      const float2 wv = __bfloat1622float2(w[size_t(i) * m.rank / 2]);
      #pragma unroll
      for (int r = 0; r < kAbsorbRows; ++r) {
        if (r >= nb) break;
        acc[r][0] = fmaf(qs[r * qk + i], wv.x, acc[r][0]);
        acc[r][1] = fmaf(qs[r * qk + i], wv.y, acc[r][1]);
      }
    }
  }
  #pragma unroll
  for (int r = 0; r < kAbsorbRows; ++r) {
    part[(warp * kAbsorbRows + r) * 64 + 2 * lane] = acc[r][0];
    part[(warp * kAbsorbRows + r) * 64 + 2 * lane + 1] = acc[r][1];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < nb * 64; i += blockDim.x) {
    const int r = i / 64, col = i % 64;
    if (c0 + col >= m.rank) continue;
    float t = 0.0f;
    #pragma unroll
    for (int w = 0; w < kAbsorbWarps; ++w) t += part[(w * kAbsorbRows + r) * 64 + col];
    q_latent[(size_t(b0 + r) * m.heads + h) * m.latent() + c0 + col] = t;
  }
  if (blockIdx.x != 0) return;
  for (int i = threadIdx.x; i < nb * m.rope; i += blockDim.x) {
    const int r = i / m.rope, d = i % m.rope;
    q_latent[(size_t(b0 + r) * m.heads + h) * m.latent() + m.rank + d] =
        rotated(qs + r * qk + m.nope, d, positions[b0 + r], rope.inv_freq, rope.scaling, m.rope, rope.interleaved);
  }
}

constexpr int kMlaHeads = 8, kTile = 8, kMaxKPer = 18, kMaxVPer = 16;  // latent up to 576, rank up to 512
constexpr int kStage = 5;  // float4 loads per thread per tile: kTile * 576 / 4 <= kStage * 256

// Block (split, 8 heads, sequence row), one warp per head: tiles of 8 latent rows (selected
// positions under DSA) go through shared memory once for the 8 heads, double-buffered so the
// next tile's loads are in flight while the current one is used; each warp keeps its head's
// online softmax and rank accumulators and writes one partial per split, as decode attention does.
__global__ void __launch_bounds__(kMlaHeads * 32) mla_attention_kernel(const float* __restrict__ q, MlaShape m,
                                                                       float scale,
                                                                       const int32_t* __restrict__ positions,
                                                                       KvLayer cache, AttentionSelect select,
                                                                       float* __restrict__ part) {
  extern __shared__ float4 tiles[];  // 2 x kTile x latent / 4
  const int split = blockIdx.x, splits = gridDim.x, b = blockIdx.z;
  const int lane = threadIdx.x & 31, h = blockIdx.y * kMlaHeads + (threadIdx.x >> 5);
  const int lat = m.latent(), lat4 = lat / 4;
  pdl_enter();
  const bool active = h < m.heads;
  const int len = select.index ? select.count[b] : positions[b] + 1;
  const int32_t* chosen = select.index ? select.index + size_t(b) * select.stride : nullptr;
  // The row's own length (positions or selected rows) cut into `splits` chunks of whole KV blocks.
  const int chunk = ((len + splits - 1) / splits + kKvBlock - 1) / kKvBlock * kKvBlock;
  const int begin = split * chunk, end = min(len, begin + chunk);
  float qr[kMaxKPer], acc[kMaxVPer];
  #pragma unroll
  for (int i = 0; i < kMaxKPer; ++i) {
    const int d = lane + 32 * i;
    qr[i] = active && d < lat ? q[(size_t(b) * m.heads + h) * lat + d] * scale : 0.0f;
  }
  #pragma unroll
  for (int i = 0; i < kMaxVPer; ++i) acc[i] = 0.0f;
  float mx = -FLT_MAX, l = 0.0f;
  float4 stage[kStage];
  auto fetch = [&](int t0) {
    const int n = min(kTile, end - t0);
    #pragma unroll
    for (int k = 0; k < kStage; ++k) {
      const int v = threadIdx.x + k * kMlaHeads * 32;
      if (v < n * lat4) {
        const int u = v / lat4, p = chosen ? chosen[t0 + u] : t0 + u;
        stage[k] = reinterpret_cast<const float4*>(kv_rows<float>(cache.k) + kv_offset(cache, b, p))[v % lat4];
      }
    }
  };
  auto commit = [&](int t0, float4* tile) {
    const int n = min(kTile, end - t0);
    #pragma unroll
    for (int k = 0; k < kStage; ++k) {
      const int v = threadIdx.x + k * kMlaHeads * 32;
      if (v < n * lat4) tile[v] = stage[k];
    }
  };
  if (begin < end) {
    fetch(begin);
    commit(begin, tiles);
  }
  __syncthreads();
  int buf = 0;
  for (int t0 = begin; t0 < end; t0 += kTile, buf ^= 1) {
    const bool more = t0 + kTile < end;
    if (more) fetch(t0 + kTile);
    const float* tile = reinterpret_cast<const float*>(tiles + buf * kTile * lat4);
    const int n = min(kTile, end - t0);
    if (active) {
      // The tile's scores summed over the warp so that each lane ends with one (lanes 4u..4u+3
      // hold position u's: warp_spread_sums), whose exponent it alone takes; the warp's max,
      // sum and correction are then one per tile, not one per position.
      float sc[kTile];
      #pragma unroll
      for (int u = 0; u < kTile; ++u) {
        float t = 0.0f;
        if (u < n) {
          const float* row = tile + u * lat;
          #pragma unroll
          for (int i = 0; i < kMaxKPer; ++i)
            if (lane + 32 * i < lat) t = fmaf(qr[i], row[lane + 32 * i], t);
        }
        sc[u] = t;
      }
      constexpr int kShift = 5 - spread_bits(kTile);
      const float total = warp_spread_sums<kTile>(sc, lane);
      const float x = (lane >> kShift) < n ? total : -FLT_MAX;
      float tmax = x;
      #pragma unroll
      for (int o = 1 << kShift; o < 32; o <<= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, o));
      const float mn = fmaxf(mx, tmax), corr = __expf(mx - mn), p = __expf(x - mn);
      float ps = p;
      #pragma unroll
      for (int o = 1 << kShift; o < 32; o <<= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
      l = l * corr + ps;
      mx = mn;
      #pragma unroll
      for (int i = 0; i < kMaxVPer; ++i) acc[i] *= corr;
      #pragma unroll
      for (int u = 0; u < kTile; ++u) {
        const float pu = __shfl_sync(0xffffffffu, p, u << kShift);
        if (u < n) {
          const float* row = tile + u * lat;
          #pragma unroll
          for (int i = 0; i < kMaxVPer; ++i)
            if (lane + 32 * i < m.rank) acc[i] = fmaf(pu, row[lane + 32 * i], acc[i]);
        }
      }
    }
    if (more) commit(t0 + kTile, tiles + (buf ^ 1) * kTile * lat4);
    __syncthreads();
  }
  if (!active) return;
  float* out = part + ((size_t(b) * m.heads + h) * splits + split) * (m.rank + 2);
  #pragma unroll
  for (int i = 0; i < kMaxVPer; ++i)
    if (lane + 32 * i < m.rank) out[lane + 32 * i] = acc[i];
  if (lane == 0) out[m.rank] = mx, out[m.rank + 1] = l;
}

constexpr int kOutWarps = 8;

// One warp per (row of W_UV, sequence row).
__global__ void __launch_bounds__(kOutWarps * 32) mla_output_kernel(const float* __restrict__ att, MlaShape m,
                                                                    DLinear kv_b, float* __restrict__ out) {
  const int lane = threadIdx.x & 31, n = blockIdx.x * kOutWarps + (threadIdx.x >> 5), b = blockIdx.y;
  pdl_enter();
  if (n >= m.heads * m.v) return;
  const int h = n / m.v, e = n % m.v;
  const float* a = att + (size_t(b) * m.heads + h) * m.rank;
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
  float* dst = kv_rows<float>(cache.k) + kv_offset(cache, b, pos);
  for (int i = threadIdx.x; i < x.dim; i += blockDim.x)
    dst[i] = i < x.rope ? rotated(v, i, pos, rope.inv_freq, rope.scaling, x.rope, rope.interleaved) : v[i];
}

constexpr int kScoreThreads = 128, kScoreLanes = 16, kMaxIndexHeads = 64;
constexpr int kHeadsPerLane = kMaxIndexHeads / kScoreLanes;

// Sixteen threads per cached position, each with a sixteenth of the heads: the key is read in
// float4 pieces (one address for the sixteen), each piece meeting the thread's heads' queries in
// shared memory before the next is loaded; four shuffles add the parts.
__global__ void __launch_bounds__(kScoreThreads) index_scores_kernel(const float* __restrict__ iq,
                                                                     const float* __restrict__ iw, IndexerShape x,
                                                                     const int32_t* __restrict__ positions,
                                                                     KvLayer cache, int max_context,
                                                                     float* __restrict__ scores) {
  // Queries in rows of dim + 4 floats: lane g reads head g + 16k, so the eight lanes of a 16-byte
  // load phase hit eight different groups of four banks.
  extern __shared__ float sm[];  // heads * (dim + 4) queries, then heads weights
  const int b = blockIdx.y, g = threadIdx.x % kScoreLanes, stride = x.dim + 4;
  const int j = blockIdx.x * (kScoreThreads / kScoreLanes) + threadIdx.x / kScoreLanes;
  pdl_enter();
  // The grid covers the capacity; blocks past the row's position leave before staging the queries
  // (a cache sized for 32k positions holding 1k would otherwise stage them 30 times over).
  if (int(blockIdx.x) * (kScoreThreads / kScoreLanes) > positions[b]) return;
  float* qs = sm;
  float* ws = sm + x.heads * stride;
  for (int i = threadIdx.x; i < x.heads * x.dim; i += blockDim.x)
    qs[(i / x.dim) * stride + i % x.dim] = iq[size_t(b) * x.heads * x.dim + i];
  const float head_weight = rsqrtf(float(x.heads)), scale = rsqrtf(float(x.dim));
  for (int i = threadIdx.x; i < x.heads; i += blockDim.x) ws[i] = iw[size_t(b) * x.heads + i] * head_weight;
  __syncthreads();
  const bool live = j <= positions[b];
  float sc = 0.0f;
  if (live) {
    const float4* key = reinterpret_cast<const float4*>(kv_rows<float>(cache.k) + kv_offset(cache, b, j));
    float dot[kHeadsPerLane];
    #pragma unroll
    for (int k = 0; k < kHeadsPerLane; ++k) dot[k] = 0.0f;
    for (int c = 0; c < x.dim / 4; ++c) {
      const float4 kv = key[c];
      #pragma unroll
      for (int k = 0; k < kHeadsPerLane; ++k) {
        const int h = g + kScoreLanes * k;
        if (h >= x.heads) break;
        const float4 qv = reinterpret_cast<const float4*>(qs + h * stride)[c];
        dot[k] = fmaf(qv.x, kv.x, fmaf(qv.y, kv.y, fmaf(qv.z, kv.z, fmaf(qv.w, kv.w, dot[k]))));
      }
    }
    #pragma unroll
    for (int k = 0; k < kHeadsPerLane; ++k) {
      const int h = g + kScoreLanes * k;
      if (h < x.heads) sc = fmaf(ws[h], fmaxf(dot[k] * scale, 0.0f), sc);
    }
  }
  #pragma unroll
  for (int o = 1; o < kScoreLanes; o <<= 1) sc += __shfl_xor_sync(0xffffffffu, sc, o);
  if (live && g == 0) scores[size_t(b) * max_context + j] = sc;
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
    // Scores of similar size share their top bits, so the lanes of a warp that fall in one bin add
    // their count with one atomic instead of contending for the same counter.
    for (int j0 = 0; j0 < len; j0 += blockDim.x) {
      const int j = j0 + tid;
      const uint32_t k = j < len ? order_key(sc[j]) : 0u;
      const int bin = j < len && (k & mask) == prefix ? int((k >> shift) & 255u) : -1;
      const unsigned peers = __match_any_sync(0xffffffffu, bin);
      if (bin >= 0 && __ffs(peers) - 1 == (tid & 31)) atomicAdd(&hist[bin], __popc(peers));
    }
    __syncthreads();
    if (tid < 32) {
      // Lane l holds bins 255 - 8l down to 248 - 8l; a scan over lanes gives the count above each.
      int cnt[8], total = 0;
      #pragma unroll
      for (int k = 0; k < 8; ++k) total += cnt[k] = hist[255 - 8 * tid - k];
      int incl = total;
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (tid >= o) incl += v;
      }
      int above = incl - total;
      const unsigned here = __ballot_sync(0xffffffffu, above < want && want <= incl);
      if (tid == __ffs(here) - 1) {
        for (int k = 0; k < 8; ++k) {
          if (above + cnt[k] >= want) {
            s_bin = 255 - 8 * tid - k;
            s_want = want - above;
            break;
          }
          above += cnt[k];
        }
      }
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
  if (!cache.table || cache.row != m.latent() || cache.type != KvType::F32)
    fail("internal: an MLA cache of rows of ", cache.row, " ", kv_type_name(cache.type), " values for latents of ",
         m.latent(), " floats");
  launch(mla_latent_store_kernel, dim3(unsigned(batch)), dim3(256), size_t(m.latent()) * sizeof(float), s, kv, m,
         norm, eps, rope, positions, cache);
  KESTREL_CUDA_LAUNCHED();
}

void launch_mla_query(const float* q, int batch, const MlaShape& m, const DLinear& kv_b, const RopeArgs& rope,
                      const int32_t* positions, float* q_latent, cudaStream_t s) {
  if (m.rank % 2 != 0) fail("CUDA MLA: kv_lora_rank must be even, got ", m.rank);
  const size_t smem = size_t(kAbsorbRows * (m.nope + m.rope) + kAbsorbWarps * kAbsorbRows * 64) * sizeof(float);
  launch(mla_query_kernel, dim3(unsigned((m.rank + 63) / 64), unsigned(m.heads), unsigned((batch + kAbsorbRows - 1) / kAbsorbRows)),
         dim3(kAbsorbWarps * 32), smem, s, q, batch, m, kv_b, rope, positions, q_latent);
  KESTREL_CUDA_LAUNCHED();
}

void launch_mla_attention(const float* q_latent, int batch, const MlaShape& m, float scale, const int32_t* positions,
                          KvLayer cache, const AttentionSplit& split, AttentionSelect select, float* scratch,
                          float* out, cudaStream_t s) {
  if (m.latent() > 32 * kMaxKPer || m.rank > 32 * kMaxVPer || m.latent() % 4 != 0)
    fail("CUDA MLA attention supports kv_lora_rank + qk_rope_head_dim up to ", 32 * kMaxKPer,
         " and a multiple of 4, got ", m.latent());
  if (!cache.table || cache.row != m.latent() || cache.type != KvType::F32)
    fail("internal: an MLA cache of rows of ", cache.row, " ", kv_type_name(cache.type), " values for latents of ",
         m.latent(), " floats");
  const dim3 grid(unsigned(split.splits), unsigned((m.heads + kMlaHeads - 1) / kMlaHeads), unsigned(batch));
  launch(mla_attention_kernel, grid, dim3(kMlaHeads * 32), size_t(2 * kTile * m.latent()) * sizeof(float), s, q_latent, m,
         scale, positions, cache, select, scratch);
  KESTREL_CUDA_LAUNCHED();
  launch_attention_combine(scratch, batch, m.heads, m.rank, split, out, s);
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
  if (!index_cache.table || index_cache.row != x.dim || index_cache.type != KvType::F32)
    fail("internal: an index cache of rows of ", index_cache.row, " ", kv_type_name(index_cache.type),
         " values for keys of ", x.dim, " floats");
  launch(index_prep_kernel, dim3(unsigned(batch), unsigned(x.heads + 1)), dim3(128), size_t(x.dim) * sizeof(float), s,
         iq, ik, x, norm_w, norm_b, rope, positions, index_cache);
  KESTREL_CUDA_LAUNCHED();
}

void launch_index_scores(const float* iq, const float* iw, int batch, const IndexerShape& x,
                         const int32_t* positions, KvLayer index_cache, int max_context, float* scores,
                         cudaStream_t s) {
  if (x.heads > kMaxIndexHeads) fail("CUDA indexer supports up to ", kMaxIndexHeads, " index heads, got ", x.heads);
  if (x.dim % 4 != 0) fail("CUDA indexer needs index_head_dim to be a multiple of 4, got ", x.dim);
  if (!index_cache.table || index_cache.row != x.dim || index_cache.type != KvType::F32)
    fail("internal: an index cache of rows of ", index_cache.row, " ", kv_type_name(index_cache.type),
         " values for keys of ", x.dim, " floats");
  const size_t smem = size_t(x.heads * (x.dim + 4) + x.heads) * sizeof(float);
  if (smem > 48 * 1024) fail("CUDA indexer: ", x.heads, " heads of ", x.dim, " need more than 48 KiB of shared memory");
  constexpr int per_block = kScoreThreads / kScoreLanes;
  launch(index_scores_kernel, dim3(unsigned((max_context + per_block - 1) / per_block), unsigned(batch)),
         dim3(kScoreThreads), smem, s, iq, iw, x, positions, index_cache, max_context, scores);
  KESTREL_CUDA_LAUNCHED();
}

void launch_topk_select(const float* scores, int batch, int max_context, int topk, const int32_t* positions,
                        int32_t* select, int32_t* count, cudaStream_t s) {
  launch(topk_select_kernel, dim3(unsigned(batch)), dim3(kSelectThreads), 0, s, scores, max_context, topk, positions,
         select, count);
  KESTREL_CUDA_LAUNCHED();
}

}  // namespace kestrel::cuda
