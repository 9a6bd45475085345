// NVFP4 and BF16 weights times groups of up to 8 activation rows on tensor cores: mma.sync m16n8k16 with FP16
// inputs and FP32 accumulation. A warp holds a 16-row tile; lane (g, j) = (lane / 4, lane % 4) reads,
// per 64-weight chunk, the 16-weight block j of rows g and g + 8 (8 bytes of codes and one scale
// each) and the same 16 activations of token g. The four k-steps of a chunk pair the codes of
// that block as e2m1x8_h2 makes them, (f, f + 2) and (8 + f, 10 + f) with f = e2m1_pair_first(t),
// as the fragment's k (2j, 2j + 1) and (2j + 8, 2j + 9); the activations are paired the same way,
// and since a dot product does not depend on the order of k, the permutation needs no repacking
// of the checkpoint layout.
//
// Exactness: a code x 2^-6 (through E4M3, see e2m1x8_h2) times its E4M3 block scale x 2^-1 is
// exact in FP16 (at most 5 significant bits, between 2^-17 and 21). Activations are scaled by
// 2^-4 and split into FP16 hi + lo parts (two MMAs), which keeps float32-level accuracy for
// |x| < 1e6. The result is acc x 2^11 x scale_2.
//
// BF16 rows take the same tiles with adjacent pairs (2t, 2t + 1) and (8 + 2t, 9 + 2t) of each
// lane's 16 weights: BF16 -> FP16 is exact for |w| in [6e-5, 65504] (smaller weights keep an
// absolute error below 3e-8). The result is acc x 2^4.
#pragma once
#include <cuda_fp16.h>

#include "backend/cuda/dequant.cuh"

namespace kestrel::cuda {

constexpr float kMmaXScale = 0.0625f;    // 2^-4 on the activations
constexpr float kMmaUnscale = 2048.0f;   // NVFP4: 2^11 (codes x 2^-6, scales x 2^-1, x x 2^-4)
constexpr float kMmaUnscaleDense = 16.0f;  // BF16: 2^4
constexpr float kMmaScaleFactor = 0.5f;   // on the E4M3 block scales

__device__ __forceinline__ uint32_t h2_bits(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ __half2 bits_h2(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }

// An E4M3 block scale x 2^-1 in both halves.
__device__ __forceinline__ uint32_t scale_h2(uint8_t s) {
  const __half h = __float2half_rn(e4m3_to_float(s) * kMmaScaleFactor);
  return h2_bits(__halves2half2(h, h));
}

// (a, b) * 2^-4 as FP16 hi and lo halves: hi + lo == (a, b) * 2^-4 to about 2^-22 relative.
__device__ __forceinline__ void split_h2(float a, float b, uint32_t& hi, uint32_t& lo) {
  a *= kMmaXScale, b *= kMmaXScale;
  const __half2 h = __floats2half2_rn(a, b);
  const float2 back = __half22float2(h);
  hi = h2_bits(h);
  lo = h2_bits(__floats2half2_rn(a - back.x, b - back.y));
}

__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Lane (g, j)'s B fragments for chunk c: the 16 activations [64c + 16j, 64c + 16j + 16) of token
// g (xg: its row of x, or null for lanes past the batch), paired as the weights of the format
// are, each pair split into FP16 hi and lo. Built once per chunk and token group, it serves every
// matrix of that format multiplied by the same activations (gate and up).
struct XFrag {
  uint32_t hi[4][2], lo[4][2];  // k-step t: (k 2j, 2j + 1) and (k 2j + 8, 2j + 9)
};

// Lane (g, j)'s 16 activations of chunk c (zeros for a null row), and their split into fragments:
// x_frag in two halves, so that a pipelined kernel can issue the loads ahead of the split.
__device__ __forceinline__ void x_load(const float* __restrict__ xg, int c, int j, float (&f)[16]) {
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 v = xg ? *reinterpret_cast<const float4*>(xg + 64 * c + 16 * j + 4 * i) : make_float4(0.f, 0.f, 0.f, 0.f);
    f[4 * i] = v.x, f[4 * i + 1] = v.y, f[4 * i + 2] = v.z, f[4 * i + 3] = v.w;
  }
}

template <bool Fp4>
__device__ __forceinline__ XFrag x_split(const float (&f)[16]) {
  XFrag x;
  #pragma unroll
  for (int t = 0; t < 4; ++t) {
    if (Fp4) {  // codes (f, f + 2) and (8 + f, 10 + f) of the block (e2m1x8_h2)
      const int p = e2m1_pair_first(t);
      split_h2(f[p], f[p + 2], x.hi[t][0], x.lo[t][0]);
      split_h2(f[8 + p], f[10 + p], x.hi[t][1], x.lo[t][1]);
    } else {  // adjacent BF16 pairs (2t, 2t + 1) and (8 + 2t, 9 + 2t)
      split_h2(f[2 * t], f[2 * t + 1], x.hi[t][0], x.lo[t][0]);
      split_h2(f[8 + 2 * t], f[9 + 2 * t], x.hi[t][1], x.lo[t][1]);
    }
  }
  return x;
}

template <bool Fp4>
__device__ __forceinline__ XFrag x_frag(const float* __restrict__ xg, int c, int j) {
  float f[16];
  x_load(xg, c, j, f);
  return x_split<Fp4>(f);
}

// The A fragments of chunk c (weights [64c, 64c + 64)) of the tile's rows ra = r0 + g and
// rb = r0 + g + 8, for the chunk's four k-steps: dequantized once, they serve every group of 8
// tokens multiplied by the chunk (mma_afrag).
struct AFrag {
  uint32_t a[4][4];
};

// The bytes of chunk c that lane (g, j) reads (nvfp4_raw, bf16_raw) and their conversion into A
// fragments (a_frag_of): apart, so that a pipelined kernel can keep several chunks' loads in flight.
struct Nvfp4Raw {
  uint2 qa, qb;    // 16 codes of rows ra and rb
  uint32_t sa, sb;  // their E4M3 block scales
};

__device__ __forceinline__ Nvfp4Raw nvfp4_raw(const DLinear& W, int ra, int rb, int c, int j) {
  const int K = W.in;
  Nvfp4Raw r;
  r.qa = __ldg(reinterpret_cast<const uint2*>(W.data + size_t(ra) * (K / 2)) + 4 * c + j);
  r.qb = __ldg(reinterpret_cast<const uint2*>(W.data + size_t(rb) * (K / 2)) + 4 * c + j);
  r.sa = __ldg(W.scales + size_t(ra) * (K / 16) + 4 * c + j);
  r.sb = __ldg(W.scales + size_t(rb) * (K / 16) + 4 * c + j);
  return r;
}

__device__ __forceinline__ AFrag a_frag_of(const Nvfp4Raw& r) {
  const __half2 ha = bits_h2(scale_h2(uint8_t(r.sa))), hb = bits_h2(scale_h2(uint8_t(r.sb)));
  uint32_t ax[4], ay[4], bx[4], by[4];
  e2m1x8_h2(r.qa.x, ax), e2m1x8_h2(r.qa.y, ay), e2m1x8_h2(r.qb.x, bx), e2m1x8_h2(r.qb.y, by);
  AFrag f;
  #pragma unroll
  for (int t = 0; t < 4; ++t) {
    f.a[t][0] = h2_bits(__hmul2(bits_h2(ax[t]), ha));
    f.a[t][1] = h2_bits(__hmul2(bits_h2(bx[t]), hb));
    f.a[t][2] = h2_bits(__hmul2(bits_h2(ay[t]), ha));
    f.a[t][3] = h2_bits(__hmul2(bits_h2(by[t]), hb));
  }
  return f;
}

__device__ __forceinline__ AFrag nvfp4_a_frag(const DLinear& W, int ra, int rb, int c, int j) {
  return a_frag_of(nvfp4_raw(W, ra, rb, c, j));
}

// The same for BF16 rows: 32 bytes of each row per lane and chunk.
struct Bf16Raw {
  uint4 wa[2], wb[2];
};

__device__ __forceinline__ Bf16Raw bf16_raw(const DLinear& W, int ra, int rb, int c, int j) {
  const int K = W.in;
  const uint4* pa = reinterpret_cast<const uint4*>(W.data + (size_t(ra) * K + 64 * c + 16 * j) * 2);
  const uint4* pb = reinterpret_cast<const uint4*>(W.data + (size_t(rb) * K + 64 * c + 16 * j) * 2);
  Bf16Raw r;
  r.wa[0] = __ldg(pa), r.wa[1] = __ldg(pa + 1), r.wb[0] = __ldg(pb), r.wb[1] = __ldg(pb + 1);
  return r;
}

__device__ __forceinline__ AFrag a_frag_of(const Bf16Raw& r) {
  auto word = [](const uint4 (&w)[2], int i) {  // BF16 weights (2i, 2i + 1) of the 16
    const uint4& q = w[i / 4];
    return (i & 3) == 0 ? q.x : (i & 3) == 1 ? q.y : (i & 3) == 2 ? q.z : q.w;
  };
  auto to_h2 = [](uint32_t u) {
    return h2_bits(__float22half2_rn(__bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u))));
  };
  AFrag f;
  #pragma unroll
  for (int t = 0; t < 4; ++t) {
    f.a[t][0] = to_h2(word(r.wa, t));
    f.a[t][1] = to_h2(word(r.wb, t));
    f.a[t][2] = to_h2(word(r.wa, 4 + t));
    f.a[t][3] = to_h2(word(r.wb, 4 + t));
  }
  return f;
}

__device__ __forceinline__ AFrag bf16_a_frag(const DLinear& W, int ra, int rb, int c, int j) {
  return a_frag_of(bf16_raw(W, ra, rb, c, j));
}

__device__ __forceinline__ AFrag a_frag(const DLinear& W, int ra, int rb, int c, int j) {
  return W.format == DFormat::NVFP4 ? nvfp4_a_frag(W, ra, rb, c, j) : bf16_a_frag(W, ra, rb, c, j);
}

// acc += A x (the activations of x, from x_frag of the same chunk and format): acc[0..1] rows
// ra, tokens 2j and 2j + 1 of the group; acc[2..3] the same for rb.
__device__ __forceinline__ void mma_afrag(const AFrag& A, const XFrag& x, float (&acc)[4]) {
  #pragma unroll
  for (int t = 0; t < 4; ++t) {
    mma_16816(acc, A.a[t], x.hi[t][0], x.hi[t][1]);
    mma_16816(acc, A.a[t], x.lo[t][0], x.lo[t][1]);
  }
}

// Adds chunk c of the tile's rows times the activations of x (x_frag<true> of the same chunk).
__device__ __forceinline__ void nvfp4_mma_chunk(const DLinear& W, int ra, int rb, const XFrag& x, int c, int j,
                                                float (&acc)[4]) {
  mma_afrag(nvfp4_a_frag(W, ra, rb, c, j), x, acc);
}

// The same for BF16 rows (x from x_frag<false>).
__device__ __forceinline__ void bf16_mma_chunk(const DLinear& W, int ra, int rb, const XFrag& x, int c, int j,
                                               float (&acc)[4]) {
  mma_afrag(bf16_a_frag(W, ra, rb, c, j), x, acc);
}

// Chunk c of W (NVFP4 or BF16) times token g's activations xg.
__device__ __forceinline__ void mma_chunk(const DLinear& W, int ra, int rb, const float* __restrict__ xg, int c, int j,
                                          float (&acc)[4]) {
  if (W.format == DFormat::NVFP4) nvfp4_mma_chunk(W, ra, rb, x_frag<true>(xg, c, j), c, j, acc);
  else bf16_mma_chunk(W, ra, rb, x_frag<false>(xg, c, j), c, j, acc);
}

// The factor that turns a tile's accumulator into W x (the scalings above).
__host__ __device__ inline float mma_unscale(const DLinear& W) {
  return W.format == DFormat::NVFP4 ? kMmaUnscale * W.scale2 : kMmaUnscaleDense;
}

// Writes a tile's accumulators (G groups of 8 tokens; `count` tokens valid from y's first row, a
// row of ldy floats each) times the tile scale k, plus the bias, into y (added to what is there
// when accumulating).
template <int G>
__device__ __forceinline__ void store_tile(const DLinear& W, float* y, int ldy, int r0, int lane, int count,
                                           const float (&acc)[G][4], int accumulate) {
  const int g = lane >> 2, j = lane & 3;
  const float k = mma_unscale(W);
  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = r0 + g + 8 * h;
    if (row >= W.out) continue;
    const float bias = W.bias ? W.bias[row] : 0.0f;
    #pragma unroll
    for (int q = 0; q < G; ++q)
      #pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int b = 8 * q + 2 * j + e;
        if (b >= count) continue;
        float* p = y + size_t(b) * ldy + row;
        *p = (accumulate ? *p : 0.0f) + acc[q][2 * h + e] * k + bias;
      }
  }
}

// Warps that split one 16-row tile's chunks: at least 4 chunks each, at most `most` warps.
__host__ __device__ inline int mma_warps_per_tile(int K, int most = 8) {
  const int chunks = K / 64;
  int ks = 1;
  while (ks < most && ks * 4 <= chunks) ks *= 2;
  return ks;
}

}  // namespace kestrel::cuda
