// The MoE layer in two stages after the router's logits. Gate/up: every block selects each
// token's experts itself (route_select.cuh, a warp per token: 128 logits, cheaper than a barrier)
// and numbers the batch's distinct experts in index order; the (distinct expert, row group) items
// and the shared expert's row groups are shared out over the grid, each row's weights read once
// for every token. Down: a warp per group of output rows sums every distinct expert's rows,
// weighted per token (0 for a token that did not choose it), and the shared expert's, into the
// residual. The selection stays in the block's shared memory from one stage to the next.
#pragma once
#include "backend/cuda/route_select.cuh"
#include "backend/cuda/stages/stage_rows.cuh"

namespace kestrel::cuda {

constexpr int kStageMaxSlots = 64;  // tokens x experts per token

// The selection in shared memory.
struct StageRoute {
  int n;                                  // distinct experts
  int expert[kStageMaxSlots];             // in index order
  float weight[kStageMaxSlots][8];        // [distinct expert][token], 0 where not chosen
  int32_t chosen[8][32];                  // per token: its experts
  float chosen_w[8][32];                  // and their weights
  float gscore[8][32];                    // select_experts' scratch per token
  int sel[8][32];
  uint32_t bits[16];                      // a bit per expert (up to 512)
};

// Floats of shared memory the selection needs beside StageRoute: each token's choice buffer.
inline int stage_route_floats(int batch_max, int experts) { return batch_max * experts; }

template <int B>
__device__ __noinline__ void stage_select(const SArgs& a, const DMoe& m, StageRoute& r, float* choice) {
  const int E = m.router.experts, K = m.router.top_k;
  for (int i = threadIdx.x; i < 16; i += blockDim.x) r.bits[i] = 0;
  for (int i = threadIdx.x; i < kStageMaxSlots * 8; i += blockDim.x) (&r.weight[0][0])[i] = 0.0f;
  __syncthreads();
  const int b = stage_warp();
  if (b < a.batch)
    select_experts<false>(m.router, a.rlogits + size_t(b) * E, choice + size_t(b) * E, r.gscore[b], r.sel[b],
                          r.chosen[b], r.chosen_w[b], stage_lane());
  __syncthreads();
  const int slots = a.batch * K, t = threadIdx.x;
  if (t < slots) atomicOr(&r.bits[r.chosen[t / K][t % K] >> 5], 1u << (r.chosen[t / K][t % K] & 31));
  __syncthreads();
  if (t < slots) {  // the expert's number among the distinct ones: the chosen bits below it
    const int e = r.chosen[t / K][t % K];
    int rank = __popc(r.bits[e >> 5] & ((1u << (e & 31)) - 1u));
    for (int w = 0; w < (e >> 5); ++w) rank += __popc(r.bits[w]);
    r.expert[rank] = e;
    r.weight[rank][t / K] = r.chosen_w[t / K][t % K];
  }
  if (t == 0) {
    int n = 0;
    for (int w = 0; w < (E + 31) / 32; ++w) n += __popc(r.bits[w]);
    r.n = n;
  }
  __syncthreads();
}

// xn: the normalized rows in shared memory (stage_norm).
template <int B>
__device__ __noinline__ void stage_expert_gate_up(const SArgs& a, const DMoe& m, const StageRoute& r, const float* xn) {
  constexpr int R = stage_rows<B>();
  const int H = a.hidden, W = m.width, per = (W + R - 1) / R;
  const int routed = r.n * per, shared = m.has_shared ? (m.shared_gate.out + R - 1) / R : 0;
  for_row_groups(routed + shared, [&](int g) {
    if (g < routed) {
      const int i = g / per, e = r.expert[i] - m.first_expert;
      if (e < 0 || e >= m.local_experts) return;  // another rank's expert
      stage_gated_rows<R, B>(m.gate[e], m.up[e], (g % per) * R, xn, H, a.batch, a.act + size_t(i) * B * W, W);
    } else {
      stage_gated_rows<R, B>(m.shared_gate, m.shared_up, (g - routed) * R, xn, H, a.batch, a.act_shared,
                             m.shared_gate.out);
    }
  });
}

// Down rows row0 .. row0 + R - 1 of every distinct expert, NVFP4 rows of whole 32-weight groups:
// the lanes take (expert, group) pairs first, first + step, ..., kU pairs' loads issued before
// the first is used, so a warp waits for one memory latency instead of one per expert.
template <int R, int B>
__device__ __forceinline__ void nvfp4_down_rows(const SArgs& a, const DMoe& m, const StageRoute& r, int row0,
                                                float (&sum)[R][B], int first, int step) {
  constexpr int kU = 3;
  const int W = m.width, groups = W / 32, pairs = r.n * groups;
  const uint64_t pol = weight_policy();
  for (int q0 = first + stage_lane(); q0 < pairs; q0 += step * kU) {
    uint4 c[kU][R];
    uint32_t sc[kU][R];
    float unscale[kU];
    const float* x[kU];
    float w[kU][B];
    #pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int q = q0 + step * u, i = min(q, pairs - 1) / groups, g = min(q, pairs - 1) % groups;
      const DLinear& D = m.down[r.expert[i] - m.first_expert];
      unscale[u] = kE2M1Unscale * D.scale2;
      x[u] = a.act + size_t(i) * B * W + 32 * g;
      #pragma unroll
      for (int b = 0; b < B; ++b) w[u][b] = q < pairs ? r.weight[i][b] : 0.0f;
      #pragma unroll
      for (int k = 0; k < R; ++k) {
        const int row = min(row0 + k, D.out - 1);
        c[u][k] = ld_weights(reinterpret_cast<const uint4*>(D.data + size_t(row) * (W / 2)) + g, pol);
        sc[u][k] = ld_weights(reinterpret_cast<const uint16_t*>(D.scales + size_t(row) * (W / 16)) + g, pol);
      }
    }
    #pragma unroll
    for (int u = 0; u < kU; ++u) {
      const NvRows mat[1] = {{nullptr, nullptr, unscale[u], 0}};
      float part[R][B];
      #pragma unroll
      for (int k = 0; k < R; ++k)
        #pragma unroll
        for (int b = 0; b < B; ++b) part[k][b] = 0.0f;
      nvfp4_group_fma<1, R, B>(mat, c[u], sc[u], x[u], W, part);
      #pragma unroll
      for (int k = 0; k < R; ++k)
        #pragma unroll
        for (int b = 0; b < B; ++b) sum[k][b] = fmaf(w[u][b], part[k][b], sum[k][b]);
    }
  }
}

// Block b takes its run of output row groups in rounds, ks warps on each (as stage_linear).
template <int B>
__device__ __noinline__ void stage_expert_down(const SArgs& a, const DMoe& m, const StageRoute& r, float* red) {
  constexpr int R = stage_rows<B>();
  const int H = a.hidden, W = m.width;
  // Every expert local (no expert parallelism here) and NVFP4 in whole groups: set at load.
  const bool grouped = m.slot_down_mma && W % 32 == 0 && m.local_experts == a.experts;
  const int groups = (H + R - 1) / R, per = (groups + int(gridDim.x) - 1) / int(gridDim.x);
  const int g0 = int(blockIdx.x) * per, n = max(0, min(groups, g0 + per) - g0);
  int ks = 1;
  while (ks < kStageWarps && n * ks * 2 <= kStageWarps && 64 * ks <= r.n * (W / 32)) ks *= 2;
  const int slots = kStageWarps / ks, w = stage_warp(), first = (w % ks) * 32, step = 32 * ks;
  for (int base = 0; base < n; base += slots) {
    const int row0 = (g0 + base + w / ks) * R;
    const bool live = base + w / ks < n;
    float sum[R][B];
    #pragma unroll
    for (int q = 0; q < R; ++q)
      #pragma unroll
      for (int b = 0; b < B; ++b) sum[q][b] = 0.0f;
    if (live && grouped) {
      nvfp4_down_rows<R, B>(a, m, r, row0, sum, first, step);
    } else if (live) {
      for (int i = 0; i < r.n; ++i) {
        const int e = r.expert[i] - m.first_expert;
        if (e < 0 || e >= m.local_experts) continue;
        float acc[R][B];
        #pragma unroll
        for (int q = 0; q < R; ++q)
          #pragma unroll
          for (int b = 0; b < B; ++b) acc[q][b] = 0.0f;
        rows_dot_partial<R, B>(m.down[e], row0, a.act + size_t(i) * B * W, W, stage_lane(), acc, first, step);
        #pragma unroll
        for (int q = 0; q < R; ++q)
          #pragma unroll
          for (int b = 0; b < B; ++b) sum[q][b] = fmaf(r.weight[i][b], acc[q][b], sum[q][b]);
      }
    }
    if (live && m.has_shared)
      rows_dot_partial<R, B>(m.shared_down, row0, a.act_shared, m.shared_gate.out, stage_lane(), sum, first, step);
    group_sum<R, B>(sum, red, ks);
    if (live && stage_lane() == 0 && w % ks == 0)
      #pragma unroll
      for (int q = 0; q < R; ++q)
        if (row0 + q < H)
          #pragma unroll
          for (int b = 0; b < B; ++b)
            if (b < a.batch) a.x[size_t(b) * H + row0 + q] += sum[q][b];
    if (ks > 1) __syncthreads();  // red is the next round's
  }
}

}  // namespace kestrel::cuda
