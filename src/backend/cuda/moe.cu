#include <cfloat>

#include "backend/cuda/check.h"
#include "backend/cuda/dequant.cuh"
#include "backend/cuda/gemv.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/moe.h"

namespace kestrel::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kMaxExperts = 1024;
constexpr int kGateUpRows = 4;  // gate rows (and as many up rows) per warp in gate_up_kernel
constexpr int kDownRows = 4;    // rows per warp in down_kernel (8 spills registers)

// Largest value in v[0..n) (ties: lowest index) across one warp. Returns the index, always in
// range: NaN logits (a diverged model) must not turn into an expert id past the end.
__device__ int warp_argmax(const float* v, int n, int lane) {
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

// One warp per token selects experts from the router logits.
__global__ void __launch_bounds__(32) select_kernel(DRouter r, const float* __restrict__ logits,
                                                    int32_t* __restrict__ out_e, float* __restrict__ out_w) {
  __shared__ float score[kMaxExperts], choice[kMaxExperts], gscore[32];
  __shared__ int sel[32];
  const int b = blockIdx.x, lane = threadIdx.x & 31;
  const int E = r.experts;
  pdl_enter();
  #pragma unroll 4
  for (int e = lane; e < E; e += 32) score[e] = logits[size_t(b) * E + e] + (r.w.bias ? r.w.bias[e] : 0.0f);
  __syncwarp();
  if (!r.sigmoid) {
    float mx = -FLT_MAX;
    for (int e = lane; e < E; e += 32) mx = fmaxf(mx, score[e]);
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.0f;
    for (int e = lane; e < E; e += 32) sum += (score[e] = expf(score[e] - mx));
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const float inv = 1.0f / sum;
    for (int e = lane; e < E; e += 32) choice[e] = score[e] = score[e] * inv;
  } else {
    for (int e = lane; e < E; e += 32) {
      score[e] = 1.0f / (1.0f + expf(-score[e]));
      choice[e] = score[e] + r.bias[e];
    }
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
  float sum = 0.0f;
  for (int j = 0; j < r.top_k; ++j) {
    const int best = warp_argmax(choice, E, lane);
    __syncwarp();
    if (lane == 0) {
      choice[best] = -INFINITY;
      sel[j] = best;
    }
    sum += score[best];
    __syncwarp();
  }
  if (lane < r.top_k) {
    float w = score[sel[lane]];
    if (r.norm_topk) w /= r.sigmoid ? sum + 1e-20f : sum;
    out_e[b * r.top_k + lane] = sel[lane];
    out_w[b * r.top_k + lane] = w * r.scaling;
  }
}

// Grid: (rows / kWarps, slots). Slot s < batch*top_k is token s / top_k's j-th expert; the
// slots after those are the shared expert of each token.
__global__ void __launch_bounds__(kWarps * 32, 3) gate_up_kernel(DMoe m, int batch, const float* __restrict__ x,
                                                              const int32_t* __restrict__ experts, float* __restrict__ act,
                                                              int act_stride) {
  constexpr int R = kGateUpRows;
  __shared__ float red[kWarps * R];
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
  if (lane == 0 && warp % ks == 0)
    #pragma unroll
    for (int r = 0; r < R; ++r)
      if (row0 + r < g.out) act[size_t(s) * act_stride + row0 + r] = gv[r][0] / (1.0f + __expf(-gv[r][0])) * uv[r][0];
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

}  // namespace

DRouter make_router(const ModelConfig& c, const DLinear& w, const float* bias) {
  DRouter r;
  r.w = w;
  r.bias = bias;
  r.experts = int(c.num_experts);
  r.top_k = int(c.experts_per_token);
  r.sigmoid = c.router == RouterKind::SigmoidBias;
  r.norm_topk = c.norm_topk_prob;
  r.n_group = int(c.n_group);
  r.topk_group = int(c.topk_group);
  r.scaling = c.routed_scaling_factor;
  return r;
}

void launch_route(const DRouter& r, const float* x, int batch, float* logits, int32_t* experts, float* weights,
                  cudaStream_t stream) {
  if (r.experts > kMaxExperts || r.top_k > 32 || r.n_group > 32)
    fail("CUDA router supports at most ", kMaxExperts, " experts, top-32 and 32 groups");
  DLinear w = r.w;
  w.bias = nullptr;  // added by the selection
  const LinearJob job{w, logits};
  launch_linear(&job, 1, x, batch, false, stream);
  launch(select_kernel, dim3(unsigned(batch)), dim3(32), 0, stream, r, logits, experts, weights);
  KESTREL_CUDA_LAUNCHED();
}

void launch_moe(const DMoe& m, const float* x, int batch, float* residual, const MoeScratch& s, cudaStream_t stream) {
  launch_route(m.router, x, batch, s.logits, s.experts, s.weights, stream);
  launch_moe_experts(m, x, batch, residual, s, stream);
}

void launch_moe_experts(const DMoe& m, const float* x, int batch, float* residual, const MoeScratch& s,
                        cudaStream_t stream) {
  if (m.expert_gate.out != m.width) fail("internal: DMoe.expert_gate does not describe the experts");
  if (m.local_experts < 1 || m.first_expert < 0 || m.first_expert + m.local_experts > m.router.experts)
    fail("internal: DMoe holds experts ", m.first_expert, " + ", m.local_experts, " of ", m.router.experts);
  const int slots = batch * m.router.top_k + (m.has_shared ? batch : 0);
  // Blocks cover the rows of the widest slot: a block holds (kWarps / ks) * kGateUpRows rows,
  // ks = warps_per_row, which is the same for every routed expert but may differ for the shared one.
  auto blocks_for = [](const DLinear& w) {
    const int rows_per_block = (kWarps / warps_per_row(w)) * kGateUpRows;
    return (w.out + rows_per_block - 1) / rows_per_block;
  };
  const int blocks = std::max(blocks_for(m.expert_gate), m.has_shared ? blocks_for(m.shared_gate) : 0);
  launch(gate_up_kernel, dim3(unsigned(blocks), unsigned(slots)), dim3(kWarps * 32), 0, stream, m, batch, x,
         s.experts, s.act, s.act_stride);
  KESTREL_CUDA_LAUNCHED();
  const int hidden = m.router.w.in;
  launch(down_kernel, dim3(unsigned((hidden + kDownRows - 1) / kDownRows), unsigned(batch)), dim3(kWarps * 32), 0,
         stream, m, batch, s.experts, s.weights, s.act, s.act_stride, residual);
  KESTREL_CUDA_LAUNCHED();
}

}  // namespace kestrel::cuda
