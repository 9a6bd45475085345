// One MoE layer's expert products for a prefill chunk as one grouped GEMM whose NVFP4 weights are
// dequantized inside the main loop, against what the GEMM prefill does today (prefill_gemm.cu:
// every expert that received rows converted to a BF16 copy in memory, then one cuBLAS GEMM per
// expert; cuBLAS refuses the grouped call for BF16 inputs with float32 outputs). The copy costs
// ~4.5 bytes of traffic per weight (0.56 read, 2 written, 2 read again) where the NVFP4 itself is
// 0.56, and the per-expert calls need the counts on the host (docs/PERF.md v38: ~70 ms of fixed
// cost per chunk). Issue 31 wants the conversion in the GEMM, tokens grouped per expert, the
// counts read on the device.
// (v3 now runs in the engine: src/backend/cuda/moe_gemm.cu, docs/PERF.md v40; v0 here stays the
// former path's cost.)
//
// The operation: E experts, expert e's weights W_e [N, K] in kestrel's NVFP4 (dlinear.h): codes
// [N, K/2] bytes row-major, weight 2j in the low nibble of byte j, E2M1 (sign, 2 exponent bits, 1
// mantissa bit: 0, .5, 1, 1.5, 2, 3, 4, 6); E4M3 block scales [N, K/16]; a float scale2 per
// matrix: w = e2m1 x e4m3 x scale2. The rows are split in `parts` matrices of N/parts rows with
// their own pointers and scale2 (gate and up fused: 2 parts of 768 rows; down: 1), as the
// engine's DLinears are. Activations X: BF16 [T, K], rows sorted by expert (expert e's rows are
// offsets[e] .. offsets[e] + counts[e] - 1; counts and offsets in device memory, never read by
// the host in v1-v3). Output Y: float32 [T, N], Y[t] = X[t] W_e^T for the expert e of row t.
// Shapes of Qwen3-30B-A3B (E = 128): gate+up N = 1536, K = 2048; down N = 2048, K = 768; rows per
// expert from a 512-token chunk (top 8: 4096 rows, ~32 per expert) and a 4096-token one (32768,
// ~256), each routed uniformly at random and skewed (E/8 experts get none, E/8 get 4x the mean).
//
// Variants (v1-v3: one kernel after a one-block prefix sum of the tiles over the device counts;
// CTA tiles of BM weight rows x BN tokens of one expert, K in chunks of 64, 8 warps):
//   v0  the baseline: every expert with rows converted to BF16 in memory (one launch, exact:
//       code x block scale), then cublasGemmEx per expert and part with alpha = scale2 (the host
//       reads the counts here, untimed; the engine's D2H copy and synchronization are not timed).
//   v1  mma.sync.m16n8k16 BF16 x BF16 -> f32 on the tensor cores, BM = 128, BN = 64, warps 4 x 2
//       of 32 rows x 32 tokens, 3 cp.async stages of codes, scales and X tiles in shared memory.
//       The weights are the A operand (rows = M, row-major = K-major, as stored) and the tokens
//       the B operand (columns = N, X's rows K-major). Each lane turns its codes into A fragments
//       in registers: a code's bits placed into a BF16's sign, low exponent and top mantissa
//       bits give code x 2^-126 exactly (code 0.5 as the subnormal 2^-127), and one
//       mul.rn.bf16x2 by (block scale x 2^118, at most 448 x 2^118 < BF16's largest) makes
//       code x scale x 2^-8, exact in BF16 (at most 6 significant bits, normal down to the
//       smallest E4M3 subnormal); the epilogue multiplies by scale2 x 2^8.
//       BF16, not FP16: the activations arrive as BF16, which FP16 cannot hold exactly (range,
//       and its 2^-14 normal floor); E2M1 x E4M3 is exact in both, so the weights decide nothing.
//       The placement pairs codes k and k + 4 of each 32-bit word (they sit 16 bits apart: two
//       shifts and masks per pair); the MMA's k order is permuted to match (a dot product does
//       not care), so the B fragments pair X[k], X[k + 4]: two LDS.128 per lane and n-tile per
//       chunk and one PRMT per register (ldmatrix cannot make those pairs).
//   v2  the tile from the mean rows per expert (T / E, known to the host without the counts):
//       >= 96: BM = 128, BN = 128, warps 4 x 2; else BM = 256, BN = 64, warps 8 x 1: a warp
//       always holds 32 rows x 64 tokens, which halves the dequantization per MMA against v1's
//       32 x 32, and small experts no longer leave half the warps idle. 4 stages.
//   v3  v2 with X in the order the gather kernel would write it (each 16-element block 4x4
//       transposed, so that X[k], X[k + 4] are neighbours: B fragments straight from LDS.128,
//       no PRMT). The permuted copy is made outside the timing (the gather's work).
// The MMA fragment layouts used (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point
// type"), lane = 4 g + t (g = groupID, t = threadID_in_group), registers of two 16-bit values,
// the lower index in the low half:
//   A (16 x 16, row): a0a1 row g, k 2t, 2t+1; a2a3 row g+8, k 2t, 2t+1; a4a5 row g, k 2t+8, 2t+9;
//                     a6a7 row g+8, k 2t+8, 2t+9.
//   B (16 x 8, col):  b0b1 k 2t, 2t+1, column g; b2b3 k 2t+8, 2t+9, column g.
//   C/D (16 x 8):     c0 c1 row g, columns 2t, 2t+1; c2 c3 row g+8, columns 2t, 2t+1.
// Here lane (g, t) owns the 16-weight block t of each 64-weight chunk of its rows (8 bytes of
// codes and one scale per row), and k-step s (0..3) of the chunk maps the MMA's k slots to
// weights of that block: slot 2t -> 16t + s, 2t+1 -> 16t + s + 4, 2t+8 -> 16t + 8 + s,
// 2t+9 -> 16t + 12 + s (every weight of the chunk once over the four steps).
//
// Checks: every variant (both tiles of v2 and v3) against a CPU reference (double) on small
// random problems, in full, the error relative to the output row's RMS; on the timed shapes a few
// hundred random outputs against the CPU, relative to the root sum of squares of their K
// products. Both are ~1e-6 when right (the BF16 weights are exact); above 1e-2 is a failure and
// the exit status non-zero. Y is filled with NaN before each checked run.
// Usage: moe_gemm_lab [runs]    (median of `runs` timed launches, 20 by default)
//        moe_gemm_lab check     (the small problems only: for compute-sanitizer)
//
// Measured (H100 80 GB HBM3, 2.99 TB/s, docs/PERF.md v39), ms per layer product, uniform routing:
// gate+up 4096 rows v0 2.184, v1 0.245, v2 0.257, v3 0.229 (112 TFLOP/s); down 4096 rows 0.944,
// 0.124, 0.130, 0.118; gate+up 32768 rows 2.387, 1.214, 1.274, 1.139 (181 TFLOP/s); down 32768
// rows 1.045, 0.605, 0.671, 0.601. Skewed routing the same within ~5%. Every check passed, and
// compute-sanitizer memcheck and racecheck on the small problems were clean.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/dequant.cuh"

#define CHECK(x)                                                    \
  do {                                                              \
    cudaError_t e_ = (x);                                           \
    if (e_ != cudaSuccess) {                                        \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                 \
    }                                                               \
  } while (0)

#define CHECK_BLAS(x)                                                      \
  do {                                                                     \
    cublasStatus_t s_ = (x);                                               \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                     \
      std::fprintf(stderr, "%s: %s\n", #x, cublasGetStatusString(s_));     \
      std::exit(1);                                                        \
    }                                                                      \
  } while (0)

using kestrel::cuda::e2m1x8_scaled;
using kestrel::cuda::e4m3_to_float;
using kestrel::cuda::kE2M1Unscale;

namespace {

constexpr int kThreads = 256, kBK = 64;
constexpr double kTolerance = 1e-2;

// ---------------------------------------------------------------------------------------------
// Random data, the same on the host and the device: a hash of each element's index.

__host__ __device__ inline uint32_t hash32(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return uint32_t(x ^ (x >> 31));
}

// Float to BF16 bits, round to nearest even (no NaN among the values made here).
__host__ __device__ inline uint16_t f2bf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

__host__ inline float bf2f(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Any code byte.
__host__ __device__ inline uint8_t gen_code(uint32_t seed, uint64_t i) {
  return uint8_t(hash32((uint64_t(seed) << 40) ^ i));
}

// E4M3 scales, positive: mostly exponents 2^-4 .. 2^2, one in 16 anywhere in the format (zero,
// subnormals and 448 included), never the NaN 0x7F.
__host__ __device__ inline uint8_t gen_scale(uint32_t seed, uint64_t i) {
  const uint32_t h = hash32((uint64_t(seed + 1) << 40) ^ i);
  const uint32_t e = (h & 15u) == 0 ? (h >> 4) & 15u : 3u + (h >> 4) % 7u;
  uint32_t m = (h >> 8) & 7u;
  if (e == 15u && m == 7u) m = 6u;
  return uint8_t(e << 3 | m);
}

// Activations: uniform in [-2, 2) rounded to BF16 (the arithmetic before the rounding is exact).
__host__ __device__ inline uint16_t gen_x(uint32_t seed, uint64_t i) {
  const uint32_t h = hash32((uint64_t(seed + 2) << 40) ^ i);
  return f2bf(float(h >> 8) * (1.0f / 4194304.0f) - 2.0f);
}

__global__ void gen_bytes_kernel(uint8_t* p, size_t n, uint32_t seed, int scales) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = scales ? gen_scale(seed, i) : gen_code(seed, i);
}

__global__ void gen_x_kernel(uint16_t* x, size_t n, uint32_t seed) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    x[i] = gen_x(seed, i);
}

// v3's activations: every 16-element block 4x4 transposed, xp[16b + 4i + j] = x[16b + 4j + i], so
// that the words of a block are (0,4) (8,12) (1,5) (9,13) (2,6) (10,14) (3,7) (11,15).
__global__ void permute_x_kernel(const uint16_t* __restrict__ x, uint16_t* __restrict__ xp, size_t blocks) {
  for (size_t b = size_t(blockIdx.x) * blockDim.x + threadIdx.x; b < blocks; b += size_t(gridDim.x) * blockDim.x)
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) xp[16 * b + 4 * i + j] = x[16 * b + 4 * j + i];
}

__global__ void gather_kernel(const float* __restrict__ y, const size_t* __restrict__ idx, int n, float* __restrict__ out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = y[idx[i]];
}

// ---------------------------------------------------------------------------------------------
// The grouped GEMM.

// One NVFP4 matrix: `parts` of these per expert.
struct Mat {
  const uint8_t* codes;   // [rows, K/2]
  const uint8_t* scales;  // [rows, K/16]
  float scale2;
};

struct GemmArgs {
  const Mat* mats;         // [E * parts]
  const uint16_t* x;       // BF16 [T, K], rows sorted by expert
  const int* counts;       // [E] device
  const int* offsets;      // [E] device
  const int* tile_start;   // [E + 1]: expert e's tiles are tile_start[e] .. tile_start[e+1]-1
  float* y;                // [T, N]
  int E, N, K, parts;
};

// Expert e's tiles: ceil(counts[e] / bn) token tiles x m_tiles row tiles, prefix-summed by one
// block (E <= 1024). tile_start[E] is the total, which the GEMM's surplus CTAs compare against.
__global__ void tile_list_kernel(const int* __restrict__ counts, int E, int bn, int m_tiles, int* __restrict__ tile_start) {
  __shared__ int s[1024];
  const int e = int(threadIdx.x);
  s[e] = e < E ? (counts[e] + bn - 1) / bn * m_tiles : 0;
  __syncthreads();
  for (int o = 1; o < int(blockDim.x); o <<= 1) {
    const int add = e >= o ? s[e - o] : 0;
    __syncthreads();
    s[e] += add;
    __syncthreads();
  }
  if (e < E) tile_start[e + 1] = s[e];
  if (e == 0) tile_start[0] = 0;
}

template <int BM_, int BN_, int WARPS_M_, int STAGES_, bool PERM_>
struct Cfg {
  static constexpr int BM = BM_, BN = BN_, WARPS_M = WARPS_M_, WARPS_N = 8 / WARPS_M_, STAGES = STAGES_;
  static constexpr bool PERM = PERM_;
  static constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;  // a warp's rows and tokens
  static constexpr int MT = WM / 16, NT = WN / 8;             // its m16 and n8 tiles
  // Shared memory per stage: codes [BM][32 B], scales [BM][4 B], X [BN][64 BF16 + 16 B of
  // padding] (a row of 144 B: the LDS.128 of lanes (g, t) and (g + 1, t) fall 16 B apart in the
  // banks, so a quarter warp's eight reads are conflict-free).
  static constexpr int kXRow = kBK * 2 + 16;
  static constexpr int kCodes = BM * kBK / 2, kScales = BM * kBK / 16, kX = BN * kXRow;
  static constexpr int kStage = kCodes + kScales + kX, kSmem = STAGES * kStage;
  static_assert(WARPS_M * WARPS_N == 8 && WM % 16 == 0 && WN % 8 == 0, "8 warps of m16 x n8 tiles");
  static_assert(kCodes % 16 == 0 && kScales % 16 == 0 && kStage % 16 == 0, "16-byte aligned regions");
  static_assert(STAGES >= 2, "a pipeline");
};

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, uint32_t src_bytes) {
  // src_bytes < 16 fills the rest with zeros (0: a row past the expert's tokens).
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Codes k and k + 4 (k = 0..3) of an 8-code word (code q in bits 4q..4q+3: sign bit 3, exponent
// bits 2-1, mantissa bit 0) as a BF16 pair, code k in the low half: each code's magnitude bits go
// to bits 6-8 (the top mantissa bit and the two low exponent bits) and its sign to bit 15, which
// makes code x 2^-126 (exponent e >= 1: 2^(e-127) (1 + m/2); e = 0: the subnormal m x 2^-127).
// The two codes sit 16 bits apart, so one shift and mask serves both.
__host__ __device__ __forceinline__ uint32_t e2m1_pair_bf16(uint32_t c, int k) {
  const uint32_t mag = (k == 0 ? c << 6 : k == 1 ? c << 2 : k == 2 ? c >> 2 : c >> 6) & 0x01C001C0u;
  const uint32_t sgn = (c << (12 - 4 * k)) & 0x80008000u;
  return mag | sgn;
}

// An E4M3 block scale x 2^118 in both halves of a BF16 pair (exact: 4 significant bits, at most
// 448 x 2^118 = 1.75 x 2^126, finite).
__device__ __forceinline__ uint32_t scale_bf16x2(uint8_t s) {
  const __nv_bfloat162 h = __float2bfloat162_rn(e4m3_to_float(s) * 0x1p118f);
  uint32_t u;
  std::memcpy(&u, &h, 4);
  return u;
}

// (code x 2^-126) x (scale x 2^118) = code x scale x 2^-8: exact in BF16 (the 0.5 codes enter as
// subnormals, which the BF16 multiply keeps; the product is normal, at least 2^-18).
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One chunk of 64 weights from stage memory st: the warp's MT x NT tiles of MMAs, 4 k-steps each.
// Lane (g, t), m-tile mt: rows ra = wm WM + 16 mt + g and rb = ra + 8 of the CTA's tile, block t
// of the chunk: codes c = 8 bytes at [row][8t] (c.x weights 16t..16t+7, c.y 16t+8..16t+15, code
// q of a word = weight q of its 8), scale [row][t]. k-step s: A registers
//   a0 = (ra: 16t+s, 16t+s+4), a1 = (rb: same), a2 = (ra: 16t+8+s, 16t+12+s), a3 = (rb: same)
// (slots 2t, 2t+1 | 2t+8, 2t+9 of the fragment, above). B: lane (g, t) holds token n = 8 nt + g
// of the warp, the same slots: b0 = X[n][16t+s, 16t+s+4], b1 = X[n][16t+8+s, 16t+12+s]. From the
// natural order (words w_j = X[2j, 2j+1] of the lane's 16): s = 0 lo(w0) lo(w2), 1 hi(w0) hi(w2),
// 2 lo(w1) lo(w3), 3 hi(w1) hi(w3), and b1 the same from w4..w7; from v3's order b0 = w_2s,
// b1 = w_2s+1.
template <class C>
__device__ __forceinline__ void compute_chunk(const uint8_t* st, int wm, int wn, int g, int t, int rows,
                                              float (&acc)[C::MT][C::NT][4]) {
  const uint8_t* sc = st;
  const uint8_t* ss = st + C::kCodes;
  const uint8_t* sx = st + C::kCodes + C::kScales;
  uint32_t a[C::MT][4][4];
#pragma unroll
  for (int mt = 0; mt < C::MT; ++mt) {
    const int ra = wm * C::WM + mt * 16 + g, rb = ra + 8;
    const uint2 ca = *reinterpret_cast<const uint2*>(sc + ra * 32 + t * 8);
    const uint2 cb = *reinterpret_cast<const uint2*>(sc + rb * 32 + t * 8);
    const uint32_t sa = scale_bf16x2(ss[ra * 4 + t]), sb = scale_bf16x2(ss[rb * 4 + t]);
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      a[mt][s][0] = bf16x2_mul(e2m1_pair_bf16(ca.x, s), sa);
      a[mt][s][1] = bf16x2_mul(e2m1_pair_bf16(cb.x, s), sb);
      a[mt][s][2] = bf16x2_mul(e2m1_pair_bf16(ca.y, s), sa);
      a[mt][s][3] = bf16x2_mul(e2m1_pair_bf16(cb.y, s), sb);
    }
  }
#pragma unroll
  for (int nt = 0; nt < C::NT; ++nt) {
    if (wn * C::WN + nt * 8 >= rows) break;  // the rest of the warp's tokens are past the expert's (uniform)
    const uint8_t* xr = sx + (wn * C::WN + nt * 8 + g) * C::kXRow + t * 32;
    const uint4 lo = *reinterpret_cast<const uint4*>(xr);
    const uint4 hi = *reinterpret_cast<const uint4*>(xr + 16);
    const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      uint32_t b0, b1;
      if constexpr (C::PERM) {
        b0 = w[2 * s], b1 = w[2 * s + 1];
      } else {
        const uint32_t sel = (s & 1) ? 0x7632u : 0x5410u;  // high halves : low halves of the two words
        b0 = prmt(w[s >> 1], w[(s >> 1) + 2], sel);
        b1 = prmt(w[4 + (s >> 1)], w[6 + (s >> 1)], sel);
      }
#pragma unroll
      for (int mt = 0; mt < C::MT; ++mt) mma_bf16(acc[mt][nt], a[mt][s], b0, b1);
    }
  }
}

// CTA b takes tile b of the list (surplus CTAs leave at once): expert e, token tile nt, row tile
// mt (row tiles of one token tile consecutive, so that concurrent CTAs share X's tile in the L2
// and read each of the expert's weights once).
template <class C>
__global__ void __launch_bounds__(kThreads, 1) moe_gemm_kernel(const GemmArgs a) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int tile = int(blockIdx.x);
  if (tile >= a.tile_start[a.E]) return;
  int lo = 0, hi = a.E;  // tile_start[lo] <= tile < tile_start[hi]: expert lo has the tile
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (a.tile_start[mid] <= tile) lo = mid;
    else hi = mid;
  }
  const int e = lo;
  const int m_tiles = a.N / C::BM;
  const int local = tile - a.tile_start[e];
  const int nt_idx = local / m_tiles, mt_idx = local - nt_idx * m_tiles;
  const int rows = min(C::BN, a.counts[e] - nt_idx * C::BN);  // >= 1
  const int tok_base = a.offsets[e] + nt_idx * C::BN;
  const int row0 = mt_idx * C::BM;  // of the expert's N rows
  const int rpp = a.N / a.parts, part = row0 / rpp;
  const Mat m = a.mats[e * a.parts + part];
  const int K = a.K, KC = K / kBK;
  const uint8_t* codes = m.codes + size_t(row0 - part * rpp) * (K / 2);
  const uint8_t* scales = m.scales + size_t(row0 - part * rpp) * (K / 16);
  const uint16_t* x = a.x + size_t(tok_base) * K;

  const uint32_t sbase = uint32_t(__cvta_generic_to_shared(smem));
  auto load = [&](int stage, int kc) {
    const uint32_t st = sbase + uint32_t(stage * C::kStage);
#pragma unroll
    for (int j = 0; j < (C::BM * 2 + kThreads - 1) / kThreads; ++j) {  // codes: 2 x 16 B per row
      const int i = int(threadIdx.x) + j * kThreads;
      if (i < C::BM * 2)
        cp_async16(st + uint32_t(i * 16), codes + size_t(i >> 1) * (K / 2) + kc * 32 + (i & 1) * 16, 16);
    }
#pragma unroll
    for (int j = 0; j < (C::BM + kThreads - 1) / kThreads; ++j) {  // scales: 4 B per row
      const int i = int(threadIdx.x) + j * kThreads;
      if (i < C::BM) cp_async4(st + uint32_t(C::kCodes + i * 4), scales + size_t(i) * (K / 16) + kc * 4);
    }
#pragma unroll
    for (int j = 0; j < (C::BN * 8 + kThreads - 1) / kThreads; ++j) {  // X: 8 x 16 B per token, zeros past the expert's
      const int i = int(threadIdx.x) + j * kThreads;
      if (i < C::BN * 8) {
        const int r = i >> 3, c = i & 7;
        const bool in = r < rows;
        cp_async16(st + uint32_t(C::kCodes + C::kScales + r * C::kXRow + c * 16),
                   x + size_t(in ? r : 0) * K + kc * kBK + c * 8, in ? 16u : 0u);
      }
    }
  };

  const int lane = int(threadIdx.x) & 31, warp = int(threadIdx.x) >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wm = warp % C::WARPS_M, wn = warp / C::WARPS_M;
  const bool busy = wn * C::WN < rows;  // the warp has tokens (uniform)
  float acc[C::MT][C::NT][4];
#pragma unroll
  for (int i = 0; i < C::MT; ++i)
#pragma unroll
    for (int j = 0; j < C::NT; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.0f;

  // Pipeline: group j (one per chunk, empty past the last) loads chunk j into stage j % STAGES.
#pragma unroll
  for (int s = 0; s < C::STAGES - 1; ++s) {
    if (s < KC) load(s, s);
    cp_async_commit();
  }
  for (int kc = 0; kc < KC; ++kc) {
    cp_async_wait<C::STAGES - 2>();  // this thread's copies of chunk kc have landed
    __syncthreads();                 // everyone's, and everyone is done with chunk kc - 1's stage
    const int next = kc + C::STAGES - 1;
    if (next < KC) load(next % C::STAGES, next);  // into chunk kc - 1's stage
    cp_async_commit();
    if (busy) compute_chunk<C>(smem + (kc % C::STAGES) * C::kStage, wm, wn, g, t, rows, acc);
  }

  // C fragment: c0 c1 = row ra, tokens 2t, 2t+1; c2 c3 = row ra + 8, the same tokens.
  const float out_scale = m.scale2 * 256.0f;  // undoes the 2^-8 of the A values
  const size_t N = size_t(a.N);
  float* yb = a.y + size_t(tok_base) * N + row0;
#pragma unroll
  for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < C::NT; ++nt) {
      const int tok = wn * C::WN + nt * 8 + 2 * t;
      float* p = yb + size_t(tok) * N + (wm * C::WM + mt * 16 + g);
      if (tok < rows) p[0] = acc[mt][nt][0] * out_scale, p[8] = acc[mt][nt][2] * out_scale;
      if (tok + 1 < rows) p[N] = acc[mt][nt][1] * out_scale, p[N + 8] = acc[mt][nt][3] * out_scale;
    }
}

// A kernel configuration: the prefix sum of its tiles, then the GEMM over an upper bound of them
// (sum of ceil(c / BN) <= T / BN + E token tiles).
struct Kernel {
  const char* name;
  int bm, bn;
  const void* func;
  int smem;
  void (*launch)(const GemmArgs&, int* tile_start, int T, cudaStream_t);
};

template <class C>
void launch_mma(const GemmArgs& a, int* tile_start, int T, cudaStream_t s) {
  if (a.E < 1 || a.E > 1024 || a.parts < 1 || a.N % a.parts != 0 || (a.N / a.parts) % C::BM != 0 || a.K % kBK != 0) {
    std::fprintf(stderr, "unsupported shape: E=%d N=%d K=%d parts=%d for BM=%d\n", a.E, a.N, a.K, a.parts, C::BM);
    std::exit(1);
  }
  const int m_tiles = a.N / C::BM;
  tile_list_kernel<<<1, (a.E + 31) / 32 * 32, 0, s>>>(a.counts, a.E, C::BN, m_tiles, tile_start);
  GemmArgs args = a;
  args.tile_start = tile_start;
  const long long bound = ((long long)(T + C::BN - 1) / C::BN + a.E) * m_tiles;
  moe_gemm_kernel<C><<<unsigned(bound), kThreads, C::kSmem, s>>>(args);
}

template <class C>
Kernel kernel(const char* name) {
  CHECK(cudaFuncSetAttribute(moe_gemm_kernel<C>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem));
  return Kernel{name, C::BM, C::BN, reinterpret_cast<const void*>(moe_gemm_kernel<C>), C::kSmem, launch_mma<C>};
}

// ---------------------------------------------------------------------------------------------
// v0: the BF16 copy (the engine's to_bf16_kernel: one thread per 16-weight block) and cuBLAS.

__global__ void experts_to_bf16_kernel(const int* __restrict__ experts, const uint8_t* __restrict__ codes,
                                       const uint8_t* __restrict__ scales, size_t per_expert, __nv_bfloat16* __restrict__ w) {
  const size_t g = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g * 16 >= per_expert) return;
  const size_t blk = size_t(experts[blockIdx.y]) * (per_expert / 16) + g;
  const uint2 c = reinterpret_cast<const uint2*>(codes)[blk];
  const float scale = e4m3_to_float(scales[blk]) * kE2M1Unscale;
  float lo[8], hi[8];
  e2m1x8_scaled(c.x, lo);
  e2m1x8_scaled(c.y, hi);
  __align__(16) __nv_bfloat16 out[16];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    out[i] = __float2bfloat16_rn(lo[i] * scale);  // exact
    out[i + 8] = __float2bfloat16_rn(hi[i] * scale);
  }
  reinterpret_cast<uint4*>(w + blk * 16)[0] = reinterpret_cast<const uint4*>(out)[0];
  reinterpret_cast<uint4*>(w + blk * 16)[1] = reinterpret_cast<const uint4*>(out)[1];
}

// ---------------------------------------------------------------------------------------------
// Problems: a weight set (E experts x N rows x K, `parts` matrices per expert, one allocation)
// and a batch of rows sorted by expert.

double e2m1_value(uint32_t nib) {
  static const double mag[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
  return (nib & 8u) ? -mag[nib & 7u] : mag[nib & 7u];
}

double e4m3_value(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const double v = e == 0 ? m / 8.0 * std::ldexp(1.0, -6) : (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
  return (b & 0x80) ? -v : v;
}

unsigned grid_for(size_t n) { return unsigned(std::min<size_t>((n + 255) / 256, 65536)); }

struct Weights {
  int E = 0, N = 0, K = 0, parts = 1;
  uint32_t seed = 0;
  uint8_t* codes = nullptr;
  uint8_t* scales = nullptr;
  Mat* mats = nullptr;
  __nv_bfloat16* wbf16 = nullptr;  // v0's copy
  std::vector<float> scale2;       // [E * parts]

  int rpp() const { return N / parts; }
  size_t code_bytes() const { return size_t(E) * N * (K / 2); }
  size_t scale_bytes() const { return size_t(E) * N * (K / 16); }
  float s2(int e, int n) const { return scale2[size_t(e) * parts + n / rpp()]; }
  // w[e][n][k] without scale2, exactly.
  double wq(int e, int n, int k) const {
    const size_t row = size_t(e) * N + n;
    const uint8_t byte = gen_code(seed, row * (K / 2) + k / 2);
    return e2m1_value((k & 1) ? byte >> 4 : byte & 15u) * e4m3_value(gen_scale(seed, row * (K / 16) + k / 16));
  }
};

Weights make_weights(int E, int N, int K, int parts, uint32_t seed, bool with_bf16) {
  Weights w;
  w.E = E, w.N = N, w.K = K, w.parts = parts, w.seed = seed;
  CHECK(cudaMalloc(&w.codes, w.code_bytes()));
  CHECK(cudaMalloc(&w.scales, w.scale_bytes()));
  gen_bytes_kernel<<<grid_for(w.code_bytes()), 256>>>(w.codes, w.code_bytes(), seed, 0);
  gen_bytes_kernel<<<grid_for(w.scale_bytes()), 256>>>(w.scales, w.scale_bytes(), seed, 1);
  CHECK(cudaGetLastError());
  std::vector<Mat> mats(size_t(E) * parts);
  w.scale2.resize(mats.size());
  for (int e = 0; e < E; ++e)
    for (int p = 0; p < parts; ++p) {
      const size_t i = size_t(e) * parts + p, row = size_t(e) * N + size_t(p) * w.rpp();
      w.scale2[i] = 0.01f * (1.0f + float(hash32((uint64_t(seed + 3) << 40) ^ i) >> 8) / 16777216.0f);
      mats[i] = Mat{w.codes + row * (K / 2), w.scales + row * (K / 16), w.scale2[i]};
    }
  CHECK(cudaMalloc(&w.mats, mats.size() * sizeof(Mat)));
  CHECK(cudaMemcpy(w.mats, mats.data(), mats.size() * sizeof(Mat), cudaMemcpyHostToDevice));
  if (with_bf16) CHECK(cudaMalloc(&w.wbf16, size_t(E) * N * K * 2));
  return w;
}

void free_weights(Weights& w) {
  CHECK(cudaFree(w.codes));
  CHECK(cudaFree(w.scales));
  CHECK(cudaFree(w.mats));
  if (w.wbf16) CHECK(cudaFree(w.wbf16));
  w = Weights{};
}

struct Batch {
  int T = 0;
  uint32_t seed = 0;
  std::vector<int> counts, offsets, expert_of;  // host copies: the generator's and the checks'
  std::vector<int> busy;                        // experts with rows (v0's host list)
  int *d_counts = nullptr, *d_offsets = nullptr, *d_busy = nullptr, *d_tiles = nullptr;
  uint16_t *x = nullptr, *xp = nullptr;
  float* y = nullptr;
  double busy_weight_bytes = 0;  // codes + scales of the experts with rows
};

Batch make_batch(const Weights& w, const std::vector<int>& counts, uint32_t seed) {
  Batch b;
  b.counts = counts;
  b.seed = seed;
  b.offsets.resize(counts.size());
  for (size_t e = 0; e < counts.size(); ++e) {
    b.offsets[e] = b.T;
    b.T += counts[e];
    for (int i = 0; i < counts[e]; ++i) b.expert_of.push_back(int(e));
    if (counts[e] > 0) b.busy.push_back(int(e));
  }
  b.busy_weight_bytes = double(b.busy.size()) * w.N * (w.K / 2 + w.K / 16);
  const size_t E = counts.size();
  CHECK(cudaMalloc(&b.d_counts, E * 4));
  CHECK(cudaMalloc(&b.d_offsets, E * 4));
  CHECK(cudaMalloc(&b.d_busy, std::max<size_t>(b.busy.size(), 1) * 4));
  CHECK(cudaMalloc(&b.d_tiles, (E + 1) * 4));
  CHECK(cudaMemcpy(b.d_counts, counts.data(), E * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(b.d_offsets, b.offsets.data(), E * 4, cudaMemcpyHostToDevice));
  if (!b.busy.empty()) CHECK(cudaMemcpy(b.d_busy, b.busy.data(), b.busy.size() * 4, cudaMemcpyHostToDevice));
  const size_t nx = std::max<size_t>(size_t(b.T) * w.K, 16);
  CHECK(cudaMalloc(&b.x, nx * 2));
  CHECK(cudaMalloc(&b.xp, nx * 2));
  CHECK(cudaMalloc(&b.y, std::max<size_t>(size_t(b.T) * w.N, 1) * 4));
  gen_x_kernel<<<grid_for(nx), 256>>>(b.x, nx, seed);
  permute_x_kernel<<<grid_for(nx / 16), 256>>>(b.x, b.xp, nx / 16);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  return b;
}

void free_batch(Batch& b) {
  for (void* p : {(void*)b.d_counts, (void*)b.d_offsets, (void*)b.d_busy, (void*)b.d_tiles, (void*)b.x, (void*)b.xp,
                  (void*)b.y})
    CHECK(cudaFree(p));
  b = Batch{};
}

// Rows per expert: rows / top_k tokens, each routed to top_k distinct experts uniformly at random.
std::vector<int> uniform_counts(int E, int rows, int top_k, std::mt19937& rng) {
  std::vector<int> c(E, 0), pick(E);
  std::iota(pick.begin(), pick.end(), 0);
  for (int tkn = 0; tkn < rows / top_k; ++tkn) {
    for (int j = 0; j < top_k; ++j) std::swap(pick[j], pick[j + rng() % (E - j)]);
    for (int j = 0; j < top_k; ++j) ++c[pick[j]];
  }
  return c;
}

// Skewed: E/8 experts get no rows, E/8 get 4x the mean, the other rows land uniformly at random on
// the remaining 3/4.
std::vector<int> skewed_counts(int E, int rows, std::mt19937& rng) {
  std::vector<int> c(E, 0), order(E);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  const int heavy = 4 * rows / E;
  int left = rows;
  for (int i = E / 8; i < E / 4; ++i) c[order[i]] = heavy, left -= heavy;
  for (; left > 0; --left) ++c[order[E / 4 + rng() % (E - E / 4)]];
  return c;
}

double x_value(const Batch& b, int K, int t, int k) { return bf2f(gen_x(b.seed, uint64_t(t) * K + k)); }

// ---------------------------------------------------------------------------------------------
// Variants.

struct Lab {
  cublasHandle_t blas = nullptr;
  Kernel v1, v2big, v2small, v3big, v3small;
};

enum VariantId { kV0, kV1, kV2, kV3, kV2Big, kV2Small, kV3Big, kV3Small };

const Kernel* kernel_of(const Lab& lab, int v, int T, int E) {
  const bool big = T >= 96 * E;  // the mean rows per expert, known without the counts
  switch (v) {
    case kV1: return &lab.v1;
    case kV2: return big ? &lab.v2big : &lab.v2small;
    case kV3: return big ? &lab.v3big : &lab.v3small;
    case kV2Big: return &lab.v2big;
    case kV2Small: return &lab.v2small;
    case kV3Big: return &lab.v3big;
    case kV3Small: return &lab.v3small;
  }
  return nullptr;
}

std::string variant_name(const Lab& lab, int v, int T, int E) {
  if (v == kV0) return "v0 bf16 copy+cuBLAS";
  const Kernel* k = kernel_of(lab, v, T, E);
  const char* tag = v == kV1 ? "v1" : (v == kV2 || v == kV2Big || v == kV2Small) ? "v2" : "v3";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s %s", tag, k->name);
  return buf;
}

// v0's conversion alone (for the breakdown), and the whole.
void run_v0_convert(const Lab& lab, const Weights& w, const Batch& b) {
  if (b.busy.empty()) return;
  const size_t per = size_t(w.N) * w.K;
  experts_to_bf16_kernel<<<dim3(unsigned((per / 16 + 255) / 256), unsigned(b.busy.size())), 256>>>(
      b.d_busy, w.codes, w.scales, per, w.wbf16);
}

void run_v0(const Lab& lab, const Weights& w, const Batch& b) {
  run_v0_convert(lab, w, b);
  const float zero = 0.0f;
  const int rpp = w.rpp();
  for (int e : b.busy)
    for (int p = 0; p < w.parts; ++p) {
      const float alpha = w.scale2[size_t(e) * w.parts + p];
      const __nv_bfloat16* A = w.wbf16 + (size_t(e) * w.N + size_t(p) * rpp) * w.K;
      const uint16_t* B = b.x + size_t(b.offsets[e]) * w.K;
      float* C = b.y + size_t(b.offsets[e]) * w.N + size_t(p) * rpp;
      CHECK_BLAS(cublasGemmEx(lab.blas, CUBLAS_OP_T, CUBLAS_OP_N, rpp, b.counts[e], w.K, &alpha, A, CUDA_R_16BF, w.K,
                              B, CUDA_R_16BF, w.K, &zero, C, CUDA_R_32F, w.N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
}

void run_variant(const Lab& lab, int v, const Weights& w, const Batch& b) {
  if (v == kV0) return run_v0(lab, w, b);
  const Kernel* k = kernel_of(lab, v, b.T, w.E);
  const bool perm = v == kV3 || v == kV3Big || v == kV3Small;
  GemmArgs a{w.mats, perm ? b.xp : b.x, b.d_counts, b.d_offsets, nullptr, b.y, w.E, w.N, w.K, w.parts};
  k->launch(a, b.d_tiles, b.T, 0);
}

template <typename F>
double median_ms(F&& f, int runs) {
  for (int i = 0; i < 3; ++i) f();
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::vector<float> t;
  for (int i = 0; i < runs; ++i) {
    CHECK(cudaEventRecord(e0));
    f();
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    t.push_back(ms);
  }
  CHECK(cudaGetLastError());
  CHECK(cudaEventDestroy(e0));
  CHECK(cudaEventDestroy(e1));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// ---------------------------------------------------------------------------------------------
// Checks.

// A small problem in full: every output against the CPU, relative to its row's RMS.
bool check_small(const Lab& lab, int E, int N, int K, int parts, int max_count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int> counts(E);
  for (int& c : counts) c = int(rng() % (max_count + 1));
  counts[1 % E] = 0;  // an expert without rows
  Weights w = make_weights(E, N, K, parts, seed, true);
  Batch b = make_batch(w, counts, seed + 7);
  const int T = b.T;
  // The reference in double.
  std::vector<double> W(size_t(E) * N * K), X(size_t(T) * K), ref(size_t(T) * N);
  for (int e = 0; e < E; ++e)
    for (int n = 0; n < N; ++n)
      for (int k = 0; k < K; ++k) W[(size_t(e) * N + n) * K + k] = w.wq(e, n, k) * w.s2(e, n);
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) X[size_t(t) * K + k] = x_value(b, K, t, k);
  std::vector<double> rms(T, 0.0);
  for (int t = 0; t < T; ++t) {
    const int e = b.expert_of[t];
    for (int n = 0; n < N; ++n) {
      double s = 0;
      for (int k = 0; k < K; ++k) s += X[size_t(t) * K + k] * W[(size_t(e) * N + n) * K + k];
      ref[size_t(t) * N + n] = s;
      rms[t] += s * s;
    }
    rms[t] = std::max(std::sqrt(rms[t] / N), 1e-30);
  }
  std::printf("check E=%d N=%d K=%d parts=%d, %d rows (counts 0..%d):", E, N, K, parts, T, max_count);
  bool ok = true;
  std::vector<float> y(size_t(T) * N);
  for (int v : {kV0, kV1, kV2Big, kV2Small, kV3Big, kV3Small}) {
    CHECK(cudaMemset(b.y, 0xFF, y.size() * 4));  // NaN: an output nobody writes fails
    run_variant(lab, v, w, b);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(y.data(), b.y, y.size() * 4, cudaMemcpyDeviceToHost));
    double worst = 0;
    for (int t = 0; t < T; ++t)
      for (int n = 0; n < N; ++n) {
        const double err = std::fabs(double(y[size_t(t) * N + n]) - ref[size_t(t) * N + n]) / rms[t];
        if (!(err <= worst)) worst = std::isnan(err) ? INFINITY : err;
      }
    const bool pass = worst <= kTolerance;
    ok = ok && pass;
    std::printf(" %s %.1e%s;", variant_name(lab, v, T, E).c_str(), worst, pass ? "" : " FAIL");
  }
  std::printf("\n");
  free_batch(b);
  free_weights(w);
  return ok;
}

// Random outputs of a timed problem against the CPU, relative to the root sum of squares of their
// K products.
struct Samples {
  std::vector<size_t> idx;
  std::vector<double> ref, scale;
  size_t* d_idx = nullptr;
  float* d_out = nullptr;
};

Samples make_samples(const Weights& w, const Batch& b, int n, uint32_t seed) {
  Samples s;
  std::mt19937 rng(seed);
  for (int i = 0; i < n; ++i) {
    // The first and last rows, then alternately the last row of a random expert with rows (where
    // a partial token tile ends) and a random row.
    const int last = b.busy[rng() % b.busy.size()];
    const int t = i == 0 ? 0 : i == 1 ? b.T - 1 : (i & 1) ? int(rng() % b.T) : b.offsets[last] + b.counts[last] - 1;
    const int c = int(rng() % w.N);
    const int e = b.expert_of[t];
    double sum = 0, sq = 0;
    for (int k = 0; k < w.K; ++k) {
      const double p = x_value(b, w.K, t, k) * w.wq(e, c, k);
      sum += p, sq += p * p;
    }
    const double s2 = w.s2(e, c);
    s.idx.push_back(size_t(t) * w.N + c);
    s.ref.push_back(sum * s2);
    s.scale.push_back(std::max(std::sqrt(sq) * s2, 1e-30));
  }
  CHECK(cudaMalloc(&s.d_idx, s.idx.size() * sizeof(size_t)));
  CHECK(cudaMalloc(&s.d_out, s.idx.size() * 4));
  CHECK(cudaMemcpy(s.d_idx, s.idx.data(), s.idx.size() * sizeof(size_t), cudaMemcpyHostToDevice));
  return s;
}

// The worst error of the samples in the current Y (NaN, e.g. an output never written, is infinite).
double sample_error(const Samples& s, const float* y) {
  const int n = int(s.idx.size());
  gather_kernel<<<(n + 255) / 256, 256>>>(y, s.d_idx, n, s.d_out);
  CHECK(cudaGetLastError());
  std::vector<float> out(static_cast<size_t>(n));
  CHECK(cudaMemcpy(out.data(), s.d_out, size_t(n) * 4, cudaMemcpyDeviceToHost));
  double worst = 0;
  for (int i = 0; i < n; ++i) {
    const double err = std::fabs(double(out[size_t(i)]) - s.ref[size_t(i)]) / s.scale[size_t(i)];
    if (!(err <= worst)) worst = std::isnan(err) ? INFINITY : err;
  }
  return worst;
}

void free_samples(Samples& s) {
  CHECK(cudaFree(s.d_idx));
  CHECK(cudaFree(s.d_out));
  s = Samples{};
}

void print_kernel(const Kernel& k, const char* tag) {
  cudaFuncAttributes attr{};
  CHECK(cudaFuncGetAttributes(&attr, k.func));
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k.func, kThreads, size_t(k.smem)));
  std::printf("  %s %-20s %3d registers, %d B spilled, %6d B shared, %d CTA(s) per SM\n", tag, k.name, attr.numRegs,
              int(attr.localSizeBytes), k.smem, per_sm);
}

}  // namespace

int main(int argc, char** argv) {
  const bool check_only = argc > 1 && std::string(argv[1]) == "check";
  const int runs = (argc > 1 && !check_only) ? std::max(1, std::atoi(argv[1])) : 20;
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs, %.0f MB L2\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1e6);
  Lab lab;
  CHECK_BLAS(cublasCreate(&lab.blas));
  lab.v1 = kernel<Cfg<128, 64, 4, 3, false>>("128x64 w32x32 3st");
  lab.v2big = kernel<Cfg<128, 128, 4, 4, false>>("128x128 w32x64 4st");
  lab.v2small = kernel<Cfg<256, 64, 8, 4, false>>("256x64 w32x64 4st");
  lab.v3big = kernel<Cfg<128, 128, 4, 4, true>>("128x128 w32x64 4st");
  lab.v3small = kernel<Cfg<256, 64, 8, 4, true>>("256x64 w32x64 4st");
  print_kernel(lab.v1, "v1");
  print_kernel(lab.v2big, "v2");
  print_kernel(lab.v2small, "v2");
  print_kernel(lab.v3big, "v3");
  print_kernel(lab.v3small, "v3");

  // Small problems in full: gate/up-like (two parts), more rows than a 128-token tile, one chunk.
  bool ok = true;
  ok = check_small(lab, 8, 512, 256, 2, 70, 11) && ok;
  ok = check_small(lab, 4, 256, 192, 1, 300, 12) && ok;
  ok = check_small(lab, 3, 256, 64, 1, 20, 13) && ok;
  if (check_only) {
    std::printf(ok ? "all checks passed\n" : "FAILED: a variant is wrong (above)\n");
    CHECK_BLAS(cublasDestroy(lab.blas));
    return ok ? 0 : 1;
  }

  // The copy bandwidth, for context (read + write of 1 GiB).
  double copy_bw = 0;
  {
    const size_t cb = size_t(1) << 30;
    void *ca = nullptr, *cbuf = nullptr;
    CHECK(cudaMalloc(&ca, cb));
    CHECK(cudaMalloc(&cbuf, cb));
    CHECK(cudaMemset(ca, 1, cb));
    const double ms = median_ms([&] { CHECK(cudaMemcpyAsync(cbuf, ca, cb, cudaMemcpyDeviceToDevice)); }, 5);
    copy_bw = 2.0 * cb / (ms * 1e-3);
    std::printf("copy bandwidth %.2f TB/s (1 GiB, read + write)\n", copy_bw / 1e12);
    CHECK(cudaFree(ca));
    CHECK(cudaFree(cbuf));
  }

  // The timed shapes (Qwen3-30B-A3B), E = 128, top 8.
  struct Shape {
    const char* name;
    int N, K, parts;
  };
  const Shape shapes[] = {{"gate+up", 1536, 2048, 2}, {"down", 2048, 768, 1}};
  const int E = 128, top_k = 8;
  std::printf("%d runs each (median); TFLOP/s = 2 T N K / time; GB/s = codes + scales of the experts with rows / time;\n"
              "err = worst of %d sampled outputs vs the CPU, relative to the RSS of their K products\n",
              runs, 256);
  uint32_t seed = 100;
  for (const Shape& sh : shapes) {
    Weights w = make_weights(E, sh.N, sh.K, sh.parts, ++seed, true);
    for (int rows : {4096, 32768})
      for (int skew = 0; skew < 2; ++skew) {
        std::mt19937 rng(++seed);
        const std::vector<int> counts = skew ? skewed_counts(E, rows, rng) : uniform_counts(E, rows, top_k, rng);
        Batch b = make_batch(w, counts, ++seed);
        Samples smp = make_samples(w, b, 256, ++seed);
        const int most = *std::max_element(counts.begin(), counts.end());
        const int none = int(std::count(counts.begin(), counts.end(), 0));
        std::printf("%s N=%d K=%d, T=%d rows, %s (most %d, %d experts without rows), %.1f MB of weights with rows "
                    "(%.3f ms at the copy bandwidth):\n",
                    sh.name, sh.N, sh.K, b.T, skew ? "skewed" : "uniform", most, none, b.busy_weight_bytes / 1e6,
                    b.busy_weight_bytes / copy_bw * 1e3);
        const double flop = 2.0 * b.T * sh.N * sh.K;
        for (int v : {kV0, kV1, kV2, kV3}) {
          CHECK(cudaMemset(b.y, 0xFF, size_t(b.T) * sh.N * 4));
          run_variant(lab, v, w, b);
          CHECK(cudaGetLastError());
          CHECK(cudaDeviceSynchronize());
          const double err = sample_error(smp, b.y);
          const bool pass = err <= kTolerance;
          ok = ok && pass;
          const double ms = median_ms([&] { run_variant(lab, v, w, b); }, runs);
          std::printf("  %-28s %8.3f ms %7.1f TFLOP/s %7.0f GB/s  err %.1e%s", variant_name(lab, v, b.T, E).c_str(), ms,
                      flop / (ms * 1e-3) / 1e12, b.busy_weight_bytes / (ms * 1e-3) / 1e9, err, pass ? "" : "  FAIL");
          if (v == kV0) std::printf("  (copy alone %.3f ms)", median_ms([&] { run_v0_convert(lab, w, b); }, runs));
          std::printf("\n");
        }
        free_samples(smp);
        free_batch(b);
      }
    free_weights(w);
  }
  CHECK_BLAS(cublasDestroy(lab.blas));
  std::printf(ok ? "all checks passed\n" : "FAILED: a variant is wrong (above)\n");
  return ok ? 0 : 1;
}
