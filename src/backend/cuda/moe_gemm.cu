// The grouped GEMM of the GEMM prefill's experts (moe_gemm.h; measured in docs/PERF.md v39-v40,
// where it was lab/moe_gemm's variant v3: two tile shapes, activations in the MMA order) with
// row tiles per part (a tile never straddles gate and up, and `out` need not be a multiple of
// the tile), inputs a multiple of 32 rather than 64 (the last 64-wide chunk may be half full;
// its missing half is zeros in shared memory), and BF16 experts beside NVFP4 ones (their
// weights copied to shared memory as they are and permuted into the same k-slots).
//
// Fragment layouts (PTX ISA, mma.m16n8k16 with BF16), lane = 4 g + t:
//   A (16 x 16, row): a0a1 row g, k 2t, 2t+1; a2a3 row g+8, same k; a4a5 row g, k 2t+8, 2t+9;
//                     a6a7 row g+8, same k.
//   B (16 x 8, col):  b0b1 k 2t, 2t+1, column g; b2b3 k 2t+8, 2t+9, column g.
//   C (16 x 8):       c0 c1 row g, columns 2t, 2t+1; c2 c3 row g+8, same columns.
// Lane (g, t) owns the 16-weight block t of each 64-weight chunk of its rows, and k-step s (0..3)
// maps the MMA's slots 2t, 2t+1, 2t+8, 2t+9 to weights 16t+s, 16t+s+4, 16t+8+s, 16t+12+s of the
// chunk (every weight once over the four steps; a dot product does not care about the order).
#include <algorithm>
#include <cstring>

#include "backend/cuda/check.h"
#include "backend/cuda/dequant.cuh"
#include "backend/cuda/moe_gemm.h"

namespace kestrel::cuda {
namespace {

constexpr int kThreads = 256, kBK = 64;

struct Args {
  const DLinear* parts[2];
  int num_parts, experts, out, in;
  const uint16_t* x;      // BF16 [rows, in], MMA order
  const int32_t* counts;  // [experts]
  const int32_t* tiles;   // [experts + 1]: expert e's tiles are tiles[e] .. tiles[e + 1] - 1
  const int32_t* first;   // [experts]: expert e's first row
  float* y;               // [rows, num_parts * out]
};

// Expert e's tiles (ceil(counts[e] / bn) token tiles x m_tiles row tiles) and first row, both
// prefix sums over the experts by one block of at least `experts` threads (<= 1024).
__global__ void tile_list_kernel(const int32_t* __restrict__ counts, int experts, int bn, int m_tiles,
                                 int32_t* __restrict__ tiles, int32_t* __restrict__ first) {
  __shared__ int st[1024], sr[1024];
  const int e = int(threadIdx.x);
  const int c = e < experts ? counts[e] : 0;
  st[e] = (c + bn - 1) / bn * m_tiles;
  sr[e] = c;
  __syncthreads();
  for (int o = 1; o < int(blockDim.x); o <<= 1) {  // inclusive scans
    const int at = e >= o ? st[e - o] : 0, ar = e >= o ? sr[e - o] : 0;
    __syncthreads();
    st[e] += at;
    sr[e] += ar;
    __syncthreads();
  }
  if (e < experts) {
    tiles[e + 1] = st[e];
    first[e] = sr[e] - c;
  }
  if (e == 0) tiles[0] = 0;
}

// BM weight rows x BN tokens per CTA, 8 warps of WARPS_M x WARPS_N, STAGES chunks of 64 in flight;
// NVFP4 weights (codes and scales) or, with BF16_, BF16 weights.
template <int BM_, int BN_, int WARPS_M_, int STAGES_, bool BF16_>
struct Tile {
  static constexpr int BM = BM_, BN = BN_, WARPS_M = WARPS_M_, WARPS_N = 8 / WARPS_M_, STAGES = STAGES_;
  static constexpr bool kBf16 = BF16_;
  static constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;  // a warp's rows and tokens
  static constexpr int MT = WM / 16, NT = WN / 8;             // its m16 and n8 tiles
  // Shared memory per stage: codes [BM][32 B] and scales [BM][4 B] (NVFP4) or weights [BM][64
  // BF16 + 16 B] (BF16), then X [BN][64 BF16 + 16 B]. The padded rows of 144 B put the 16-byte
  // loads of lanes g and g + 1 in different banks.
  static constexpr int kRow = kBK * 2 + 16;
  static constexpr int kCodes = BF16_ ? BM * kRow : BM * kBK / 2, kScales = BF16_ ? 0 : BM * kBK / 16;
  static constexpr int kX = BN * kRow;
  static constexpr int kStage = kCodes + kScales + kX, kSmem = STAGES * kStage;
  static_assert(WARPS_M * WARPS_N == 8 && WM % 16 == 0 && WN % 8 == 0, "8 warps of m16 x n8 tiles");
  static_assert(kCodes % 16 == 0 && kScales % 16 == 0 && kStage % 16 == 0, "16-byte aligned regions");
  static_assert(STAGES >= 2, "a pipeline");
};
template <bool BF16>
using BigTile = Tile<128, 128, 4, 4, BF16>;   // warps of 32 rows x 64 tokens
template <bool BF16>
using SmallTile = Tile<256, 64, 8, 4, BF16>;  // the same per warp; no warp idle on small experts

// src_bytes 0 fills the 16 (or 4) bytes with zeros and reads nothing.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Chunk kc (kBK values) of rows 0..ROWS-1 of a row-major BF16 matrix K values wide into shared
// rows ROW_BYTES apart at `dst`; rows from `valid` on and values past K are zeros. The BF16
// experts' weights and the tokens' inputs both load this way.
template <int ROWS, int ROW_BYTES>
__device__ __forceinline__ void load_bf16_chunk(uint32_t dst, const uint16_t* src, int valid, int K, int kc) {
#pragma unroll
  for (int j = 0; j < (ROWS * 8 + kThreads - 1) / kThreads; ++j) {  // 8 x 16 B per row
    const int i = int(threadIdx.x) + j * kThreads;
    if (i < ROWS * 8) {
      const int r = i >> 3, col = kc * kBK + (i & 7) * 8;  // values; K is a multiple of 32
      const bool in = r < valid && col < K;
      cp_async16(dst + uint32_t(r * ROW_BYTES + (i & 7) * 16), in ? src + size_t(r) * size_t(K) + col : src,
                 in ? 16u : 0u);
    }
  }
}

// Codes k and k + 4 (k = 0..3) of an 8-code word as a BF16 pair, code k in the low half: each
// code's magnitude bits go to bits 6-8 (the top mantissa bit and the two low exponent bits) and
// its sign to bit 15, which makes code x 2^-126 exactly (0.5 as the subnormal 2^-127).
__device__ __forceinline__ uint32_t e2m1_pair_bf16(uint32_t c, int k) {
  const uint32_t mag = (k == 0 ? c << 6 : k == 1 ? c << 2 : k == 2 ? c >> 2 : c >> 6) & 0x01C001C0u;
  const uint32_t sgn = (c << (12 - 4 * k)) & 0x80008000u;
  return mag | sgn;
}

// An E4M3 block scale x 2^118 in both halves of a BF16 pair (exact, finite: at most 448 x 2^118).
__device__ __forceinline__ uint32_t scale_bf16x2(uint8_t s) {
  const __nv_bfloat162 h = __float2bfloat162_rn(e4m3_to_float(s) * 0x1p118f);
  uint32_t u;
  memcpy(&u, &h, 4);
  return u;
}

// (code x 2^-126) x (scale x 2^118) = code x scale x 2^-8, exact in BF16; the epilogue
// multiplies by scale2 x 2^8.
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One chunk of 64 weights from stage memory st: the warp's MT x NT tiles, 4 k-steps each. Lane
// (g, t), m-tile mt: rows ra = wm WM + 16 mt + g and rb = ra + 8 of the CTA's tile; codes c = 8
// bytes at [row][8t] (c.x weights 16t..16t+7, c.y 16t+8..16t+15), scale [row][t]. k-step s:
//   a0 = (ra: 16t+s, 16t+s+4), a1 = (rb: same), a2 = (ra: 16t+8+s, 16t+12+s), a3 = (rb: same).
// B: lane (g, t) holds token n = 8 nt + g of the warp, the same slots: b0 = X[n][16t+s, 16t+s+4],
// b1 = X[n][16t+8+s, 16t+12+s], which in the MMA order are the words 2s and 2s + 1 of the lane's
// 32 bytes of the row.
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
    if constexpr (C::kBf16) {
      // The lane's 16 weights 16t .. 16t+15 of each row as 8 words (pairs 2i, 2i+1); slots of
      // k-step s: (16t+s, 16t+s+4) from the halves s % 2 of words s/2 and s/2 + 2.
      const uint4* pa = reinterpret_cast<const uint4*>(sc + ra * C::kRow + t * 32);
      const uint4* pb = reinterpret_cast<const uint4*>(sc + rb * C::kRow + t * 32);
      const uint4 a0 = pa[0], a1 = pa[1], b0 = pb[0], b1 = pb[1];
      const uint32_t wa[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
      const uint32_t wb[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const uint32_t sel = s & 1 ? 0x7632u : 0x5410u;
        a[mt][s][0] = __byte_perm(wa[s / 2], wa[s / 2 + 2], sel);
        a[mt][s][1] = __byte_perm(wb[s / 2], wb[s / 2 + 2], sel);
        a[mt][s][2] = __byte_perm(wa[s / 2 + 4], wa[s / 2 + 6], sel);
        a[mt][s][3] = __byte_perm(wb[s / 2 + 4], wb[s / 2 + 6], sel);
      }
      continue;
    }
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
    if (wn * C::WN + nt * 8 >= rows) break;  // the warp's other tokens are past the expert's (uniform)
    const uint8_t* xr = sx + (wn * C::WN + nt * 8 + g) * C::kRow + t * 32;
    const uint4 lo = *reinterpret_cast<const uint4*>(xr);
    const uint4 hi = *reinterpret_cast<const uint4*>(xr + 16);
    const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
      for (int mt = 0; mt < C::MT; ++mt) mma_bf16(acc[mt][nt], a[mt][s], w[2 * s], w[2 * s + 1]);
  }
}

// CTA b takes tile b of the list (surplus CTAs leave at once): expert e, token tile nt, row tile
// mt (the row tiles of one token tile consecutive, so that concurrent CTAs share X's tile in the
// L2 and read each of the expert's weights about once). Row tiles run part by part: part p's
// rows are p * per_part .. (p + 1) * per_part - 1, the last of each part possibly partial.
template <class C>
__global__ void __launch_bounds__(kThreads, 1) moe_gemm_kernel(const Args a) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int tile = int(blockIdx.x);
  if (tile >= a.tiles[a.experts]) return;
  int lo = 0, hi = a.experts;  // tiles[lo] <= tile < tiles[hi]: expert lo has the tile
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (a.tiles[mid] <= tile) lo = mid;
    else hi = mid;
  }
  const int e = lo;
  const int per_part = (a.out + C::BM - 1) / C::BM, m_tiles = a.num_parts * per_part;
  const int local = tile - a.tiles[e];
  const int nt_idx = local / m_tiles, mt_idx = local - nt_idx * m_tiles;
  const int part = mt_idx / per_part;
  const int row0 = (mt_idx - part * per_part) * C::BM;  // of the part's `out` rows
  const int mrows = min(C::BM, a.out - row0);           // >= 1
  const int rows = min(C::BN, a.counts[e] - nt_idx * C::BN);  // tokens, >= 1
  const int tok_base = a.first[e] + nt_idx * C::BN;
  const DLinear& w = (part == 0 ? a.parts[0] : a.parts[1])[e];  // no dynamic index into the parameters (a local copy)
  const int K = a.in, KC = (K + kBK - 1) / kBK;
  const bool whole = K % kBK == 0;  // else the last chunk is half full and the scale rows 2-byte aligned
  const uint8_t* codes = C::kBf16 ? w.data : w.data + size_t(row0) * size_t(K / 2);
  const uint8_t* scales = C::kBf16 ? w.scales : w.scales + size_t(row0) * size_t(K / 16);
  const uint16_t* wrow = reinterpret_cast<const uint16_t*>(w.data) + size_t(row0) * size_t(K);  // BF16
  const float out_scale = C::kBf16 ? 1.0f : w.scale2 * 256.0f;  // NVFP4: undoes the 2^-8 of the A values
  const uint16_t* x = a.x + size_t(tok_base) * size_t(K);

  // Stage `stage` <- chunk kc; whatever lies past the tile's rows, tokens or K is zeros (zero
  // codes, scales and inputs: products of 0, never NaN).
  const uint32_t sbase = uint32_t(__cvta_generic_to_shared(smem));
  auto load = [&](int stage, int kc) {
    const uint32_t st = sbase + uint32_t(stage * C::kStage);
    if constexpr (C::kBf16) {
      load_bf16_chunk<C::BM, C::kRow>(st, wrow, mrows, K, kc);
    } else {
#pragma unroll
      for (int j = 0; j < (C::BM * 2 + kThreads - 1) / kThreads; ++j) {  // codes: 2 x 16 B per row
        const int i = int(threadIdx.x) + j * kThreads;
        if (i < C::BM * 2) {
          const int r = i >> 1, col = kc * 32 + (i & 1) * 16;  // bytes; K / 2 is a multiple of 16
          const bool in = r < mrows && col < K / 2;
          cp_async16(st + uint32_t(i * 16), in ? codes + size_t(r) * size_t(K / 2) + col : codes, in ? 16u : 0u);
        }
      }
#pragma unroll
      for (int j = 0; j < (C::BM + kThreads - 1) / kThreads; ++j) {  // scales: 4 B per row
        const int i = int(threadIdx.x) + j * kThreads;
        if (i < C::BM) {
          const uint8_t* row = scales + size_t(i) * size_t(K / 16);
          if (whole) {
            const bool in = i < mrows;
            cp_async4(st + uint32_t(C::kCodes + i * 4), in ? row + kc * 4 : scales, in ? 4u : 0u);
          } else {  // rows K / 16 = 2 mod 4 bytes apart: byte loads, stored before the barrier that precedes their use
            uint32_t v = 0;
            if (i < mrows)
              for (int b = 0; b < 4; ++b)
                if (kc * 4 + b < K / 16) v |= uint32_t(row[kc * 4 + b]) << (8 * b);
            *reinterpret_cast<uint32_t*>(smem + stage * C::kStage + C::kCodes + i * 4) = v;
          }
        }
      }
    }
    load_bf16_chunk<C::BN, C::kRow>(st + uint32_t(C::kCodes + C::kScales), x, rows, K, kc);  // the tokens
  };

  const int lane = int(threadIdx.x) & 31, warp = int(threadIdx.x) >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wm = warp % C::WARPS_M, wn = warp / C::WARPS_M;
  const bool busy = wn * C::WN < rows && wm * C::WM < mrows;  // the warp has tokens and rows (uniform)
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
  cp_async_wait<0>();  // no copy outlives the CTA (the groups left are empty)

  // C fragment: c0 c1 = row ra, tokens 2t, 2t+1; c2 c3 = row ra + 8, the same tokens.
  const size_t ldy = size_t(a.num_parts) * size_t(a.out);
  float* yb = a.y + size_t(tok_base) * ldy + size_t(part) * size_t(a.out) + row0;
#pragma unroll
  for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < C::NT; ++nt) {
      const int tok = wn * C::WN + nt * 8 + 2 * t, r = wm * C::WM + mt * 16 + g;
      float* p = yb + size_t(tok) * ldy + r;
      if (tok < rows) {
        if (r < mrows) p[0] = acc[mt][nt][0] * out_scale;
        if (r + 8 < mrows) p[8] = acc[mt][nt][2] * out_scale;
      }
      if (tok + 1 < rows) {
        if (r < mrows) p[ldy] = acc[mt][nt][1] * out_scale;
        if (r + 8 < mrows) p[ldy + 8] = acc[mt][nt][3] * out_scale;
      }
    }
}

// The tile list, then the GEMM over an upper bound of the tiles (the sum of ceil(c / BN) over
// the experts is at most ceil(rows / BN) + experts token tiles).
template <class C>
void launch_tiles(const Args& args, int rows, int32_t* scratch, cudaStream_t s) {
  const int m_tiles = args.num_parts * ((args.out + C::BM - 1) / C::BM);
  Args a = args;
  int32_t* tiles = scratch;
  int32_t* first = scratch + args.experts + 1;
  a.tiles = tiles, a.first = first;
  tile_list_kernel<<<1, unsigned((args.experts + 31) / 32 * 32), 0, s>>>(args.counts, args.experts, C::BN, m_tiles,
                                                                         tiles, first);
  KESTREL_CUDA_LAUNCHED();
  KESTREL_CUDA_CHECK(cudaFuncSetAttribute(moe_gemm_kernel<C>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem));
  const long long bound = (static_cast<long long>(rows + C::BN - 1) / C::BN + args.experts) * m_tiles;
  moe_gemm_kernel<C><<<unsigned(bound), kThreads, C::kSmem, s>>>(a);
  KESTREL_CUDA_LAUNCHED();
}

}  // namespace

void launch_moe_gemm(const MoeGemm& m, const __nv_bfloat16* x, int rows, const int32_t* counts, int32_t* scratch,
                     float* y, cudaStream_t s) {
  if (rows <= 0) return;
  if (m.experts < 1 || m.experts > 1024 || m.num_parts < 1 || m.num_parts > 2 || m.out < 1 || m.in < 32 ||
      m.in % 32 != 0 || (m.format != DFormat::NVFP4 && m.format != DFormat::BF16))
    fail("internal: a grouped expert GEMM of ", m.experts, " experts, ", m.num_parts, " parts of [", m.out, ", ",
         m.in, "]");
  Args a{};
  a.parts[0] = m.parts[0], a.parts[1] = m.num_parts > 1 ? m.parts[1] : m.parts[0];
  a.num_parts = m.num_parts, a.experts = m.experts, a.out = m.out, a.in = m.in;
  a.x = reinterpret_cast<const uint16_t*>(x);
  a.counts = counts;
  a.y = y;
  // The tile from the mean rows per expert (the lab's v2/v3 threshold): large experts fill
  // 128-token tiles; small ones take 256 rows x 64 tokens so that no warp idles on the tokens.
  const bool big = rows >= 96 * m.experts;
  if (m.format == DFormat::BF16) {
    if (big) launch_tiles<BigTile<true>>(a, rows, scratch, s);
    else launch_tiles<SmallTile<true>>(a, rows, scratch, s);
  } else {
    if (big) launch_tiles<BigTile<false>>(a, rows, scratch, s);
    else launch_tiles<SmallTile<false>>(a, rows, scratch, s);
  }
}

}  // namespace kestrel::cuda
