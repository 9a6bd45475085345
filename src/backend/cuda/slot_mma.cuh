// One token's activations times NVFP4 rows on tensor cores (the per-slot gate/up and down kernels,
// where each expert's matrix meets a single token): mma.sync m16n8k16 with every column of B
// holding the same token, so that each lane ends with the dot products of its own two rows, no
// shuffles needed.
//
// Lane (g, j) = (lane / 4, lane % 4) takes, of each 128-weight chunk of rows ra and rb, the 32
// weights [32j, 32j + 32): 16 bytes of codes and two block scales per row, one load each. A dot
// product does not depend on the order of k, so the chunk's 8 k-steps may pair any of the lane's
// weights as long as the activations are paired the same way: k-step s = 2i + p takes from word
// i of the 16 bytes the code pairs (4p, 4p + 2) as fragment k (2j, 2j + 1) and (4p + 1, 4p + 3)
// as k (2j + 8, 2j + 9) (e2m1x8_h2's pairs 2p and 2p + 1). The token's activations are stored
// in that order by the kernel that makes them, as FP16 hi + lo parts of x * 2^-4 (a "fragment
// row", frag_store), so each k-step's B fragments are one 16-byte load. Accuracy and scalings
// are those of mma_tiles.cuh: the result is acc x mma_unscale(W).
//
// Every lane loads the token's activations for its own k-steps (8 copies of the same values per
// warp): splitting them per tile from floats, that lost to the CUDA-core gate/up (docs/PERF.md
// v17); from fragment rows made once by the router's normalization it wins (v26).
//
// The expert-grouped kernels (moe.cu, 2+ tokens) and the fragment-row linear kernel (gemv.cu)
// take the same chunks with lane (g, j) passing token g's fragment row, so that the 8 columns of
// B are 8 tokens: the activations split into hi + lo once per layer instead of once per 16-row
// tile and chunk.
#pragma once
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "backend/cuda/mma_tiles.cuh"

namespace kestrel::cuda {

constexpr int kFragChunk = 128;  // weights per chunk: 4 lanes x 32
constexpr int kSlotChunks = 4;   // chunks whose loads a lane has in flight at once (2 rows: 128 bytes)

// A fragment row of n values (n % 128 == 0) takes n 32-bit words, as many as the floats it
// replaces: per chunk c, 8 k-steps, each 4 lanes j x {hi b0, hi b1, lo b0, lo b1}, so that the
// 4 lanes of a token read 64 contiguous bytes per k-step (lanes of 8 tokens: 8 segments per
// load; with the lane's 8 k-steps contiguous instead, 32 lines per load made the grouped kernels
// slower than splitting x per tile from 16 tokens on).

// The 32-bit word of a fragment row that holds value e (hi part; the lo part is 2 words later),
// and which half of it (0: low).
__device__ __forceinline__ int frag_word(int e, int& half) {
  const int c = e >> 7, j = (e >> 5) & 3, i = (e >> 3) & 3, n = e & 7;  // code n of the lane's word i
  half = (n >> 1) & 1;
  return ((c * 8 + 2 * i + (n >> 2)) * 4 + j) * 4 + (n & 1);
}

// Stores value v as element e of the fragment row f.
__device__ __forceinline__ void frag_store(uint32_t* f, int e, float v) {
  int half;
  const int w = frag_word(e, half);
  v *= kMmaXScale;
  const __half hi = __float2half_rn(v);
  const __half lo = __float2half_rn(v - __half2float(hi));
  __half* h = reinterpret_cast<__half*>(f);
  h[2 * w + half] = hi;
  h[2 * (w + 2) + half] = lo;
}

// Stores v as elements e .. e + 3 (e % 4 == 0) of the fragment row f in one 16-byte store:
// frag_word puts e + 1 one word after e and e + 2, e + 3 in the upper halves of those two, then
// the lo parts two words on.
__device__ __forceinline__ void frag_store4(uint32_t* f, int e, float4 v) {
  int half;
  const int w = frag_word(e, half);
  uint32_t h02, l02, h13, l13;
  split_h2(v.x, v.z, h02, l02);
  split_h2(v.y, v.w, h13, l13);
  *reinterpret_cast<uint4*>(f + w) = make_uint4(h02, h13, l02, l13);
}

// Two E4M3 block scales (a little-endian 16-bit pair) x 2^-1, each in both halves of a half2.
__device__ __forceinline__ void scale_pair_h2(uint32_t two, __half2& s0, __half2& s1) {
  const __half2 s = __hmul2(bits_h2(e4m3x2_h2(two)), __float2half2_rn(kMmaScaleFactor));
  s0 = __low2half2(s), s1 = __high2half2(s);
}

// The bytes of one chunk that lane j reads for rows ra and rb of W.
struct SlotChunk {
  uint4 qa, qb;     // 32 codes of each row
  uint32_t sa, sb;  // their two block scales
};

__device__ __forceinline__ SlotChunk slot_chunk_load(const DLinear& W, int ra, int rb, int c, int j) {
  const int K = W.in;
  SlotChunk r;
  r.qa = __ldg(reinterpret_cast<const uint4*>(W.data + size_t(ra) * (K / 2)) + 4 * c + j);
  r.qb = __ldg(reinterpret_cast<const uint4*>(W.data + size_t(rb) * (K / 2)) + 4 * c + j);
  r.sa = __ldg(reinterpret_cast<const uint16_t*>(W.scales + size_t(ra) * (K / 16)) + 4 * c + j);
  r.sb = __ldg(reinterpret_cast<const uint16_t*>(W.scales + size_t(rb) * (K / 16)) + 4 * c + j);
  return r;
}

__device__ __forceinline__ uint32_t word_of(const uint4& q, int i) {
  return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w;
}

// acc[m] += chunk c of rows ra, rb of matrix m times the fragment row xf (M matrices, e.g. gate
// and up, share each B fragment load): acc[m][0..1] row ra, acc[m][2..3] row rb, columns 2j and
// 2j + 1. Every lane of the per-slot kernels passes the same row, so a lane's two columns are
// equal; in the expert-grouped kernels lane (g, j) passes token g's row, so column n is token n.
// kWritten: xf is global memory written earlier in the same kernel (the stage step), read
// through the L2 rather than the read-only path.
template <int M, bool kWritten = false>
__device__ __forceinline__ void slot_chunks_mma(const SlotChunk (&r)[M], const uint32_t* __restrict__ xf, int c, int j,
                                                float (&acc)[M][4]) {
  __half2 sa[M][2], sb[M][2];
  #pragma unroll
  for (int m = 0; m < M; ++m) scale_pair_h2(r[m].sa, sa[m][0], sa[m][1]), scale_pair_h2(r[m].sb, sb[m][0], sb[m][1]);
  const uint4* xb = reinterpret_cast<const uint4*>(xf) + c * 32 + j;  // k-step s at xb[4 s]
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t pa[M][4], pb[M][4];
    #pragma unroll
    for (int m = 0; m < M; ++m) e2m1x8_h2(word_of(r[m].qa, i), pa[m]), e2m1x8_h2(word_of(r[m].qb, i), pb[m]);
    #pragma unroll
    for (int p = 0; p < 2; ++p) {
      const uint4 b = kWritten ? __ldcg(xb + 4 * (2 * i + p)) : xb[4 * (2 * i + p)];
      #pragma unroll
      for (int m = 0; m < M; ++m) {
        const uint32_t a[4] = {h2_bits(__hmul2(bits_h2(pa[m][2 * p]), sa[m][i >> 1])),
                               h2_bits(__hmul2(bits_h2(pb[m][2 * p]), sb[m][i >> 1])),
                               h2_bits(__hmul2(bits_h2(pa[m][2 * p + 1]), sa[m][i >> 1])),
                               h2_bits(__hmul2(bits_h2(pb[m][2 * p + 1]), sb[m][i >> 1]))};
        mma_16816(acc[m], a, b.x, b.y);
        mma_16816(acc[m], a, b.z, b.w);
      }
    }
  }
}

template <bool kWritten = false>
__device__ __forceinline__ void slot_chunk_mma(const SlotChunk& r, const uint32_t* __restrict__ xf, int c, int j,
                                               float (&acc)[4]) {
  slot_chunks_mma<1, kWritten>(reinterpret_cast<const SlotChunk(&)[1]>(r), xf, c, j,
                               reinterpret_cast<float(&)[1][4]>(acc));
}

// One round of N chunks: the loads of chunks [c, min(c + N, c1)), then their products.
template <int N>
__device__ __forceinline__ void slot_round_load(const DLinear& W, int ra, int rb, int c, int c1, int j,
                                                SlotChunk (&ch)[N]) {
  #pragma unroll
  for (int u = 0; u < N; ++u)
    if (c + u < c1) ch[u] = slot_chunk_load(W, ra, rb, c + u, j);
}

// Each chunk of the round into its own accumulator: the 16 MMAs of a chunk depend on each other
// through theirs, and independent chains let the tensor core overlap them.
template <int N>
__device__ __forceinline__ void slot_round_mma(const SlotChunk (&ch)[N], const uint32_t* __restrict__ xf, int c, int c1,
                                               int j, float (&acc)[N][4]) {
  #pragma unroll
  for (int u = 0; u < N; ++u)
    if (c + u < c1) slot_chunk_mma(ch[u], xf, c + u, j, acc[u]);
}

// The sum of a round's accumulators: rows ra (out[0]) and rb (out[1]).
template <int N>
__device__ __forceinline__ void slot_acc_sum(const float (&acc)[N][4], float (&out)[2]) {
  #pragma unroll
  for (int u = 0; u < N; ++u) out[0] += acc[u][0], out[1] += acc[u][2];
}

// Matrices that take fragment rows (the per-slot down kernel, the grouped kernels): NVFP4, whole chunks.
__host__ __device__ inline bool slot_mma_fits(const DLinear& W) {
  return W.format == DFormat::NVFP4 && W.in % kFragChunk == 0;
}

}  // namespace kestrel::cuda
