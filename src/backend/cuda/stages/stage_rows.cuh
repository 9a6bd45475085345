// What every product stage shares: the RMSNorm of the residual rows into shared memory (each
// block computes it itself: 8-16 KB from the L2, cheaper than a barrier), and a matrix's rows
// shared out over the grid, block b taking a contiguous run of row groups and its warps taking
// them in turn. A warp computes R rows for all B tokens at once (dequant.cuh's row products, the
// launched kernels' own), so each weight is read once per step.
#pragma once
#include "backend/cuda/dequant.cuh"
#include "backend/cuda/slot_mma.cuh"
#include "backend/cuda/stages/stage_args.h"

namespace kestrel::cuda {

// Rows per warp: each activation value loaded serves R rows.
template <int B>
__host__ __device__ constexpr int stage_rows() {
  return B <= 2 ? 2 : 1;
}

__device__ __forceinline__ int stage_warp() { return int(threadIdx.x) >> 5; }
__device__ __forceinline__ int stage_lane() { return int(threadIdx.x) & 31; }
constexpr int kStageWarps = kStageThreads / 32;

// out[b] = w * x[b] / rms(x[b]) for b < batch, zeros for batch <= b < B (so that the products'
// unused columns stay finite); where xf is given (n % 128 == 0), rows b < batch also as fragment
// rows there (slot_mma.cuh). x: global rows of n floats written by other blocks before the
// barrier; out, xf: shared memory. red: 32 x B floats. Ends with a barrier.
template <int B>
__device__ __noinline__ void stage_norm(const float* x, const float* w, int batch, int n, float eps, float* out, float* red,
                                        uint32_t* xf = nullptr) {
  float ss[B];
  #pragma unroll
  for (int b = 0; b < B; ++b) ss[b] = 0.0f;
  for (int i = threadIdx.x; i < n / 4; i += blockDim.x)
    #pragma unroll
    for (int b = 0; b < B; ++b)
      if (b < batch) {
        const float4 v = reinterpret_cast<const float4*>(x + size_t(b) * n)[i];
        reinterpret_cast<float4*>(out + size_t(b) * n)[i] = v;
        ss[b] += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
      }
  #pragma unroll
  for (int b = 0; b < B; ++b) ss[b] = warp_sum(ss[b]);
  if (stage_lane() == 0)
    #pragma unroll
    for (int b = 0; b < B; ++b) red[stage_warp() * B + b] = ss[b];
  __syncthreads();
  float inv[B];
  #pragma unroll
  for (int b = 0; b < B; ++b) {
    float t = 0.0f;
    for (int k = 0; k < kStageWarps; ++k) t += red[k * B + b];
    inv[b] = rsqrtf(t / float(n) + eps);
  }
  for (int i = threadIdx.x; i < n / 4; i += blockDim.x) {
    const float4 g = reinterpret_cast<const float4*>(w)[i];
    #pragma unroll
    for (int b = 0; b < B; ++b) {
      float4& v = reinterpret_cast<float4*>(out + size_t(b) * n)[i];
      if (b < batch) v = make_float4(g.x * v.x * inv[b], g.y * v.y * inv[b], g.z * v.z * inv[b], g.w * v.w * inv[b]);
      else v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (xf && b < batch) frag_store4(xf + size_t(b) * n, 4 * i, v);
    }
  }
  __syncthreads();
}

// Calls f(g) for the row groups g in [0, groups) that this warp takes: block b the run
// [b per, (b + 1) per), its warps in turn.
template <class F>
__device__ __forceinline__ void for_row_groups(int groups, F&& f) {
  const int per = (groups + int(gridDim.x) - 1) / int(gridDim.x);
  const int g0 = int(blockIdx.x) * per, g1 = min(groups, g0 + per);
  for (int g = g0 + stage_warp(); g < g1; g += kStageWarps) f(g);
}

// The weights' loads mark their lines evict-first in the L2, which keeps the kernel's code and
// the activations there while the weights stream past (docs/PERF.md v37: -12% at batch 1).
__device__ __forceinline__ uint64_t weight_policy() {
  uint64_t p;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 0f3F800000;" : "=l"(p));
  return p;
}
__device__ __forceinline__ uint4 ld_weights(const uint4* p, uint64_t pol) {
  uint4 v;
  asm("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
  return v;
}
__device__ __forceinline__ uint32_t ld_weights(const uint16_t* p, uint64_t pol) {
  unsigned short v;
  asm("ld.global.nc.L2::cache_hint.u16 %0, [%1], %2;" : "=h"(v) : "l"(p), "l"(pol));
  return v;
}

// NVFP4 rows whose groups a warp covers in at most kIters steps (K <= 32 x kIters x step, a
// multiple of 32): every one of the lane's groups loaded before the first is used, so the warp
// waits for one memory latency instead of one per step through K (rows_dot_partial's loop).
// M matrices of R rows (M = 2: gate and up), acc as nvfp4_rows_dot's. False where it does not
// apply (uniform over the block): the caller takes rows_dot_partial.
template <int M, int R, int B, int kIters>
__device__ __forceinline__ bool nvfp4_rows_deep(const NvRows (&mat)[M], int K, const float* x, int ldx,
                                                float (&acc)[M * R][B], int first, int step) {
  const int groups = K / 32;
  if (K % 32 != 0 || groups > kIters * step) return false;
  uint4 c[kIters][M * R];
  uint32_t sc[kIters][M * R];
  const uint64_t pol = weight_policy();
  #pragma unroll
  for (int j = 0; j < kIters; ++j) {
    const int g = min(first + stage_lane() + j * step, groups - 1);
    #pragma unroll
    for (int q = 0; q < M * R; ++q) {
      const int row = min(q % R, mat[q / R].last);
      c[j][q] = ld_weights(reinterpret_cast<const uint4*>(mat[q / R].codes + size_t(row) * (K / 2)) + g, pol);
      sc[j][q] = ld_weights(reinterpret_cast<const uint16_t*>(mat[q / R].scales + size_t(row) * (K / 16)) + g, pol);
    }
  }
  #pragma unroll
  for (int j = 0; j < kIters; ++j) {
    const int g = first + stage_lane() + j * step;
    if (g < groups) nvfp4_group_fma<M, R, B>(mat, c[j], sc[j], x + 32 * g, ldx, acc);
  }
  return true;
}

// rows_dot_partial, with NVFP4 rows of up to 4 steps through K loaded all at once.
template <int R, int B>
__device__ __forceinline__ void stage_rows_dot(const DLinear& W, int row0, const float* x, int ldx, float (&acc)[R][B],
                                               int first, int step) {
  if (W.format == DFormat::NVFP4) {
    const NvRows mat[1] = {nv_rows(W, row0)};
    if (nvfp4_rows_deep<1, R, B, 4>(mat, W.in, x, ldx, acc, first, step)) return;
  }
  rows_dot_partial<R, B>(W, row0, x, ldx, stage_lane(), acc, first, step);
}

// By one lane: rows row0 .. row0 + R - 1 of W (those that exist) for the first `batch` of B
// tokens, y[b * ldy + row] = (accumulate ? y : 0) + acc + bias.
template <int R, int B>
__device__ __forceinline__ void store_rows(const DLinear& W, int row0, const float (&acc)[R][B], int batch, float* y,
                                           int ldy, bool accumulate) {
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = row0 + r;
    if (row >= W.out) break;
    const float bias = W.bias ? W.bias[row] : 0.0f;
    #pragma unroll
    for (int b = 0; b < B; ++b)
      if (b < batch) {
        float* o = y + size_t(b) * ldy + row;
        *o = (accumulate ? *o : 0.0f) + acc[r][b] + bias;
      }
  }
}

// Rows row0 .. row0 + R - 1 of W by one warp, x: B rows of ldx floats (shared or global memory).
template <int R, int B>
__device__ __noinline__ void stage_linear_rows(const DLinear& W, int row0, const float* x, int ldx, int batch,
                                                  float* y, int ldy, bool accumulate) {
  float acc[R][B];
  #pragma unroll
  for (int r = 0; r < R; ++r)
    #pragma unroll
    for (int b = 0; b < B; ++b) acc[r][b] = 0.0f;
  stage_rows_dot<R, B>(W, row0, x, ldx, acc, 0, 32);
  warp_sum<R, B>(acc);
  if (stage_lane() == 0) store_rows<R, B>(W, row0, acc, batch, y, ldy, accumulate);
}

// Warps that share one row group when a block has n groups: as many as keep all 16 busy, but
// no more than give each lane a 32-weight (NVFP4) or 8-weight group of the row (warps_per_row).
// A block with few groups (the router: one or none; o and down: eight) then waits for one
// memory latency instead of one per step of a lane through the row.
__device__ __forceinline__ int stage_split_k(const DLinear& W, int n) {
  int ks = 1;
  const int cap = warps_per_row(W) * 2;  // warps_per_row stops at 8
  while (ks < kStageWarps && ks < cap && n * ks * 2 <= kStageWarps) ks *= 2;
  return ks;
}

// Every row of W over the grid: y[b * ldy + row] = (accumulate ? y : 0) + W x + bias. Block b
// takes its run of row groups in rounds of 16 / ks groups, ks warps on each (the same for every
// warp of the block: group_sum meets at barriers). red: 16 x R x B floats of shared memory.
template <int B>
__device__ __noinline__ void stage_linear(const DLinear& W, const float* x, int ldx, int batch, float* y, int ldy, bool accumulate,
                             float* red) {
  constexpr int R = stage_rows<B>();
  const int groups = (W.out + R - 1) / R, per = (groups + int(gridDim.x) - 1) / int(gridDim.x);
  const int g0 = int(blockIdx.x) * per, n = max(0, min(groups, g0 + per) - g0);
  const int ks = stage_split_k(W, n), slots = kStageWarps / ks, w = stage_warp();
  for (int base = 0; base < n; base += slots) {
    const int g = g0 + base + w / ks;
    const bool live = base + w / ks < n;
    float acc[R][B];
    #pragma unroll
    for (int r = 0; r < R; ++r)
      #pragma unroll
      for (int b = 0; b < B; ++b) acc[r][b] = 0.0f;
    if (live) stage_rows_dot<R, B>(W, g * R, x, ldx, acc, (w % ks) * 32, ks * 32);
    group_sum<R, B>(acc, red, ks);
    if (live && stage_lane() == 0 && w % ks == 0) store_rows<R, B>(W, g * R, acc, batch, y, ldy, accumulate);
    if (ks > 1) __syncthreads();  // red is the next round's
  }
}

// silu(gate . x) * (up . x) for rows row0 .. row0 + R - 1 into y[b * ldy + row], b < batch.
template <int R, int B>
__device__ __noinline__ void stage_gated_rows(const DLinear& G, const DLinear& U, int row0, const float* x, int ldx,
                                                 int batch, float* y, int ldy) {
  float g[R][B], u[R][B];
  #pragma unroll
  for (int r = 0; r < R; ++r)
    #pragma unroll
    for (int b = 0; b < B; ++b) g[r][b] = u[r][b] = 0.0f;
  bool deep = false;
  if (G.format == DFormat::NVFP4 && U.format == DFormat::NVFP4 && G.in == U.in) {
    const NvRows mat[2] = {nv_rows(G, row0), nv_rows(U, row0)};
    float acc[2 * R][B];
    #pragma unroll
    for (int q = 0; q < 2 * R; ++q)
      #pragma unroll
      for (int b = 0; b < B; ++b) acc[q][b] = 0.0f;
    deep = nvfp4_rows_deep<2, R, B, 2>(mat, G.in, x, ldx, acc, 0, 32);
    #pragma unroll
    for (int r = 0; r < R; ++r)
      #pragma unroll
      for (int b = 0; b < B; ++b) g[r][b] = acc[r][b], u[r][b] = acc[R + r][b];
  }
  if (!deep) gated_rows_dot_partial<R, B>(G, U, row0, x, ldx, stage_lane(), g, u, 0, 32);
  warp_sum<R, B>(g);
  warp_sum<R, B>(u);
  if (stage_lane() == 0)
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = row0 + r;
      if (row >= G.out) break;
      #pragma unroll
      for (int b = 0; b < B; ++b)
        if (b < batch) y[size_t(b) * ldy + row] = g[r][b] / (1.0f + __expf(-g[r][b])) * u[r][b];
    }
}

}  // namespace kestrel::cuda
