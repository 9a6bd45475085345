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
  int32_t chosen[8][32];                  // per token: its experts, then their weights
  float chosen_w[8][32];
  float gscore[8][32];
  int sel[8][32];
  uint32_t bits[16];                      // a bit per expert (up to 512)
};

// Floats of shared memory the selection needs beside StageRoute: each token's choice buffer.
inline int stage_route_floats(int batch_max, int experts) { return batch_max * experts; }

template <int B>
__device__ void stage_select(const SArgs& a, const DMoe& m, StageRoute& r, float* choice) {
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

// By one warp, once the route is known: this block's down rows of every distinct expert, and of
// the shared expert, into the L2 (as stage_expert_down shares the rows out).
template <int B>
__device__ __forceinline__ void prefetch_down(const DMoe& m, const StageRoute& r) {
  constexpr int R = stage_rows<B>();
  const int H = m.router.w.in, total = (H + R - 1) / R;
  for (int i = stage_lane(); i < r.n; i += 32) {
    const int e = r.expert[i] - m.first_expert;
    if (e >= 0 && e < m.local_experts) prefetch_row_share(m.down[e], 0, R, total);
  }
  if (m.has_shared && stage_lane() == 0) prefetch_row_share(m.shared_down, 0, R, total);
}

// xn: the normalized rows in shared memory (stage_norm).
template <int B>
__device__ void stage_expert_gate_up(const SArgs& a, const DMoe& m, const StageRoute& r, const float* xn) {
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

// One 32-weight group of an NVFP4 row (16 bytes of codes, two E4M3 scales) against B rows of x
// (x[b * ldx ...]), each token's dot product times w[b] added to acc[b].
template <int B>
__device__ __forceinline__ void nvfp4_group_dot(uint4 c, uint32_t sc, float unscale, const float* x, int ldx,
                                                const float (&w)[B], float (&acc)[B]) {
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t word = i == 0 ? c.x : i == 1 ? c.y : i == 2 ? c.z : c.w;
    const float s = e4m3_to_float(uint8_t(sc >> (8 * (i / 2)))) * unscale;
    float v[8];
    e2m1x8_scaled(word, v);
    #pragma unroll
    for (int b = 0; b < B; ++b) {
      const float4 x0 = *reinterpret_cast<const float4*>(x + size_t(b) * ldx + 8 * i);
      const float4 x1 = *reinterpret_cast<const float4*>(x + size_t(b) * ldx + 8 * i + 4);
      const float part = v[0] * x0.x + v[1] * x0.y + v[2] * x0.z + v[3] * x0.w + v[4] * x1.x + v[5] * x1.y +
                         v[6] * x1.z + v[7] * x1.w;
      acc[b] = fmaf(part * s, w[b], acc[b]);
    }
  }
}

// Down rows row0 .. row0 + R - 1 of every distinct expert, NVFP4 rows of whole 32-weight groups:
// the lanes take (expert, group) pairs, kU pairs' loads issued before the first is used, so a
// warp waits for one memory latency instead of one per expert.
template <int R, int B>
__device__ __forceinline__ void nvfp4_down_rows(const SArgs& a, const DMoe& m, const StageRoute& r, int row0,
                                                float (&sum)[R][B]) {
  constexpr int kU = 3;
  const int W = m.width, groups = W / 32, pairs = r.n * groups;
  for (int q0 = stage_lane(); q0 < pairs; q0 += 32 * kU) {
    uint4 c[kU][R];
    uint32_t sc[kU][R];
    float unscale[kU];
    const float* x[kU];
    float w[kU][B];
    #pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int q = q0 + 32 * u, i = min(q, pairs - 1) / groups, g = min(q, pairs - 1) % groups;
      const DLinear& D = m.down[r.expert[i] - m.first_expert];
      unscale[u] = kE2M1Unscale * D.scale2;
      x[u] = a.act + size_t(i) * B * W + 32 * g;
      #pragma unroll
      for (int b = 0; b < B; ++b) w[u][b] = q < pairs ? r.weight[i][b] : 0.0f;
      #pragma unroll
      for (int k = 0; k < R; ++k) {
        const int row = min(row0 + k, D.out - 1);
        c[u][k] = __ldg(reinterpret_cast<const uint4*>(D.data + size_t(row) * (W / 2)) + g);
        sc[u][k] = __ldg(reinterpret_cast<const uint16_t*>(D.scales + size_t(row) * (W / 16)) + g);
      }
    }
    #pragma unroll
    for (int u = 0; u < kU; ++u)
      #pragma unroll
      for (int k = 0; k < R; ++k) nvfp4_group_dot<B>(c[u][k], sc[u][k], unscale[u], x[u], W, w[u], sum[k]);
  }
}

template <int B>
__device__ void stage_expert_down(const SArgs& a, const DMoe& m, const StageRoute& r) {
  constexpr int R = stage_rows<B>();
  const int H = a.hidden, W = m.width;
  // Every expert local (no expert parallelism here) and NVFP4 in whole groups: set at load.
  const bool grouped = m.slot_down_mma && W % 32 == 0 && m.local_experts == a.experts;
  for_row_groups((H + R - 1) / R, [&](int g) {
    const int row0 = g * R;
    float sum[R][B];
    #pragma unroll
    for (int q = 0; q < R; ++q)
      #pragma unroll
      for (int b = 0; b < B; ++b) sum[q][b] = 0.0f;
    if (grouped) {
      nvfp4_down_rows<R, B>(a, m, r, row0, sum);
    } else {
      for (int i = 0; i < r.n; ++i) {
        const int e = r.expert[i] - m.first_expert;
        if (e < 0 || e >= m.local_experts) continue;
        float acc[R][B];
        #pragma unroll
        for (int q = 0; q < R; ++q)
          #pragma unroll
          for (int b = 0; b < B; ++b) acc[q][b] = 0.0f;
        rows_dot_partial<R, B>(m.down[e], row0, a.act + size_t(i) * B * W, W, stage_lane(), acc);
        #pragma unroll
        for (int q = 0; q < R; ++q)
          #pragma unroll
          for (int b = 0; b < B; ++b) sum[q][b] = fmaf(r.weight[i][b], acc[q][b], sum[q][b]);
      }
    }
    if (m.has_shared)
      rows_dot_partial<R, B>(m.shared_down, row0, a.act_shared, m.shared_gate.out, stage_lane(), sum);
    warp_sum<R, B>(sum);
    if (stage_lane() == 0)
      #pragma unroll
      for (int q = 0; q < R; ++q)
        if (row0 + q < H)
          #pragma unroll
          for (int b = 0; b < B; ++b)
            if (b < a.batch) a.x[size_t(b) * H + row0 + q] += sum[q][b];
  });
}

}  // namespace kestrel::cuda
