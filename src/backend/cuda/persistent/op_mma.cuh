// The persistent step's products on tensor cores: rows of NVFP4 matrices that the block's stage
// holds (weights.cuh lays them out, padded) times the batch's activations, with slot_mma.cuh's
// chunks and lane (g, j) passing token g's fragment row, so that column n of every MMA is token
// n (1 to 8 tokens, one MMA column each). About 1.4 instructions per weight against 3.5 for the
// CUDA-core rows of op_rows.cuh, which keep the tiles this does not fit (mma_tile_fits).
//
// A warp takes 16 rows (row groups); when a tile has fewer than 8 groups the warps of a group
// split its 128-weight chunks, and their sums meet in shared memory in warp order (the result
// does not depend on timing).
#pragma once
#include "backend/cuda/persistent/weights.cuh"
#include "backend/cuda/slot_mma.cuh"

namespace kestrel::cuda {

constexpr int kMmaRedFloats = (kPersistentThreads / 32) * 2 * 16 * 8;  // the warps' partial sums, 2 matrices

// The Bt fragment rows (mma_frag_words apart) of the batch's rows of x (zeros past the batch):
// every thread its share of float4s, then a barrier.
template <int Bt>
__device__ __forceinline__ void frag_rows(const float* x, int ldx, int K, int batch, uint32_t* xf) {
  const uint32_t fs = mma_frag_words(K);
  for (int b = 0; b < Bt; ++b)
    for (int e = 4 * int(threadIdx.x); e < K; e += 4 * kPersistentThreads) {
      const float4 v = b < batch ? *reinterpret_cast<const float4*>(x + size_t(b) * ldx + e) : make_float4(0, 0, 0, 0);
      frag_store4(xf + b * fs, e, v);
    }
  __syncthreads();
}

// Chunk c of local rows la and lb of a staged matrix (codes and scales at their strides).
__device__ __forceinline__ SlotChunk staged_chunk(const uint8_t* codes, const uint8_t* scales, const StagedRows& s, int la,
                                                  int lb, int c, int j) {
  SlotChunk r;
  r.qa = *reinterpret_cast<const uint4*>(codes + la * s.codes_stride + 64 * c + 16 * j);
  r.qb = *reinterpret_cast<const uint4*>(codes + lb * s.codes_stride + 64 * c + 16 * j);
  r.sa = *reinterpret_cast<const uint16_t*>(scales + la * s.scales_stride + 8 * c + 2 * j);
  r.sb = *reinterpret_cast<const uint16_t*>(scales + lb * s.scales_stride + 8 * c + 2 * j);
  return r;
}

// Where a product tile's results go: row r of token b to dst[b * ld + r], added to what is there
// when `add` (the residual).
struct RowsOut {
  float* dst;
  int64_t ld;
  int add;
  __device__ __forceinline__ void operator()(int row, int b, float v) const {
    float* d = dst + b * ld + row;
    *d = add ? *d + v : v;
  }
};

// For rows [r0, r1) of the M matrices W (staged as s; M = 2: gate and up, same K): out(row, b, v)
// for every token b < batch, v = W row . x[b] + bias (M = 2: silu(gate) * up), by one thread per
// (row, b). x: the batch's rows of K values, ldx apart. xf: the block's fragment rows; red:
// kMmaRedFloats floats. Not inlined: one copy per (M, Bt) serves every op (the kernel's size).
__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.0f + expf(-g)) * u; }

template <int M>
__device__ __forceinline__ float rows_result(const float (&v)[M]) {
  if constexpr (M == 2) return silu_times(v[0], v[1]);
  else return v[0];
}

template <int M, int Bt>
__device__ __noinline__ void mma_rows(const DLinear (&W)[M], const StagedRows (&s)[M], const uint8_t* stage, int r0,
                                      int r1, const float* x, int ldx, int batch, uint32_t* xf, float* red, RowsOut out) {
  const int K = W[0].in, n = r1 - r0, nc = K / kFragChunk, ng = (n + 15) / 16;
  if (n <= 0) return;
  frag_rows<Bt>(x, ldx, K, batch, xf);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, j = lane & 3;
  constexpr int warps = kPersistentThreads / 32;
  const int parts = ng >= warps ? 1 : warps / ng;  // warps per row group
  const uint32_t* xr = xf + (g % Bt) * mma_frag_words(K);
  for (int rg = warp / parts; rg < ng && warp < (ng >= warps ? warps : ng * parts); rg += warps / parts) {
    const int part = warp % parts, la = min(16 * rg + g, n - 1), lb = min(16 * rg + 8 + g, n - 1);
    // Two accumulators, alternate chunks: a chunk's 16 MMAs chain through theirs.
    float acc[2][M][4];
    #pragma unroll
    for (int u = 0; u < 2; ++u)
      #pragma unroll
      for (int m = 0; m < M; ++m)
        #pragma unroll
        for (int q = 0; q < 4; ++q) acc[u][m][q] = 0.0f;
    #pragma unroll 1
    for (int c = part; c < nc; c += 2 * parts) {
      SlotChunk ch[2][M];
      #pragma unroll
      for (int m = 0; m < M; ++m) {
        ch[0][m] = staged_chunk(stage + s[m].codes, stage + s[m].scales, s[m], la, lb, c, j);
        if (c + parts < nc) ch[1][m] = staged_chunk(stage + s[m].codes, stage + s[m].scales, s[m], la, lb, c + parts, j);
      }
      slot_chunks_mma<M>(ch[0], xr, c, j, acc[0]);
      if (c + parts < nc) slot_chunks_mma<M>(ch[1], xr, c + parts, j, acc[1]);
    }
    // Lane (g, j): rows 16rg + g (q 0, 1) and 16rg + 8 + g (q 2, 3), tokens 2j and 2j + 1.
    #pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int r = q < 2 ? g : 8 + g, b = 2 * j + (q & 1), row = 16 * rg + r;
      if (parts > 1) {
        #pragma unroll
        for (int m = 0; m < M; ++m) red[((warp * M + m) * 16 + r) * 8 + b] = acc[0][m][q] + acc[1][m][q];
      } else if (row < n && b < batch) {
        float v[M];
        #pragma unroll
        for (int m = 0; m < M; ++m)
          v[m] = (acc[0][m][q] + acc[1][m][q]) * mma_unscale(W[m]) + (W[m].bias ? W[m].bias[r0 + row] : 0.0f);
        out(r0 + row, b, rows_result<M>(v));
      }
    }
  }
  if (parts == 1) return;
  __syncthreads();
  for (int i = threadIdx.x; i < ng * 16 * batch; i += kPersistentThreads) {
    const int rg = i / (16 * batch), r = (i / batch) % 16, b = i % batch, row = 16 * rg + r;
    if (row >= n) continue;
    float v[M];
    #pragma unroll
    for (int m = 0; m < M; ++m) {
      float sum = 0.0f;
      for (int p = 0; p < parts; ++p) sum += red[(((rg * parts + p) * M + m) * 16 + r) * 8 + b];
      v[m] = sum * mma_unscale(W[m]) + (W[m].bias ? W[m].bias[r0 + row] : 0.0f);
    }
    out(r0 + row, b, rows_result<M>(v));
  }
}

}  // namespace kestrel::cuda
