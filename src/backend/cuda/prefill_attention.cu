// The GEMM prefill's causal attention on tensor cores (prefill_attention.h).
//
// A CTA takes 128 query rows of one KV head: 8 warps of 16 rows, each warp one query head at 16
// consecutive positions. Where query heads share the KV head (GQA), the CTA takes gh of them (the
// largest power of two up to 8 that divides nq / nkv) at 128 / gh positions: every K and V tile
// it loads serves 128 rows (half the L2 traffic per flop of a 64-row tile), and its warps'
// positions lie within 128 / gh of each other, so little of the tile at the diagonal is masked
// work. The CTA walks the KV tiles of 64 positions from 0 to its last row's position, K and V
// in shared memory as BF16 in two stages: a BF16 cache's next tile is copied with cp.async while
// the current one is used; a float32 cache's is loaded into registers and rounded to BF16 as it
// is stored, before the current tile's products (one wait on its loads per tile; BF16 caches,
// the default for GQA models, are the fast path).
// Rows are padded to hd x 2 + 16 bytes, so the 8 rows of an ldmatrix lie in different banks.
// Per tile, each warp: S = Q K^T (Q's fragments in registers, scaled by scale x log2(e) and
// rounded to BF16 once; K's from ldmatrix); on tiles that reach past its first row's
// position, the causal mask (-inf: weight exactly 0); the online softmax in float32 with exp2;
// P rounded to BF16 in registers, where it already is the A operand of O += P V (V's fragments
// from ldmatrix.trans). A warp skips the tiles past its last row's position. Rows are normalized at the end by the sum
// of their rounded weights and stored as BF16. Positions past the chunk's last are never read
// (their blocks may not exist): they are zeros in shared memory, so a masked weight meets a zero
// value, never NaN. CTAs run the last (longest) position tiles first.
// Registers (ptxas, sm_90a): 205 (BF16 cache) and 222 (float32) at hd 128, one CTA of 8 warps
// per SM; at most 128 at hd 64 and below, two CTAs per SM (__launch_bounds__); no spills.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 with BF16), lane = 4 g + t:
//   A (16 x 16, row): a0a1 row g, k 2t, 2t+1; a2a3 row g+8, same k; a4a5 row g, k 2t+8, 2t+9;
//                     a6a7 row g+8, same k.
//   B (16 x 8, col):  b0b1 k 2t, 2t+1, column g; b2b3 k 2t+8, 2t+9, column g.
//   C (16 x 8):       c0 c1 row g, columns 2t, 2t+1; c2 c3 row g+8, same columns.
// S = Q K^T: A = Q (rows x dims), B = K^T (dims x keys). K's rows in shared memory are [key][dim],
// B's "col" layout, so plain ldmatrix gives its fragments (matrix rows = keys: lane (g, t) gets
// key g, dims 2t, 2t+1). O += P V: the C fragments of S's n8 tiles 2s and 2s + 1, rounded to
// BF16 pairs, are the A fragment of k-step s (keys 16s .. 16s + 15): tile 2s's c0c1 = a0a1 and
// c2c3 = a2a3, tile 2s + 1's = a4 .. a7. B = V (keys x dims) is [key][dim] in shared memory, B's
// "row" layout, which ldmatrix.trans turns into its fragments (lane (g, t) gets keys 2t, 2t+1 of
// dim g).
#include <cstdint>
#include <cstring>

#include "backend/cuda/check.h"
#include "backend/cuda/kv_paged.cuh"
#include "backend/cuda/prefill_attention.h"

namespace kestrel::cuda {
namespace {

constexpr int kWarps = 8, kThreads = kWarps * 32;
constexpr int kRows = kWarps * 16;  // query rows (positions x heads) per CTA
constexpr int kKeys = 64;           // positions per KV tile
constexpr float kLog2e = 1.4426950408889634f;

template <int HD>
struct Shape {
  static constexpr int kRow = HD * 2 + 16;    // bytes of a K or V row in shared memory
  static constexpr int kTile = kKeys * kRow;  // one K or V tile
  static constexpr int kSmem = 4 * kTile;     // K and V, two stages
  static constexpr int KS = HD / 16;          // k-steps of Q K^T
  static constexpr int DT = HD / 8;           // n8 tiles of O
  static_assert(HD % 16 == 0 && DT % 2 == 0, "whole k-steps, pairs of n8 tiles");
};

struct Args {
  const float* q;
  int n, nq, pos;
  float qscale;  // scale x log2(e)
  KvLayer cache;
  __nv_bfloat16* out;
  int group;        // nq / nkv
  int gh, bm;       // query heads and positions per CTA: gh x bm = kRows
  int head_groups;  // nq / gh
  int tiles;        // position tiles: ceil(n / bm)
};

// src_bytes 0 fills the 16 bytes with zeros and reads nothing.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// (lo, hi) rounded to a BF16 pair, lo in the low half (the lower k or column).
__device__ __forceinline__ uint32_t bf16x2(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &h, 4);
  return u;
}
__device__ __forceinline__ float bf16_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t u) { return __uint_as_float(u & 0xFFFF0000u); }

// 2^x (MUFU; 2^-inf = +0).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Stage `stage` <- K and V of positions kt x 64 .. kt x 64 + 63 as BF16 (K's tile, then V's);
// those past `last` are zeros, their table entries never read. kb, vb: the KV head's values in
// the first row of the pool. Every chunk's row of the pool first (kv_offset's, as a 32-bit row
// index for the registers): the table loads issue together, and the value loads wait for them
// once.
template <int HD, class T>
__device__ __forceinline__ void load_tile(uint8_t* smem, uint32_t sbase, int stage, int kt, int last,
                                          const KvLayer& c, const T* kb, const T* vb) {
  using S = Shape<HD>;
  constexpr int kPerRow = HD * int(sizeof(T)) / 16, kChunks = kKeys * kPerRow;  // 16-byte chunks
  constexpr int kEach = (kChunks + kThreads - 1) / kThreads, kValues = 16 / int(sizeof(T));
  const int p0 = kt * kKeys;
  constexpr uint32_t kNone = ~0u;
  uint32_t row[kEach];  // the chunk's row of the pool; kNone: past `last` (or past the tile)
#pragma unroll
  for (int j = 0; j < kEach; ++j) {
    const int i = int(threadIdx.x) + j * kThreads, p = p0 + i / kPerRow;
    row[j] = i < kChunks && p <= last
                 ? uint32_t(__ldg(c.table + (p >> kKvBlockShift))) * kKvBlock + uint32_t(p & (kKvBlock - 1))
                 : kNone;
  }
  if constexpr (sizeof(T) == 2) {
    const uint32_t st = sbase + uint32_t(stage * 2 * S::kTile);
#pragma unroll
    for (int j = 0; j < kEach; ++j) {
      const int i = int(threadIdx.x) + j * kThreads, r = i / kPerRow, col = i % kPerRow;
      if (kChunks % kThreads != 0 && i >= kChunks) break;
      const bool ok = row[j] != kNone;
      const size_t at = ok ? size_t(row[j]) * size_t(c.row) + size_t(col) * kValues : 0;  // values from kb (vb)
      const uint32_t dst = st + uint32_t(r * S::kRow + col * 16);
      cp_async16(dst, kb + at, ok ? 16u : 0u);
      cp_async16(dst + S::kTile, vb + at, ok ? 16u : 0u);
    }
  } else {
    // Float32: every load of the tile first (one wait for all of them), then each 4 values as
    // 4 BF16 in one 8-byte store.
    static_assert(kChunks % kThreads == 0, "whole float4 chunks per thread");
    float4 kx[kEach], vx[kEach];
#pragma unroll
    for (int j = 0; j < kEach; ++j) {
      if (row[j] != kNone) {
        const int col = (int(threadIdx.x) + j * kThreads) % kPerRow;
        const size_t at = size_t(row[j]) * size_t(c.row) + size_t(col) * kValues;
        kx[j] = __ldg(reinterpret_cast<const float4*>(kb + at));
        vx[j] = __ldg(reinterpret_cast<const float4*>(vb + at));
      } else {
        kx[j] = vx[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    }
    uint8_t* st = smem + stage * 2 * S::kTile;
#pragma unroll
    for (int j = 0; j < kEach; ++j) {
      const int i = int(threadIdx.x) + j * kThreads, r = i / kPerRow, col = i % kPerRow;
      uint8_t* dst = st + r * S::kRow + col * 8;
      *reinterpret_cast<uint2*>(dst) = make_uint2(bf16x2(kx[j].x, kx[j].y), bf16x2(kx[j].z, kx[j].w));
      *reinterpret_cast<uint2*>(dst + S::kTile) = make_uint2(bf16x2(vx[j].x, vx[j].y), bf16x2(vx[j].z, vx[j].w));
    }
  }
}

template <int HD, class T>
__global__ void __launch_bounds__(kThreads, HD <= 64 ? 2 : 1) prefill_attention_kernel(const Args a) {
  using S = Shape<HD>;
  extern __shared__ __align__(128) uint8_t smem[];
  const int tile = a.tiles - 1 - int(blockIdx.x) / a.head_groups;  // the last (longest) tiles first
  const int head0 = int(blockIdx.x) % a.head_groups * a.gh;
  const int lane = int(threadIdx.x) & 31, warp = int(threadIdx.x) >> 5, g = lane >> 2, t = lane & 3;
  const int head = head0 + warp % a.gh;
  const int row0 = tile * a.bm + warp / a.gh * 16;  // the warp's first row
  const int last = a.pos + a.n - 1;                 // the last cached position
  const int first_pos = a.pos + row0;               // the warp's rows are positions first_pos + 0 .. 15
  // The warp's last row's position; -1 when all its rows are past the chunk (it only loads).
  const int last_pos = first_pos <= last ? min(first_pos + 15, last) : -1;
  const int kv_tiles = min(a.pos + tile * a.bm + a.bm - 1, last) / kKeys + 1;
  const KvLayer c = a.cache;
  const size_t kv_head = size_t(head0 / a.group) * HD;
  const T* kb = kv_rows<T>(c.k) + kv_head;
  const T* vb = kv_rows<T>(c.v) + kv_head;
  const uint32_t sbase = uint32_t(__cvta_generic_to_shared(smem));

  load_tile<HD, T>(smem, sbase, 0, 0, last, c, kb, vb);
  cp_async_commit();

  // Q's A fragments, scaled and rounded once; rows past the chunk are zeros (never stored).
  const int ra = row0 + g, rb = ra + 8;
  uint32_t qf[S::KS][4];
  {
    const float* qa = a.q + (size_t(min(ra, a.n - 1)) * a.nq + head) * HD + 2 * t;
    const float* qb = a.q + (size_t(min(rb, a.n - 1)) * a.nq + head) * HD + 2 * t;
    auto pair = [&](const float* p, bool ok) {
      const float2 v = ok ? *reinterpret_cast<const float2*>(p) : make_float2(0.0f, 0.0f);
      return bf16x2(v.x * a.qscale, v.y * a.qscale);
    };
#pragma unroll
    for (int kk = 0; kk < S::KS; ++kk) {
      qf[kk][0] = pair(qa + 16 * kk, ra < a.n);
      qf[kk][1] = pair(qb + 16 * kk, rb < a.n);
      qf[kk][2] = pair(qa + 16 * kk + 8, ra < a.n);
      qf[kk][3] = pair(qb + 16 * kk + 8, rb < a.n);
    }
  }

  // ldmatrix x4: lanes 8i .. 8i + 7 address the rows of matrix i. K: matrix i = keys + 8 (i / 2),
  // dims + 8 (i % 2): b0b1 and b2b3 of an n8 key tile, then of the next. V, transposed: matrix
  // i = keys + 8 (i % 2), dims + 8 (i / 2): b0b1 and b2b3 of an n8 dim tile, then of the next.
  const uint32_t k_lane = uint32_t(((lane >> 4) * 8 + (lane & 7)) * S::kRow + ((lane >> 3) & 1) * 16);
  const uint32_t v_lane = uint32_t((((lane >> 3) & 1) * 8 + (lane & 7)) * S::kRow + (lane >> 4) * 16);

  float o[S::DT][4];
#pragma unroll
  for (int d = 0; d < S::DT; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY};  // running max (log2 units) of rows g and g + 8
  float l[2] = {0.0f, 0.0f};            // running sum of the lane's rounded weights

  for (int kt = 0; kt < kv_tiles; ++kt) {
    cp_async_wait_all();  // this thread's copies of tile kt have landed
    __syncthreads();      // everyone's, and everyone is done with tile kt - 1's stage
    if (kt + 1 < kv_tiles) load_tile<HD, T>(smem, sbase, (kt + 1) & 1, kt + 1, last, c, kb, vb);
    cp_async_commit();
    const int key0 = kt * kKeys;
    if (key0 > last_pos) continue;  // every key of the tile is past the warp's rows (uniform)
    const uint32_t sk = sbase + uint32_t((kt & 1) * 2 * S::kTile), sv = sk + uint32_t(S::kTile);

    float s[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < S::KS; ++kk)
#pragma unroll
      for (int j = 0; j < 8; j += 2) {
        uint32_t b[4];
        ldmatrix_x4(sk + k_lane + uint32_t(j * 8 * S::kRow + kk * 32), b);
        mma_bf16(s[j], qf[kk], b[0], b[1]);
        mma_bf16(s[j + 1], qf[kk], b[2], b[3]);
      }
    if (key0 + kKeys - 1 > first_pos) {  // the tile reaches past some row's position
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (key0 + 8 * j + 2 * t + (e & 1) > first_pos + g + 8 * (e >> 1)) s[j][e] = -INFINITY;
    }

    // The online softmax: new maxima over the quad's lanes (a row's 64 scores), the old sums and
    // outputs rescaled to them. A row whose every score so far is masked keeps max -inf and
    // subtracts 0 instead (its weights are exactly 0; cannot happen past tile 0, whose key 0
    // every row sees, but costs nothing).
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      mx[0] = fmaxf(mx[0], fmaxf(s[j][0], s[j][1]));
      mx[1] = fmaxf(mx[1], fmaxf(s[j][2], s[j][3]));
    }
    float base[2], corr[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
      base[i] = mx[i] == -INFINITY ? 0.0f : mx[i];
      corr[i] = exp2_approx(m[i] - base[i]);
      m[i] = mx[i];
    }
    // P as BF16 A fragments of the 4 key k-steps; the sums are of the rounded weights, the ones
    // the product uses.
    uint32_t p[4][4];
    float sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t lo = bf16x2(exp2_approx(s[j][0] - base[0]), exp2_approx(s[j][1] - base[0]));
      const uint32_t hi = bf16x2(exp2_approx(s[j][2] - base[1]), exp2_approx(s[j][3] - base[1]));
      sum[0] += bf16_lo(lo) + bf16_hi(lo);
      sum[1] += bf16_lo(hi) + bf16_hi(hi);
      p[j / 2][(j & 1) * 2] = lo;
      p[j / 2][(j & 1) * 2 + 1] = hi;
    }
    l[0] = l[0] * corr[0] + sum[0];
    l[1] = l[1] * corr[1] + sum[1];
#pragma unroll
    for (int d = 0; d < S::DT; ++d) {
      o[d][0] *= corr[0], o[d][1] *= corr[0];
      o[d][2] *= corr[1], o[d][3] *= corr[1];
    }
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
#pragma unroll
      for (int d = 0; d < S::DT; d += 2) {
        uint32_t b[4];
        ldmatrix_x4_trans(sv + v_lane + uint32_t(ks * 16 * S::kRow + d * 16), b);
        mma_bf16(o[d], p[ks], b[0], b[1]);
        mma_bf16(o[d + 1], p[ks], b[2], b[3]);
      }
  }
  cp_async_wait_all();  // no copy outlives the CTA (the last group is empty)
  if (last_pos < 0) return;

  // Each row's sum over its quad, then its normalized values as BF16 pairs.
  float inv[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    inv[i] = 1.0f / l[i];
  }
  const size_t ld = size_t(a.nq) * HD;
  __nv_bfloat16* oa = a.out + size_t(ra) * ld + size_t(head) * HD + 2 * t;
  __nv_bfloat16* ob = oa + 8 * ld;
#pragma unroll
  for (int d = 0; d < S::DT; ++d) {
    if (ra < a.n) *reinterpret_cast<uint32_t*>(oa + 8 * d) = bf16x2(o[d][0] * inv[0], o[d][1] * inv[0]);
    if (rb < a.n) *reinterpret_cast<uint32_t*>(ob + 8 * d) = bf16x2(o[d][2] * inv[1], o[d][3] * inv[1]);
  }
}

template <int HD, class T>
void launch_hd(const Args& a, cudaStream_t s) {
  constexpr int smem = Shape<HD>::kSmem;
  auto* kernel = prefill_attention_kernel<HD, T>;
  if (smem > 48 * 1024)
    KESTREL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<unsigned(a.tiles * a.head_groups), kThreads, smem, s>>>(a);
  KESTREL_CUDA_LAUNCHED();
}

bool head_size_taken(int hd, KvType) { return hd == 16 || hd == 32 || hd == 64 || hd == 128; }  // either type

template <class T>
void launch_type(int hd, const Args& a, cudaStream_t s) {
  switch (hd) {
    case 16: return launch_hd<16, T>(a, s);
    case 32: return launch_hd<32, T>(a, s);
    case 64: return launch_hd<64, T>(a, s);
    case 128: return launch_hd<128, T>(a, s);
    default: fail("internal: prefill attention over heads of ", hd);
  }
}

}  // namespace

bool prefill_attention_takes(int hd, KvType type) { return head_size_taken(hd, type); }

void launch_prefill_attention(const float* q, int n, int nq, int nkv, int hd, float scale, int pos,
                              const KvLayer& cache, __nv_bfloat16* out, cudaStream_t s) {
  if (n < 1) return;
  if (!head_size_taken(hd, cache.type) || nkv < 1 || nq % nkv != 0 || pos < 0)
    fail("internal: prefill attention of ", nq, " query heads over ", nkv, " KV heads of ", hd, " at position ", pos);
  if (!cache.table || cache.table_stride != 0 || cache.row != nkv * hd)
    fail("internal: prefill attention over a KV cache of rows of ", cache.row, " values (table stride ",
         cache.table_stride, ") for ", nkv, " heads of ", hd);
  Args a{};
  a.q = q, a.n = n, a.nq = nq, a.pos = pos;
  a.qscale = scale * kLog2e;
  a.cache = cache;
  a.out = out;
  a.group = nq / nkv;
  a.gh = 1;
  while (a.gh < kWarps && a.group % (2 * a.gh) == 0) a.gh *= 2;
  a.bm = kRows / a.gh;
  a.head_groups = nq / a.gh;
  a.tiles = (n + a.bm - 1) / a.bm;
  if (cache.type == KvType::BF16) launch_type<__nv_bfloat16>(hd, a, s);
  else launch_type<float>(hd, a, s);
}

}  // namespace kestrel::cuda
