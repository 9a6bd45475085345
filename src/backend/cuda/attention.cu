#include <cfloat>

#include "backend/cuda/attention.h"
#include "backend/cuda/check.h"
#include "backend/cuda/kv_paged.cuh"
#include "backend/cuda/launch.cuh"

namespace kestrel::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kMaxHd = 256;
constexpr int kUnroll = 4;  // positions whose keys are loaded before the first is used

// Split-K decode attention (flash-decoding): block (head, sequence, split) covers positions
// [split * chunk, (split + 1) * chunk) of that sequence; each warp keeps an online softmax over
// its share and the block writes one partial (max, sum, weighted values) per split. A warp takes
// kUnroll consecutive positions at a time, 16 apart between warps; with chunks of whole blocks
// (attention_split) they lie in one block of the paged cache, so one table entry serves them.
template <int kPer>
__global__ void __launch_bounds__(kWarps * 32) attention_partial_kernel(const float* __restrict__ q, int nq, int nkv,
                                                                       int hd, float scale, int chunk,
                                                                       const int32_t* __restrict__ positions,
                                                                       KvLayer cache, float* __restrict__ part) {
  __shared__ float s_m[kWarps], s_l[kWarps], s_acc[kWarps][kPer * 32];
  const int h = blockIdx.x, b = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  pdl_enter();
  const int kvh = h / (nq / nkv), len = positions[b] + 1;
  const int begin = split * chunk, end = min(len, begin + chunk);
  const float* qv = q + (size_t(b) * nq + h) * hd;
  float qr[kPer], acc[kPer];
  #pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int d = lane + 32 * i;
    qr[i] = d < hd ? qv[d] * scale : 0.0f;
    acc[i] = 0.0f;
  }
  float m = -FLT_MAX, l = 0.0f;
  const float* kbase = cache.k + size_t(kvh) * hd;
  const float* vbase = cache.v + size_t(kvh) * hd;
  for (int p0 = begin + warp * kUnroll; p0 < end; p0 += kWarps * kUnroll) {
    float kr[kUnroll][kPer], vr[kUnroll][kPer];
    const size_t first = kv_offset(cache, b, p0);
    #pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int p = p0 + u;
      // Positions past the first one's block (only with chunks that are not whole blocks) look
      // up their own; positions past the end are not read.
      const size_t at = (p0 & (kKvBlock - 1)) + u < kKvBlock ? first + size_t(u) * cache.row
                        : p < end                             ? kv_offset(cache, b, p)
                                                              : 0;
      #pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int d = lane + 32 * i;
        const bool ok = p < end && d < hd;
        kr[u][i] = ok ? kbase[at + d] : 0.0f;
        vr[u][i] = ok ? vbase[at + d] : 0.0f;
      }
    }
    #pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (p0 + u >= end) break;
      float sdot = 0.0f;
      #pragma unroll
      for (int i = 0; i < kPer; ++i) sdot = fmaf(qr[i], kr[u][i], sdot);
      #pragma unroll
      for (int o = 16; o > 0; o >>= 1) sdot += __shfl_xor_sync(0xffffffffu, sdot, o);
      const float mn = fmaxf(m, sdot), corr = __expf(m - mn), pw = __expf(sdot - mn);
      l = l * corr + pw;
      #pragma unroll
      for (int i = 0; i < kPer; ++i) acc[i] = fmaf(pw, vr[u][i], acc[i] * corr);
      m = mn;
    }
  }
  if (lane == 0) s_m[warp] = m, s_l[warp] = l;
  #pragma unroll
  for (int i = 0; i < kPer; ++i) s_acc[warp][lane + 32 * i] = acc[i];
  __syncthreads();
  if (warp != 0) return;
  float M = -FLT_MAX;
  for (int w = 0; w < kWarps; ++w) M = fmaxf(M, s_m[w]);
  float L = 0.0f;
  for (int w = 0; w < kWarps; ++w) L += s_l[w] * __expf(s_m[w] - M);
  // Partial layout: [b][h][split][hd + 2] = weighted values, then max and sum.
  float* out = part + ((size_t(b) * nq + h) * splits + split) * (hd + 2);
  #pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int d = lane + 32 * i;
    if (d >= hd) continue;
    float t = 0.0f;
    for (int w = 0; w < kWarps; ++w) t += s_acc[w][d] * __expf(s_m[w] - M);
    out[d] = t;
  }
  if (lane == 0) out[hd] = M, out[hd + 1] = L;
}

constexpr int kMaxSplits = 64;  // attention_split never makes more
constexpr int kSplitsPerLane = kMaxSplits / 32, kCombineDims = 128;

// Block (head, sequence, 128 dimensions): the first warp turns the splits' maxima and sums into
// one weight per split, then every thread adds its dimension over the splits with the loads of
// several splits in flight.
__global__ void __launch_bounds__(kCombineDims) attention_combine_kernel(const float* __restrict__ part, int nq,
                                                                         int hd, int splits, float* __restrict__ out) {
  __shared__ float weight[kMaxSplits];
  const int h = blockIdx.x, b = blockIdx.y, d = blockIdx.z * kCombineDims + threadIdx.x;
  pdl_enter();
  const float* p = part + (size_t(b) * nq + h) * splits * (hd + 2);
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    float m[kSplitsPerLane], l[kSplitsPerLane], M = -FLT_MAX;
    #pragma unroll
    for (int i = 0; i < kSplitsPerLane; ++i) {
      const int s = lane + 32 * i;
      m[i] = s < splits ? p[s * (hd + 2) + hd] : -FLT_MAX;
      l[i] = s < splits ? p[s * (hd + 2) + hd + 1] : 0.0f;
      M = fmaxf(M, m[i]);
    }
    for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    float L = 0.0f;
    #pragma unroll
    for (int i = 0; i < kSplitsPerLane; ++i) L += l[i] * __expf(m[i] - M);
    for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
    #pragma unroll
    for (int i = 0; i < kSplitsPerLane; ++i) {
      const int s = lane + 32 * i;
      if (s < splits) weight[s] = __expf(m[i] - M) / L;
    }
  }
  __syncthreads();
  if (d >= hd) return;
  float t = 0.0f;
  #pragma unroll 8
  for (int s = 0; s < splits; ++s) t = fmaf(p[s * (hd + 2) + d], weight[s], t);
  out[(size_t(b) * nq + h) * hd + d] = t;
}

}  // namespace

AttentionSplit attention_split(int max_context) {
  AttentionSplit s;
  const int splits = std::min(kMaxSplits, std::max(1, (max_context + 63) / 64));
  // Chunks of whole blocks of the paged cache (kv_layer.h): a warp's positions share a table entry.
  s.chunk = ((max_context + splits - 1) / splits + kKvBlock - 1) / kKvBlock * kKvBlock;
  s.splits = std::max(1, (max_context + s.chunk - 1) / s.chunk);
  return s;
}

void launch_decode_attention(const float* q, int batch, int nq, int nkv, int hd, float scale,
                             const int32_t* positions, KvLayer cache, const AttentionSplit& split, float* scratch,
                             float* out, cudaStream_t s) {
  if (hd > kMaxHd) fail("CUDA decode attention supports head_dim up to ", kMaxHd, ", got ", hd);
  if (!cache.table || cache.row != nkv * hd)
    fail("internal: a KV cache of rows of ", cache.row, " floats for ", nkv, " heads of ", hd);
  const dim3 grid(unsigned(nq), unsigned(batch), unsigned(split.splits));
  if (hd <= 32)
    launch(attention_partial_kernel<1>, grid, dim3(kWarps * 32), 0, s, q, nq, nkv, hd, scale, split.chunk, positions,
           cache, scratch);
  else if (hd <= 64)
    launch(attention_partial_kernel<2>, grid, dim3(kWarps * 32), 0, s, q, nq, nkv, hd, scale, split.chunk, positions,
           cache, scratch);
  else if (hd <= 128)
    launch(attention_partial_kernel<4>, grid, dim3(kWarps * 32), 0, s, q, nq, nkv, hd, scale, split.chunk, positions,
           cache, scratch);
  else
    launch(attention_partial_kernel<8>, grid, dim3(kWarps * 32), 0, s, q, nq, nkv, hd, scale, split.chunk, positions,
           cache, scratch);
  KESTREL_CUDA_LAUNCHED();
  launch_attention_combine(scratch, batch, nq, hd, split, out, s);
}

void launch_attention_combine(const float* part, int batch, int nq, int hd, const AttentionSplit& split, float* out,
                              cudaStream_t s) {
  if (split.splits > kMaxSplits) fail("internal: attention combine takes at most ", kMaxSplits, " splits");
  launch(attention_combine_kernel, dim3(unsigned(nq), unsigned(batch), unsigned((hd + kCombineDims - 1) / kCombineDims)),
         dim3(kCombineDims), 0, s, part, nq, hd, split.splits, out);
  KESTREL_CUDA_LAUNCHED();
}

}  // namespace kestrel::cuda
