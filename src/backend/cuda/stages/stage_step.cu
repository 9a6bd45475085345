#include "backend/cuda/stages/stage_step.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "backend/cuda/check.h"
#include "backend/cuda/device_buffers.h"
#include "backend/cuda/embed_row.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/stages/grid_barrier.cuh"
#include "backend/cuda/stages/stage_attention.cuh"
#include "backend/cuda/stages/stage_mma.cuh"
#include "backend/cuda/stages/stage_moe.cuh"
#include "backend/cuda/stages/stage_rows.cuh"
#include "common/error.h"

namespace kestrel::cuda {

const char* stage_name(Stage s) {
  switch (s) {
    case Stage::Embed: return "embed";
    case Stage::Qkv: return "norm_qkv";
    case Stage::Attention: return "attn_split";
    case Stage::Combine: return "attn_combine";
    case Stage::O: return "o_proj";
    case Stage::Router: return "norm_router";
    case Stage::ExpertGateUp: return "route_gate_up";
    case Stage::ExpertDown: return "expert_down";
    case Stage::MlpGateUp: return "norm_mlp_gate_up";
    case Stage::MlpDown: return "mlp_down";
    case Stage::Head: return "norm_lm_head";
    case Stage::Count: break;
  }
  return "?";
}

namespace {

static_assert(std::is_trivially_copyable_v<DLayer>, "layers are copied to the device as they are");
static_assert(sizeof(DLayer) % 4 == 0 && sizeof(KvLayer) % 4 == 0 && sizeof(SArgs) % 4 == 0,
              "descriptors are copied in words");

// Layer l's descriptors into shared memory (slot l & 1), a word per thread: the stages read
// them after their barriers, when the L1 has been emptied and the L2 has streamed past them.
__device__ __forceinline__ void load_layer(const SArgs& a, int l, DLayer* s_layer, KvLayer* s_kv) {
  if (l >= a.n_layers) return;
  constexpr int kL = sizeof(DLayer) / 4, kK = sizeof(KvLayer) / 4;
  const uint32_t* src = reinterpret_cast<const uint32_t*>(a.layers + l);
  const uint32_t* ksrc = reinterpret_cast<const uint32_t*>(a.kv + l);
  uint32_t* dst = reinterpret_cast<uint32_t*>(s_layer + (l & 1));
  uint32_t* kdst = reinterpret_cast<uint32_t*>(s_kv + (l & 1));
  for (int i = threadIdx.x; i < kL + kK; i += blockDim.x) {
    if (i < kL) dst[i] = src[i];
    else kdst[i - kL] = ksrc[i - kL];
  }
}

// One block per SM runs every stage of the step. B: the batch rounded up to 1, 2, 4 or 8 (the
// products' columns); T: the KV cache's values.
template <int B, class T>
__global__ void __launch_bounds__(kStageThreads, 1) stage_step_kernel(const SArgs args) {
  extern __shared__ __align__(16) float smem[];
  // The arguments in shared memory: the stages are functions of their own (each compiled once,
  // so that a layer's code fits the SM's instruction caches), and a parameter passed to one by
  // reference would be copied to the stack, which the streaming weights evict from the L1.
  __shared__ __align__(16) SArgs s_args;
  for (int i = threadIdx.x; i < int(sizeof(SArgs) / 4); i += blockDim.x)
    reinterpret_cast<uint32_t*>(&s_args)[i] = reinterpret_cast<const uint32_t*>(&args)[i];
  __syncthreads();
  const SArgs& a = s_args;
  __shared__ __align__(16) DLayer s_layer[2];
  __shared__ __align__(16) KvLayer s_kv[2];
  __shared__ StageRoute s_route;
  __shared__ float s_red[kStageWarps * 8];  // a block's reductions: 16 warps x R x B
  __shared__ uint32_t s_epoch;
  float* const xn = smem;                   // [B][hidden]: the normalized rows
  uint32_t* const xf = reinterpret_cast<uint32_t*>(smem) + size_t(B) * a.hidden;  // and as fragment rows (mma)
  float* const scratch = smem + a.xn_floats;
  if (threadIdx.x == 0) s_epoch = *a.epoch;
  load_layer(a, 0, s_layer, s_kv);
  __syncthreads();
  const uint32_t epoch = s_epoch;
  const int H = a.hidden;
  int k = 0;  // the stage running
  long long t0 = a.trace && threadIdx.x == 0 ? clock64() : 0;
  // Ends stage k (its times into the trace) and passes the barrier after it.
  auto next = [&]() -> bool {
    if (a.trace && threadIdx.x == 0) {
      long long* t = a.trace + (size_t(k) * gridDim.x + blockIdx.x) * 2;
      t[0] = t0, t[1] = clock64();
    }
    if (!grid_barrier(a, epoch, k)) return false;
    ++k;
    if (a.trace && threadIdx.x == 0) t0 = clock64();
    return true;
  };

  constexpr int R = stage_rows<B>();
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < a.batch * H; i += gridDim.x * blockDim.x)
    a.x[i] = embed_value(a.embed, a.tokens[i / H], i % H);
  if (!next()) return;

  for (int l = 0; l < a.n_layers; ++l) {
    const DLayer& L = s_layer[l & 1];
    const int hd = a.head_dim;
    {  // RMSNorm and q | k | v
      const int Q = (a.heads + 2 * a.kv_heads) * hd;
      const bool mma = a.mma && H % kFragChunk == 0 && slot_mma_fits(L.q) && slot_mma_fits(L.k) && slot_mma_fits(L.v);
      stage_norm<B>(a.x, L.attn_norm, a.batch, H, a.eps, xn, s_red, mma ? xf : nullptr);
      if (mma) {
        const StageMmaJobs jobs{{&L.q, &L.k, &L.v}, {a.qkv, a.qkv + a.heads * hd, a.qkv + (a.heads + a.kv_heads) * hd}, 3};
        stage_linear_mma<false>(jobs, xf, a.batch, Q, false, scratch);
      } else {
        const int gq = (a.heads * hd + R - 1) / R, gk = (a.kv_heads * hd + R - 1) / R;
        for_row_groups(gq + 2 * gk, [&](int g) {
          if (g < gq) stage_linear_rows<R, B>(L.q, g * R, xn, H, a.batch, a.qkv, Q, false);
          else if (g < gq + gk) stage_linear_rows<R, B>(L.k, (g - gq) * R, xn, H, a.batch, a.qkv + a.heads * hd, Q, false);
          else
            stage_linear_rows<R, B>(L.v, (g - gq - gk) * R, xn, H, a.batch, a.qkv + (a.heads + a.kv_heads) * hd, Q, false);
        });
      }
    }
    if (!next()) return;
    stage_attention_split<B, T>(a, L, s_kv[l & 1], scratch);
    if (!next()) return;
    // o on tensor cores takes attention's output as fragment rows.
    const bool o_mma = a.mma && (a.heads * hd) % kFragChunk == 0 && slot_mma_fits(L.o);
    load_layer(a, l + 1, s_layer, s_kv);  // read from the next layer's first stage on
    stage_attention_combine(a, o_mma);
    if (!next()) return;
    if (o_mma) {
      const StageMmaJobs jobs{{&L.o, nullptr, nullptr}, {a.x, nullptr, nullptr}, 1};
      stage_linear_mma<true>(jobs, reinterpret_cast<const uint32_t*>(a.att), a.batch, H, true, scratch);
    } else {
      stage_linear<B>(L.o, a.att, a.heads * hd, a.batch, a.x, H, true, s_red);
    }
    if (!next()) return;
    if (L.is_moe) {
      const DMoe& m = L.moe;
      const bool mma = a.mma && H % kFragChunk == 0 && m.frag_gate_up && m.slot_down_mma &&
                       m.local_experts == a.experts &&
                       (!m.has_shared || (slot_mma_fits(m.shared_gate) && slot_mma_fits(m.shared_up) &&
                                          slot_mma_fits(m.shared_down) && m.shared_gate.out % kFragChunk == 0));
      stage_norm<B>(a.x, L.ffn_norm, a.batch, H, a.eps, xn, s_red, mma ? xf : nullptr);  // kept for the next stage
      stage_linear<B>(m.router.w, xn, H, a.batch, a.rlogits, m.router.experts, false, s_red);
      if (!next()) return;
      stage_select<B>(a, m, s_route, scratch);
      if (mma) stage_expert_gate_up_mma<B>(a, m, s_route, xf, scratch);
      else stage_expert_gate_up<B>(a, m, s_route, xn);
      if (!next()) return;
      if (mma) stage_expert_down_mma<B>(a, m, s_route, scratch);
      else stage_expert_down<B>(a, m, s_route, s_red);
    } else {
      stage_norm<B>(a.x, L.ffn_norm, a.batch, H, a.eps, xn, s_red);
      const int I = L.gate.out;
      for_row_groups((I + R - 1) / R,
                     [&](int g) { stage_gated_rows<R, B>(L.gate, L.up, g * R, xn, H, a.batch, a.act, I); });
      if (!next()) return;
      stage_linear<B>(L.down, a.act, I, a.batch, a.x, H, true, s_red);
    }
    if (!next()) return;
  }
  stage_norm<B>(a.x, a.final_norm, a.batch, H, a.eps, xn, s_red);
  stage_linear<B>(a.lm_head, xn, H, a.batch, a.logits, a.vocab, false, s_red);
  if (a.trace && threadIdx.x == 0) {
    long long* t = a.trace + (size_t(k) * gridDim.x + blockIdx.x) * 2;
    t[0] = t0, t[1] = clock64();
  }
  // The last block to finish advances the epoch: the next step's barriers wait for higher counts.
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(a.blocks_done, 1u) == gridDim.x - 1) {
      *a.blocks_done = 0;
      __threadfence();
      *a.epoch = epoch + 1;
    }
  }
}

int device_sms() {
  int dev = 0, n = 0;
  KESTREL_CUDA_CHECK(cudaGetDevice(&dev));
  KESTREL_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
}

}  // namespace

struct StageStep::Device {
  SArgs args;
  std::vector<void*> owned;
  size_t smem = 0;
  int blocks = 0;
  void (*kernel)(SArgs) = nullptr;
  ~Device() {
    for (void* p : owned) cudaFree(p);
  }
};

StageStep::StageStep(const DeviceModel& model, Decoder& kv, int batch) : d_(std::make_unique<Device>()) {
  const ModelConfig& c = model.config();
  const int64_t H = c.hidden_size, hd = c.head_dim, nq = c.num_heads, nkv = c.num_kv_heads;
  if (batch < 1 || batch > 8) fail("stage step: 1 to 8 sequences, not ", batch);
  if (batch > kv.max_batch()) fail("stage step: ", batch, " sequences over a decoder of ", kv.max_batch());
  if (c.is_mla()) fail("stage step: no MLA stages yet (", c.architecture, ")");
  if (model.lm_head().out != c.vocab_size)
    fail("stage step: an LM head of ", model.lm_head().out, " rows for a vocabulary of ", c.vocab_size,
         " (a split model's share) is not taken yet");
  if (kv.kv(0).table_stride == 0) fail("stage step: decode steps only, not a one-sequence (prefill) decoder");
  if (H % 4 != 0) fail("stage step: hidden size ", H, " (a multiple of 4)");
  if (hd > kStageMaxHeadDim || hd % 2 || nq % nkv)
    fail("stage step: heads of ", hd, " dimensions (an even number up to ", kStageMaxHeadDim, "), ", nq, " over ", nkv);
  const int64_t G = nq / nkv;
  if (G * hd > int64_t(kStageMaxHeadDim) * 16) fail("stage step: ", G, " query heads of ", hd, " per KV head");
  if (c.rope.rotary_dim > hd) fail("stage step: rotary dimensions ", c.rope.rotary_dim, " over heads of ", hd);
  if (c.num_moe_layers() > 0) {
    if (c.experts_per_token > 32 || int64_t(batch) * c.experts_per_token > kStageMaxSlots || c.num_experts > 512)
      fail("stage step: ", c.num_experts, " experts, ", c.experts_per_token, " per token, at ", batch, " sequences");
  }
  SArgs& a = d_->args;
  std::vector<void*>& owned = d_->owned;
  const int Bt = batch == 1 ? 1 : batch == 2 ? 2 : batch <= 4 ? 4 : 8;
  d_->blocks = device_sms();
  a.splits = std::clamp(d_->blocks / int(batch * nkv), 1, kStageMaxSplits);
  a.n_layers = int(c.num_layers);
  a.layers = device_copy(model.layers(), owned);
  std::vector<KvLayer> layers_kv;
  for (int l = 0; l < a.n_layers; ++l) layers_kv.push_back(kv.kv(l));
  a.kv = device_copy(layers_kv, owned);
  a.embed = model.embed();
  a.lm_head = model.lm_head();
  a.final_norm = model.final_norm();
  a.rope.inv_freq = model.rope_inv_freq();
  a.rope.scaling = c.rope.attention_scaling();
  a.rope.rotary_dim = int(c.rope.rotary_dim);
  a.rope.interleaved = c.rope.interleaved;
  a.eps = c.rms_norm_eps;
  a.scale = 1.0f / std::sqrt(float(hd));
  a.batch = batch;
  a.hidden = int(H);
  a.heads = int(nq);
  a.kv_heads = int(nkv);
  a.head_dim = int(hd);
  a.vocab = int(c.vocab_size);
  a.experts = int(c.num_experts);
  int shared_width = 0;
  for (const DLayer& L : model.layers())
    if (L.is_moe && L.moe.has_shared) shared_width = std::max(shared_width, L.moe.shared_gate.out);
  a.tokens = kv.tokens();
  a.pos = kv.positions();
  const size_t Bs = size_t(Bt);
  a.x = device_zeros<float>(Bs * H, owned);
  a.qkv = device_zeros<float>(Bs * size_t(nq + 2 * nkv) * hd, owned);
  a.part_ml = device_zeros<float>(Bs * nq * a.splits * 2, owned);
  a.part = device_zeros<float>(Bs * nq * a.splits * hd, owned);
  a.att = device_zeros<float>(Bs * nq * hd, owned);
  a.rlogits = device_zeros<float>(Bs * size_t(std::max<int64_t>(c.num_experts, 1)), owned);
  const size_t moe_act = c.num_moe_layers() > 0 ? size_t(kStageMaxSlots) * Bs * size_t(c.moe_intermediate_size) : 0;
  a.act = device_zeros<float>(std::max(moe_act, Bs * size_t(std::max<int64_t>(c.intermediate_size, 0))), owned);
  a.act_shared = device_zeros<float>(Bs * size_t(shared_width), owned);
  a.logits = device_zeros<float>(Bs * size_t(c.vocab_size), owned);
  logits_ = a.logits;
  a.arrived = device_zeros<uint32_t>(1, owned);
  a.epoch = device_zeros<uint32_t>(1, owned);
  a.blocks_done = device_zeros<uint32_t>(1, owned);
  a.error = device_zeros<int32_t>(1, owned);

  // The stages of a step, and the barriers between them.
  stages_.push_back(Stage::Embed);
  for (const DLayer& L : model.layers()) {
    for (Stage s : {Stage::Qkv, Stage::Attention, Stage::Combine, Stage::O}) stages_.push_back(s);
    if (L.is_moe)
      for (Stage s : {Stage::Router, Stage::ExpertGateUp, Stage::ExpertDown}) stages_.push_back(s);
    else
      for (Stage s : {Stage::MlpGateUp, Stage::MlpDown}) stages_.push_back(s);
  }
  stages_.push_back(Stage::Head);
  a.barriers = int(stages_.size()) - 1;

  auto pick = [&](auto bt) {
    constexpr int R = decltype(bt)::value;
    d_->kernel = kv.kv_type() == KvType::BF16 ? stage_step_kernel<R, __nv_bfloat16> : stage_step_kernel<R, float>;
  };
  if (Bt == 1) pick(std::integral_constant<int, 1>{});
  else if (Bt == 2) pick(std::integral_constant<int, 2>{});
  else if (Bt == 4) pick(std::integral_constant<int, 4>{});
  else pick(std::integral_constant<int, 8>{});
  // Shared memory: the normalized rows (and, with the tensor-core products, the same rows as
  // fragment rows), then the largest of the attention's, the route's and the tile sums' scratch.
  auto smem_bytes = [&](bool mma) {
    const size_t xn = Bs * size_t(H) * (mma ? 2 : 1);
    const size_t scratch = std::max({size_t(stage_attention_floats(int(G), int(hd))),
                                     size_t(stage_route_floats(Bt, int(std::max<int64_t>(c.num_experts, 1)))),
                                     mma ? size_t(kStageMmaRedFloats) : size_t(0)});
    return (xn + scratch) * 4 + 16;
  };
  // NVFP4 products on tensor cores from two tokens on, where their fragment rows fit beside the
  // floats (docs/PERF.md v39, H100: 7.26 / 10.4 / 17.3 ms at 2 / 4 / 8 tokens against the CUDA-core
  // rows' 7.99 / 27.7 / 82.1; at one token the rows are faster, 4.71 against 5.61).
  cudaFuncAttributes attr{};
  KESTREL_CUDA_CHECK(cudaFuncGetAttributes(&attr, d_->kernel));
  int dev = 0, optin = 0;
  KESTREL_CUDA_CHECK(cudaGetDevice(&dev));
  KESTREL_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  a.mma = batch >= 2 && smem_bytes(true) + attr.sharedSizeBytes <= size_t(optin) ? 1 : 0;
  a.xn_floats = uint32_t(Bs * size_t(H) * (a.mma ? 2 : 1));
  d_->smem = smem_bytes(a.mma != 0);
  if (d_->smem + attr.sharedSizeBytes > size_t(optin))
    fail("stage step: ", batch, " sequences of ", H, " hidden values need ", d_->smem + attr.sharedSizeBytes,
         " bytes of shared memory per block, more than the GPU's ", optin);
  KESTREL_CUDA_CHECK(cudaFuncSetAttribute(d_->kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(d_->smem)));
  int per_sm = 0;
  KESTREL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, d_->kernel, kStageThreads, d_->smem));
  if (per_sm < 1)
    fail("stage step: a block of ", kStageThreads, " threads and ", d_->smem, " bytes of shared memory does not fit an SM");
}

StageStep::~StageStep() = default;

int StageStep::blocks() const { return d_->blocks; }
int StageStep::barriers() const { return d_->args.barriers; }

void StageStep::run(cudaStream_t s) {
  launch_cooperative(d_->kernel, d_->blocks, kStageThreads, d_->smem, s, d_->args);
}

std::vector<StageStep::StageTime> StageStep::trace(cudaStream_t s) {
  const size_t n = stages_.size() * size_t(d_->blocks) * 2;
  long long* buf = nullptr;
  KESTREL_CUDA_CHECK(cudaMalloc(&buf, n * sizeof(long long)));
  KESTREL_CUDA_CHECK(cudaMemsetAsync(buf, 0, n * sizeof(long long), s));
  d_->args.trace = buf;
  run(s);
  d_->args.trace = nullptr;
  std::vector<long long> t(n);
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(t.data(), buf, n * sizeof(long long), cudaMemcpyDeviceToHost, s));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
  KESTREL_CUDA_CHECK(cudaFree(buf));
  check();
  std::vector<StageTime> out(size_t(Stage::Count));
  for (size_t i = 0; i < out.size(); ++i) out[i].stage = Stage(i);
  const int nb = d_->blocks;
  for (size_t k = 0; k < stages_.size(); ++k) {
    StageTime& o = out[size_t(stages_[k])];
    ++o.count;
    double run = 0, wall = 0;
    for (int b = 0; b < nb; ++b) {
      const long long* tb = t.data() + (k * size_t(nb) + size_t(b)) * 2;
      run += double(tb[1] - tb[0]);
      // The stage's whole time on this block: to the next stage's start (the last: its end).
      wall += double(k + 1 < stages_.size() ? t[((k + 1) * size_t(nb) + size_t(b)) * 2] - tb[0] : tb[1] - tb[0]);
    }
    o.run_cycles += run / nb;
    o.wall_cycles += wall / nb;
  }
  std::erase_if(out, [](const StageTime& o) { return o.count == 0; });
  return out;
}

void StageStep::check() const {
  int32_t error = 0;
  KESTREL_CUDA_CHECK(cudaMemcpy(&error, d_->args.error, sizeof error, cudaMemcpyDeviceToHost));
  if (error > 0) {
    const int j = error - 1;
    fail("stage step: the barrier after stage ", j, " (", stage_name(stages_.at(size_t(j))), ") waited past ",
         double(d_->args.timeout_ns) / 1e9, " s (a block not resident, or a stage that did not end)");
  }
}

void StageStep::reset() {
  const SArgs& a = d_->args;
  KESTREL_CUDA_CHECK(cudaMemset(a.arrived, 0, 4));
  KESTREL_CUDA_CHECK(cudaMemset(a.epoch, 0, 4));
  KESTREL_CUDA_CHECK(cudaMemset(a.blocks_done, 0, 4));
  KESTREL_CUDA_CHECK(cudaMemset(a.error, 0, 4));
}

}  // namespace kestrel::cuda
