// The mixture-of-experts ops of the persistent step: the route (a warp per token selects its
// experts, then the batch's distinct experts in index order become the expert positions), one
// expert position's gate/up rows, and rows of the weighted sum of the experts' down products
// (experts in index order, then the shared experts, as cpu::moe_forward sums them).
#pragma once
#include "backend/cuda/persistent/op_rows.cuh"
#include "backend/cuda/persistent/weights.cuh"
#include "backend/cuda/route_select.cuh"

namespace kestrel::cuda {

// smem: per warp E choice floats, 32 group scores and 32 selections.
__device__ inline void route_tokens(const PProgram& P, const PInstr& in, float* smem) {
  const DRouter& r = layer_of(P, in.layer).moe.router;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x / 32, E = P.experts, K = P.top_k;
  float* choice = smem + size_t(warp) * (E + 64);
  float* gscore = choice + E;
  int* sel = reinterpret_cast<int*>(gscore + 32);
  for (int b = warp; b < P.batch; b += warps)
    select_experts<false>(r, P.router + size_t(b) * E, choice, gscore, sel, P.route_e + size_t(b) * K,
                          P.route_w + size_t(b) * K, lane);
  // The distinct experts in index order: a thread per expert looks for it among the batch's
  // choices, and a ballot per warp and a running base across passes of a block's threads number them.
  __shared__ int chosen[8 * 32];  // batch x top_k, at most 8 x 32
  __shared__ int warp_count[kPersistentThreads / 32];
  __shared__ int base;
  __syncthreads();  // the choices, for every thread
  trace_mark(P, 0);
  const int n = P.batch * K;
  for (int i = threadIdx.x; i < n; i += blockDim.x) chosen[i] = P.route_e[i];
  if (threadIdx.x == 0) base = 0;
  __syncthreads();
  for (int e0 = 0; e0 < E; e0 += blockDim.x) {
    const int e = e0 + int(threadIdx.x);
    bool mine = false;
    if (e < E)
      for (int i = 0; i < n && !mine; ++i) mine = chosen[i] == e;
    const unsigned votes = __ballot_sync(0xffffffffu, mine);
    if (lane == 0) warp_count[warp] = __popc(votes);
    __syncthreads();
    int at = base + __popc(votes & ((1u << lane) - 1u));
    for (int w = 0; w < warp; ++w) at += warp_count[w];
    if (e < E) {
      P.expert_position[e] = mine ? at : -1;
      if (mine) P.position_expert[at] = e;
    }
    __syncthreads();
    if (threadIdx.x == 0)
      for (int w = 0; w < warps; ++w) base += warp_count[w];
    __syncthreads();
  }
  for (int p = base + int(threadIdx.x); p < P.positions; p += blockDim.x) P.position_expert[p] = -1;
}

// One expert position's gate/up rows [a, b): the expert is known once the route ran, so its rows
// come after the wait, into the stage by bulk copies while the block normalizes (tensor cores),
// or where the tile does not fit the stage or the tensor-core tiles, from the L2 as they are read.
// bar/parity: the stage's barrier and the phase it completes next (the caller's, flipped here).
template <int B>
__device__ void expert_gate_up(const PProgram& P, const PInstr& in, uint8_t* stage, uint64_t* bar, uint32_t& parity) {
  const int e = P.position_expert[in.c];
  if (e < 0) return;
  const DMoe& m = layer_of(P, in.layer).moe;
  const DLinear& G = m.gate[e - m.first_expert];
  const DLinear& U = m.up[e - m.first_expert];
  uint32_t at = 0;
  const StagedRows sg = stage_rows(G, in.a, in.b, &at, B), su = stage_rows(U, in.a, in.b, &at, B);
  const bool mma = mma_tile_fits(G, B) && mma_tile_fits(U, B) && G.in == U.in && at <= P.stage_bytes;
  if (threadIdx.x < 32) {
    if (mma) {
      const uint32_t bytes = 2u * uint32_t(in.b - in.a) * uint32_t(G.in / 2 + G.in / 16);  // copied: the rows, not the padding
      stage_matrix(G, in.a, in.b, sg, stage, bar, bytes, threadIdx.x);
      stage_matrix(U, in.a, in.b, su, stage, bar, 0, threadIdx.x);
    } else if (threadIdx.x == 0) {
      bulk_prefetch_rows(G, in.a, in.b);
      bulk_prefetch_rows(U, in.a, in.b);
    }
  }
  float* xn = block_xn(P);
  norm_rows(P, layer_of(P, in.layer).ffn_norm, ffn_norm_point(in.layer), xn);
  trace_mark(P, 0);
  float* mid = P.expert_mid;
  const int I = P.expert_rows, Pn = P.positions, p = in.c;
  const RowsOut out{mid + size_t(p) * I, int64_t(Pn) * I, 0};
  if (mma) {
    mbar_wait(bar, parity);
    parity ^= 1u;
    trace_mark(P, 2);
    const DLinear w[2] = {G, U};
    const StagedRows st[2] = {sg, su};
    mma_rows<2, B>(w, st, stage, in.a, in.b, xn, P.hidden, P.batch, block_frag(P), persistent_smem, out);
  } else {
    tile_gated_rows<B, false>(G, U, in.a, in.b, xn, P.hidden, P.batch, out);
  }
  trace_mark(P, 1);
}

template <int B>
__device__ void shared_gate_up(const PProgram& P, const PInstr& in, const uint8_t* stage) {
  const DMoe& m = layer_of(P, in.layer).moe;
  float* xn = block_xn(P);
  norm_rows(P, layer_of(P, in.layer).ffn_norm, ffn_norm_point(in.layer), xn);
  const int S = P.shared_rows;
  uint32_t at = 0;
  product_gated_rows<B>(P, m.shared_gate, m.shared_up, in.a, in.b, xn, P.hidden, stage, &at, RowsOut{P.shared_mid, S, 0});
}

// Rows [a, b) of x += sum over the token's experts (index order) of weight * down(mid) + shared
// down(shared mid). The warps take (expert, 4 rows) items, so each lane has 4 rows' loads in
// flight and the experts' rows load side by side; the products meet in shared memory, where a
// thread per row adds them in the CPU's order. smem: kDownRows x (top_k + 1) floats.
constexpr int kDownRows = 64;

__device__ inline void expert_down(const PProgram& P, const PInstr& in, float* smem) {
  const DMoe& m = layer_of(P, in.layer).moe;
  const int K = P.top_k, I = P.expert_rows, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  constexpr int warps = kPersistentThreads / 32, R = 4;
  for (int p = threadIdx.x; p < P.positions; p += blockDim.x) {
    const int e = P.position_expert[p];
    if (e >= 0) bulk_prefetch_rows(m.down[e - m.first_expert], in.a, in.b);
  }
  const int J = K + (m.has_shared ? 1 : 0);  // products per row: the experts, then the shared experts
  float* part = smem;                        // [kDownRows][J]
  __shared__ int order[32];  // the token's slots with their experts in index order (top_k is at most 32)
  for (int b = 0; b < P.batch; ++b) {
    // A thread per slot counts the slots whose experts come first (the experts are distinct): a
    // sort in registers, not in a thread's local memory, where each step was an L2 round trip.
    if (threadIdx.x < K) {
      const int e = P.route_e[b * K + threadIdx.x];
      int rank = 0;
      for (int j = 0; j < K; ++j) rank += P.route_e[b * K + j] < e;
      order[rank] = threadIdx.x;
    }
    __syncthreads();
    for (int r0 = in.a; r0 < in.b; r0 += kDownRows) {
      const int n = min(kDownRows, in.b - r0), groups = (n + R - 1) / R;
      for (int it = warp; it < groups * J; it += warps) {
        const int j = it / groups, row = r0 + (it % groups) * R;
        float acc[R][1];
        #pragma unroll
        for (int r = 0; r < R; ++r) acc[r][0] = 0.0f;
        float w = 1.0f;
        if (j < K) {
          const int e = P.route_e[b * K + order[j]];
          w = P.route_w[b * K + order[j]];
          rows_dot_partial<R, 1, false>(m.down[e - m.first_expert], row,
                                        P.expert_mid + (size_t(b) * P.positions + P.expert_position[e]) * I, I, lane, acc);
        } else {
          rows_dot_partial<R, 1, false>(m.shared_down, row, P.shared_mid + size_t(b) * P.shared_rows, P.shared_rows, lane, acc);
        }
        warp_sum<R, 1>(acc);
        if (lane == 0)
          #pragma unroll
          for (int r = 0; r < R; ++r)
            if (row + r < r0 + n) part[(row + r - r0) * J + j] = j < K ? w * acc[r][0] : acc[r][0];
      }
      __syncthreads();
      trace_mark(P, 0);
      for (int r = threadIdx.x; r < n; r += blockDim.x) {
        float total = 0.0f;
        for (int j = 0; j < J; ++j) total += part[r * J + j];
        P.x[size_t(b) * P.hidden + r0 + r] += total;
      }
      __syncthreads();  // part is rewritten next
    }
  }
}

}  // namespace kestrel::cuda
