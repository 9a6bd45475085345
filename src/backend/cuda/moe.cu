#include <algorithm>
#include <cmath>

#include "backend/cuda/check.h"
#include "backend/cuda/dequant.cuh"
#include "backend/cuda/gemv.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/mma_tiles.cuh"
#include "backend/cuda/moe.h"
#include "backend/cuda/slot_mma.cuh"
#include "common/env.h"

namespace kestrel::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kGateUpRows = 4;  // gate rows (and as many up rows) per warp in gate_up_kernel
constexpr int kDownRows = 4;    // rows per warp in down_kernel (8 spills registers)

// Before the wait, block (0, 0) of the per-slot gate/up kernels puts the expert descriptors into
// L2 while the router runs: every block reads two after it.
__device__ __forceinline__ void prefetch_expert_descriptors(const DMoe& m) {
  if (blockIdx.x == 0 && blockIdx.y == 0) {
    prefetch_bytes_l2(m.gate, size_t(m.local_experts) * sizeof(DLinear));
    prefetch_bytes_l2(m.up, size_t(m.local_experts) * sizeof(DLinear));
    prefetch_bytes_l2(m.down, size_t(m.local_experts) * sizeof(DLinear));
  }
}

// Grid: (rows / kWarps, slots). Slot s < batch*top_k is token s / top_k's j-th expert; the
// slots after those are the shared expert of each token. Frag: act receives fragment rows
// (slot_mma.cuh) for down_mma_kernel instead of floats.
template <bool Frag>
__global__ void __launch_bounds__(kWarps * 32, 3) gate_up_kernel(DMoe m, int batch, const float* __restrict__ x,
                                                              const int32_t* __restrict__ experts, float* __restrict__ act,
                                                              int act_stride) {
  constexpr int R = kGateUpRows;
  __shared__ float red[kWarps * R];
  prefetch_expert_descriptors(m);
  pdl_enter();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int s = blockIdx.y, K = m.router.top_k;
  const bool shared = s >= batch * K;
  const int b = shared ? s - batch * K : s / K;
  const int e = shared ? 0 : experts[s] - m.first_expert;
  if (!shared && (e < 0 || e >= m.local_experts)) return;  // another rank's expert (expert parallelism)
  const DLinear g = shared ? m.shared_gate : m.gate[e];
  const DLinear u = shared ? m.shared_up : m.up[e];
  const int ks = warps_per_row(g);
  const int row0 = (blockIdx.x * (kWarps / ks) + warp / ks) * R;
  if (blockIdx.x * (kWarps / ks) * R >= g.out) return;  // the whole block is past this slot's rows
  const float* xb = x + size_t(b) * g.in;
  float gv[R][1], uv[R][1];
  #pragma unroll
  for (int r = 0; r < R; ++r) gv[r][0] = uv[r][0] = 0.0f;
  if (row0 < g.out) gated_rows_dot_partial<R, 1>(g, u, row0, xb, g.in, lane, gv, uv, (warp % ks) * 32, ks * 32);
  group_sum<R, 1>(gv, red, ks);
  __syncthreads();
  group_sum<R, 1>(uv, red, ks);
  if (warp % ks == 0) {
    // Lane r < R stores row row0 + r (the sums are valid in lane 0).
    float v = 0.0f;
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      const float y = __shfl_sync(0xffffffffu, gv[r][0] / (1.0f + __expf(-gv[r][0])) * uv[r][0], 0);
      if (lane == r) v = y;
    }
    if (lane < R && row0 + lane < g.out) {
      if (Frag) frag_store(reinterpret_cast<uint32_t*>(act) + size_t(s) * act_stride, row0 + lane, v);
      else act[size_t(s) * act_stride + row0 + lane] = v;
    }
  }
}

// One block per (output element, token): warp w takes the token's slots w, w + kWarps, ...
// (the shared expert is the last slot) and the partial sums are added in slot order, so the
// result does not depend on scheduling.
__global__ void __launch_bounds__(kWarps * 32, 3) down_kernel(DMoe m, int batch, const int32_t* __restrict__ experts,
                                                           const float* __restrict__ weights, const float* __restrict__ act,
                                                           int act_stride, float* __restrict__ residual) {
  constexpr int R = kDownRows;
  __shared__ float part[kWarps][R];
  pdl_enter();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row0 = blockIdx.x * R, b = blockIdx.y, K = m.router.top_k;
  const int hidden = m.router.w.in, slots = K + (m.has_shared ? 1 : 0);
  float total[R][1];
  #pragma unroll
  for (int r = 0; r < R; ++r) total[r][0] = 0.0f;
  for (int j = warp; j < slots; j += kWarps) {
    float acc[R][1];
    #pragma unroll
    for (int r = 0; r < R; ++r) acc[r][0] = 0.0f;
    if (j < K) {
      const int s = b * K + j, e = experts[s] - m.first_expert;
      if (e < 0 || e >= m.local_experts) continue;  // another rank's expert
      rows_dot_partial<R, 1>(m.down[e], row0, act + size_t(s) * act_stride, 0, lane, acc);
      #pragma unroll
      for (int r = 0; r < R; ++r) total[r][0] = fmaf(weights[s], acc[r][0], total[r][0]);
    } else {
      rows_dot_partial<R, 1>(m.shared_down, row0, act + size_t(batch * K + b) * act_stride, 0, lane, acc);
      #pragma unroll
      for (int r = 0; r < R; ++r) total[r][0] += acc[r][0];
    }
  }
  warp_sum<R, 1>(total);
  if (lane == 0)
    #pragma unroll
    for (int r = 0; r < R; ++r) part[warp][r] = total[r][0];
  __syncthreads();
  if (threadIdx.x < R && row0 + int(threadIdx.x) < hidden) {
    float sum = 0.0f;
    for (int w = 0; w < kWarps; ++w) sum += part[w][threadIdx.x];
    residual[size_t(b) * hidden + row0 + threadIdx.x] += sum;
  }
}

// ---- The per-slot down kernel on tensor cores (one token, NVFP4 down matrices; slot_mma.cuh) ----

constexpr int kSlotDownWarps = 16;  // warps per block, sharing one 16-row tile

// Grid: (16-row tiles of hidden, tokens); act holds fragment rows (gate_up_kernel<true>). The
// block's warps take token b's (slot, K part) tasks in turn, a task being one slot's down rows of
// the tile over one part of its chunks, the parts sized so that a part is one round of loads (the
// routed experts': a wider shared expert takes a few rounds); each warp sums its tasks x routing
// weight, and the warps' sums are added in warp order, so the result does not depend on scheduling.
// One block per SM (over 100 registers): 16 warps with 128 bytes of loads each in flight.
// Early: each warp's first round of weights loads before the wait on gate/up. Neither the routing
// (written two kernels back, so complete once gate/up's blocks have passed their own wait) nor the
// weights depend on gate/up, so a block that lands on an SM gate/up has left starts its loads then
// instead of after gate/up's last block.
template <bool Early>
__global__ void __launch_bounds__(kSlotDownWarps * 32, 1) down_mma_kernel(DMoe m, int batch, const int32_t* __restrict__ experts,
                                                                   const float* __restrict__ weights,
                                                                   const uint32_t* __restrict__ act, int act_stride,
                                                                   float* __restrict__ residual) {
  __shared__ float part[kSlotDownWarps][16];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, j = lane & 3;
  const int r0 = blockIdx.x * 16, b = blockIdx.y, K = m.router.top_k;
  const int hidden = m.router.w.in, slots = K + (m.has_shared ? 1 : 0);
  const int ra = min(r0 + g, hidden - 1), rb = min(r0 + g + 8, hidden - 1);
  constexpr int N = kSlotChunks;
  const int parts = (m.width / kFragChunk + N - 1) / N;  // of the routed experts' chunks
  // Task t: slot s (sh: the shared expert), its matrix, and chunks [c0, c1); false: another rank's expert.
  struct Task {
    int s;
    bool sh;
    const DLinear* D;
    int c0, c1;
  };
  auto task_of = [&](int t, Task& k) {
    const int jj = t / parts, q = t % parts;
    k.sh = jj >= K;
    k.s = k.sh ? batch * K + b : b * K + jj;
    const int e = k.sh ? 0 : experts[k.s] - m.first_expert;
    if (!k.sh && (e < 0 || e >= m.local_experts)) return false;
    k.D = k.sh ? &m.shared_down : m.down + e;
    // The shared expert may be wider: its chunks split into as many parts, each a few rounds longer.
    const int chunks = k.D->in / kFragChunk, per = (chunks + parts - 1) / parts;
    k.c0 = q * per;
    k.c1 = min(chunks, (q + 1) * per);
    return true;
  };
  SlotChunk ch[N];
  Task k;
  bool loaded = false;  // ch holds the first round of task `warp`
  if (Early && warp < slots * parts && task_of(warp, k)) {
    slot_round_load(*k.D, ra, rb, k.c0, k.c1, j, ch);
    loaded = true;
  }
  pdl_enter();
  float total[2] = {0.0f, 0.0f};
  for (int task = warp; task < slots * parts; task += kSlotDownWarps) {
    if (!loaded && !task_of(task, k)) continue;
    const DLinear& D = *k.D;
    const uint32_t* xs = act + size_t(k.s) * act_stride;
    float acc[N][4] = {}, y[2] = {0.0f, 0.0f};
    for (int c = k.c0; c < k.c1; c += N) {
      if (!loaded) slot_round_load(D, ra, rb, c, k.c1, j, ch);
      loaded = false;
      slot_round_mma(ch, xs, c, k.c1, j, acc);
    }
    slot_acc_sum(acc, y);
    const float w = (k.sh ? 1.0f : weights[k.s]) * mma_unscale(D);
    total[0] = fmaf(w, y[0], total[0]);
    total[1] = fmaf(w, y[1], total[1]);
    if (D.bias && k.c0 == 0) {
      const float wb = k.sh ? 1.0f : weights[k.s];
      total[0] = fmaf(wb, D.bias[ra], total[0]);
      total[1] = fmaf(wb, D.bias[rb], total[1]);
    }
  }
  if (j == 0) part[warp][g] = total[0], part[warp][g + 8] = total[1];
  __syncthreads();
  if (threadIdx.x < 16 && r0 + int(threadIdx.x) < hidden) {
    float sum = 0.0f;
    for (int w = 0; w < kSlotDownWarps; ++w) sum += part[w][threadIdx.x];
    residual[size_t(b) * hidden + r0 + threadIdx.x] += sum;
  }
}

// ---- The per-slot gate/up kernel on tensor cores (one token, x as fragment rows) ----

// Sums a tile's partial accumulators over its ks warps (warp order) into the tile's first warp.
template <int N>
__device__ __forceinline__ void tile_sum(float (&acc)[N], float (*red)[32][8], int ks) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (ks == 1) return;
  #pragma unroll
  for (int i = 0; i < N; ++i) red[warp][lane][i] = acc[i];
  __syncthreads();
  if (warp % ks == 0)
    for (int w = warp + 1; w < warp + ks; ++w)
      #pragma unroll
      for (int i = 0; i < N; ++i) acc[i] += red[w][lane][i];
}

// Grid: (row blocks, slots), as gate_up_kernel; x: the token's row as fragment rows (made by the
// router's normalization). A block holds kWarps / ks tiles of 16 gate rows and the same up rows,
// the ks warps of a tile taking its 128-weight chunks in turn, two chunks of both matrices (144
// bytes a lane) loaded per round; each lane passes the token's row, so all 8 columns of an MMA
// are the same token and lane (g, j < 2) stores row r0 + g + 8j of the result, as fragment rows
// for down_mma_kernel (frag_act) or floats for down_kernel. At 1.4 instructions per weight for
// the dequantization and a quarter for the MMAs, against gate_up_kernel's 4.7 on CUDA cores.
__global__ void __launch_bounds__(kWarps * 32, 2) gate_up_mma_kernel(DMoe m, int batch, const uint32_t* __restrict__ xf,
                                                                  const int32_t* __restrict__ experts,
                                                                  float* __restrict__ act, int act_stride, int ks,
                                                                  int frag_act) {
  __shared__ float red[kWarps][32][8];
  prefetch_expert_descriptors(m);
  pdl_enter();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, j = lane & 3;
  const int s = blockIdx.y, K = m.router.top_k;
  const bool shared = s >= batch * K;
  const int b = shared ? s - batch * K : s / K;
  const int e = shared ? 0 : experts[s] - m.first_expert;
  if (!shared && (e < 0 || e >= m.local_experts)) return;  // another rank's expert (expert parallelism)
  const DLinear G = shared ? m.shared_gate : m.gate[e];
  const DLinear U = shared ? m.shared_up : m.up[e];
  const int tiles = kWarps / ks, out = G.out;
  if (int(blockIdx.x) * tiles * 16 >= out) return;  // past this slot's rows (the shared expert may be wider)
  const int r0 = (blockIdx.x * tiles + warp / ks) * 16, wk = warp % ks, chunks = G.in / kFragChunk;
  const int ra = min(r0 + g, out - 1), rb = min(r0 + g + 8, out - 1);
  const uint32_t* xr = xf + size_t(b) * G.in;
  float acc[2][4] = {};  // gate, up
  if (r0 < out) {
    #pragma unroll 1
    for (int c = wk; c < chunks; c += 2 * ks) {
      SlotChunk ch[2][2];
      #pragma unroll
      for (int u = 0; u < 2; ++u)
        if (c + u * ks < chunks)
          ch[u][0] = slot_chunk_load(G, ra, rb, c + u * ks, j), ch[u][1] = slot_chunk_load(U, ra, rb, c + u * ks, j);
      #pragma unroll
      for (int u = 0; u < 2; ++u)
        if (c + u * ks < chunks) slot_chunks_mma<2>(ch[u], xr, c + u * ks, j, acc);
    }
  }
  float gu[8];
  #pragma unroll
  for (int i = 0; i < 4; ++i) gu[i] = acc[0][i], gu[4 + i] = acc[1][i];
  tile_sum<8>(gu, red, ks);
  const int row = r0 + g + 8 * j;
  if (wk == 0 && j < 2 && row < out) {
    const float gv = (j ? gu[2] : gu[0]) * mma_unscale(G) + (G.bias ? G.bias[row] : 0.0f);
    const float uv = (j ? gu[6] : gu[4]) * mma_unscale(U) + (U.bias ? U.bias[row] : 0.0f);
    const float y = gv / (1.0f + __expf(-gv)) * uv;
    if (frag_act) frag_store(reinterpret_cast<uint32_t*>(act) + size_t(s) * act_stride, row, y);
    else act[size_t(s) * act_stride + row] = y;
  }
}

// ---- Expert-grouped kernels (2+ tokens, tensor cores) ----

constexpr int kMaxGroupTokens = 256;  // tokens of a batch the grouped kernels take
constexpr int kGroupWarps = 4;        // warps per block: small blocks, so that 5 fit an SM at 92 registers

// One block's expert and the slots (b * top_k + j: token b's j-th choice) that selected it, in
// token order. Block row y = 0 is the shared expert (all tokens; slot batch * top_k + b), y >= 1
// the (y - 1)-th smallest local expert the batch selected; rows past the selected ones exit.
struct Group {
  int expert;  // local index (expert id - first_expert), or -1: nothing for this block row
  int count;
  int slots[kMaxGroupTokens];
};

// Fills g (block-shared) for block row y; every thread of the block calls it. Each block derives
// the grouping from the routing itself, so grouping costs no launch and no global scratch.
__device__ bool find_group(const DMoe& m, int batch, const int32_t* __restrict__ experts, int y, Group& g) {
  __shared__ uint32_t mask[kMaxExperts / 32];
  const int tid = threadIdx.x, lane = tid & 31, K = m.router.top_k, n = batch * K;
  if (y == 0) {
    if (!m.has_shared) return false;
    for (int b = tid; b < batch; b += blockDim.x) g.slots[b] = n + b;
    if (tid == 0) g.expert = 0, g.count = batch;
    __syncthreads();
    return true;
  }
  const int words = (m.local_experts + 31) / 32;
  for (int w = tid; w < words; w += blockDim.x) mask[w] = 0;
  if (tid == 0) g.expert = -1, g.count = 0;
  __syncthreads();
  for (int t = tid; t < n; t += blockDim.x) {
    const int e = experts[t] - m.first_expert;
    if (e >= 0 && e < m.local_experts) atomicOr(&mask[e >> 5], 1u << (e & 31));
  }
  __syncthreads();
  if (tid < 32) {
    // The (y - 1)-th set bit of the mask: a warp scan of the words' population counts.
    const int cnt = lane < words ? __popc(mask[lane]) : 0;
    int incl = cnt;
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    const int want = y - 1, below = incl - cnt;
    if (lane < words && want >= below && want < incl) {
      uint32_t w = mask[lane];
      for (int r = want - below; r > 0; --r) w &= w - 1;  // drop the lower set bits
      g.expert = lane * 32 + __ffs(w) - 1;
    }
    __syncwarp();
    const int e = g.expert;
    if (e >= 0) {  // the tokens that chose e (each token chooses an expert at most once)
      int base = 0;
      for (int b0 = 0; b0 < batch; b0 += 32) {
        const int b = b0 + lane;
        int slot = -1;
        if (b < batch)
          for (int j = 0; j < K; ++j)
            if (experts[b * K + j] - m.first_expert == e) slot = b * K + j;
        const uint32_t has = __ballot_sync(0xffffffffu, slot >= 0);
        if (slot >= 0) g.slots[base + __popc(has & ((1u << lane) - 1))] = slot;
        base += __popc(has);
      }
      if (lane == 0) g.count = base;
    }
  }
  __syncthreads();
  return g.expert >= 0;
}

// A gate/up tile's results, SiLU(gate) x up (rows r0 + g and r0 + g + 8, the group's tokens
// t0 + 2j and t0 + 2j + 1), into each slot's row of act: floats, or with frag_act fragment rows.
__device__ __forceinline__ void store_gate_up_tile(const DLinear& G, const DLinear& U, const Group& grp, int r0, int t0,
                                                   int g, int j, const float (&ag)[4], const float (&au)[4],
                                                   bool frag_act, float* __restrict__ act, int act_stride) {
  const float kg = mma_unscale(G), ku = mma_unscale(U);
  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = r0 + g + 8 * h;
    if (row >= G.out) continue;
    #pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int t = t0 + 2 * j + q;
      if (t >= grp.count) continue;
      const float gv = ag[2 * h + q] * kg + (G.bias ? G.bias[row] : 0.0f);
      const float uv = au[2 * h + q] * ku + (U.bias ? U.bias[row] : 0.0f);
      const float y = gv / (1.0f + __expf(-gv)) * uv;
      if (frag_act) frag_store(reinterpret_cast<uint32_t*>(act) + size_t(grp.slots[t]) * act_stride, row, y);
      else act[size_t(grp.slots[t]) * act_stride + row] = y;
    }
  }
}

// Grid: (row blocks, 1 + min(local experts, batch * top_k)). A block holds kGroupWarps / ks tiles of 16
// gate rows and the same up rows; the ks warps of a tile take its 64-weight chunks in turn (ks is
// chosen by the host so that the grid fills the GPU: 1 when many experts are selected, so each
// warp streams whole rows and the block's set-up is paid once for 64 rows). Each group of 8
// tokens of the expert is one pass over the block's weights (from L2 after the first).
__global__ void __launch_bounds__(kGroupWarps * 32) grouped_gate_up_kernel(DMoe m, int batch, const float* __restrict__ x,
                                                                      const int32_t* __restrict__ experts,
                                                                      float* __restrict__ act, int act_stride, int ks) {
  __shared__ Group grp;
  __shared__ float red[kGroupWarps][32][8];
  pdl_enter();
  if (!find_group(m, batch, experts, blockIdx.y, grp)) return;
  const bool sh = blockIdx.y == 0;
  const DLinear G = sh ? m.shared_gate : m.gate[grp.expert];
  const DLinear U = sh ? m.shared_up : m.up[grp.expert];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tiles = kGroupWarps / ks;
  if (int(blockIdx.x) * tiles * 16 >= G.out) return;  // past this expert's rows (the shared one may be wider)
  const int r0 = (blockIdx.x * tiles + warp / ks) * 16, wk = warp % ks, K = m.router.top_k;
  const int g = lane >> 2, j = lane & 3;
  const int ra = min(r0 + g, G.out - 1), rb = min(r0 + g + 8, G.out - 1);
  const bool fp4 = G.format == DFormat::NVFP4;
  for (int t0 = 0; t0 < grp.count; t0 += 8) {
    const int slot = t0 + g < grp.count ? grp.slots[t0 + g] : -1;
    const float* xg = slot < 0 ? nullptr : x + size_t(sh ? slot - batch * K : slot / K) * G.in;
    float ag[4] = {0.0f, 0.0f, 0.0f, 0.0f}, au[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (r0 < G.out) {
      if (fp4) {
        #pragma unroll 4
        for (int c = wk; c < G.in / 64; c += ks) {
          const XFrag xf = x_frag<true>(xg, c, j);
          nvfp4_mma_chunk(G, ra, rb, xf, c, j, ag);
          nvfp4_mma_chunk(U, ra, rb, xf, c, j, au);
        }
      } else {
        for (int c = wk; c < G.in / 64; c += ks) {
          const XFrag xf = x_frag<false>(xg, c, j);
          bf16_mma_chunk(G, ra, rb, xf, c, j, ag);
          bf16_mma_chunk(U, ra, rb, xf, c, j, au);
        }
      }
    }
    if (ks > 1) {
      #pragma unroll
      for (int i = 0; i < 4; ++i) red[warp][lane][i] = ag[i], red[warp][lane][4 + i] = au[i];
      __syncthreads();
      if (wk == 0)
        for (int w = warp + 1; w < warp + ks; ++w)
          #pragma unroll
          for (int i = 0; i < 4; ++i) ag[i] += red[w][lane][i], au[i] += red[w][lane][4 + i];
    }
    if (wk == 0 && r0 < G.out) store_gate_up_tile(G, U, grp, r0, t0, g, j, ag, au, false, act, act_stride);
    if (ks > 1) __syncthreads();  // red is reused by the next token group
  }
}

// A down tile's results (rows r0 + g and r0 + g + 8, the group's tokens t0 + 2j and t0 + 2j + 1)
// into out, each times its slot's routing weight (the shared expert's: 1).
__device__ __forceinline__ void store_down_tile(const DLinear& D, const Group& grp, int r0, int t0, int g, int j,
                                                bool sh, const float* __restrict__ weights, const float (&acc)[4],
                                                float* __restrict__ out) {
  const float k = mma_unscale(D);
  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = r0 + g + 8 * h;
    if (row >= D.out) continue;
    #pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int t = t0 + 2 * j + q;
      if (t >= grp.count) continue;
      const int slot = grp.slots[t];
      const float y = acc[2 * h + q] * k + (D.bias ? D.bias[row] : 0.0f);
      out[size_t(slot) * D.out + row] = sh ? y : weights[slot] * y;
    }
  }
}

// Grid: (row blocks over hidden, as above). out[slot] = weight(slot) x down(act[slot]).
__global__ void __launch_bounds__(kGroupWarps * 32) grouped_down_kernel(DMoe m, int batch, const int32_t* __restrict__ experts,
                                                                   const float* __restrict__ weights,
                                                                   const float* __restrict__ act, int act_stride,
                                                                   float* __restrict__ out, int ks) {
  __shared__ Group grp;
  __shared__ float red[kGroupWarps][32][4];
  pdl_enter();
  if (!find_group(m, batch, experts, blockIdx.y, grp)) return;
  const bool sh = blockIdx.y == 0;
  const DLinear D = sh ? m.shared_down : m.down[grp.expert];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tiles = kGroupWarps / ks;
  const int r0 = (blockIdx.x * tiles + warp / ks) * 16, wk = warp % ks;
  const int g = lane >> 2, j = lane & 3;
  const int ra = min(r0 + g, D.out - 1), rb = min(r0 + g + 8, D.out - 1);
  for (int t0 = 0; t0 < grp.count; t0 += 8) {
    const float* xg = t0 + g < grp.count ? act + size_t(grp.slots[t0 + g]) * act_stride : nullptr;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (r0 < D.out) {
      #pragma unroll 4
      for (int c = wk; c < D.in / 64; c += ks) mma_chunk(D, ra, rb, xg, c, j, acc);
    }
    if (ks > 1) {
      #pragma unroll
      for (int i = 0; i < 4; ++i) red[warp][lane][i] = acc[i];
      __syncthreads();
      if (wk == 0)
        for (int w = warp + 1; w < warp + ks; ++w)
          #pragma unroll
          for (int i = 0; i < 4; ++i) acc[i] += red[w][lane][i];
    }
    if (wk == 0 && r0 < D.out) store_down_tile(D, grp, r0, t0, g, j, sh, weights, acc, out);
    if (ks > 1) __syncthreads();
  }
}

// ---- The same on fragment rows (NVFP4 experts whose inputs are multiples of 128 wide) ----
//
// The layer's input is split into FP16 hi + lo fragment rows once (frag_rows_kernel), gate/up
// writes its output the same way where down takes it, and each tile runs the 128-weight chunks
// of slot_mma.cuh with lane (g, j) passing token g's row, instead of splitting float activations
// for every 64-weight chunk. Kept apart from the kernels above, whose code generation moved by
// 3-7% per step when they carried both paths (docs/PERF.md v22); they share the tile epilogues
// (store_gate_up_tile, store_down_tile), which leave every kernel's machine code as it was.

// Lane g's token row of a group of 8 starting at t0: the g-th, or past the group's count its
// first, whose columns are computed and dropped.
__device__ __forceinline__ int group_slot(const Group& grp, int t0, int g) {
  return grp.slots[t0 + g < grp.count ? t0 + g : t0];
}

// As grouped_gate_up_kernel, x as fragment rows xf; frag_act: act receives fragment rows too.
__global__ void __launch_bounds__(kGroupWarps * 32) grouped_gate_up_frag_kernel(DMoe m, int batch,
                                                                           const uint32_t* __restrict__ xf,
                                                                           const int32_t* __restrict__ experts,
                                                                           float* __restrict__ act, int act_stride,
                                                                           int ks, int frag_act) {
  __shared__ Group grp;
  __shared__ float red[kGroupWarps][32][8];
  pdl_enter();
  if (!find_group(m, batch, experts, blockIdx.y, grp)) return;
  const bool sh = blockIdx.y == 0;
  const DLinear G = sh ? m.shared_gate : m.gate[grp.expert];
  const DLinear U = sh ? m.shared_up : m.up[grp.expert];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tiles = kGroupWarps / ks;
  if (int(blockIdx.x) * tiles * 16 >= G.out) return;  // past this expert's rows (the shared one may be wider)
  const int r0 = (blockIdx.x * tiles + warp / ks) * 16, wk = warp % ks, K = m.router.top_k;
  const int g = lane >> 2, j = lane & 3;
  const int ra = min(r0 + g, G.out - 1), rb = min(r0 + g + 8, G.out - 1);
  for (int t0 = 0; t0 < grp.count; t0 += 8) {
    const int slot = group_slot(grp, t0, g);
    const uint32_t* xr = xf + size_t(sh ? slot - batch * K : slot / K) * G.in;
    float acc[2][4] = {};  // gate, up
    if (r0 < G.out) {
      #pragma unroll 2
      for (int c = wk; c < G.in / kFragChunk; c += ks) {
        const SlotChunk ch[2] = {slot_chunk_load(G, ra, rb, c, j), slot_chunk_load(U, ra, rb, c, j)};
        slot_chunks_mma<2>(ch, xr, c, j, acc);
      }
    }
    float gu[8];
    #pragma unroll
    for (int i = 0; i < 4; ++i) gu[i] = acc[0][i], gu[4 + i] = acc[1][i];
    tile_sum<8>(gu, red, ks);
    if (wk == 0 && r0 < G.out)
      store_gate_up_tile(G, U, grp, r0, t0, g, j, reinterpret_cast<const float(&)[4]>(gu[0]),
                         reinterpret_cast<const float(&)[4]>(gu[4]), frag_act, act, act_stride);
    if (ks > 1) __syncthreads();  // red is reused by the next token group
  }
}

// As grouped_down_kernel, act as fragment rows.
__global__ void __launch_bounds__(kGroupWarps * 32) grouped_down_frag_kernel(DMoe m, int batch,
                                                                        const int32_t* __restrict__ experts,
                                                                        const float* __restrict__ weights,
                                                                        const uint32_t* __restrict__ act, int act_stride,
                                                                        float* __restrict__ out, int ks) {
  __shared__ Group grp;
  __shared__ float red[kGroupWarps][32][8];
  pdl_enter();
  if (!find_group(m, batch, experts, blockIdx.y, grp)) return;
  const bool sh = blockIdx.y == 0;
  const DLinear D = sh ? m.shared_down : m.down[grp.expert];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tiles = kGroupWarps / ks;
  const int r0 = (blockIdx.x * tiles + warp / ks) * 16, wk = warp % ks;
  const int g = lane >> 2, j = lane & 3;
  const int ra = min(r0 + g, D.out - 1), rb = min(r0 + g + 8, D.out - 1);
  for (int t0 = 0; t0 < grp.count; t0 += 8) {
    const uint32_t* xr = act + size_t(group_slot(grp, t0, g)) * act_stride;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (r0 < D.out) {
      #pragma unroll 4
      for (int c = wk; c < D.in / kFragChunk; c += ks) slot_chunk_mma(slot_chunk_load(D, ra, rb, c, j), xr, c, j, acc);
    }
    tile_sum<4>(acc, red, ks);
    if (wk == 0 && r0 < D.out) store_down_tile(D, grp, r0, t0, g, j, sh, weights, acc, out);
    if (ks > 1) __syncthreads();
  }
}

// Rows [batch, n] of x (n % 128 == 0) as fragment rows (slot_mma.cuh) for the grouped gate/up
// kernel: the split into FP16 hi + lo done once per layer instead of by every 16-row tile of
// every expert. Four values a thread.
__global__ void __launch_bounds__(256) frag_rows_kernel(const float* __restrict__ x, int n, uint32_t* __restrict__ xf) {
  pdl_enter();
  const int e = 4 * (blockIdx.x * blockDim.x + threadIdx.x), b = blockIdx.y;
  if (e < n) frag_store4(xf + size_t(b) * n, e, *reinterpret_cast<const float4*>(x + size_t(b) * n + e));
}

unsigned frag_rows_blocks(int n) { return unsigned((n / 4 + 255) / 256); }

// residual[b] += the weighted outputs of token b's slots, in slot order (the shared expert last),
// so the sum does not depend on how the grouped kernels were scheduled.
__global__ void __launch_bounds__(256) slot_sum_kernel(DMoe m, int batch, const int32_t* __restrict__ experts,
                                                       const float* __restrict__ out, float* __restrict__ residual) {
  pdl_enter();
  const int H = m.router.w.in, K = m.router.top_k, b = blockIdx.y;
  const int h = blockIdx.x * blockDim.x + threadIdx.x;
  if (h >= H) return;
  float sum = 0.0f;
  for (int j = 0; j < K; ++j) {
    const int s = b * K + j, e = experts[s] - m.first_expert;
    if (e >= 0 && e < m.local_experts) sum += out[size_t(s) * H + h];
  }
  if (m.has_shared) sum += out[size_t(batch * K + b) * H + h];
  residual[size_t(b) * H + h] += sum;
}

// Batches from this size take the expert-grouped kernels: 2 on fragment rows, else 4
// (KESTREL_MOE_GROUPED_MIN_BATCH=N sets both, for A/B runs). Measured (docs/PERF.md v23): on
// fragment rows at 2 and 3 tokens 9-19% faster per step than the per-slot kernels (Qwen3-30B-A3B,
// GLM-4.5-Air, GLM-5); splitting x per tile, 11% slower at 2 tokens and even at 3 (most experts
// serve one token, and the split is paid per 16-row tile).
int grouped_min_batch(bool fragment_rows) {
  static const int v = env_int("KESTREL_MOE_GROUPED_MIN_BATCH", 0);
  return v > 0 ? v : fragment_rows ? 2 : 4;
}

// NVFP4 experts in the grouped kernels take their activations split once into fragment rows
// (KESTREL_MOE_FRAG=0: split by every 16-row tile per chunk, for A/B runs).
bool moe_frag_enabled() {
  static const bool v = env_switch("KESTREL_MOE_FRAG");
  return v;
}

// The per-slot down kernel on tensor cores at one token where the experts allow
// (KESTREL_MOE_SLOT_MMA=0: the CUDA-core one, for A/B runs).
bool slot_mma_enabled() {
  static const bool v = env_switch("KESTREL_MOE_SLOT_MMA");
  return v;
}

// One token's gate/up on tensor cores from fragment rows of x where the caller made them
// (KESTREL_MOE_ONE_TOKEN_MMA=0: on CUDA cores, for A/B runs).
bool one_token_mma_enabled() {
  static const bool v = env_switch("KESTREL_MOE_ONE_TOKEN_MMA");
  return v;
}

// down_mma_kernel may load its first weights before the wait (KESTREL_MOE_PRELOAD=0: never, for A/B runs).
bool moe_preload() {
  static const bool v = env_switch("KESTREL_MOE_PRELOAD");
  return v;
}

bool on_tensor_cores(const DLinear& w) {
  return (w.format == DFormat::NVFP4 || w.format == DFormat::BF16) && w.in % 64 == 0;
}

}  // namespace

void describe_experts(DMoe& m, const std::vector<DLinear>& gate, const std::vector<DLinear>& up,
                      const std::vector<DLinear>& down) {
  if (gate.empty() || gate.size() != up.size() || gate.size() != down.size())
    fail("internal: describe_experts needs as many gate, up and down matrices, at least one");
  m.expert_gate = gate[0];
  bool tc = true;
  for (size_t e = 0; e < gate.size(); ++e)
    tc &= on_tensor_cores(gate[e]) && on_tensor_cores(up[e]) && on_tensor_cores(down[e]) &&
          gate[e].format == up[e].format;
  m.tensor_cores = tc ? 1 : 0;
  bool sm = true, gu = true;
  for (const DLinear& d : down) sm &= slot_mma_fits(d);
  for (size_t e = 0; e < gate.size(); ++e) gu &= slot_mma_fits(gate[e]) && slot_mma_fits(up[e]);
  m.slot_down_mma = sm ? 1 : 0;
  m.frag_gate_up = gu ? 1 : 0;
}

bool moe_takes_fragment_rows(const DMoe& m) {
  return moe_frag_enabled() && m.frag_gate_up &&
         (!m.has_shared || (slot_mma_fits(m.shared_gate) && slot_mma_fits(m.shared_up)));
}

bool moe_one_token_takes_fragment_rows(const DMoe& m) { return one_token_mma_enabled() && moe_takes_fragment_rows(m); }

namespace {
// Whether launch_moe_experts takes the expert-grouped kernels for this batch (with or without
// fragment rows of x).
bool takes_grouped(const DMoe& m, int batch, const MoeScratch& s, bool frag_in) {
  return s.out && m.tensor_cores && batch >= grouped_min_batch(frag_in) && batch <= kMaxGroupTokens &&
         (!m.has_shared || (on_tensor_cores(m.shared_gate) && on_tensor_cores(m.shared_up) &&
                            on_tensor_cores(m.shared_down) && m.shared_gate.format == m.shared_up.format));
}
}  // namespace

bool moe_reads_fragment_rows(const DMoe& m, int batch, const MoeScratch& s) {
  if (!s.xf) return false;
  return batch == 1 ? moe_one_token_takes_fragment_rows(m) : moe_takes_fragment_rows(m) && takes_grouped(m, batch, s, true);
}

void launch_moe(const DMoe& m, const float* x, int batch, float* residual, const MoeScratch& s, cudaStream_t stream) {
  launch_route(m.router, x, batch, s.logits, s.route_done, s.experts, s.weights, stream);
  const bool frag = batch == 1 && s.xf && moe_one_token_takes_fragment_rows(m);
  if (frag) {  // what the router's normalization makes in a decode step
    launch(frag_rows_kernel, dim3(frag_rows_blocks(m.router.w.in), 1u), dim3(256), 0, stream, x, m.router.w.in, s.xf);
    KESTREL_CUDA_LAUNCHED();
  }
  launch_moe_experts(m, x, batch, residual, s, stream, frag);
}

int launch_moe_experts(const DMoe& m, const float* x, int batch, float* residual, const MoeScratch& s,
                       cudaStream_t stream, bool xf_made) {
  if (m.expert_gate.out != m.width) fail("internal: DMoe.expert_gate does not describe the experts");
  if (m.local_experts < 1 || m.first_expert < 0 || m.first_expert + m.local_experts > m.router.experts)
    fail("internal: DMoe holds experts ", m.first_expert, " + ", m.local_experts, " of ", m.router.experts);
  const int slots = batch * m.router.top_k + (m.has_shared ? batch : 0);
  const int hidden = m.router.w.in;
  // Fragment rows (slot_mma.cuh) in and out of gate/up where every matrix of that side takes them.
  const bool frag_in = s.xf && moe_takes_fragment_rows(m);
  const bool grouped = takes_grouped(m, batch, s, frag_in);
  if (grouped) {
    const bool frag_act = frag_in && m.slot_down_mma && (!m.has_shared || slot_mma_fits(m.shared_down));
    // Warps per tile: the fewest (longest rows per warp, least set-up per byte) that still give
    // four blocks per SM for the experts uniform routing is expected to select, and each warp at
    // least two chunks.
    const int E = m.local_experts;
    const double expected = E * (1.0 - std::pow(1.0 - double(m.router.top_k) / m.router.experts, batch)) + m.has_shared;
    auto warps_per_tile = [&](int rows, int in, bool fragment) {
      const int chunks = in / (fragment ? kFragChunk : 64);
      int ks = 1;
      auto blocks = [&](int k) { return expected * std::ceil(rows / (16.0 * kGroupWarps / k)); };
      while (ks < kGroupWarps && 2 * ks <= chunks && blocks(ks) < 4.0 * sm_count()) ks *= 2;
      return ks;
    };
    // Row blocks of the wider of the routed and the shared expert; extra blocks of the narrower exit.
    auto blocks_for = [](int rows, int ks) { return (rows + 16 * (kGroupWarps / ks) - 1) / (16 * (kGroupWarps / ks)); };
    const unsigned groups = unsigned(1 + std::min(E, batch * m.router.top_k));
    const int shared_w = m.has_shared ? m.shared_gate.out : 0;
    const int ks_gu = warps_per_tile(std::max(m.width, shared_w), hidden, frag_in);
    const int ks_dn = warps_per_tile(hidden, std::min(m.width, m.has_shared ? m.shared_down.in : m.width), frag_act);
    int launches = 3;
    if (frag_in && !xf_made) {
      launch(frag_rows_kernel, dim3(frag_rows_blocks(hidden), unsigned(batch)), dim3(256), 0, stream, x, hidden,
             s.xf);
      KESTREL_CUDA_LAUNCHED();
      ++launches;
    }
    // Launched without PDL: with it (its blocks resident and waiting while the selection runs)
    // the step took 9.31 instead of 8.23 ms at batch 8 on Qwen3-30B-A3B shapes (docs/PERF.md v12);
    // PDL on the two kernels after it, and on the per-slot kernels, measured neutral.
    if (frag_in)
      launch_pdl(false, grouped_gate_up_frag_kernel, dim3(unsigned(blocks_for(std::max(m.width, shared_w), ks_gu)), groups),
                 dim3(kGroupWarps * 32), 0, stream, m, batch, s.xf, s.experts, s.act, s.act_stride, ks_gu,
                 frag_act ? 1 : 0);
    else
      launch_pdl(false, grouped_gate_up_kernel, dim3(unsigned(blocks_for(std::max(m.width, shared_w), ks_gu)), groups),
                 dim3(kGroupWarps * 32), 0, stream, m, batch, x, s.experts, s.act, s.act_stride, ks_gu);
    KESTREL_CUDA_LAUNCHED();
    if (frag_act)
      launch(grouped_down_frag_kernel, dim3(unsigned(blocks_for(hidden, ks_dn)), groups), dim3(kGroupWarps * 32), 0, stream,
             m, batch, s.experts, s.weights, reinterpret_cast<const uint32_t*>(s.act), s.act_stride, s.out, ks_dn);
    else
      launch(grouped_down_kernel, dim3(unsigned(blocks_for(hidden, ks_dn)), groups), dim3(kGroupWarps * 32), 0, stream, m,
             batch, s.experts, s.weights, s.act, s.act_stride, s.out, ks_dn);
    KESTREL_CUDA_LAUNCHED();
    launch(slot_sum_kernel, dim3(unsigned((hidden + 255) / 256), unsigned(batch)), dim3(256), 0, stream, m, batch,
           s.experts, s.out, residual);
    KESTREL_CUDA_LAUNCHED();
    return launches;
  }
  // Blocks cover the rows of the widest slot: a block holds (kWarps / ks) * kGateUpRows rows,
  // ks = warps_per_row, which is the same for every routed expert but may differ for the shared one.
  auto blocks_for = [](const DLinear& w) {
    const int rows_per_block = (kWarps / warps_per_row(w)) * kGateUpRows;
    return (w.out + rows_per_block - 1) / rows_per_block;
  };
  const int blocks = std::max(blocks_for(m.expert_gate), m.has_shared ? blocks_for(m.shared_gate) : 0);
  // One token: down on tensor cores, a block of 16 warps per 16 rows of hidden at one block per
  // SM. Measured (docs/PERF.md v17): ahead of the CUDA-core kernel where that grid is at most two
  // waves (Qwen3-30B-A3B, hidden 2048: -2.5% per step; GLM-4.5-Air, 4096: -2.2%), behind beyond
  // (GLM-5, 6144: +1.4% per MoE layer; DeepSeek-V3, 7168: +2.4%) and from 2 tokens (a block row
  // per token: as many waves again).
  const int down_tiles = (hidden + 15) / 16;
  const bool down_mma = batch == 1 && down_tiles <= 2 * sm_count() && slot_mma_enabled() && m.slot_down_mma &&
                        (!m.has_shared || slot_mma_fits(m.shared_down));
  if (batch == 1 && xf_made && s.xf && moe_one_token_takes_fragment_rows(m)) {
    // Warps per tile: the most that keep the grid one wave of two blocks per SM (each warp at
    // least two chunks).
    const int rows = std::max(m.width, m.has_shared ? m.shared_gate.out : 0), chunks = hidden / kFragChunk;
    auto blocks_of = [&](int ks) { return (rows + 16 * (kWarps / ks) - 1) / (16 * (kWarps / ks)); };
    int ks = 1;
    while (ks < kWarps && 4 * ks <= chunks && blocks_of(2 * ks) * slots <= 2 * sm_count()) ks *= 2;
    launch(gate_up_mma_kernel, dim3(unsigned(blocks_of(ks)), unsigned(slots)), dim3(kWarps * 32), 0, stream, m, batch,
           s.xf, s.experts, s.act, s.act_stride, ks, down_mma ? 1 : 0);
  } else if (down_mma) {
    launch(gate_up_kernel<true>, dim3(unsigned(blocks), unsigned(slots)), dim3(kWarps * 32), 0, stream, m, batch, x,
           s.experts, s.act, s.act_stride);
  } else {
    launch(gate_up_kernel<false>, dim3(unsigned(blocks), unsigned(slots)), dim3(kWarps * 32), 0, stream, m, batch, x,
           s.experts, s.act, s.act_stride);
  }
  KESTREL_CUDA_LAUNCHED();
  if (down_mma) {
    // Its first loads before the wait where its blocks fit one wave (measured: Qwen3-30B-A3B's 128
    // blocks -1.4% per step; GLM-4.5-Air's 256 +0.2%: a second wave starts after gate/up anyway).
    const bool early = moe_preload() && down_tiles <= sm_count();
    launch(early ? down_mma_kernel<true> : down_mma_kernel<false>, dim3(unsigned(down_tiles), unsigned(batch)),
           dim3(kSlotDownWarps * 32), 0, stream, m, batch, s.experts, s.weights, reinterpret_cast<const uint32_t*>(s.act),
           s.act_stride, residual);
    KESTREL_CUDA_LAUNCHED();
    return 2;
  }
  launch(down_kernel, dim3(unsigned((hidden + kDownRows - 1) / kDownRows), unsigned(batch)), dim3(kWarps * 32), 0,
         stream, m, batch, s.experts, s.weights, s.act, s.act_stride, residual);
  KESTREL_CUDA_LAUNCHED();
  return 2;
}

}  // namespace kestrel::cuda
