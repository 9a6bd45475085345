// Device-side dot products of one weight row with activation vectors, per storage format.
// A warp shares a row: lane l takes the 16-weight blocks l, l+32, ... and the caller reduces.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "backend/cuda/dlinear.h"
#include "backend/cuda/launch.cuh"

namespace kestrel::cuda {

__device__ __forceinline__ float e4m3_to_float(uint8_t v) {
  __nv_fp8_e4m3 s;
  s.__x = v;
  return float(s);
}

// Four E4M3 values (a word, low byte first) as two half2: bytes 0-1 into lo, 2-3 into hi, one
// instruction each on Hopper (written in PTX so that hi reads the upper half without a shift).
__device__ __forceinline__ void e4m3x4_h2(uint32_t u, uint32_t& lo, uint32_t& hi) {
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}"
      : "=r"(lo), "=r"(hi)
      : "r"(u));
}

// Two E4M3 values (the low 16 bits of u) as a half2.
__device__ __forceinline__ uint32_t e4m3x2_h2(uint32_t u) {
  uint32_t h;
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.rn.f16x2.e4m3x2 %0, l;\n}" : "=r"(h) : "r"(u));
  return h;
}

// The eight E2M1 codes of a word (code n in nibble n) as four half2 of code x 2^-6, by way of
// E4M3: a code's sign and its 2 exponent and 1 mantissa bits are an E4M3 byte's sign, the low 2
// bits of its exponent and the top bit of its mantissa (subnormals included), so two masks and
// shifts per four codes make the bytes and the GPU converts each pair to FP16 in one instruction
// (about 1.4 instructions per code, against 2.25 placing each pair in FP16 bits directly).
// Pairs: h[t] = codes (f, f + 2), f = e2m1_pair_first(t): (0, 2), (1, 3), (4, 6), (5, 7).
__device__ __forceinline__ void e2m1x8_h2(uint32_t w, uint32_t (&h)[4]) {
  const uint32_t even = ((w << 4) & 0x80808080u) | ((w << 2) & 0x1C1C1C1Cu);  // codes 0, 2, 4, 6
  const uint32_t odd = (w & 0x80808080u) | ((w >> 2) & 0x1C1C1C1Cu);         // codes 1, 3, 5, 7
  e4m3x4_h2(even, h[0], h[2]);
  e4m3x4_h2(odd, h[1], h[3]);
}
__host__ __device__ constexpr int e2m1_pair_first(int t) { return (t & 1) + 4 * (t >> 1); }

// Two E2M1 codes (one byte, low nibble first) as FP16 values scaled by 2^-14: the 3 magnitude
// bits land in the FP16 exponent/mantissa so that subnormals come out right too.
__device__ __forceinline__ float2 e2m1x2_scaled(uint32_t byte) {
  const uint32_t lo = ((byte & 0x7u) << 9) | ((byte & 0x8u) << 12);
  const uint32_t hi = ((byte & 0x70u) << 5) | ((byte & 0x80u) << 8);
  const uint32_t bits = lo | (hi << 16);
  __half2 h = *reinterpret_cast<const __half2*>(&bits);
  return __half22float2(h);
}
constexpr float kE2M1Unscale = 16384.0f;  // 2^14

// Eight E2M1 codes (one little-endian word, weight 2j in the low nibble of byte j) the same way,
// two at a time: the nibbles of weights k and k + 4 sit 16 bits apart, so one shift and two masks
// place both in a half2 (about half the instructions of converting byte by byte).
__device__ __forceinline__ void e2m1x8_scaled(uint32_t word, float (&w)[8]) {
  #pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t v = word >> (4 * k);
    const uint32_t bits = ((v & 0x00070007u) << 9) | ((v & 0x00080008u) << 12);
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&bits));
    w[k] = f.x, w[k + 4] = f.y;
  }
}

// Rows per warp for a batch of B: each x value loaded is used for R rows, which is what keeps
// the loads of x from L1 below the weight stream; fewer rows for larger batches bound registers.
template <int B>
__host__ __device__ constexpr int rows_per_warp() {
  return B <= 2 ? 4 : (B <= 4 ? 2 : 1);
}

// R consecutive rows of an NVFP4 matrix starting at a row: codes and scales of that row, the
// dequantization factor, and the index of the last valid row (later rows repeat it).
struct NvRows {
  const uint8_t* codes;
  const uint8_t* scales;
  float unscale;
  int last;
};

__device__ __forceinline__ NvRows nv_rows(const DLinear& W, int row0) {
  const int row = min(row0, W.out - 1);
  return {W.data + size_t(row) * (W.in / 2), W.scales + size_t(row) * (W.in / 16), kE2M1Unscale * W.scale2,
          W.out - 1 - row};
}

// One 32-weight group of M * R NVFP4 rows (c: 16 bytes of codes, sc: two E4M3 scales per row)
// against B activation rows at x (x[b * ldx + 0..31]): acc[q][b] += the group's dot product. Each
// x value is read once for all M * R rows.
template <int M, int R, int B>
__device__ __forceinline__ void nvfp4_group_fma(const NvRows (&mat)[M], const uint4 (&c)[M * R],
                                                const uint32_t (&sc)[M * R], const float* x, int ldx,
                                                float (&acc)[M * R][B]) {
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    float xv[B][8];
    #pragma unroll
    for (int b = 0; b < B; ++b) {
      const float4 a = *reinterpret_cast<const float4*>(x + size_t(b) * ldx + 8 * i);
      const float4 d = *reinterpret_cast<const float4*>(x + size_t(b) * ldx + 8 * i + 4);
      xv[b][0] = a.x, xv[b][1] = a.y, xv[b][2] = a.z, xv[b][3] = a.w;
      xv[b][4] = d.x, xv[b][5] = d.y, xv[b][6] = d.z, xv[b][7] = d.w;
    }
    #pragma unroll
    for (int q = 0; q < M * R; ++q) {
      const uint32_t word = i == 0 ? c[q].x : i == 1 ? c[q].y : i == 2 ? c[q].z : c[q].w;
      const float s = e4m3_to_float(uint8_t(sc[q] >> (8 * (i / 2)))) * mat[q / R].unscale;
      float w[8];
      e2m1x8_scaled(word, w);
      #pragma unroll
      for (int b = 0; b < B; ++b) {
        float part = 0.0f;
        #pragma unroll
        for (int j = 0; j < 8; ++j) part = fmaf(w[j], xv[b][j], part);
        acc[q][b] = fmaf(part, s, acc[q][b]);
      }
    }
  }
}

// Partial dot products of M blocks of R NVFP4 rows of length K (M = 2: gate and up) with B
// activation rows x[b * ldx ...]; acc[m * R + r][b] += partial, the caller reduces the warp. Lane
// l takes the 32-weight groups first + l, first + l + step, ...: 16 bytes of codes per row and
// load, all M * R rows' loads issued before the first is used so that M * R * 16 bytes per lane
// are in flight; x is read 8 weights at a time to bound registers. `first`/`step` split K
// between the warps of a block (first = warp * 32, step = 32 * warps); one warp alone: 0 and 32.
template <int M, int R, int B>
__device__ __forceinline__ void nvfp4_rows_dot(const NvRows (&mat)[M], int K, const float* __restrict__ x, int ldx,
                                               int lane, float (&acc)[M * R][B], int first, int step) {
  const int groups32 = (K % 32) == 0 ? K / 32 : 0;
  #pragma unroll 1
  for (int g = first + lane; g < groups32; g += step) {
    uint4 c[M * R];
    uint32_t sc[M * R];
    #pragma unroll
    for (int m = 0; m < M; ++m)
      #pragma unroll
      for (int r = 0; r < R; ++r) {
        const int row = min(r, mat[m].last);
        if constexpr (M == 2) {
          // Gate and up rows: addresses from one 32-bit byte offset per row (the scales' is an
          // eighth of it) instead of 2 x 2R 64-bit row pointers, which spilled registers in the
          // MoE gate/up kernel (docs/PERF.md v17: its step -12% at one token). Single matrices
          // keep the pointers: measured slower this way (o_proj +28%).
          const uint32_t off = uint32_t(row) * uint32_t(K / 2) + uint32_t(g) * 16u;
          c[m * R + r] = __ldg(reinterpret_cast<const uint4*>(mat[m].codes + off));
          sc[m * R + r] = __ldg(reinterpret_cast<const uint16_t*>(mat[m].scales + (off >> 3)));
        } else {
          c[m * R + r] = __ldg(reinterpret_cast<const uint4*>(mat[m].codes + row * (K / 2)) + g);
          sc[m * R + r] = __ldg(reinterpret_cast<const uint16_t*>(mat[m].scales + row * (K / 16)) + g);
        }
      }
    nvfp4_group_fma<M, R, B>(mat, c, sc, x + 32 * g, ldx, acc);
  }
  // K % 32 == 16 (rows not 16-byte aligned): 16-weight blocks, 8 bytes of codes per load.
  #pragma unroll 1
  for (int blk = (K % 32) == 0 ? K / 16 : first + lane; blk < K / 16; blk += step) {
    #pragma unroll
    for (int q = 0; q < M * R; ++q) {
      const int row = min(q % R, mat[q / R].last);
      const uint2 c = __ldg(reinterpret_cast<const uint2*>(mat[q / R].codes + row * (K / 2)) + blk);
      const float s = e4m3_to_float(__ldg(mat[q / R].scales + row * (K / 16) + blk)) * mat[q / R].unscale;
      float w[16];
      e2m1x8_scaled(c.x, reinterpret_cast<float(&)[8]>(w[0]));
      e2m1x8_scaled(c.y, reinterpret_cast<float(&)[8]>(w[8]));
      #pragma unroll
      for (int b = 0; b < B; ++b) {
        float part = 0.0f;
        #pragma unroll
        for (int j = 0; j < 16; ++j) part = fmaf(w[j], x[size_t(b) * ldx + 16 * blk + j], part);
        acc[q][b] = fmaf(part, s, acc[q][b]);
      }
    }
  }
}

// Partial dot products of rows row0 .. row0+R-1 (clamped to the matrix) with B activation rows
// x[b * ldx ...], in any storage format. Lane l takes the 8-weight groups l, l + 32, ... (NVFP4:
// 32-weight groups, see nvfp4_rows_dot): its codes, scales and x values are contiguous across the
// warp. acc[r][b] += partial; the caller reduces the warp. `first`/`step` as in nvfp4_rows_dot.
template <int R, int B>
__device__ __forceinline__ void rows_dot_partial(const DLinear& W, int row0, const float* __restrict__ x, int ldx,
                                                 int lane, float (&acc)[R][B], int first = 0, int step = 32) {
  const int K = W.in;
  int rows[R];
  #pragma unroll
  for (int r = 0; r < R; ++r) rows[r] = min(row0 + r, W.out - 1);
  if (W.format == DFormat::NVFP4) {
    const NvRows mat[1] = {nv_rows(W, row0)};
    nvfp4_rows_dot<1, R, B>(mat, K, x, ldx, lane, acc, first, step);
    return;
  }
  if (W.format == DFormat::BF16 && K % 8 == 0) {
    #pragma unroll 1
    for (int g = first + lane; g < K / 8; g += step) {
      float xv[B][8];
      #pragma unroll
      for (int b = 0; b < B; ++b) {
        const float4 a = *reinterpret_cast<const float4*>(x + size_t(b) * ldx + 8 * g);
        const float4 c = *reinterpret_cast<const float4*>(x + size_t(b) * ldx + 8 * g + 4);
        xv[b][0] = a.x, xv[b][1] = a.y, xv[b][2] = a.z, xv[b][3] = a.w;
        xv[b][4] = c.x, xv[b][5] = c.y, xv[b][6] = c.z, xv[b][7] = c.w;
      }
      #pragma unroll
      for (int r = 0; r < R; ++r) {
        const uint4 raw = __ldg(reinterpret_cast<const uint4*>(W.data + size_t(rows[r]) * K * 2) + g);
        const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&raw);
        float w[8];
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 f = __bfloat1622float2(p[i]);
          w[2 * i] = f.x, w[2 * i + 1] = f.y;
        }
        #pragma unroll
        for (int b = 0; b < B; ++b)
          #pragma unroll
          for (int i = 0; i < 8; ++i) acc[r][b] = fmaf(w[i], xv[b][i], acc[r][b]);
      }
    }
    return;
  }
  // F32, F16 and BF16 rows whose length is not a multiple of 8: rare, one element per lane step.
  #pragma unroll
  for (int r = 0; r < R; ++r)
    for (int k = first + lane; k < K; k += step) {
      const size_t i = size_t(rows[r]) * K + k;
      const float wf = W.format == DFormat::F32    ? reinterpret_cast<const float*>(W.data)[i]
                       : W.format == DFormat::F16 ? __half2float(reinterpret_cast<const __half*>(W.data)[i])
                                                  : __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(W.data)[i]);
      #pragma unroll
      for (int b = 0; b < B; ++b) acc[r][b] = fmaf(wf, x[size_t(b) * ldx + k], acc[r][b]);
    }
}

// One row (routing logits, tests).
template <int B>
__device__ __forceinline__ void row_dot_partial(const DLinear& W, int row, const float* __restrict__ x, int ldx,
                                                int lane, float (&acc)[B]) {
  float a[1][B];
  #pragma unroll
  for (int b = 0; b < B; ++b) a[0][b] = 0.0f;
  rows_dot_partial<1, B>(W, row, x, ldx, lane, a);
  #pragma unroll
  for (int b = 0; b < B; ++b) acc[b] += a[0][b];
}

// Gate and up rows row0 .. row0+R-1 of a gated FFN: g[r][b] += gate partial, u[r][b] += up
// partial. When both are NVFP4 the 2R rows' codes are loaded together (twice the bytes in flight).
template <int R, int B>
__device__ __forceinline__ void gated_rows_dot_partial(const DLinear& G, const DLinear& U, int row0,
                                                       const float* __restrict__ x, int ldx, int lane,
                                                       float (&g)[R][B], float (&u)[R][B], int first, int step) {
  if (G.format == DFormat::NVFP4 && U.format == DFormat::NVFP4 && G.in == U.in) {
    const NvRows mat[2] = {nv_rows(G, row0), nv_rows(U, row0)};
    float acc[2 * R][B];
    #pragma unroll
    for (int q = 0; q < 2 * R; ++q)
      #pragma unroll
      for (int b = 0; b < B; ++b) acc[q][b] = 0.0f;
    nvfp4_rows_dot<2, R, B>(mat, G.in, x, ldx, lane, acc, first, step);
    #pragma unroll
    for (int r = 0; r < R; ++r)
      #pragma unroll
      for (int b = 0; b < B; ++b) g[r][b] += acc[r][b], u[r][b] += acc[R + r][b];
    return;
  }
  rows_dot_partial<R, B>(G, row0, x, ldx, lane, g, first, step);
  rows_dot_partial<R, B>(U, row0, x, ldx, lane, u, first, step);
}

// Prefetches rows [row0, row0 + rows) of W (values or codes, and scales) into L2.
__device__ __forceinline__ void prefetch_rows_l2(const DLinear& W, int row0, int rows) {
  rows = min(rows, W.out - row0);
  if (rows <= 0) return;
  const size_t K = size_t(W.in);
  if (W.format == DFormat::NVFP4) {
    prefetch_bytes_l2(W.data + size_t(row0) * (K / 2), size_t(rows) * (K / 2));
    prefetch_bytes_l2(W.scales + size_t(row0) * (K / 16), size_t(rows) * (K / 16));
    return;
  }
  const size_t elt = W.format == DFormat::F32 ? 4 : 2;
  prefetch_bytes_l2(W.data + size_t(row0) * K * elt, size_t(rows) * K * elt);
}

template <int B>
__device__ __forceinline__ void warp_sum(float (&v)[B]) {
  #pragma unroll
  for (int b = 0; b < B; ++b)
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v[b] += __shfl_xor_sync(0xffffffffu, v[b], o);
}

template <int R, int B>
__device__ __forceinline__ void warp_sum(float (&v)[R][B]) {
  #pragma unroll
  for (int r = 0; r < R; ++r) warp_sum<B>(v[r]);
}

// Sums v over each group of `ks` consecutive warps in warp order (deterministic); the result is
// valid in the first lane of the group's first warp. `red` holds warps * R * B floats.
template <int R, int B>
__device__ __forceinline__ void group_sum(float (&v)[R][B], float* red, int ks) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  warp_sum<R, B>(v);
  if (ks == 1) return;
  if (lane == 0)
    #pragma unroll
    for (int r = 0; r < R; ++r)
      #pragma unroll
      for (int b = 0; b < B; ++b) red[(warp * R + r) * B + b] = v[r][b];
  __syncthreads();
  if (lane == 0 && warp % ks == 0)
    #pragma unroll
    for (int r = 0; r < R; ++r)
      #pragma unroll
      for (int b = 0; b < B; ++b) {
        float t = 0.0f;
        for (int w = warp; w < warp + ks; ++w) t += red[(w * R + r) * B + b];
        v[r][b] = t;
      }
}

// Warps that share one row group so that every lane has work: a row of K weights has K/32
// NVFP4 groups (K/8 for other formats), one per lane. A power of two in 1..8.
__host__ __device__ inline int warps_per_row(const DLinear& W) {
  const int groups = W.format == DFormat::NVFP4 ? W.in / 32 : W.in / 8;
  int ks = 1;
  while (ks < 8 && ks * 32 < groups) ks *= 2;
  return ks;
}

}  // namespace kestrel::cuda
