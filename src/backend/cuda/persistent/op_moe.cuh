// The mixture-of-experts ops of the persistent step: the route (a warp per token selects its
// experts, then the batch's distinct experts in index order become the expert positions), one
// expert position's gate/up rows, and rows of the weighted sum of the experts' down products
// (experts in index order, then the shared experts, as cpu::moe_forward sums them).
#pragma once
#include "backend/cuda/persistent/op_rows.cuh"
#include "backend/cuda/route_select.cuh"

namespace kestrel::cuda {

// smem: per warp E choice floats, 32 group scores and 32 selections.
__device__ inline void route_tokens(const PProgram& P, const PInstr& in, float* smem) {
  const DRouter& r = P.layers[in.layer].moe.router;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x / 32, E = P.experts, K = P.top_k;
  float* choice = smem + size_t(warp) * (E + 64);
  float* gscore = choice + E;
  int* sel = reinterpret_cast<int*>(gscore + 32);
  for (int b = warp; b < P.batch; b += warps)
    select_experts<false>(r, P.router + size_t(b) * E, choice, gscore, sel, P.route_e + size_t(b) * K,
                          P.route_w + size_t(b) * K, lane);
  __syncthreads();
  // The distinct experts in index order, by one thread (at most experts x batch x top_k steps).
  if (threadIdx.x == 0) {
    int p = 0;
    for (int e = 0; e < E; ++e) {
      bool chosen = false;
      for (int i = 0; i < P.batch * K && !chosen; ++i) chosen = P.route_e[i] == e;
      P.expert_position[e] = chosen ? p : -1;
      if (chosen) P.position_expert[p++] = e;
    }
    for (; p < P.positions; ++p) P.position_expert[p] = -1;
  }
}

template <int B>
__device__ void expert_gate_up(const PProgram& P, const PInstr& in) {
  const int e = P.position_expert[in.c];
  if (e < 0) return;
  const DMoe& m = P.layers[in.layer].moe;
  float* xn = block_xn(P);
  norm_rows(P, P.layers[in.layer].ffn_norm, xn);
  const DLinear& G = m.gate[e - m.first_expert];
  const DLinear& U = m.up[e - m.first_expert];
  float* mid = P.expert_mid;
  const int I = P.expert_rows, Pn = P.positions, p = in.c;
  tile_gated_rows<B>(G, U, in.a, in.b, xn, P.hidden, P.batch,
                     [&](int row, int b, float v) { mid[(size_t(b) * Pn + p) * I + row] = v; });
}

template <int B>
__device__ void shared_gate_up(const PProgram& P, const PInstr& in) {
  const DMoe& m = P.layers[in.layer].moe;
  float* xn = block_xn(P);
  norm_rows(P, P.layers[in.layer].ffn_norm, xn);
  const int S = P.shared_rows;
  tile_gated_rows<B>(m.shared_gate, m.shared_up, in.a, in.b, xn, P.hidden, P.batch,
                     [&](int row, int b, float v) { P.shared_mid[size_t(b) * S + row] = v; });
}

// Rows [a, b) of x += sum over the token's experts (index order) of weight * down(mid) + shared
// down(shared mid). A warp owns its rows throughout, so it adds them up without a barrier.
__device__ inline void expert_down(const PProgram& P, const PInstr& in) {
  const DMoe& m = P.layers[in.layer].moe;
  const int K = P.top_k, I = P.expert_rows, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  constexpr int warps = kPersistentThreads / 32;
  for (int b = 0; b < P.batch; ++b) {
    // The token's experts in index order (top_k is at most 32).
    int order[32];
    for (int j = 0; j < K; ++j) order[j] = j;
    for (int j = 1; j < K; ++j)
      for (int i = j; i > 0 && P.route_e[b * K + order[i]] < P.route_e[b * K + order[i - 1]]; --i) {
        const int t = order[i];
        order[i] = order[i - 1];
        order[i - 1] = t;
      }
    for (int row = in.a + warp; row < in.b; row += warps) {
      float total = 0.0f;
      for (int j = 0; j < K; ++j) {
        const int e = P.route_e[b * K + order[j]];
        const float w = P.route_w[b * K + order[j]];
        const float* mid = P.expert_mid + (size_t(b) * P.positions + P.expert_position[e]) * I;
        float acc[1] = {0.0f};
        row_dot_partial<1>(m.down[e - m.first_expert], row, mid, I, lane, acc);
        for (int o = 16; o > 0; o >>= 1) acc[0] += __shfl_xor_sync(0xffffffffu, acc[0], o);
        total += w * acc[0];
      }
      if (m.has_shared) {
        float acc[1] = {0.0f};
        row_dot_partial<1>(m.shared_down, row, P.shared_mid + size_t(b) * P.shared_rows, P.shared_rows, lane, acc);
        for (int o = 16; o > 0; o >>= 1) acc[0] += __shfl_xor_sync(0xffffffffu, acc[0], o);
        total += acc[0];
      }
      if (lane == 0) P.x[size_t(b) * P.hidden + row] += total;
    }
  }
}

}  // namespace kestrel::cuda
