// What every product tile of the persistent step shares: the RMSNorm of the batch's residual
// rows into the block's scratch, and rows [r0, r1) of a matrix against the batch's input rows,
// a warp per group of rows (the same rows always to the same warp, so a warp may accumulate a
// row over several matrices without a barrier).
#pragma once
#include "backend/cuda/dequant.cuh"
#include "backend/cuda/persistent/op_mma.cuh"
#include "backend/cuda/persistent/program.h"
#include "backend/cuda/persistent/weights.cuh"
#include "backend/cuda/reduce.cuh"

namespace kestrel::cuda {

static_assert(kPersistentThreads == kRowNormThreads, "a persistent block normalizes a row as block_rms_norm does");

// The persistent kernel's dynamic shared memory: the ops' scratch, the normalized rows when they
// fit, the weight stage (PersistentStep lays it out).
extern __shared__ __align__(128) float persistent_smem[];

// The block's normalized rows [B, hidden]: in shared memory when they fit there (the products
// read them once per weight group: an L2 round trip each from global memory), else its own rows
// of P.xn [8, hidden].
__device__ __forceinline__ float* block_xn(const PProgram& P) {
  if (P.xn_offset != kNotStaged) return persistent_smem + P.xn_offset / 4;
  return P.xn + size_t(blockIdx.x) * 8 * P.hidden;
}

// Clocks of the running instruction's marks, by thread 0 when tracing (0: not reached).
__shared__ long long trace_marks[kTraceMarks];
__device__ __forceinline__ void trace_mark(const PProgram& P, int k) {
  if (P.trace && threadIdx.x == 0) trace_marks[k] = clock64();
}

// The descriptors of the layer the block's instruction is in, copied into shared memory by warp 1
// before the instruction's wait (load_layer): the wait's acquire fence empties the L1, and the
// weights streaming through the L2 may have evicted them from there, so a read of P.layers after
// the wait would be a round trip on the tile's path (docs/PERF.md v32).
__shared__ DLayer s_layer;
__shared__ KvLayer s_kv;
__shared__ int s_layer_at;  // the layer s_layer and s_kv describe, or -1

__device__ __forceinline__ const DLayer& layer_of(const PProgram& P, int l) { return l == s_layer_at ? s_layer : P.layers[l]; }
__device__ __forceinline__ const KvLayer& kv_of(const PProgram& P, int l) { return l == s_layer_at ? s_kv : P.kv[l]; }

template <class D>
__device__ __forceinline__ void copy_words(D& dst, const D& src, int lane) {
  static_assert(sizeof(D) % 8 == 0 && alignof(D) >= 8, "descriptors copy in 8-byte words");
  const uint2* s = reinterpret_cast<const uint2*>(&src);
  uint2* d = reinterpret_cast<uint2*>(&dst);
  for (int i = lane; i < int(sizeof(D) / 8); i += 32) d[i] = s[i];
}
// By the lanes of warp 1, before the wait: layer l's descriptors into s_layer and s_kv unless they
// hold them already (the other warps read them only past the barrier that ends the wait).
__device__ __forceinline__ void load_layer(const PProgram& P, int l, int lane) {
  if (l < 0 || l == s_layer_at) return;
  copy_words(s_layer, P.layers[l], lane);
  copy_words(s_kv, P.kv[l], lane);
  __syncwarp();
  if (lane == 0) s_layer_at = l;
}

// The point of the step whose normalized rows the block's scratch holds (kNoNormPoint at its
// start): 2l for layer l's attention input, 2l + 1 for its FFN input, -1 for the final norm. Every
// tile that normalizes at one point runs while the residual rows are the same (they wait for all
// its writers, and its next writers wait for them), so a block that holds them need not
// normalize again. Keyed by the point, not the weights: models may share one norm vector
// between points (random-weight models do), and the residual differs between them.
constexpr int kNoNormPoint = -1000000;
__device__ __forceinline__ int attn_norm_point(int layer) { return 2 * layer; }
__device__ __forceinline__ int ffn_norm_point(int layer) { return 2 * layer + 1; }
constexpr int kFinalNormPoint = -1;
__shared__ int xn_point;

// xn[b] = RMSNorm(x[b]) * w for the batch's rows at `point`, unless the scratch holds them
// already; ends with a barrier.
__device__ __forceinline__ void norm_rows(const PProgram& P, const float* w, int point, float* xn) {
  if (xn_point == point) return;
  __shared__ float red[32];
  float4 g[kRowNormPer];
  row_norm_weights(w, P.hidden, g);
  for (int b = 0; b < P.batch; ++b) block_rms_norm(P.x + size_t(b) * P.hidden, g, P.hidden, P.eps, xn + size_t(b) * P.hidden, red);
  if (threadIdx.x == 0) xn_point = point;
  __syncthreads();
}

// For rows [r0, r1) of W: out(row, b, value + bias) for every token b < batch, by the first lane
// of the row's warp. x: B rows of W.in values, ldx apart (rows past the batch are read, unused).
template <int B, bool Generic, class Out>
__device__ __forceinline__ void tile_rows(const DLinear& W, int r0, int r1, const float* x, int ldx, int batch, Out out) {
  constexpr int R = rows_per_warp<B>();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = kPersistentThreads / 32;
  for (int row = r0 + warp * R; row < r1; row += warps * R) {
    float acc[R][B];
    #pragma unroll
    for (int r = 0; r < R; ++r)
      #pragma unroll
      for (int b = 0; b < B; ++b) acc[r][b] = 0.0f;
    rows_dot_partial<R, B, Generic>(W, row, x, ldx, lane, acc);
    warp_sum<R, B>(acc);
    if (lane == 0)
      #pragma unroll
      for (int r = 0; r < R; ++r) {
        if (row + r >= r1) break;
        const float bias = W.bias ? W.bias[row + r] : 0.0f;
        #pragma unroll
        for (int b = 0; b < B; ++b)
          if (b < batch) out(row + r, b, acc[r][b] + bias);
      }
  }
}

// The same for gate and up rows of a gated FFN: out(row, b, silu(gate) * up).
template <int B, bool Generic, class Out>
__device__ __forceinline__ void tile_gated_rows(const DLinear& G, const DLinear& U, int r0, int r1, const float* x, int ldx,
                                                int batch, Out out) {
  constexpr int R = rows_per_warp<B>();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = kPersistentThreads / 32;
  for (int row = r0 + warp * R; row < r1; row += warps * R) {
    float g[R][B], u[R][B];
    #pragma unroll
    for (int r = 0; r < R; ++r)
      #pragma unroll
      for (int b = 0; b < B; ++b) g[r][b] = u[r][b] = 0.0f;
    gated_rows_dot_partial<R, B, Generic>(G, U, row, x, ldx, lane, g, u, 0, 32);
    warp_sum<R, B>(g);
    warp_sum<R, B>(u);
    if (lane == 0)
      #pragma unroll
      for (int r = 0; r < R; ++r) {
        if (row + r >= r1) break;
        #pragma unroll
        for (int b = 0; b < B; ++b)
          if (b < batch) {
            const float gv = g[r][b] + (G.bias ? G.bias[row + r] : 0.0f), uv = u[r][b] + (U.bias ? U.bias[row + r] : 0.0f);
            out(row + r, b, silu_times(gv, uv));
          }
      }
  }
}

__device__ __forceinline__ uint32_t* block_frag(const PProgram& P) {
  return reinterpret_cast<uint32_t*>(persistent_smem) + P.frag_offset / 4;
}

// Rows [r0, r1) of W for the batch's tokens: from the stage when the instruction is staged (stage
// not null; *at: where the op's next matrix sits in it, weights.cuh), on tensor cores where the
// tile fits them (op_mma.cuh), else as tile_rows computes them.
template <int B>
__device__ __forceinline__ void product_rows(const PProgram& P, const DLinear& W, int r0, int r1, const float* x, int ldx,
                                             const uint8_t* stage, uint32_t* at, RowsOut out) {
  if (!stage) return tile_rows<B, false>(W, r0, r1, x, ldx, P.batch, out);
  const StagedRows s = stage_rows(W, r0, r1, at, B);
  if (mma_tile_fits(W, B)) {
    const DLinear w[1] = {W};
    const StagedRows st[1] = {s};
    return mma_rows<1, B>(w, st, stage, r0, r1, x, ldx, P.batch, block_frag(P), persistent_smem, out);
  }
  tile_rows<B, true>(staged(W, r0, r1, stage, s), r0, r1, x, ldx, P.batch, out);
}

// The same for gate and up rows: out(row, b, silu(gate) * up) (staged gate first, then up).
template <int B>
__device__ __forceinline__ void product_gated_rows(const PProgram& P, const DLinear& G, const DLinear& U, int r0, int r1,
                                                   const float* x, int ldx, const uint8_t* stage, uint32_t* at, RowsOut out) {
  if (!stage) return tile_gated_rows<B, false>(G, U, r0, r1, x, ldx, P.batch, out);
  const StagedRows sg = stage_rows(G, r0, r1, at, B);
  const StagedRows su = stage_rows(U, r0, r1, at, B);
  if (mma_tile_fits(G, B) && mma_tile_fits(U, B) && G.in == U.in) {
    const DLinear w[2] = {G, U};
    const StagedRows st[2] = {sg, su};
    return mma_rows<2, B>(w, st, stage, r0, r1, x, ldx, P.batch, block_frag(P), persistent_smem, out);
  }
  tile_gated_rows<B, true>(staged(G, r0, r1, stage, sg), staged(U, r0, r1, stage, su), r0, r1, x, ldx, P.batch, out);
}

}  // namespace kestrel::cuda
