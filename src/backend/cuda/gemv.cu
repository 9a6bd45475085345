#include <cooperative_groups.h>

#include <algorithm>
#include <array>
#include <type_traits>

#include "backend/cuda/check.h"
#include "backend/cuda/dequant.cuh"
#include "backend/cuda/gemv.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/mma_tiles.cuh"
#include "backend/cuda/norm_rope.h"
#include "backend/cuda/reduce.cuh"
#include "backend/cuda/slot_mma.cuh"
#include "common/env.h"

namespace kestrel::cuda {
namespace {

constexpr int kWarps = 8;

struct Jobs {
  LinearJob j[3];
  int n;
  int ks[3];      // warps per row group of each job (warps_per_row)
  int blocks[3];  // blocks of each job
  int blocks_total;
};

// A block holds kWarps / ks row groups of R rows; the ks warps of a group split K and their
// partial sums are added in warp order, so that all lanes have work and results are exact
// functions of the inputs.
// With norm.w (one token): x is the raw row, normalized by every block into shared memory.
template <int B>
__global__ void __launch_bounds__(kWarps * 32) linear_kernel(Jobs jobs, const float* __restrict__ x, int accumulate,
                                                             RowNorm norm) {
  constexpr int R = rows_per_warp<B>();
  __shared__ float red[kWarps * R * B];
  extern __shared__ float4 xs4[];  // norm.w: the normalized row
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int blk = blockIdx.x, j = 0;
  while (blk >= jobs.blocks[j]) blk -= jobs.blocks[j++];
  const DLinear& W = jobs.j[j].w;
  const int ks = jobs.ks[j];
  const int row0 = (blk * (kWarps / ks) + warp / ks) * R;
  prefetch_rows_l2(W, blk * (kWarps / ks) * R, (kWarps / ks) * R);
  float4 g[kRowNormPer];
  if (B == 1 && norm.w) row_norm_weights(norm.w, W.in, g);
  pdl_enter();
  if (B == 1 && norm.w) {
    float* xs = reinterpret_cast<float*>(xs4);
    block_rms_norm(x, g, W.in, norm.eps, xs, red);
    x = xs;
  }
  float acc[R][B];
  #pragma unroll
  for (int r = 0; r < R; ++r)
    #pragma unroll
    for (int b = 0; b < B; ++b) acc[r][b] = 0.0f;
  if (row0 < W.out) rows_dot_partial<R, B>(W, row0, x, W.in, lane, acc, (warp % ks) * 32, ks * 32);
  group_sum<R, B>(acc, red, ks);
  if (lane == 0 && warp % ks == 0) {
    float* y = jobs.j[j].y;
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = row0 + r;
      if (row >= W.out) break;
      const float bias = W.bias ? W.bias[row] : 0.0f;
      #pragma unroll
      for (int b = 0; b < B; ++b) {
        float* p = y + size_t(b) * W.out + row;
        *p = (accumulate ? *p : 0.0f) + acc[r][b] + bias;
      }
    }
  }
}

// Tensor cores (mma_tiles.cuh), every job NVFP4 or BF16 with K % 64 == 0, up to 64 tokens (nb)
// per launch. A block holds kWarps / ks tiles of 16 rows; the ks warps of a tile take its chunks
// in turn and their accumulators are added in warp order. Each chunk of a tile is dequantized
// once (a_frag) and multiplied by the activations of G groups of 8 tokens, so the
// dequantization, which bounds the tensor-core path, is paid once per 8G tokens; block row y of
// the grid takes the tokens from 8 G y (small matrices give more blocks that way).
// NW warps per block: 8, or 16 where one group's 16-warp blocks all fit on the GPU at once, so
// that twice the warps each walk half the chunks (o_proj at 2-8 tokens: Qwen3-30B-A3B's 128 tiles
// left 2 warps per scheduler, each a chain of 8 chunks stalled on its loads most of the time;
// GLM-4.5-Air's 256 tiles of 192 chunks a chain of 24).
template <int G, int NW>
__global__ void __launch_bounds__(NW * 32, 2) mma_linear_wide_kernel(Jobs jobs, const float* __restrict__ x,
                                                                           int nb, int accumulate) {
  constexpr int kChunksInFlight = G == 1 ? 2 : 1;  // one group: two chunks' loads in flight
  __shared__ float red[NW][4 * G][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int blk = blockIdx.x, jb = 0;
  while (blk >= jobs.blocks[jb]) blk -= jobs.blocks[jb++];
  const DLinear& W = jobs.j[jb].w;
  const int ks = jobs.ks[jb], tiles = NW / ks;
  const int r0 = (blk * tiles + warp / ks) * 16, wk = warp % ks;
  const int t0 = int(blockIdx.y) * 8 * G;
  if (blockIdx.y == 0) prefetch_rows_l2(W, blk * tiles * 16, tiles * 16);
  x += size_t(t0) * W.in;
  nb -= t0;
  pdl_enter();
  const int g = lane >> 2, j = lane & 3;
  const int ra = min(r0 + g, W.out - 1), rb = min(r0 + g + 8, W.out - 1);
  const bool fp4 = W.format == DFormat::NVFP4;
  float acc[G][4];
  #pragma unroll
  for (int q = 0; q < G; ++q) acc[q][0] = acc[q][1] = acc[q][2] = acc[q][3] = 0.0f;
  // The format is chosen outside the chunk loop so that unrolled chunks' loads can be hoisted.
  auto chunks = [&](auto fp4_format) {
    constexpr bool kFp4 = decltype(fp4_format)::value;
    #pragma unroll kChunksInFlight
    for (int c = wk; c < W.in / 64; c += ks) {
      const AFrag A = kFp4 ? nvfp4_a_frag(W, ra, rb, c, j) : bf16_a_frag(W, ra, rb, c, j);
      #pragma unroll
      for (int q = 0; q < G; ++q) {
        const int t = 8 * q + g;
        mma_afrag(A, x_frag<kFp4>(t < nb ? x + size_t(t) * W.in : nullptr, c, j), acc[q]);
      }
    }
  };
  if (r0 < W.out) {
    if (fp4) chunks(std::true_type{});
    else chunks(std::false_type{});
  }
  if (ks > 1) {
    #pragma unroll
    for (int q = 0; q < G; ++q)
      #pragma unroll
      for (int i = 0; i < 4; ++i) red[warp][4 * q + i][lane] = acc[q][i];
    __syncthreads();
    if (wk != 0) return;
    for (int w = warp + 1; w < warp + ks; ++w)
      #pragma unroll
      for (int q = 0; q < G; ++q)
        #pragma unroll
        for (int i = 0; i < 4; ++i) acc[q][i] += red[w][4 * q + i][lane];
  }
  if (r0 >= W.out) return;
  store_tile<G>(W, jobs.j[jb].y + size_t(t0) * W.out, W.out, r0, lane, nb, acc, accumulate);
}

// One group of tokens (up to 8) given as fragment rows (slot_mma.cuh; made by the kernel before
// the product: the normalization before q/k/v, attention before o), every job NVFP4 with
// K % 128 == 0: the wide kernel's blocks (NW warps) and K split, over the 128-weight chunks of
// slot_mma.cuh with lane (g, j) passing token g's row, as the grouped MoE kernels do, so that no
// tile splits the activations itself (37% of the wide kernel's instructions per chunk). Held to
// 80 registers at 8 warps (3 blocks per SM), 64 at 16 (2).
template <int NW>
__global__ void __launch_bounds__(NW * 32, NW == 16 ? 2 : 3) mma_linear_frag_kernel(Jobs jobs,
                                                                                 const uint32_t* __restrict__ xf,
                                                                                 int nb, int accumulate) {
  __shared__ float red[NW][4][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int blk = blockIdx.x, jb = 0;
  while (blk >= jobs.blocks[jb]) blk -= jobs.blocks[jb++];
  const DLinear& W = jobs.j[jb].w;
  const int ks = jobs.ks[jb], tiles = NW / ks;
  const int r0 = (blk * tiles + warp / ks) * 16, wk = warp % ks;
  prefetch_rows_l2(W, blk * tiles * 16, tiles * 16);
  pdl_enter();
  const int g = lane >> 2, j = lane & 3;
  const int ra = min(r0 + g, W.out - 1), rb = min(r0 + g + 8, W.out - 1);
  // Lanes past the batch repeat its last token: their columns are not stored.
  const uint32_t* xr = xf + size_t(min(g, nb - 1)) * W.in;
  float acc[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
  if (r0 < W.out) {
    #pragma unroll 4
    for (int c = wk; c < W.in / kFragChunk; c += ks) slot_chunk_mma(slot_chunk_load(W, ra, rb, c, j), xr, c, j, acc[0]);
  }
  if (ks > 1) {
    #pragma unroll
    for (int i = 0; i < 4; ++i) red[warp][i][lane] = acc[0][i];
    __syncthreads();
    if (wk != 0) return;
    for (int w = warp + 1; w < warp + ks; ++w)
      #pragma unroll
      for (int i = 0; i < 4; ++i) acc[0][i] += red[w][i][lane];
  }
  if (r0 >= W.out) return;
  store_tile<1>(W, jobs.j[jb].y, W.out, r0, lane, nb, acc, accumulate);
}

// 8..64 tokens, tiled: a block holds kWarps tiles of 16 rows (128 rows) and G groups of 8 tokens,
// and every warp walks the chunks of its tile. The activations of a chunk are loaded once per
// block and split into FP16 hi + lo fragments (x_split) in shared memory by the first G warps,
// one group each, then read by all kWarps warps: the wide kernel's blocks each read the whole
// activation matrix for 16 rows. Loads run ahead of their use: each warp keeps the raw weights of
// the next D chunks in registers, and the activations of the next chunk are loaded one chunk
// before they are split (two register sets, by chunk parity).
// Matrices of too few 128-row blocks to give every SM one (q/k/v, o) are split along K over a
// cluster of `parts` blocks (blockIdx.x = row block * parts + part, part = the cluster rank): part
// p walks chunks [p C / parts, (p + 1) C / parts), and the parts' accumulators are added in part
// order through the cluster's shared memory, so the result does not depend on scheduling.
template <int G, bool kFp4>
__global__ void __launch_bounds__(kWarps * 32, 1) mma_linear_tiled_kernel(Jobs jobs, const float* __restrict__ x,
                                                                         int nb, int accumulate, int parts) {
  constexpr int D = kFp4 ? 4 : 2;  // weight chunks in flight per warp (even: see the parity below)
  using Raw = std::conditional_t<kFp4, Nvfp4Raw, Bf16Raw>;
  // [buffer][group][fragment word][lane]; after the chunk loop, [warp][4 G][lane] partial sums.
  __shared__ uint32_t xs[2][G][16][32];
  static_assert(sizeof(xs) == kWarps * 4 * G * 32 * sizeof(float), "the partial sums reuse xs");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int part = int(blockIdx.x) % parts;
  int blk = int(blockIdx.x) / parts, jb = 0;
  while (blk >= jobs.blocks[jb]) blk -= jobs.blocks[jb++];
  const DLinear& W = jobs.j[jb].w;
  const int r0 = (blk * kWarps + warp) * 16, t0 = int(blockIdx.y) * 8 * G;
  const int g = lane >> 2, j = lane & 3, C = W.in / 64;
  const int cb = part * C / parts, n = (part + 1) * C / parts - cb;  // this part's chunks: cb .. cb + n - 1
  const int ra = min(r0 + g, W.out - 1), rb = min(r0 + g + 8, W.out - 1);
  auto raw = [&](int c) {
    if constexpr (kFp4) return nvfp4_raw(W, ra, rb, c, j);
    else return bf16_raw(W, ra, rb, c, j);
  };
  Raw ring[D];  // local chunk l's bytes in ring[l % D]: weights do not depend on the previous kernel
  #pragma unroll
  for (int i = 0; i < D; ++i)
    if (i < n) ring[i] = raw(cb + i);
  pdl_enter();
  const bool producer = warp < G;
  const int token = t0 + 8 * warp + g;  // the token whose activations this lane stages
  const float* xg = producer && token < nb ? x + size_t(token) * W.in : nullptr;
  auto stage = [&](const float (&f)[16], int buf) {
    const XFrag xf = x_split<kFp4>(f);
    #pragma unroll
    for (int t = 0; t < 4; ++t)
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        xs[buf][warp][4 * t + 2 * h][lane] = xf.hi[t][h];
        xs[buf][warp][4 * t + 2 * h + 1][lane] = xf.lo[t][h];
      }
  };
  float xr[2][16];  // activations of local chunks of parity 0 and 1, loaded ahead
  if (producer && n > 0) {
    x_load(xg, cb, j, xr[0]);
    stage(xr[0], 0);
    if (n > 1) x_load(xg, cb + 1, j, xr[1]);
  }
  __syncthreads();
  // The tensor core's accumulators take D chunks, then are added into acc: long chains of MMAs
  // into one accumulator measured 2-3x the error of the wide kernel's 4-chunk chains.
  float acc[G][4], mma_acc[G][4];
  #pragma unroll
  for (int q = 0; q < G; ++q) acc[q][0] = acc[q][1] = acc[q][2] = acc[q][3] = 0.0f;
  for (int l0 = 0; l0 < n; l0 += D) {
    #pragma unroll
    for (int q = 0; q < G; ++q) mma_acc[q][0] = mma_acc[q][1] = mma_acc[q][2] = mma_acc[q][3] = 0.0f;
    #pragma unroll
    for (int i = 0; i < D; ++i) {
      const int l = l0 + i, c = cb + l, p = i & 1;  // l0 is a multiple of D (even): l % 2 == p
      if (l >= n) break;  // n is the same for the whole block
      if (producer && l + 2 < n) x_load(xg, c + 2, j, xr[p]);  // chunk c was staged an iteration ago
      const AFrag A = a_frag_of(ring[i]);
      if (l + D < n) ring[i] = raw(c + D);
      #pragma unroll
      for (int q = 0; q < G; ++q) {
        XFrag xf;
        #pragma unroll
        for (int t = 0; t < 4; ++t)
          #pragma unroll
          for (int h = 0; h < 2; ++h) {
            xf.hi[t][h] = xs[p][q][4 * t + 2 * h][lane];
            xf.lo[t][h] = xs[p][q][4 * t + 2 * h + 1][lane];
          }
        mma_afrag(A, xf, mma_acc[q]);
      }
      if (producer && l + 1 < n) stage(xr[p ^ 1], p ^ 1);
      __syncthreads();
    }
    #pragma unroll
    for (int q = 0; q < G; ++q)
      #pragma unroll
      for (int i = 0; i < 4; ++i) acc[q][i] += mma_acc[q][i];
  }
  float* const y = jobs.j[jb].y + size_t(t0) * W.out;
  if (parts == 1) {
    if (r0 < W.out) store_tile<G>(W, y, W.out, r0, lane, nb - t0, acc, accumulate);
    return;
  }
  // The loop ended with a barrier, so xs is free for the partial sums. Part p stores the tiles of
  // the warps w with w % parts == p; every block stays until all have read its shared memory.
  float* const red = reinterpret_cast<float*>(&xs[0][0][0][0]);
  #pragma unroll
  for (int q = 0; q < G; ++q)
    #pragma unroll
    for (int i = 0; i < 4; ++i) red[(warp * 4 * G + 4 * q + i) * 32 + lane] = acc[q][i];
  cluster_sync();
  if (warp % parts == part && r0 < W.out) {
    float sum[G][4];
    #pragma unroll
    for (int q = 0; q < G; ++q) sum[q][0] = sum[q][1] = sum[q][2] = sum[q][3] = 0.0f;
    for (int k = 0; k < parts; ++k) {
      const float* rk = cooperative_groups::this_cluster().map_shared_rank(red, k);
      #pragma unroll
      for (int q = 0; q < G; ++q)
        #pragma unroll
        for (int i = 0; i < 4; ++i) sum[q][i] += rk[(warp * 4 * G + 4 * q + i) * 32 + lane];
    }
    store_tile<G>(W, y, W.out, r0, lane, nb - t0, sum, accumulate);
  }
  cluster_sync();
}

template <int B>
__global__ void __launch_bounds__(kWarps * 32) gated_kernel(DLinear gate, DLinear up, int ks, const float* __restrict__ x,
                                                            float* __restrict__ out) {
  constexpr int R = rows_per_warp<B>();
  __shared__ float red[kWarps * R * B];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row0 = (blockIdx.x * (kWarps / ks) + warp / ks) * R;
  prefetch_rows_l2(gate, blockIdx.x * (kWarps / ks) * R, (kWarps / ks) * R);
  prefetch_rows_l2(up, blockIdx.x * (kWarps / ks) * R, (kWarps / ks) * R);
  pdl_enter();
  float g[R][B], u[R][B];
  #pragma unroll
  for (int r = 0; r < R; ++r)
    #pragma unroll
    for (int b = 0; b < B; ++b) g[r][b] = u[r][b] = 0.0f;
  if (row0 < gate.out) gated_rows_dot_partial<R, B>(gate, up, row0, x, gate.in, lane, g, u, (warp % ks) * 32, ks * 32);
  group_sum<R, B>(g, red, ks);
  __syncthreads();
  group_sum<R, B>(u, red, ks);
  if (lane == 0 && warp % ks == 0) {
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = row0 + r;
      if (row >= gate.out) break;
      #pragma unroll
      for (int b = 0; b < B; ++b) {
        const float gv = g[r][b] + (gate.bias ? gate.bias[row] : 0.0f), uv = u[r][b] + (up.bias ? up.bias[row] : 0.0f);
        out[size_t(b) * gate.out + row] = gv / (1.0f + __expf(-gv)) * uv;
      }
    }
  }
}

// A dense gated FFN's gate and up products for 2..32 tokens (nb) on tensor cores, SiLU(gate) x up
// written per token: G groups of 8 tokens per pass, each chunk of a gate tile and of the same up
// tile dequantized once and shared by the groups (G <= 4 bounds registers). Grid and K split as
// in mma_linear_wide_kernel.
template <int G>
__global__ void __launch_bounds__(kWarps * 32) mma_gated_kernel(DLinear gate, DLinear up, int ks,
                                                                const float* __restrict__ x, int nb,
                                                                float* __restrict__ out) {
  __shared__ float red[kWarps][8 * G][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, tiles = kWarps / ks;
  const int r0 = (blockIdx.x * tiles + warp / ks) * 16, wk = warp % ks;
  prefetch_rows_l2(gate, blockIdx.x * tiles * 16, tiles * 16);
  prefetch_rows_l2(up, blockIdx.x * tiles * 16, tiles * 16);
  pdl_enter();
  const int g = lane >> 2, j = lane & 3;
  const int ra = min(r0 + g, gate.out - 1), rb = min(r0 + g + 8, gate.out - 1);
  const bool fp4 = gate.format == DFormat::NVFP4;
  float ag[G][4], au[G][4];
  #pragma unroll
  for (int q = 0; q < G; ++q)
    #pragma unroll
    for (int i = 0; i < 4; ++i) ag[q][i] = au[q][i] = 0.0f;
  if (r0 < gate.out) {
    #pragma unroll 1
    for (int c = wk; c < gate.in / 64; c += ks) {
      const AFrag Ag = a_frag(gate, ra, rb, c, j), Au = a_frag(up, ra, rb, c, j);
      #pragma unroll
      for (int q = 0; q < G; ++q) {
        const int t = 8 * q + g;
        const float* xg = t < nb ? x + size_t(t) * gate.in : nullptr;
        const XFrag xf = fp4 ? x_frag<true>(xg, c, j) : x_frag<false>(xg, c, j);
        mma_afrag(Ag, xf, ag[q]);
        mma_afrag(Au, xf, au[q]);
      }
    }
  }
  if (ks > 1) {
    #pragma unroll
    for (int q = 0; q < G; ++q)
      #pragma unroll
      for (int i = 0; i < 4; ++i) red[warp][8 * q + i][lane] = ag[q][i], red[warp][8 * q + 4 + i][lane] = au[q][i];
    __syncthreads();
    if (wk != 0) return;
    for (int w = warp + 1; w < warp + ks; ++w)
      #pragma unroll
      for (int q = 0; q < G; ++q)
        #pragma unroll
        for (int i = 0; i < 4; ++i) ag[q][i] += red[w][8 * q + i][lane], au[q][i] += red[w][8 * q + 4 + i][lane];
  }
  if (r0 >= gate.out) return;
  const float kg = mma_unscale(gate), ku = mma_unscale(up);
  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = r0 + g + 8 * h;
    if (row >= gate.out) continue;
    const float bg = gate.bias ? gate.bias[row] : 0.0f, bu = up.bias ? up.bias[row] : 0.0f;
    #pragma unroll
    for (int q = 0; q < G; ++q)
      #pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int b = 8 * q + 2 * j + e;
        if (b >= nb) continue;
        const float gv = ag[q][2 * h + e] * kg + bg, uv = au[q][2 * h + e] * ku + bu;
        out[size_t(b) * gate.out + row] = gv / (1.0f + __expf(-gv)) * uv;
      }
  }
}

// Batches from this size take the tensor-core path for NVFP4 (KESTREL_MMA_MIN_BATCH, for A/B runs).
int mma_min_batch() {
  static const int v = std::max(1, env_int("KESTREL_MMA_MIN_BATCH", 2));
  return v;
}

// Blocks per SM below which a tensor-core pass spreads its token groups over more block rows
// (KESTREL_LINEAR_FILL, for A/B runs; 0 keeps every group of a pass in one block).
int linear_fill() {
  static const int v = std::max(0, env_int("KESTREL_LINEAR_FILL", 2));
  return v;
}

// Blocks of 16 warps the wide kernel holds on the GPU at once: one group of tokens whose tiles
// fit in that many blocks takes 16 warps a block (KESTREL_LINEAR_WIDE16=0: never, for A/B runs).
int linear_wide16_blocks() {
  static const int v = [] {
    if (!env_switch("KESTREL_LINEAR_WIDE16")) return 0;
    int per_sm = 0;
    KESTREL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, mma_linear_wide_kernel<1, 16>, 16 * 32, 0));
    return per_sm * sm_count();
  }();
  return v;
}

// Passes of at least this many tokens take the tiled kernel for large matrices whose jobs share
// one format (KESTREL_LINEAR_TILED: 0 never, else the smallest pass, for A/B runs). Measured on
// Qwen3-30B-A3B shapes with K split (docs/PERF.md v21): batch 8 -1.8% per step, batch 4 +6%.
int linear_tiled_min() {
  static const int v = [] {
    const int n = env_int("KESTREL_LINEAR_TILED", 8);
    return n <= 0 ? 1 << 30 : n;
  }();
  return v;
}

// Groups of 8 tokens per block for a pass of nb tokens over `blocks` row blocks: as many as the
// pass has (each tile dequantized once), halved while the grid would have fewer than min_blocks.
int groups_per_block(int nb, int blocks, int min_blocks) {
  const int groups = (nb + 7) / 8;
  int G = groups > 4 ? 8 : groups > 2 ? 4 : groups;
  while (G > 1 && blocks * ((groups + G - 1) / G) < min_blocks) G /= 2;
  return G;
}

// Whether tiled passes may split K over a cluster (KESTREL_LINEAR_SPLIT=0: never, for A/B runs).
bool linear_split() {
  static const bool v = env_switch("KESTREL_LINEAR_SPLIT");
  return v;
}

// The tiled kernel's shape for a pass: G groups of 8 tokens per block and K in `parts` parts (a
// cluster), or G = 0 where the wide kernel is the better choice.
struct TiledPlan {
  int G = 0, parts = 1;
};

// Clusters of `parts` tiled blocks the GPU holds at once (one block per SM, for registers; a
// cluster's blocks share a GPC, so this is below sm_count() / parts), 0 for parts of 1 or over 8.
int tiled_clusters(int parts) {
  static const std::array<int, 9> most = [] {
    std::array<int, 9> n{};
    for (int p = 2; p <= std::min(8, cluster_limit()); ++p)
      n[size_t(p)] = active_clusters(mma_linear_tiled_kernel<8, true>, dim3(kWarps * 32), 0, p);
    return n;
  }();
  return parts >= 2 && parts <= 8 ? most[size_t(parts)] : 0;
}

// The kernel holds one block per SM, so a grid of more than one wave runs in rounds. Whole rows
// per block where the 128-row blocks alone give every SM one (the LM head); else the most groups
// per block (each chunk dequantized once for them) whose grid, K split into the most parts (at
// most the chunks) whose clusters all fit at once, fills at least 60% of the SMs. A cluster left
// for a second wave doubles the time (Nsight Compute: 40 clusters of 3 where 39 fit). Small
// matrices find no plan and keep the wide kernel, as do all where the split is off.
TiledPlan tiled_plan(int row_blocks, int groups, int chunks) {
  const int sm = sm_count();
  const int G0 = groups > 4 ? 8 : groups > 2 ? 4 : groups;
  if (row_blocks >= sm) return {groups_per_block(groups * 8, row_blocks, (linear_fill() * sm + 1) / 2), 1};
  if (!linear_split()) return {};
  for (int G = G0; G >= 1; G /= 2) {
    const int clusters = row_blocks * ((groups + G - 1) / G);
    for (int parts = std::min(8, chunks); parts >= 2; --parts)
      if (clusters <= tiled_clusters(parts) && 10 * clusters * parts >= 6 * sm) return {G, parts};
    if (linear_fill() == 0) break;  // every group of a pass in one block row
  }
  return {};
}

// f(std::integral_constant<int, G>) for G = 1, 2, 4 or 8.
template <typename F>
void by_groups(int G, F&& f) {
  switch (G) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    default: fail("internal: ", G, " token groups per block");
  }
}

}  // namespace

namespace {
// Whether a pass starting with `left` tokens still to go takes the tensor-core kernels.
bool pass_on_mma(const LinearJob* jobs, int njobs, int left) {
  bool tc = true, bf16 = true;
  for (int i = 0; i < njobs; ++i) {
    tc &= (jobs[i].w.format == DFormat::NVFP4 || jobs[i].w.format == DFormat::BF16) && jobs[i].w.in % 64 == 0;
    bf16 &= jobs[i].w.format == DFormat::BF16;
  }
  // One token takes tensor cores for BF16 only: its conversion is cheap, NVFP4's dequantization
  // is not, and a token uses one column of eight.
  return tc && (left >= mma_min_batch() || bf16);
}
}  // namespace

namespace {
// Passes from this many tokens read fragment rows where given (KESTREL_LINEAR_FRAG_MIN_BATCH, for
// A/B runs): one token's o from attention's fragment rows, and its q/k/v where they are large
// (linear_frag_min_weights).
int linear_frag_min_batch() {
  static const int v = std::max(1, env_int("KESTREL_LINEAR_FRAG_MIN_BATCH", 1));
  return v;
}

// One token's products of at least this many weights in all (millions; KESTREL_LINEAR_FRAG_MIN_MWEIGHTS,
// for A/B runs) take their normalization as a launch of its own that writes fragment rows, and
// then tensor cores, rather than the CUDA-core kernel with the normalization inside: about 1.4
// instructions per weight instead of 4.7, for a launch more. Set between the q/k/v measured at one
// token (docs/PERF.md v27, per step): Qwen3-30B-A3B's 10.5 M weights +2.4% on tensor cores; 14.7 M
// (48 heads) -4.1%, Qwen3-235B-A22B's 37.7 M -3.8%, GLM-4.5-Air's 58.7 M -7%.
double linear_frag_min_weights() {
  static const double v = 1e6 * std::max(0, env_int("KESTREL_LINEAR_FRAG_MIN_MWEIGHTS", 12));
  return v;
}
}  // namespace

bool linear_fuses_norm(const LinearJob* jobs, int njobs, int batch, bool frag_room) {
  if (batch != 1 || njobs < 1 || pass_on_mma(jobs, njobs, batch)) return false;
  const int in = jobs[0].w.in;
  double weights = 0;
  for (int i = 0; i < njobs; ++i) {
    if (jobs[i].w.in != in) return false;
    weights += double(jobs[i].w.in) * jobs[i].w.out;
  }
  if (frag_room && weights >= linear_frag_min_weights() && linear_takes_fragment_rows(jobs, njobs, batch)) return false;
  return in % 4 == 0 && in <= kRowNormMax;
}

bool linear_takes_fragment_rows(const LinearJob* jobs, int njobs, int batch) {
  static const bool on = env_switch("KESTREL_LINEAR_FRAG");
  if (!on || batch < linear_frag_min_batch() || batch > 8 || batch >= linear_tiled_min() || njobs < 1 ||
      jobs[0].w.in > kRowNormMax)
    return false;
  for (int i = 0; i < njobs; ++i)
    if (!slot_mma_fits(jobs[i].w) || jobs[i].w.in != jobs[0].w.in) return false;
  return true;
}

void launch_linear(const LinearJob* jobs, int njobs, const float* x, int batch, bool accumulate, cudaStream_t s,
                   RowNorm norm, const uint32_t* x_frag) {
  if (njobs < 1 || njobs > 3) fail("internal: launch_linear takes 1 to 3 jobs");
  // The input as fragment rows, where the kernel before made them (x_frag) or the normalization does.
  const uint32_t* xf = x_frag && linear_takes_fragment_rows(jobs, njobs, batch) ? x_frag : nullptr;
  if (x_frag && norm.w) fail("internal: launch_linear takes fragment rows of its input or a normalization, not both");
  if (norm.w && !linear_fuses_norm(jobs, njobs, batch, norm.frag != nullptr)) {
    const bool frag = norm.frag && linear_takes_fragment_rows(jobs, njobs, batch);
    if (!norm.out && !frag) fail("internal: launch_linear cannot fuse this normalization and has no buffer for it");
    if (frag) {
      launch_rms_norm_frag(x, norm.w, batch, jobs[0].w.in, norm.eps, norm.out, norm.frag, s);
      xf = norm.frag;
    } else {
      launch_rms_norm(x, norm.w, batch, jobs[0].w.in, norm.eps, norm.out, s);
    }
    x = norm.out;
    norm = RowNorm{};
  }
  bool bf16 = true, fp4 = true;  // every job is BF16; is NVFP4
  for (int i = 0; i < njobs; ++i) {
    bf16 &= jobs[i].w.format == DFormat::BF16;
    fp4 &= jobs[i].w.format == DFormat::NVFP4;
  }
  // Passes of up to 64 tokens on tensor cores, else of up to 8 on CUDA cores.
  for (int b0 = 0, nb = 0; b0 < batch; b0 += nb) {
    const bool mma = xf || pass_on_mma(jobs, njobs, batch - b0);
    nb = std::min(mma ? 64 : 8, batch - b0);
    const float* xb = x + size_t(b0) * jobs[0].w.in;
    // Blocks of (warps / ks) tiles of rows_per_tile rows; the tiled kernel has one warp per tile.
    auto jobs_for = [&](int rows_per_tile, bool tiled, int warps = kWarps) {
      Jobs J{};
      J.n = njobs;
      for (int i = 0; i < njobs; ++i) {
        J.j[i] = jobs[i];
        J.j[i].y = jobs[i].y + size_t(b0) * jobs[i].w.out;
        J.ks[i] = tiled ? 1 : mma ? mma_warps_per_tile(jobs[i].w.in, warps) : warps_per_row(jobs[i].w);
        const int rows_per_block = (warps / J.ks[i]) * rows_per_tile;
        J.blocks[i] = (jobs[i].w.out + rows_per_block - 1) / rows_per_block;
        J.blocks_total += J.blocks[i];
      }
      return J;
    };
    const int acc = accumulate ? 1 : 0;
    const int groups = (nb + 7) / 8;
    const bool tiled = mma && nb >= linear_tiled_min() && (fp4 || bf16);
    const Jobs Jt = tiled ? jobs_for(16, true) : Jobs{};
    const TiledPlan plan = tiled ? tiled_plan(Jt.blocks_total, groups, jobs[0].w.in / 64) : TiledPlan{};
    if (plan.G > 0) {
      const dim3 grid(unsigned(Jt.blocks_total * plan.parts), unsigned((groups + plan.G - 1) / plan.G)),
          block(kWarps * 32), cluster(unsigned(plan.parts));
      by_groups(plan.G, [&](auto g) {
        const auto kernel = fp4 ? mma_linear_tiled_kernel<g(), true> : mma_linear_tiled_kernel<g(), false>;
        if (plan.parts > 1) launch_cluster(kernel, grid, cluster, block, 0, s, Jt, xb, nb, acc, plan.parts);
        else launch(kernel, grid, block, 0, s, Jt, xb, nb, acc, 1);
      });
    } else if (mma) {
      // Fewer groups per block, in more block rows, where the tiles alone give under two blocks
      // per SM (o_proj of Qwen3-30B-A3B is 128 blocks; docs/PERF.md v14 has the A/B of 0, 1 and 2).
      Jobs J = jobs_for(16, false);
      const int G = groups_per_block(nb, J.blocks_total, linear_fill() * sm_count());
      // One group whose tiles give few blocks: 16 warps a block where every tile splits over 16 and
      // the blocks still fit at once.
      bool w16 = G == 1 && J.blocks_total <= linear_wide16_blocks();
      if (w16) {
        const Jobs J16 = jobs_for(16, false, 16);
        for (int i = 0; i < njobs; ++i) w16 &= J16.ks[i] == 16;
        if (w16) J = J16;
      }
      const dim3 grid(unsigned(J.blocks_total), unsigned((groups + G - 1) / G)), block((w16 ? 16 : kWarps) * 32);
      if (xf) {  // one pass of one group (linear_takes_fragment_rows)
        if (w16) launch(mma_linear_frag_kernel<16>, grid, block, 0, s, J, xf, nb, acc);
        else launch(mma_linear_frag_kernel<kWarps>, grid, block, 0, s, J, xf, nb, acc);
      } else if (w16) {
        launch(mma_linear_wide_kernel<1, 16>, grid, block, 0, s, J, xb, nb, acc);
      } else {
        by_groups(G, [&](auto g) { launch(mma_linear_wide_kernel<g(), kWarps>, grid, block, 0, s, J, xb, nb, acc); });
      }
    } else {
      by_batch(nb, [&](auto B) {
        const Jobs J = jobs_for(rows_per_warp<B()>(), false);
        const size_t smem = norm.w ? size_t(jobs[0].w.in) * sizeof(float) : 0;
        launch(linear_kernel<B()>, dim3(unsigned(J.blocks_total)), dim3(kWarps * 32), smem, s, J, xb, acc, norm);
      });
    }
    KESTREL_CUDA_LAUNCHED();
  }
}

void launch_gated(const DLinear& gate, const DLinear& up, const float* x, int batch, float* out, cudaStream_t s) {
  auto on_tc = [](const DLinear& w) {
    return (w.format == DFormat::NVFP4 || w.format == DFormat::BF16) && w.in % 64 == 0;
  };
  const bool tc = on_tc(gate) && on_tc(up) && gate.format == up.format && gate.in == up.in && gate.out == up.out;
  // Passes of up to 32 tokens on tensor cores (from mma_min_batch tokens), else of up to 8.
  for (int b0 = 0, nb = 0; b0 < batch; b0 += nb) {
    const bool mma = tc && batch - b0 >= mma_min_batch();
    nb = std::min(mma ? 32 : 8, batch - b0);
    const float* xb = x + size_t(b0) * gate.in;
    float* ob = out + size_t(b0) * gate.out;
    if (mma) {
      const int ks = mma_warps_per_tile(gate.in), rows_per_block = (kWarps / ks) * 16;
      const dim3 grid(unsigned((gate.out + rows_per_block - 1) / rows_per_block)), block(kWarps * 32);
      if (nb <= 8) launch(mma_gated_kernel<1>, grid, block, 0, s, gate, up, ks, xb, nb, ob);
      else if (nb <= 16) launch(mma_gated_kernel<2>, grid, block, 0, s, gate, up, ks, xb, nb, ob);
      else launch(mma_gated_kernel<4>, grid, block, 0, s, gate, up, ks, xb, nb, ob);
    } else {
      by_batch(nb, [&](auto B) {
        constexpr int R = rows_per_warp<B()>();
        const int ks = warps_per_row(gate), rows_per_block = (kWarps / ks) * R;
        const unsigned grid = unsigned((gate.out + rows_per_block - 1) / rows_per_block);
        launch(gated_kernel<B()>, dim3(grid), dim3(kWarps * 32), 0, s, gate, up, ks, xb, ob);
      });
    }
    KESTREL_CUDA_LAUNCHED();
  }
}

}  // namespace kestrel::cuda
