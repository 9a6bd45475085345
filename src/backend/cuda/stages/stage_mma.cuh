// The stage step's products on tensor cores: NVFP4 matrices whose K is whole 128-weight chunks,
// computed as slot_mma.cuh computes them for the launched kernels (mma.sync m16n8k16 on the codes
// dequantized to FP16, the activations as FP16 hi + lo fragment rows), so that a warp's 16-row
// tile serves all B <= 8 tokens at the cost of one: lane (g, j) passes token g's fragment row and
// column n of the product is token n. On CUDA cores every token costs its own FMAs (8 tokens 82 ms
// a step on an H100 where 1 takes 4.7; on tensor cores 17.3, docs/PERF.md v39); at one token the
// CUDA-core rows stay faster, so the stage step takes these from two tokens on.
//
// Inputs as fragment rows: the normalized rows in shared memory (stage_norm writes them beside
// the floats), attention's output in global memory (the combine writes them for o), the experts'
// activations in global memory (gate/up writes them for down). A block's tiles are a contiguous
// run, ks warps per tile splitting its chunks, their sums added in warp order.
#pragma once
#include "backend/cuda/slot_mma.cuh"
#include "backend/cuda/stages/stage_moe.cuh"

namespace kestrel::cuda {

// Floats of shared memory a block's tile sums take (16 warps x 32 lanes x 8).
constexpr int kStageMmaRedFloats = kStageWarps * 32 * 8;

// Chunk c of rows ra, rb of W for lane j, streamed evict-first (stage_rows.cuh).
__device__ __forceinline__ SlotChunk stage_chunk_load(const DLinear& W, int ra, int rb, int c, int j, uint64_t pol) {
  const int K = W.in;
  SlotChunk r;
  r.qa = ld_weights(reinterpret_cast<const uint4*>(W.data + size_t(ra) * (K / 2)) + 4 * c + j, pol);
  r.qb = ld_weights(reinterpret_cast<const uint4*>(W.data + size_t(rb) * (K / 2)) + 4 * c + j, pol);
  r.sa = ld_weights(reinterpret_cast<const uint16_t*>(W.scales + size_t(ra) * (K / 16)) + 4 * c + j, pol);
  r.sb = ld_weights(reinterpret_cast<const uint16_t*>(W.scales + size_t(rb) * (K / 16)) + 4 * c + j, pol);
  return r;
}

// acc[m] += rows ra, rb of the M matrices (same K) times the fragment row xr over chunks first,
// first + step, ... < chunks: U chunks' loads in flight before their MMAs. kWritten: xr is global
// memory written earlier in the step (slot_chunks_mma).
template <int M, bool kWritten>
__device__ __forceinline__ void stage_tile_mma(const DLinear* const (&W)[M], int ra, int rb, const uint32_t* xr,
                                               int first, int step, int chunks, float (&acc)[M][4]) {
  constexpr int U = M == 1 ? 4 : 2;
  const int j = stage_lane() & 3;
  const uint64_t pol = weight_policy();
  for (int c = first; c < chunks; c += U * step) {
    SlotChunk ch[U][M];
    #pragma unroll
    for (int u = 0; u < U; ++u)
      if (c + u * step < chunks)
        #pragma unroll
        for (int m = 0; m < M; ++m) ch[u][m] = stage_chunk_load(*W[m], ra, rb, c + u * step, j, pol);
    #pragma unroll
    for (int u = 0; u < U; ++u)
      if (c + u * step < chunks) slot_chunks_mma<M, kWritten>(ch[u], xr, c + u * step, j, acc);
  }
}

// Adds each tile's N partial sums over its ks warps (warp order) into the tile's first warp. Every
// warp of the block calls it (it meets at barriers).
template <int N>
__device__ __forceinline__ void stage_tile_sum(float (&acc)[N], float* red, int ks) {
  if (ks == 1) return;
  const int lane = stage_lane(), w = stage_warp();
  #pragma unroll
  for (int i = 0; i < N; ++i) red[(w * 32 + lane) * N + i] = acc[i];
  __syncthreads();
  if (w % ks == 0)
    for (int v = w + 1; v < w + ks; ++v)
      #pragma unroll
      for (int i = 0; i < N; ++i) acc[i] += red[(v * 32 + lane) * N + i];
  __syncthreads();  // red is the next round's
}

// Warps per tile for a block of n tiles of `chunks` chunks each: as many as keep the 16 busy,
// each taking two chunks or more.
__device__ __forceinline__ int stage_mma_split(int n, int chunks) {
  int ks = 1;
  while (ks < kStageWarps && n * ks * 2 <= kStageWarps && ks * 4 <= chunks) ks *= 2;
  return ks;
}

// Block b's run of T tiles: [g0, g0 + n).
__device__ __forceinline__ void stage_tile_run(int T, int& g0, int& n) {
  const int per = (T + int(gridDim.x) - 1) / int(gridDim.x);
  g0 = int(blockIdx.x) * per;
  n = max(0, min(T, g0 + per) - g0);
}

// Up to three matrices of the same K (q, k, v) whose tiles are shared out together; y[k]: the
// first output column of matrix k in rows of ldy floats.
struct StageMmaJobs {
  const DLinear* w[3];
  float* y[3];
  int n;
};

// y[b * ldy + row] = (accumulate ? y : 0) + W x[b] + bias for every row of every job, b < batch;
// xf: the batch's fragment rows of K words (kWritten: in global memory, written by this step).
template <bool kWritten>
__device__ __noinline__ void stage_linear_mma(const StageMmaJobs& jobs, const uint32_t* xf, int batch, int ldy,
                                              bool accumulate, float* red) {
  int tiles[3] = {0, 0, 0}, T = 0;
  for (int k = 0; k < jobs.n; ++k) tiles[k] = (jobs.w[k]->out + 15) / 16, T += tiles[k];
  const int K = jobs.w[0]->in, chunks = K / kFragChunk;
  int g0, n;
  stage_tile_run(T, g0, n);
  const int ks = stage_mma_split(n, chunks), slots = kStageWarps / ks, w = stage_warp(), g = stage_lane() >> 2;
  const uint32_t* xr = xf + size_t(min(g, batch - 1)) * K;
  for (int base = 0; base < n; base += slots) {
    const bool live = base + w / ks < n;
    int k = 0, t = g0 + base + w / ks;
    while (k + 1 < jobs.n && t >= tiles[k]) t -= tiles[k++];
    const DLinear& W = *jobs.w[k];
    const int r0 = t * 16, ra = min(r0 + g, W.out - 1), rb = min(r0 + g + 8, W.out - 1);
    float acc[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
    if (live) {
      const DLinear* one[1] = {&W};
      stage_tile_mma<1, kWritten>(one, ra, rb, xr, w % ks, ks, chunks, acc);
    }
    stage_tile_sum<4>(acc[0], red, ks);
    if (live && w % ks == 0) store_tile<1>(W, jobs.y[k], ldy, r0, stage_lane(), batch, acc, accumulate);
  }
}

// Gate/up of every distinct expert (and the shared expert) for the batch: silu(gate) * up as
// fragment rows, act_frag[(i * B + b) * width ...] for distinct expert i and token b (the shared
// expert's at shared_frag[b * its width ...]). Every token gets every chosen expert's rows: down
// weighs them by the route (0 where not chosen).
template <int B>
__device__ __noinline__ void stage_expert_gate_up_mma(const SArgs& a, const DMoe& m, const StageRoute& r,
                                                      const uint32_t* xf, float* red) {
  const int H = a.hidden, W = m.width, tw = (W + 15) / 16, chunks = H / kFragChunk;
  const int Ws = m.has_shared ? m.shared_gate.out : 0;
  const int routed = r.n * tw, T = routed + (Ws + 15) / 16;
  int g0, n;
  stage_tile_run(T, g0, n);
  const int ks = stage_mma_split(n, chunks), slots = kStageWarps / ks, w = stage_warp();
  const int g = stage_lane() >> 2, j = stage_lane() & 3;
  const uint32_t* xr = xf + size_t(min(g, a.batch - 1)) * H;
  uint32_t* act = reinterpret_cast<uint32_t*>(a.act);
  uint32_t* act_shared = reinterpret_cast<uint32_t*>(a.act_shared);
  for (int base = 0; base < n; base += slots) {
    const int t = g0 + base + w / ks;
    bool live = base + w / ks < n;
    const DLinear *G = &m.shared_gate, *U = &m.shared_up;
    uint32_t* dst = act_shared;
    int r0 = (t - routed) * 16, out = Ws;
    if (t < routed) {
      const int i = t / tw, e = r.expert[i] - m.first_expert;
      live = live && e >= 0 && e < m.local_experts;  // another rank's expert
      G = &m.gate[live ? e : 0], U = &m.up[live ? e : 0];
      dst = act + size_t(i) * B * W, r0 = (t % tw) * 16, out = W;
    }
    float acc[2][4] = {};
    if (live) {
      const DLinear* gu[2] = {G, U};
      stage_tile_mma<2, false>(gu, min(r0 + g, out - 1), min(r0 + g + 8, out - 1), xr, w % ks, ks, chunks, acc);
    }
    float v[8];
    #pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = acc[0][i], v[4 + i] = acc[1][i];
    stage_tile_sum<8>(v, red, ks);
    if (!live || w % ks != 0) continue;
    const float kg = mma_unscale(*G), ku = mma_unscale(*U);
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = r0 + g + 8 * h;
      if (row >= out) continue;
      const float bg = G->bias ? G->bias[row] : 0.0f, bu = U->bias ? U->bias[row] : 0.0f;
      #pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int b = 2 * j + e;
        if (b >= a.batch) continue;
        const float gv = v[2 * h + e] * kg + bg, uv = v[4 + 2 * h + e] * ku + bu;
        frag_store(dst + size_t(b) * out, row, gv / (1.0f + __expf(-gv)) * uv);
      }
    }
  }
}

// Down of every distinct expert and the shared expert into the residual: a block's 16-row tiles of
// the output one at a time, all 16 warps sharing out its (expert, chunk) pairs (the shared
// expert's chunks last), each pair's product weighted per token column by the route.
template <int B>
__device__ __noinline__ void stage_expert_down_mma(const SArgs& a, const DMoe& m, const StageRoute& r, float* red) {
  const int H = a.hidden, W = m.width, chunks = W / kFragChunk;
  const int Ws = m.has_shared ? m.shared_gate.out : 0, shared_chunks = Ws / kFragChunk;
  const int pairs = r.n * chunks + shared_chunks;
  int g0, n;
  stage_tile_run((H + 15) / 16, g0, n);
  const int w = stage_warp(), g = stage_lane() >> 2, j = stage_lane() & 3;
  const int bx = min(g, a.batch - 1);
  const uint32_t* act = reinterpret_cast<const uint32_t*>(a.act);
  const uint32_t* act_shared = reinterpret_cast<const uint32_t*>(a.act_shared);
  const uint64_t pol = weight_policy();
  for (int tile = g0; tile < g0 + n; ++tile) {
    const int r0 = tile * 16, ra = min(r0 + g, H - 1), rb = min(r0 + g + 8, H - 1);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    constexpr int U = 3;
    for (int p0 = w; p0 < pairs; p0 += U * kStageWarps) {
      SlotChunk ch[U];
      const DLinear* D[U];
      const uint32_t* xr[U];
      int c[U];
      float w0[U], w1[U];
      #pragma unroll
      for (int u = 0; u < U; ++u) {
        const int p = min(p0 + u * kStageWarps, pairs - 1);
        if (p < r.n * chunks) {
          const int i = p / chunks, e = r.expert[i] - m.first_expert;
          const bool mine = e >= 0 && e < m.local_experts;
          D[u] = &m.down[mine ? e : 0], c[u] = p % chunks;
          xr[u] = act + (size_t(i) * B + bx) * W;
          w0[u] = mine ? r.weight[i][2 * j] : 0.0f, w1[u] = mine ? r.weight[i][2 * j + 1] : 0.0f;
        } else {
          D[u] = &m.shared_down, c[u] = p - r.n * chunks;
          xr[u] = act_shared + size_t(bx) * Ws;
          w0[u] = 1.0f, w1[u] = 1.0f;
        }
        if (p0 + u * kStageWarps >= pairs) w0[u] = w1[u] = 0.0f;
        ch[u] = stage_chunk_load(*D[u], ra, rb, c[u], j, pol);
      }
      #pragma unroll
      for (int u = 0; u < U; ++u) {
        float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        slot_chunk_mma<true>(ch[u], xr[u], c[u], j, part);
        const float k = mma_unscale(*D[u]);
        acc[0] = fmaf(part[0] * k, w0[u], acc[0]), acc[1] = fmaf(part[1] * k, w1[u], acc[1]);
        acc[2] = fmaf(part[2] * k, w0[u], acc[2]), acc[3] = fmaf(part[3] * k, w1[u], acc[3]);
      }
    }
    stage_tile_sum<4>(acc, red, kStageWarps);
    if (w != 0) continue;
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = r0 + g + 8 * h;
      if (row >= H) continue;
      #pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int b = 2 * j + e;
        if (b < a.batch) a.x[size_t(b) * H + row] += acc[2 * h + e];
      }
    }
  }
}

}  // namespace kestrel::cuda
