// The selection of one token's experts from its router logits by one warp, for every kernel
// that routes (route.cu's launches and the persistent step's route instruction).
#pragma once
#include <cfloat>
#include <cstdint>

#include "backend/cuda/route.h"

namespace kestrel::cuda {

// Largest value in v[0..n) (ties: lowest index) across one warp. Returns the index, always in
// range: NaN logits (a diverged model) must not turn into an expert id past the end.
__device__ inline int warp_argmax(const float* v, int n, int lane) {
  float best = -INFINITY;
  int idx = n;
  for (int i = lane; i < n; i += 32)
    if (v[i] > best || (v[i] == best && i < idx)) best = v[i], idx = i;
  for (int o = 16; o > 0; o >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
    if (ob > best || (ob == best && oi < idx)) best = ob, idx = oi;
  }
  return min(idx, n - 1);
}

// The k largest of v[0..n) (ties: lowest index first) into sel[0..k), by one warp, n <= 32 * P:
// each lane holds P of them as keys that order like the floats, and each round is two warp
// reductions (the largest key, then the lowest index holding it) instead of warp_argmax's ten
// shuffles. NaN sorts first, like the largest value; the index is always in range.
template <int P>
__device__ inline void warp_top_k(const float* v, int n, int k, int* sel, int lane) {
  uint32_t key[P];  // 0: taken, or past n (every float's key is above 0)
  #pragma unroll
  for (int i = 0; i < P; ++i) {
    const int e = i * 32 + lane;
    const uint32_t b = __float_as_uint(e < n ? v[e] + 0.0f : 0.0f);  // + 0: -0 ties with +0
    key[i] = e < n ? ((b & 0x80000000u) ? ~b : (b | 0x80000000u)) : 0u;
  }
  for (int j = 0; j < k; ++j) {
    uint32_t best = 0;
    uint32_t at = 0xffffffffu;
    #pragma unroll
    for (int i = 0; i < P; ++i)
      if (key[i] > best) best = key[i], at = uint32_t(i * 32 + lane);
    const uint32_t top = __reduce_max_sync(0xffffffffu, best);
    const uint32_t e = __reduce_min_sync(0xffffffffu, best == top ? at : 0xffffffffu);
    #pragma unroll
    for (int i = 0; i < P; ++i)
      if (uint32_t(i * 32 + lane) == e) key[i] = 0;
    if (lane == 0) sel[j] = int(min(e, uint32_t(n - 1)));
  }
  __syncwarp();
}

// Selects one token's experts from its router logits (one warp): softmax, or sigmoid plus the
// correction bias with group-limited choice; then top-k, renormalization and routed scaling.
// `logit`: in global memory, written by other blocks of this launch (read through L2), or in this
// block's shared memory (Shared). choice: E floats of shared memory; gscore, sel: 32 each.
template <bool Shared>
__device__ inline float logit_at(const float* logit, int e) {
  if constexpr (Shared) return logit[e];
  else return __ldcg(logit + e);
}

template <bool Shared>
__device__ inline void select_experts(const DRouter& r, const float* logit, float* choice, float* gscore, int* sel,
                               int32_t* __restrict__ out_e, float* __restrict__ out_w, int lane) {
  const int E = r.experts;
  float mx = 0.0f, inv = 0.0f;
  if (!r.sigmoid) {
    mx = -FLT_MAX;
    #pragma unroll 4
    for (int e = lane; e < E; e += 32) mx = fmaxf(mx, choice[e] = logit_at<Shared>(logit, e));
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.0f;
    for (int e = lane; e < E; e += 32) sum += (choice[e] = expf(choice[e] - mx));
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    inv = 1.0f / sum;
    for (int e = lane; e < E; e += 32) choice[e] *= inv;
  } else {
    #pragma unroll 4
    for (int e = lane; e < E; e += 32) choice[e] = 1.0f / (1.0f + expf(-logit_at<Shared>(logit, e))) + r.bias[e];
  }
  __syncwarp();
  if (r.sigmoid && r.n_group > 1) {
    const int per = E / r.n_group;
    if (lane < r.n_group) {  // a group's score: the sum of its two best choices
      float a = -FLT_MAX, c = -FLT_MAX;
      for (int i = 0; i < per; ++i) {
        const float v = choice[lane * per + i];
        if (v > a) c = a, a = v;
        else if (v > c) c = v;
      }
      gscore[lane] = a + c;
    }
    __syncwarp();
    for (int g = 0; g < r.topk_group; ++g) {
      const int best = warp_argmax(gscore, r.n_group, lane);
      __syncwarp();
      if (lane == 0) gscore[best] = -INFINITY, sel[g] = best;
      __syncwarp();
    }
    for (int e = lane; e < E; e += 32) {
      bool kept = false;
      for (int g = 0; g < r.topk_group; ++g) kept |= sel[g] == e / per;
      if (!kept) choice[e] = -INFINITY;
    }
    __syncwarp();
  }
  if (E <= 128) warp_top_k<4>(choice, E, r.top_k, sel, lane);
  else if (E <= 256) warp_top_k<8>(choice, E, r.top_k, sel, lane);
  else
    for (int j = 0; j < r.top_k; ++j) {
      const int best = warp_argmax(choice, E, lane);
      __syncwarp();
      if (lane == 0) choice[best] = -INFINITY, sel[j] = best;
      __syncwarp();
    }
  // The chosen experts' scores, recomputed from their logits with the expressions above (the same
  // bits: choice holds score + bias for sigmoid routers), summed in choice order.
  float w = 0.0f;
  if (lane < r.top_k) {
    const float l = logit_at<Shared>(logit, sel[lane]);
    w = r.sigmoid ? 1.0f / (1.0f + expf(-l)) : expf(l - mx) * inv;
  }
  float sum = 0.0f;
  for (int j = 0; j < r.top_k; ++j) sum += __shfl_sync(0xffffffffu, w, j);
  if (lane < r.top_k) {
    if (r.norm_topk) w /= r.sigmoid ? sum + 1e-20f : sum;
    out_e[lane] = sel[lane];
    out_w[lane] = w * r.scaling;
  }
}

}  // namespace kestrel::cuda
