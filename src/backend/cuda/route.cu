#include <cooperative_groups.h>

#include <algorithm>
#include <cfloat>

#include "backend/cuda/check.h"
#include "backend/cuda/dequant.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/norm_rope.h"
#include "backend/cuda/reduce.cuh"
#include "backend/cuda/route.h"
#include "backend/cuda/route_select.cuh"
#include "backend/cuda/slot_mma.cuh"
#include "common/env.h"

namespace kestrel::cuda {
namespace {

constexpr int kRouteWarps = 8;  // warps per router block: a chunk's tokens (kRouteTokens) get a warp each
constexpr int kRouteRows = 4;   // router rows per block: 32 blocks per token chunk for 128 experts
static_assert(kRouteTokens <= kRouteWarps, "the router selects a chunk's tokens with a warp each");

// Grid: (blocks of kRouteRows experts, chunks of B tokens). Each block writes the logits of its
// rows for its chunk's tokens, then counts itself done in done[chunk]; the block that finishes a
// chunk last selects the experts of the chunk's tokens (a warp per token), so routing costs one
// launch, and sets the count back to 0 for the next launch (graph replays included). The last
// chunk may hold fewer than B tokens: it computes the B tokens ending at `batch` (re-reading some
// of the previous chunk's) and writes only its own, so that every logit has one writer.
template <int B>
__global__ void __launch_bounds__(kRouteWarps * 32) route_kernel(DRouter r, const float* __restrict__ x, int batch,
                                                                 float* logits, unsigned* done,
                                                                 int32_t* __restrict__ out_e,
                                                                 float* __restrict__ out_w, RowNorm norm) {
  // Rows per warp as in linear_kernel (fewer for more tokens bounds registers); the ks warps
  // that share them split K, and their partial sums are added in warp order.
  constexpr int R = rows_per_warp<B>() < kRouteRows ? rows_per_warp<B>() : kRouteRows;
  constexpr int ks = kRouteWarps / (kRouteRows / R);
  static_assert(kRouteRows % R == 0 && kRouteWarps % (kRouteRows / R) == 0, "router rows must split over the warps");
  __shared__ float red[kRouteWarps * R * B];
  __shared__ float gscore[kRouteWarps][32];
  __shared__ int sel[kRouteWarps][32];
  __shared__ bool last;
  extern __shared__ float choice[];  // [kRouteWarps, experts]: the selection's; then norm.w: the normalized row
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const DLinear& W = r.w;
  const int E = r.experts, K = W.in;
  const int block_row0 = blockIdx.x * kRouteRows, row0 = block_row0 + (warp / ks) * R;
  if (blockIdx.y == 0) prefetch_rows_l2(W, block_row0, kRouteRows);
  float4 g[kRowNormPer];
  if (B == 1 && norm.w) row_norm_weights(norm.w, K, g);
  pdl_enter();
  if (B == 1 && norm.w) {  // one token: every block normalizes it; the first leaves it for the experts
    float* xs = choice + kRouteWarps * E;
    block_rms_norm(x, g, K, norm.eps, xs, red);
    if (blockIdx.x == 0)
      for (int i = threadIdx.x; i < K / 4; i += blockDim.x) {
        const float4 v = reinterpret_cast<const float4*>(xs)[i];
        reinterpret_cast<float4*>(norm.out)[i] = v;
        if (norm.frag) frag_store4(norm.frag, 4 * i, v);
      }
    x = xs;
  }
  const int t0 = blockIdx.y * B, owned = min(B, batch - t0), c0 = min(t0, batch - B);
  float acc[R][B];
  #pragma unroll
  for (int i = 0; i < R; ++i)
    #pragma unroll
    for (int b = 0; b < B; ++b) acc[i][b] = 0.0f;
  if (row0 < E) rows_dot_partial<R, B>(W, row0, x + size_t(c0) * K, K, lane, acc, (warp % ks) * 32, ks * 32);
  group_sum<R, B>(acc, red, ks);
  if (lane == 0 && warp % ks == 0) {
    #pragma unroll
    for (int i = 0; i < R; ++i) {
      const int row = row0 + i;
      if (row >= E) break;
      const float bias = W.bias ? W.bias[row] : 0.0f;
      #pragma unroll
      for (int b = 0; b < B; ++b)
        if (c0 + b >= t0) logits[size_t(c0 + b) * E + row] = acc[i][b] + bias;
    }
    __threadfence();  // the logits before the count (release)
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(&done[blockIdx.y], 1u) == gridDim.x - 1;
    if (last) {
      done[blockIdx.y] = 0;  // every block of the chunk has counted: nothing else touches it in this launch
      __threadfence();       // the count before the other blocks' logits (acquire)
    }
  }
  __syncthreads();
  if (!last || warp >= owned) return;
  const int t = t0 + warp;
  select_experts<false>(r, logits + size_t(t) * E, choice + size_t(warp) * E, gscore[warp], sel[warp],
                 out_e + size_t(t) * r.top_k, out_w + size_t(t) * r.top_k, lane);
}

// ---- Up to kClusterTokens tokens in one cluster of blocks (Hopper) ----

constexpr int kClusterThreads = 256;
constexpr int kClusterRowsMax = 16;                 // router rows per block
constexpr size_t kClusterBlockBytes = 64u << 10;    // router weight bytes per block at most

// Eight router weights (an 8-weight group of one row) as loaded: BF16 in one 16-byte load, F32 in two.
template <bool F32>
struct Raw8 {
  uint4 v[F32 ? 2 : 1];
};

template <bool F32>
__device__ __forceinline__ Raw8<F32> load8(const DLinear& W, int row, int g) {
  const uint4* p = reinterpret_cast<const uint4*>(W.data + (size_t(row) * W.in + size_t(g) * 8) * (F32 ? 4 : 2));
  Raw8<F32> w;
  w.v[0] = __ldg(p);
  if constexpr (F32) w.v[1] = __ldg(p + 1);
  return w;
}

// acc + the group's weights . x, added in weight order (as rows_dot_partial does).
template <bool F32>
__device__ __forceinline__ float fma8(const Raw8<F32>& w, const float (&x)[8], float acc) {
  const uint32_t* u = reinterpret_cast<const uint32_t*>(w.v);  // 8 floats, or 4 pairs of BF16 (low half first)
  #pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float wf = F32 ? __uint_as_float(u[j]) : __uint_as_float((j & 1) ? u[j / 2] & 0xffff0000u : u[j / 2] << 16);
    acc = fmaf(wf, x[j], acc);
  }
  return acc;
}

// Registers a thread of route_cluster_kernel<R, G, F32, T> holds for its sums, x values and
// weights; the host takes the cluster kernel only where this stays within kClusterRegs.
__host__ __device__ constexpr int cluster_regs(int R, int G, bool f32, int T) { return R * T + G * T * 8 + G * R * (f32 ? 8 : 4); }
constexpr int kClusterRegs = 224;

// Grid: one cluster of blocks for up to T tokens (batch of them); block `rank` holds router rows
// rank * rows .. + rows - 1 (rows <= R). Each thread takes the 8-weight groups tid, tid + 256, ...
// of its rows, G groups' loads in flight at once, and with norm.w also sums the squares of the
// same x values: the RMSNorm's scale then multiplies the finished dot products, so x and the
// weights arrive in one memory latency (instead of the norm's, then the weights'). The blocks
// store their logits into the first block's shared memory; after the cluster barrier a warp of it
// per token selects, so no counter in global memory and no second trip through L2 for the logits.
// Dynamic shared memory: 2 * T * experts floats.
template <int R, int G, bool F32, int T>
__global__ void __launch_bounds__(kClusterThreads, 1) route_cluster_kernel(DRouter r, int rows, const float* __restrict__ x,
                                                                        int batch, float* __restrict__ logits,
                                                                        int32_t* __restrict__ out_e,
                                                                        float* __restrict__ out_w, RowNorm norm) {
  extern __shared__ float dyn[];  // the first block's: [T][experts] logits of every block, then the selection's
  __shared__ float red[kClusterThreads / 32][(R + 1) * T];  // per warp: sums [row][token], then x^2 [token]
  __shared__ float gscore[T][32];
  __shared__ int sel[T][32];
  cluster_arrive_relaxed();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int rank = int(cooperative_groups::this_cluster().block_rank());
  const DLinear& W = r.w;
  const int E = r.experts, K = W.in, groups = K / 8, row0 = rank * rows, nrows = max(0, min(rows, E - row0));
  float* const logit_s = dyn;
  float* const choice = dyn + T * E;
  if (nrows > 0) prefetch_rows_l2(W, row0, nrows);
  pdl_enter();
  float acc[R][T], ss[T];
  #pragma unroll
  for (int t = 0; t < T; ++t) {
    ss[t] = 0.0f;
    #pragma unroll
    for (int i = 0; i < R; ++i) acc[i][t] = 0.0f;
  }
  #pragma unroll 1
  for (int g0 = tid; g0 < groups; g0 += G * kClusterThreads) {
    float xv[G][T][8];
    Raw8<F32> w[G][R];
    #pragma unroll
    for (int i = 0; i < G; ++i) {
      const int g = g0 + i * kClusterThreads;
      const bool ok = g < groups;
      #pragma unroll
      for (int t = 0; t < T; ++t) {
        const bool in = ok && t < batch;
        const float4* xt = reinterpret_cast<const float4*>(x + size_t(t) * K);
        const float4 a = in ? xt[2 * g] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        const float4 b = in ? xt[2 * g + 1] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        xv[i][t][0] = a.x, xv[i][t][1] = a.y, xv[i][t][2] = a.z, xv[i][t][3] = a.w;
        xv[i][t][4] = b.x, xv[i][t][5] = b.y, xv[i][t][6] = b.z, xv[i][t][7] = b.w;
      }
      #pragma unroll
      for (int rr = 0; rr < R; ++rr) {
        w[i][rr] = Raw8<F32>{};
        if (ok && rr < nrows) w[i][rr] = load8<F32>(W, row0 + rr, g);
      }
    }
    #pragma unroll
    for (int i = 0; i < G; ++i) {
      const int g = g0 + i * kClusterThreads;
      if (norm.w && g < groups) {
        const float4 a = __ldg(reinterpret_cast<const float4*>(norm.w) + 2 * g);
        const float4 b = __ldg(reinterpret_cast<const float4*>(norm.w) + 2 * g + 1);
        const float gw[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        #pragma unroll
        for (int t = 0; t < T; ++t)
          #pragma unroll
          for (int j = 0; j < 8; ++j) ss[t] = fmaf(xv[i][t][j], xv[i][t][j], ss[t]), xv[i][t][j] *= gw[j];
      }
      #pragma unroll
      for (int rr = 0; rr < R; ++rr)
        #pragma unroll
        for (int t = 0; t < T; ++t) acc[rr][t] = fma8<F32>(w[i][rr], xv[i][t], acc[rr][t]);
    }
  }
  #pragma unroll
  for (int t = 0; t < T; ++t) {
    ss[t] = warp_sum(ss[t]);
    #pragma unroll
    for (int rr = 0; rr < R; ++rr) acc[rr][t] = warp_sum(acc[rr][t]);
  }
  if (lane == 0) {
    #pragma unroll
    for (int t = 0; t < T; ++t) {
      red[warp][R * T + t] = ss[t];
      #pragma unroll
      for (int rr = 0; rr < R; ++rr) red[warp][rr * T + t] = acc[rr][t];
    }
  }
  __syncthreads();
  // inv(t): token t's RMSNorm scale, summed over the warps in order.
  auto inv = [&](int t) {
    if (!norm.w) return 1.0f;
    float v = 0.0f;
    for (int w = 0; w < kClusterThreads / 32; ++w) v += red[w][R * T + t];
    return rsqrtf(v / float(K) + norm.eps);
  };
  cluster_wait();
  for (int i = tid; i < nrows * batch; i += kClusterThreads) {
    const int rr = i % nrows, t = i / nrows, row = row0 + rr;
    float d = 0.0f;
    for (int w = 0; w < kClusterThreads / 32; ++w) d += red[w][rr * T + t];
    const float l = d * inv(t) + (W.bias ? W.bias[row] : 0.0f);
    logits[size_t(t) * E + row] = l;
    *cooperative_groups::this_cluster().map_shared_rank(logit_s + t * E + row, 0) = l;
  }
  // The normalized rows for the experts, in block_rms_norm's expression, spread over the cluster's
  // threads (every block has every token's scale; the first block alone took them a token at a time).
  if (norm.w)
    for (int i = rank * kClusterThreads + tid; i < batch * (K / 4); i += int(gridDim.x) * kClusterThreads) {
      const int t = i / (K / 4), k = i % (K / 4);
      const float4 a = reinterpret_cast<const float4*>(x + size_t(t) * K)[k];
      const float4 g = __ldg(reinterpret_cast<const float4*>(norm.w) + k);
      const float s = inv(t);
      const float4 v = make_float4(g.x * (a.x * s), g.y * (a.y * s), g.z * (a.z * s), g.w * (a.w * s));
      reinterpret_cast<float4*>(norm.out + size_t(t) * K)[k] = v;
      if (norm.frag) frag_store4(norm.frag + size_t(t) * K, 4 * k, v);
    }
  cluster_sync();
  if (rank != 0 || warp >= batch) return;
  select_experts<true>(r, logit_s + warp * E, choice + warp * E, gscore[warp], sel[warp], out_e + size_t(warp) * r.top_k,
                       out_w + size_t(warp) * r.top_k, lane);
}

// KESTREL_ROUTE_CLUSTER=0: the counter-based kernel at every batch (A/B runs).
bool route_cluster_enabled() {
  static const bool v = env_switch("KESTREL_ROUTE_CLUSTER");
  return v;
}

// Blocks of the routing cluster the GPU schedules: 16, else 8; 0 without clusters.
int route_cluster_most() {
  static const int most = [] {
    const int n = max_cluster_blocks(route_cluster_kernel<kClusterRowsMax, 2, true, 1>, dim3(kClusterThreads),
                                     size_t(2 * kMaxExperts) * sizeof(float));
    return n >= 8 ? n : 0;
  }();
  return most;
}

// Blocks of the routing cluster: route_cluster_most() within cluster_limit(). Measured on
// Qwen3-30B-A3B shapes (docs/PERF.md v18): 8 blocks of 16 rows make a step 1.3% slower than 16 of 8.
int route_cluster_blocks() {
  const int n = std::min(route_cluster_most(), cluster_limit());
  return n >= 8 ? n : 0;
}

// Tokens the cluster kernel takes at once: its template's T for a batch. Up to 4: at 8 tokens the
// counter kernel measured faster (Qwen3-30B-A3B shapes, docs/PERF.md v18: 7.74 against 7.86 ms).
constexpr int kClusterTokens = 4;
int cluster_tokens(int batch) { return batch <= 1 ? 1 : batch <= 2 ? 2 : 4; }

template <int R, int G, bool F32, int T>
void launch_route_cluster(const DRouter& r, int blocks, int rows, const float* x, int batch, float* logits,
                          int32_t* experts, float* weights, cudaStream_t stream, RowNorm norm) {
  launch_cluster(route_cluster_kernel<R, G, F32, T>, dim3(unsigned(blocks)), dim3(unsigned(blocks)),
                 dim3(kClusterThreads), size_t(2 * T * r.experts) * sizeof(float), stream, r, rows, x, batch, logits,
                 experts, weights, norm);
}

}  // namespace

DRouter make_router(const ModelConfig& c, const DLinear& w, const float* bias) {
  DRouter r;
  r.w = w;
  r.bias = bias;
  r.experts = int(c.num_experts);
  r.top_k = int(c.experts_per_token);
  r.sigmoid = c.router == RouterKind::SigmoidBias;
  r.norm_topk = c.norm_topk_prob;
  r.n_group = int(c.n_group);
  r.topk_group = int(c.topk_group);
  r.scaling = c.routed_scaling_factor;
  return r;
}

namespace {

// Whether the cluster kernel of `blocks` blocks takes this router and batch.
bool cluster_fits(const DRouter& r, int batch, int blocks) {
  const bool f32 = r.w.format == DFormat::F32;
  if (blocks == 0 || batch < 1 || batch > kClusterTokens || !(f32 || r.w.format == DFormat::BF16) ||
      r.w.in % 8 != 0 || r.experts > kMaxExperts || r.w.out != r.experts)
    return false;
  const int rows = (r.experts + blocks - 1) / blocks, R = rows <= 8 ? 8 : kClusterRowsMax;
  const int G = r.w.in / 8 > kClusterThreads ? 2 : 1;
  return rows <= kClusterRowsMax && size_t(rows) * size_t(r.w.in) * (f32 ? 4 : 2) <= kClusterBlockBytes &&
         cluster_regs(R, G, f32, cluster_tokens(batch)) <= kClusterRegs &&
         size_t(2 * cluster_tokens(batch) * r.experts) * sizeof(float) <= 48 * 1024;
}

}  // namespace

bool route_in_cluster(const DRouter& r, int batch) {
  if (!route_cluster_enabled()) return false;
  const int blocks = route_cluster_blocks();
  const bool fits = cluster_fits(r, batch, blocks);
  // Under a lowered cluster_limit() (the graph profiler), say when the kernel differs from the step's.
  if (blocks < route_cluster_most() && cluster_fits(r, batch, route_cluster_most())) cluster_lowered() = true;
  return fits;
}

bool route_fuses_norm(const DRouter& r, int batch) {
  const int K = r.w.in;
  if (route_in_cluster(r, batch)) return true;  // any batch it takes
  return batch == 1 && K % 4 == 0 && K <= kRowNormMax &&
         (size_t(kRouteWarps) * size_t(r.experts) + size_t(K)) * sizeof(float) <= 48 * 1024;  // default smem limit
}

void launch_route(const DRouter& r, const float* x, int batch, float* logits, uint32_t* done, int32_t* experts,
                  float* weights, cudaStream_t stream, RowNorm norm) {
  if (norm.w && !norm.out) fail("internal: a router normalization needs a buffer for the normalized rows");
  if (norm.frag && r.w.in % kFragChunk != 0) fail("internal: fragment rows of ", r.w.in, " values");
  if (norm.w && !route_fuses_norm(r, batch)) {
    if (norm.frag) launch_rms_norm_frag(x, norm.w, batch, r.w.in, norm.eps, norm.out, norm.frag, stream);
    else launch_rms_norm(x, norm.w, batch, r.w.in, norm.eps, norm.out, stream);
    x = norm.out;
    norm = RowNorm{};
  }
  if (r.experts > kMaxExperts || r.top_k > 32 || r.n_group > 32)
    fail("CUDA router supports at most ", kMaxExperts, " experts, top-32 and 32 groups");
  if (r.w.out != r.experts || batch < 1 || !done)
    fail("internal: a router of ", r.w.out, " rows for ", r.experts, " experts, batch ", batch,
         done ? "" : ", no counters");
  if (route_in_cluster(r, batch)) {
    const int blocks = route_cluster_blocks(), rows = (r.experts + blocks - 1) / blocks;
    const bool two = r.w.in / 8 > kClusterThreads, f32 = r.w.format == DFormat::F32;
    auto go = [&](auto R, auto T) {
      if constexpr (cluster_regs(R(), 1, false, T()) <= kClusterRegs) {  // the others are never taken
        if (two) {
          if (f32) launch_route_cluster<R(), 2, true, T()>(r, blocks, rows, x, batch, logits, experts, weights, stream, norm);
          else launch_route_cluster<R(), 2, false, T()>(r, blocks, rows, x, batch, logits, experts, weights, stream, norm);
        } else {
          if (f32) launch_route_cluster<R(), 1, true, T()>(r, blocks, rows, x, batch, logits, experts, weights, stream, norm);
          else launch_route_cluster<R(), 1, false, T()>(r, blocks, rows, x, batch, logits, experts, weights, stream, norm);
        }
      }
    };
    auto by_rows = [&](auto T) {
      if (rows <= 8) go(std::integral_constant<int, 8>{}, T);
      else go(std::integral_constant<int, kClusterRowsMax>{}, T);
    };
    switch (cluster_tokens(batch)) {
      case 1: by_rows(std::integral_constant<int, 1>{}); break;
      case 2: by_rows(std::integral_constant<int, 2>{}); break;
      default: by_rows(std::integral_constant<int, 4>{});
    }
    KESTREL_CUDA_LAUNCHED();
    return;
  }
  // Chunks of up to kRouteTokens tokens, as even as they can be: `per` tokens each, the last maybe fewer.
  const int per = (batch + route_chunks(batch) - 1) / route_chunks(batch), chunks = (batch + per - 1) / per;
  const dim3 grid(unsigned((r.experts + kRouteRows - 1) / kRouteRows), unsigned(chunks));
  const size_t smem = (size_t(kRouteWarps) * size_t(r.experts) + (norm.w ? size_t(r.w.in) : 0)) * sizeof(float);
  by_batch(per, [&](auto B) {
    launch(route_kernel<B()>, grid, dim3(kRouteWarps * 32), smem, stream, r, x, batch, logits, done, experts, weights,
           norm);
  });
  KESTREL_CUDA_LAUNCHED();
}

}  // namespace kestrel::cuda
