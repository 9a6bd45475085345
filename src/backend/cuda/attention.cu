#include <cooperative_groups.h>

#include <algorithm>
#include <cfloat>

#include "backend/cuda/attention.h"
#include "backend/cuda/check.h"
#include "backend/cuda/kv_paged.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/reduce.cuh"
#include "backend/cuda/slot_mma.cuh"
#include "common/env.h"

namespace kestrel::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kMaxHd = 256;

// The head dimension that a lane holds as its value i of a vector: lane + 32 i, or over a BF16
// cache (two values or more per lane) pairs, 2 lane and 2 lane + 1, then 64 + 2 lane, ..., so
// that a warp's 4-byte loads read whole 128-byte lines of the cache. With 2-byte loads, two
// loads shared each line: BF16 steps were 20-40% slower than float32 ones at 8192 positions.
template <class T, int kPer>
__device__ __forceinline__ int lane_dim(int lane, int i) {
  if constexpr (sizeof(T) == 2 && kPer >= 2) return 64 * (i >> 1) + 2 * lane + (i & 1);
  else return lane + 32 * i;
}

// Split-K decode attention (flash-decoding), grouped by KV head: block (KV head and group of GH
// of its query heads, sequence, split) covers positions [split * chunk, (split + 1) * chunk) of
// that sequence and loads each key and value row once for its GH query heads (GQA: the
// cache is read once per group, not once per query head). The chunk comes from the sequence's
// own length (whole KV blocks, at least one), so a short sequence in a decoder sized for a long
// context still spreads over every split. Each of the W warps keeps an online softmax per head
// over its share and the block merges them. A warp takes kUnroll consecutive positions at a
// time, W * kUnroll apart between warps; in chunks of whole blocks they lie in one block of the
// paged cache, so one table entry serves them.
// Split (Fused = false): the block writes one partial (max, sum, weighted values) per head and
// split (empty splits too) for attention_combine_kernel. Fused: the splits are the blocks of one
// thread block cluster, which merge their partials through distributed shared memory and write
// the output themselves: no partials in global memory and no second launch.
// With prep (prep.k set): q is as projected; each block normalizes and rotates its own query
// heads, and the blocks whose chunk holds the new position do the same for the new key, attend
// to it from shared memory, and one of them per KV head stores it and its value to the cache.
// T: the type of the cache's values (KvType).
template <int kPer, int GH, int W, bool Fused, class T>
__global__ void __launch_bounds__(W * 32) attention_partial_kernel(const float* __restrict__ q, int nq, int nkv, int hd,
                                                                  float scale, const int32_t* __restrict__ positions,
                                                                  KvLayer cache, QkPrep prep, float* __restrict__ part,
                                                                  float* __restrict__ out, uint32_t* __restrict__ out_frag,
                                                                  int preload) {
  constexpr int kUnroll = kPer >= 8 ? 2 : 4;  // positions whose rows are loaded before the first is used
  static_assert(kKvBlock % kUnroll == 0, "a warp's positions lie in one KV block");
  constexpr int kRow = kPer * 32;  // floats per head vector in shared memory
  __shared__ float s_m[W][GH], s_l[W][GH];
  extern __shared__ float s_acc[];  // [W][GH][kRow]; Fused: [0][g] then holds the block's merged values
  const int groups = nq / nkv / GH, kvh = blockIdx.x / groups;
  const int h0 = kvh * (nq / nkv) + (blockIdx.x % groups) * GH;
  const int b = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // Positions change only between steps (the step's last kernel advances them), so the chunk is
  // known before the previous kernel ends.
  const int pos = positions[b], len = pos + 1;
  const int chunk = ((len + splits - 1) / splits + kKvBlock - 1) / kKvBlock * kKvBlock;
  const int begin = split * chunk, end = min(len, begin + chunk);
  const bool prepping = prep.k != nullptr, has_new = prepping && begin <= pos && pos < end;
  const int cached_end = has_new ? pos : end;  // positions read from the cache
  const T* kbase = kv_rows<T>(cache.k) + size_t(kvh) * hd;
  const T* vbase = kv_rows<T>(cache.v) + size_t(kvh) * hd;
  // The rows of positions p0 .. p0 + kUnroll - 1 (one KV block).
  constexpr bool kPairs = sizeof(T) == 2 && kPer >= 2;  // lane_dim
  auto load = [&](int p0, float (&kr)[kUnroll][kPer], float (&vr)[kUnroll][kPer]) {
    const size_t first = kv_offset(cache, b, p0);
    #pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const size_t row = first + size_t(u) * cache.row;
      #pragma unroll
      for (int i = 0; i < kPer; i += kPairs ? 2 : 1) {
        const int d = lane_dim<T, kPer>(lane, i);
        const bool ok = p0 + u < cached_end && d < hd;
        if constexpr (kPairs) {
          kv_load_pair(kbase, row + d, ok, kr[u][i], kr[u][i + 1]);
          kv_load_pair(vbase, row + d, ok, vr[u][i], vr[u][i + 1]);
        } else {
          kr[u][i] = kv_load(kbase, row + d, ok);
          vr[u][i] = kv_load(vbase, row + d, ok);
        }
      }
    }
  };
  int p0 = begin + warp * kUnroll;
  // With prep, every row read from the cache was written by an earlier step: the warp's first
  // rows load before the wait, behind the previous kernel. Not in the cluster kernel, whose
  // batches gained nothing from it and whose registers it spills (16 warps, at most 128 each).
  const bool early = !Fused && prepping && preload;
  float k0[kUnroll][kPer], v0[kUnroll][kPer];
  if (early && p0 < cached_end) load(p0, k0, v0);
  pdl_enter();
  __shared__ float s_new[GH + 2][kRow];  // prep: the block's queries, the new key, the new value
  if (prepping) {
    __shared__ float s_cos[kRow / 2], s_sin[kRow / 2];
    const int half = prep.rope.rotary_dim / 2;
    for (int j = threadIdx.x; j < half; j += W * 32) {
      const float f = float(pos) * prep.rope.inv_freq[j];
      s_cos[j] = cosf(f) * prep.rope.scaling;
      s_sin[j] = sinf(f) * prep.rope.scaling;
    }
    // Warp w normalizes vectors w, w + W, ...: the GH queries, then the new key.
    const int nv = GH + (has_new ? 1 : 0);
    for (int h = warp; h < nv; h += W) {
      const bool key = h == GH;
      const float* src = key ? prep.k + (size_t(b) * nkv + kvh) * hd : q + (size_t(b) * nq + h0 + h) * hd;
      const float* w = key ? prep.k_norm : prep.q_norm;
      float x[kPer], ss = 0.0f;
      #pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int d = lane + 32 * i;
        x[i] = d < hd ? src[d] : 0.0f;
        ss = fmaf(x[i], x[i], ss);
      }
      if (w) {
        const float inv = rsqrtf(warp_sum(ss) / float(hd) + prep.eps);
        #pragma unroll
        for (int i = 0; i < kPer; ++i) {
          const int d = lane + 32 * i;
          if (d < hd) x[i] = w[d] * (x[i] * inv);
        }
      }
      #pragma unroll
      for (int i = 0; i < kPer; ++i) s_new[h][lane + 32 * i] = x[i];
    }
    if (has_new)
      for (int d = threadIdx.x; d < hd; d += W * 32) s_new[GH + 1][d] = prep.v[(size_t(b) * nkv + kvh) * hd + d];
    __syncthreads();
    // The rotation: a thread turns whole pairs, so it alone reads and writes their elements.
    for (int t = threadIdx.x; t < nv * half; t += W * 32) {
      const int h = t / half, j = t % half;
      const int a = prep.rope.interleaved ? 2 * j : j, c = prep.rope.interleaved ? 2 * j + 1 : j + half;
      const float xa = s_new[h][a], xc = s_new[h][c];
      s_new[h][a] = xa * s_cos[j] - xc * s_sin[j];
      s_new[h][c] = xc * s_cos[j] + xa * s_sin[j];
    }
    __syncthreads();
    if (has_new) {
      // The new row as the cache holds it (BF16: rounded, as later steps read it), attended from
      // shared memory; the KV head's first block stores it.
      const bool store = blockIdx.x % groups == 0;
      const size_t at = store ? kv_offset(cache, b, pos) + size_t(kvh) * hd : 0;
      for (int d = threadIdx.x; d < hd; d += W * 32) {
        const T kc = kv_value<T>(s_new[GH][d]), vc = kv_value<T>(s_new[GH + 1][d]);
        s_new[GH][d] = kv_float(kc), s_new[GH + 1][d] = kv_float(vc);
        if (store) kv_rows<T>(cache.k)[at + d] = kc, kv_rows<T>(cache.v)[at + d] = vc;
      }
      __syncthreads();
    }
  }
  // Each lane keeps the running max and sum of one head (its `mine` below), the values of all.
  float qr[GH][kPer], acc[GH][kPer], m_run = -FLT_MAX, l_run = 0.0f;
  #pragma unroll
  for (int g = 0; g < GH; ++g) {
    const float* qv = q + (size_t(b) * nq + h0 + g) * hd;
    #pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int d = lane_dim<T, kPer>(lane, i);
      qr[g][i] = d < hd ? (prepping ? s_new[g][d] : qv[d]) * scale : 0.0f;
      acc[g][i] = 0.0f;
    }
  }
  // A round of kUnroll positions (the first `valid` of them) into the warp's online softmax of
  // each head. The kUnroll x GH scores are summed over the warp so that each lane ends with one
  // of them (warp_spread_sums), whose exponent it alone takes: per round two exponentials a
  // lane, not two per position and head, and N shuffles for the sums instead of about 2.5 N.
  // Lane `lane` holds score (head, position) = (mine / kUnroll, mine % kUnroll).
  constexpr int kN = kUnroll * GH, kShift = 5 - spread_bits(kN);
  static_assert(kN >= 2 && kN <= 32, "a round's scores fit the warp");
  const int mine = lane >> kShift;
  auto attend = [&](const float (&kr)[kUnroll][kPer], const float (&vr)[kUnroll][kPer], int valid) {
    float sc[kN];
    #pragma unroll
    for (int g = 0; g < GH; ++g)
      #pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float t = 0.0f;
        #pragma unroll
        for (int i = 0; i < kPer; ++i) t = fmaf(qr[g][i], kr[u][i], t);
        sc[g * kUnroll + u] = t;
      }
    const float total = warp_spread_sums<kN>(sc, lane);  // every lane: it shuffles
    const float x = (mine % kUnroll) < valid ? total : -FLT_MAX;
    // The head's max and sum over the round: the lanes of one head differ in the bits of u.
    float mx = x;
    #pragma unroll
    for (int o = 1; o < kUnroll; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o << kShift));
    const float mn = fmaxf(m_run, mx), corr = __expf(m_run - mn), p = __expf(x - mn);
    float ps = p;
    #pragma unroll
    for (int o = 1; o < kUnroll; o <<= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o << kShift);
    l_run = l_run * corr + ps;
    m_run = mn;
    #pragma unroll
    for (int g = 0; g < GH; ++g) {
      const float c = __shfl_sync(0xffffffffu, corr, (g * kUnroll) << kShift);
      #pragma unroll
      for (int i = 0; i < kPer; ++i) acc[g][i] *= c;
      #pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const float pu = __shfl_sync(0xffffffffu, p, (g * kUnroll + u) << kShift);
        #pragma unroll
        for (int i = 0; i < kPer; ++i) acc[g][i] = fmaf(pu, vr[u][i], acc[g][i]);
      }
    }
  };
  if (has_new && warp == W - 1) {  // the new position, from shared memory (the last warp has the fewest rows)
    float kn[kUnroll][kPer] = {}, vn[kUnroll][kPer] = {};
    #pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int d = lane_dim<T, kPer>(lane, i);
      kn[0][i] = s_new[GH][d], vn[0][i] = s_new[GH + 1][d];
    }
    attend(kn, vn, 1);
  }
  if (early) {
    if (p0 < cached_end) attend(k0, v0, min(kUnroll, cached_end - p0));
    p0 += W * kUnroll;
  }
  // The remaining rounds, each loaded into registers of its own iteration (carrying a round across
  // iterations made the 16-warp cluster kernel 3-5% slower per step at 8192 positions).
  for (; p0 < cached_end; p0 += W * kUnroll) {
    float kr[kUnroll][kPer], vr[kUnroll][kPer];
    load(p0, kr, vr);
    attend(kr, vr, min(kUnroll, cached_end - p0));
  }
  if (lane == ((mine / kUnroll) * kUnroll) << kShift)  // the first lane of its head
    s_m[warp][mine / kUnroll] = m_run, s_l[warp][mine / kUnroll] = l_run;
  #pragma unroll
  for (int g = 0; g < GH; ++g) {
    #pragma unroll
    for (int i = 0; i < kPer; ++i) s_acc[(warp * GH + g) * kRow + lane_dim<T, kPer>(lane, i)] = acc[g][i];
  }
  __syncthreads();
  // Warp w merges the warps' partials of heads w, w + W, ... (in Fused, into s_acc[0][g]: each
  // element is read by the one lane that then overwrites it).
  __shared__ float c_m[GH], c_l[GH];
  for (int g = warp; g < GH; g += W) {
    float M = -FLT_MAX;
    for (int w = 0; w < W; ++w) M = fmaxf(M, s_m[w][g]);
    float L = 0.0f;
    for (int w = 0; w < W; ++w) L += s_l[w][g] * __expf(s_m[w][g] - M);
    // Partial layout: [b][h][split][hd + 2] = weighted values, then max and sum.
    float* o = Fused ? s_acc + g * kRow : part + ((size_t(b) * nq + h0 + g) * splits + split) * (hd + 2);
    #pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int d = lane + 32 * i;
      if (d >= hd) continue;
      float t = 0.0f;
      for (int w = 0; w < W; ++w) t += s_acc[(w * GH + g) * kRow + d] * __expf(s_m[w][g] - M);
      o[d] = t;
    }
    if (lane == 0) {
      if constexpr (Fused) c_m[g] = M, c_l[g] = L;
      else o[hd] = M, o[hd + 1] = L;
    }
  }
  if constexpr (Fused) {
    cluster_sync();  // every block's merged values are in its shared memory
    // The cluster's GH x hd outputs, a contiguous share per block: each is the blocks' values
    // weighted by exp(max - overall max), over the blocks' sums weighted alike.
    namespace cg = cooperative_groups;
    const cg::cluster_group cl = cg::this_cluster();
    const int n = GH * hd, per = (n + splits - 1) / splits;
    for (int o = split * per + int(threadIdx.x); o < min(n, (split + 1) * per); o += W * 32) {
      const int g = o / hd, d = o % hd;
      float M = -FLT_MAX;
      for (int c = 0; c < splits; ++c) M = fmaxf(M, *cl.map_shared_rank(c_m + g, c));
      float L = 0.0f, t = 0.0f;
      for (int c = 0; c < splits; ++c) {
        const float w = __expf(*cl.map_shared_rank(c_m + g, c) - M);
        L = fmaf(*cl.map_shared_rank(c_l + g, c), w, L);
        t = fmaf(*cl.map_shared_rank(s_acc + g * kRow + d, c), w, t);
      }
      out[(size_t(b) * nq + h0 + g) * hd + d] = t / L;
      if (out_frag) frag_store(out_frag + size_t(b) * nq * hd, (h0 + g) * hd + d, t / L);
    }
    cluster_sync();  // no block leaves while another reads its shared memory
  }
}

constexpr int kMaxSplits = 64;  // attention_split never makes more
constexpr int kSplitsPerLane = kMaxSplits / 32, kCombineDims = 128;

constexpr int kEarly = 32;  // splits whose values a combine thread loads while the weights are made

// Block (head, sequence, 128 dimensions): the first warp turns the splits' maxima and sums into
// one weight per split while every thread already loads its dimension of the first kEarly
// splits; then each thread adds its dimension over the splits (usually one memory round trip).
__global__ void __launch_bounds__(kCombineDims) attention_combine_kernel(const float* __restrict__ part, int nq,
                                                                         int hd, int splits, float* __restrict__ out,
                                                                         uint32_t* __restrict__ out_frag) {
  __shared__ float weight[kMaxSplits];
  const int h = blockIdx.x, b = blockIdx.y, d = blockIdx.z * kCombineDims + threadIdx.x;
  pdl_enter();
  const float* p = part + (size_t(b) * nq + h) * splits * (hd + 2);
  float early[kEarly];
  #pragma unroll
  for (int s = 0; s < kEarly; ++s) early[s] = s < splits && d < hd ? p[s * (hd + 2) + d] : 0.0f;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    float m[kSplitsPerLane], l[kSplitsPerLane], M = -FLT_MAX;
    #pragma unroll
    for (int i = 0; i < kSplitsPerLane; ++i) {
      const int s = lane + 32 * i;
      m[i] = s < splits ? p[s * (hd + 2) + hd] : -FLT_MAX;
      l[i] = s < splits ? p[s * (hd + 2) + hd + 1] : 0.0f;
      M = fmaxf(M, m[i]);
    }
    for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    float L = 0.0f;
    #pragma unroll
    for (int i = 0; i < kSplitsPerLane; ++i) L += l[i] * __expf(m[i] - M);
    for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
    #pragma unroll
    for (int i = 0; i < kSplitsPerLane; ++i) {
      const int s = lane + 32 * i;
      if (s < splits) weight[s] = __expf(m[i] - M) / L;
    }
  }
  __syncthreads();
  float t = 0.0f;
  if (d < hd) {
    #pragma unroll
    for (int s = 0; s < kEarly; ++s)
      if (s < splits) t = fmaf(early[s], weight[s], t);
    #pragma unroll 8
    for (int s = kEarly; s < splits; ++s) t = fmaf(p[s * (hd + 2) + d], weight[s], t);
    out[(size_t(b) * nq + h) * hd + d] = t;
  }
  if (out_frag) {  // every fourth thread stores its and the next three's values (hd % 4 == 0)
    const float t1 = __shfl_down_sync(0xffffffffu, t, 1), t2 = __shfl_down_sync(0xffffffffu, t, 2),
                t3 = __shfl_down_sync(0xffffffffu, t, 3);
    if (d < hd && (threadIdx.x & 3) == 0) frag_store4(out_frag + size_t(b) * nq * hd, h * hd + d, make_float4(t, t1, t2, t3));
  }
}

}  // namespace

AttentionSplit attention_split(int max_context, int parallel) {
  int splits = std::min(kMaxSplits, std::max(1, (max_context + 63) / 64));
  if (parallel > 0) {
    // Enough blocks for two per SM, and no block longer than 256 positions (long prompts), but
    // no chunk shorter than a KV block.
    const int fill = (2 * sm_count() + parallel - 1) / parallel, length = (max_context + 255) / 256;
    const int most = std::min(kMaxSplits, (max_context + kKvBlock - 1) / kKvBlock);
    splits = std::max(1, std::min(most, std::max(fill, length)));
  }
  AttentionSplit s;
  // Chunks of whole blocks of the paged cache (kv_layer.h): a warp's positions share a table entry.
  s.chunk = ((max_context + splits - 1) / splits + kKvBlock - 1) / kKvBlock * kKvBlock;
  s.splits = std::max(1, (max_context + s.chunk - 1) / s.chunk);
  return s;
}

int attention_heads_per_block(int nq, int nkv, int hd, int batch) {
  // 8 heads a block only once the batch holds 2 x SMs query heads (head blocks of 8 >= SMs / 4):
  // with fewer the split grid holds too few warps (Qwen3-30B-A3B shapes, docs/PERF.md v18: 4 heads
  // -4.7% at batch 1, -3.6% at 4, even at 8; 8 ahead from 16).
  const int group = nq / nkv, most = hd > 128 || batch * nq < 2 * sm_count() ? 4 : 8;
  for (int gh = most; gh > 1; gh /= 2)
    if (group % gh == 0) return gh;
  return 1;
}

namespace {

// With prep, the partial kernels load their first rows before waiting on the previous kernel
// (KESTREL_ATT_PRELOAD=0: after, for A/B runs).
int attention_preload() {
  static const int v = env_switch("KESTREL_ATT_PRELOAD") ? 1 : 0;
  return v;
}

constexpr int kFusedWarps = 16;  // warps per block of the cluster path: its C blocks do the work of 4C splits

// What launch_decode_attention hands each partial kernel.
struct PartialArgs {
  const float* q;
  int batch, nq, nkv, hd;
  float scale;
  const int32_t* positions;
  KvLayer cache;
  QkPrep prep;
  float* scratch;
  float* out;
  uint32_t* out_frag;
};

template <int kPer, int GH, class T>
void launch_partial_gh(const PartialArgs& a, const AttentionSplit& split, cudaStream_t s) {
  const dim3 grid(unsigned(a.nq / GH), unsigned(a.batch), unsigned(split.cluster > 0 ? split.cluster : split.splits));
  if (split.cluster > 0) {
    auto* k = attention_partial_kernel<kPer, GH, kFusedWarps, true, T>;
    const size_t smem = size_t(kFusedWarps) * GH * kPer * 32 * sizeof(float);
    KESTREL_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    launch_cluster(k, grid, dim3(1, 1, grid.z), dim3(kFusedWarps * 32), smem, s, a.q, a.nq, a.nkv, a.hd, a.scale,
                   a.positions, a.cache, a.prep, nullptr, a.out, a.out_frag, attention_preload());
    return;
  }
  launch(attention_partial_kernel<kPer, GH, kWarps, false, T>, grid, dim3(kWarps * 32),
         size_t(kWarps) * GH * kPer * 32 * sizeof(float), s, a.q, a.nq, a.nkv, a.hd, a.scale, a.positions, a.cache,
         a.prep, a.scratch, nullptr, nullptr, attention_preload());
}

template <int kPer, class T>
void launch_partial(int gh, const PartialArgs& a, const AttentionSplit& split, cudaStream_t s) {
  switch (gh) {
    case 1: launch_partial_gh<kPer, 1, T>(a, split, s); break;
    case 2: launch_partial_gh<kPer, 2, T>(a, split, s); break;
    case 4: launch_partial_gh<kPer, 4, T>(a, split, s); break;
    default:
      if constexpr (kPer < 8) {
        launch_partial_gh<kPer, 8, T>(a, split, s);
      } else {
        fail("internal: ", gh, " query heads per attention block at head_dim ", a.hd);
      }
  }
}

template <class T>
void launch_partial_hd(int gh, const PartialArgs& a, const AttentionSplit& split, cudaStream_t s) {
  if (a.hd <= 32) launch_partial<1, T>(gh, a, split, s);
  else if (a.hd <= 64) launch_partial<2, T>(gh, a, split, s);
  else if (a.hd <= 128) launch_partial<4, T>(gh, a, split, s);
  else launch_partial<8, T>(gh, a, split, s);
}

}  // namespace

// Clusters of more blocks than this lose to the split path: with one head block per block of
// the cluster path, a wave of them holds fewer warps than the splits do (Qwen3-30B-A3B shapes,
// docs/PERF.md v18: batch 1 and 4 slower with clusters of 16 and 8; batch 16 and 32, clusters of 2
// and 1, 5% and 8% faster). KESTREL_ATT_CLUSTER=N sets it (0: the split path always; A/B runs).
int attention_cluster_most() {
  static const int v = std::max(0, std::min(16, env_int("KESTREL_ATT_CLUSTER", 2)));
  return v;
}

int attention_cluster(int head_blocks) {
  static const int most = [] {
    auto* k = attention_partial_kernel<4, 8, kFusedWarps, true, float>;
    const size_t smem = size_t(kFusedWarps) * 8 * 4 * 32 * sizeof(float);
    KESTREL_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    return max_cluster_blocks(k, dim3(kFusedWarps * 32), smem);
  }();
  if (most == 0 || head_blocks < 1 || head_blocks > sm_count()) return 0;
  int c = 1;
  while (2 * c <= std::min({most, 16, cluster_limit()}) && head_blocks * 2 * c <= sm_count()) c *= 2;
  return c <= attention_cluster_most() ? c : 0;
}

bool attention_takes_qk_step(const KvLayer& cache, int batch) {
  static const bool on = env_switch("KESTREL_ATT_QK");
  return on && (cache.table_stride != 0 || batch == 1);
}

int launch_decode_attention(const float* q, int batch, int nq, int nkv, int hd, float scale,
                            const int32_t* positions, KvLayer cache, const AttentionSplit& split, float* scratch,
                            float* out, cudaStream_t s, const QkPrep* prep, uint32_t* out_frag) {
  if (hd > kMaxHd) fail("CUDA decode attention supports head_dim up to ", kMaxHd, ", got ", hd);
  if (out_frag && ((nq * hd) % kFragChunk != 0 || hd % 4 != 0))
    fail("internal: fragment rows of ", nq, " heads of ", hd, " values");
  if (nkv < 1 || nq % nkv != 0) fail("internal: ", nq, " query heads over ", nkv, " KV heads");
  if (!cache.table || cache.row != nkv * hd)
    fail("internal: a KV cache of rows of ", cache.row, " values for ", nkv, " heads of ", hd);
  if (cache.type == KvType::BF16 && hd % 2 != 0)  // lane_dim's pairs
    fail("CUDA decode attention over a BF16 cache needs an even head_dim, got ", hd);
  if (split.cluster < 0 || split.cluster > 16 || (split.cluster & (split.cluster - 1)) != 0)
    fail("internal: attention clusters of ", split.cluster, " blocks");
  if (prep) {
    if (cache.table_stride == 0 && batch > 1)  // attention_takes_qk_step
      fail("internal: attention with the QK step inside takes rows of distinct sequences (a prefill's rows see "
           "each other's keys)");
    if (prep->rope.rotary_dim < 0 || prep->rope.rotary_dim > hd || prep->rope.rotary_dim % 2 != 0)
      fail("internal: a rotary dimension of ", prep->rope.rotary_dim, " in heads of ", hd);
  }
  const PartialArgs a{q, batch, nq, nkv, hd, scale, positions, cache, prep ? *prep : QkPrep{}, scratch, out, out_frag};
  const int gh = attention_heads_per_block(nq, nkv, hd, batch);
  if (cache.type == KvType::BF16) launch_partial_hd<__nv_bfloat16>(gh, a, split, s);
  else launch_partial_hd<float>(gh, a, split, s);
  KESTREL_CUDA_LAUNCHED();
  if (split.cluster > 0) return 1;
  launch_attention_combine(scratch, batch, nq, hd, split, out, s, out_frag);
  return 2;
}

void launch_attention_combine(const float* part, int batch, int nq, int hd, const AttentionSplit& split, float* out,
                              cudaStream_t s, uint32_t* out_frag) {
  if (split.splits > kMaxSplits) fail("internal: attention combine takes at most ", kMaxSplits, " splits");
  launch(attention_combine_kernel, dim3(unsigned(nq), unsigned(batch), unsigned((hd + kCombineDims - 1) / kCombineDims)),
         dim3(kCombineDims), 0, s, part, nq, hd, split.splits, out, out_frag);
  KESTREL_CUDA_LAUNCHED();
}

}  // namespace kestrel::cuda
