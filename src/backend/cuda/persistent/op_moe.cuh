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
  const StagedRows sg = stage_rows_packed(G, in.a, in.b, &at), su = stage_rows_packed(U, in.a, in.b, &at);
  const bool mma = mma_tile_fits(G, B) && mma_tile_fits(U, B) && G.in == U.in && at <= P.stage_bytes;
  if (threadIdx.x == 0) {
    if (mma) {
      stage_expect(bar, at);  // both matrices' rows
      copy_packed_rows(G, in.a, in.b, sg, stage, bar);
      copy_packed_rows(U, in.a, in.b, su, stage, bar);
    } else {
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

// The rows of the experts' down matrices come into the stage once the wait is over (the route
// has chosen them), a position's rows [a, b) at p * down_stage_bytes, when every position's fit
// there (few tokens); otherwise into the L2 and from there as they are read.
__device__ __forceinline__ uint32_t down_stage_bytes(const DLinear& W, int a, int b) {
  uint32_t at = 0;
  stage_rows_packed(W, a, b, &at);
  return at;
}

__device__ inline void expert_down(const PProgram& P, const PInstr& in, float* smem, uint8_t* stage, uint64_t* bar,
                                   uint32_t& parity) {
  const DMoe& m = layer_of(P, in.layer).moe;
  const int K = P.top_k, I = P.expert_rows, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  constexpr int warps = kPersistentThreads / 32, R = 4;
  // slot_down_mma: every expert's down is NVFP4 of the first's shape, so one expert's layout holds for all.
  const DLinear& D0 = m.down[0];
  const uint32_t per = down_stage_bytes(D0, in.a, in.b);
  const bool staged = m.slot_down_mma && packed_rows_fit(D0, in.a, in.b) &&
                      uint64_t(per) * uint64_t(P.positions) <= P.stage_bytes;
  if (staged && warp == 0) {
    uint32_t total = 0;
    for (int p = lane; p < P.positions; p += 32) total += P.position_expert[p] >= 0 ? per : 0u;
    total = __reduce_add_sync(0xffffffffu, total);
    if (lane == 0) stage_expect(bar, total);
    __syncwarp();
    for (int p = lane; p < P.positions; p += 32) {
      const int e = P.position_expert[p];
      if (e < 0) continue;
      const DLinear& W = m.down[e - m.first_expert];
      uint32_t at = uint32_t(p) * per;
      copy_packed_rows(W, in.a, in.b, stage_rows_packed(W, in.a, in.b, &at), stage, bar);
    }
  } else if (!staged) {
    for (int p = threadIdx.x; p < P.positions; p += blockDim.x) {
      const int e = P.position_expert[p];
      if (e >= 0) bulk_prefetch_rows(m.down[e - m.first_expert], in.a, in.b);
    }
  }
  const int J = K + (m.has_shared ? 1 : 0);  // products per row: the experts, then the shared experts
  float* part = smem;                        // [kDownRows][J]
  // The token's slots: their experts, weights and positions read once, a thread per slot (each
  // read from the L2 is a round trip on the tile's path), then in the experts' index order.
  __shared__ int slot_e[32], slot_p[32], order[32];  // top_k is at most 32
  __shared__ float slot_w[32];
  for (int b = 0; b < P.batch; ++b) {
    if (threadIdx.x < K) {
      const int e = P.route_e[b * K + threadIdx.x];
      slot_e[threadIdx.x] = e;
      slot_w[threadIdx.x] = P.route_w[b * K + threadIdx.x];
      slot_p[threadIdx.x] = P.expert_position[e];
    }
    __syncthreads();
    // A thread per slot counts the slots whose experts come first (the experts are distinct).
    if (threadIdx.x < K) {
      const int e = slot_e[threadIdx.x];
      int rank = 0;
      for (int j = 0; j < K; ++j) rank += slot_e[j] < e;
      order[rank] = threadIdx.x;
    }
    __syncthreads();
    trace_mark(P, 1);
    if (staged && b == 0) {
      mbar_wait(bar, parity);
      parity ^= 1u;
      trace_mark(P, 2);
    }
    for (int r0 = in.a; r0 < in.b; r0 += kDownRows) {
      const int n = min(kDownRows, in.b - r0), groups = (n + R - 1) / R;
      for (int it = warp; it < groups * J; it += warps) {
        const int j = it / groups, row = r0 + (it % groups) * R;
        float acc[R][1];
        #pragma unroll
        for (int r = 0; r < R; ++r) acc[r][0] = 0.0f;
        float w = 1.0f;
        if (j < K) {
          const int e = slot_e[order[j]], p = slot_p[order[j]];
          w = slot_w[order[j]];
          const float* mid = P.expert_mid + (size_t(b) * P.positions + p) * I;
          const DLinear& W = m.down[e - m.first_expert];
          if (staged) {
            uint32_t at = uint32_t(p) * per;
            rows_dot_partial<R, 1, true>(kestrel::cuda::staged(W, in.a, in.b, stage, stage_rows_packed(W, in.a, in.b, &at)),
                                         row, mid, I, lane, acc);
          } else {
            rows_dot_partial<R, 1, false>(W, row, mid, I, lane, acc);
          }
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
