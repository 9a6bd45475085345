#include "backend/cuda/persistent/persistent_step.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "backend/cuda/check.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/persistent/counters.cuh"
#include "backend/cuda/persistent/op_attention.cuh"
#include "backend/cuda/persistent/op_moe.cuh"
#include "backend/cuda/persistent/op_products.cuh"
#include "backend/cuda/persistent/program.h"
#include "plan/step_plan_check.h"

namespace kestrel::cuda {
namespace {

static_assert(std::is_trivially_copyable_v<DLayer>, "layers are copied to the device as they are");

template <int B, class T>
__device__ void run_instr(const PProgram& P, const PInstr& in, float* smem) {
  switch (StepOp(in.op)) {
    case StepOp::Embed: return embed_rows(P);
    case StepOp::AttnNormQkv: return norm_qkv<B>(P, in);
    case StepOp::QkRopeStore: return qk_rope_store<T>(P, in, smem);
    case StepOp::AttnSplit: return attn_split<T>(P, in, smem);
    case StepOp::AttnCombine: return attn_combine(P, in);
    case StepOp::OProj: return o_proj<B>(P, in);
    case StepOp::FfnNormRouter: return norm_router<B>(P, in);
    case StepOp::Route: return route_tokens(P, in, smem);
    case StepOp::ExpertGateUp: return expert_gate_up<B>(P, in);
    case StepOp::SharedGateUp: return shared_gate_up<B>(P, in);
    case StepOp::ExpertDown: return expert_down(P, in);
    case StepOp::MlpGateUp: return mlp_gate_up<B>(P, in);
    case StepOp::MlpDown: return mlp_down<B>(P, in);
    case StepOp::HeadNormLogits: return head_logits<B>(P, in);
    default: return;  // MLA's ops: refused when the plan is uploaded
  }
}

// One block per SM runs its queue. B: the batch rounded up to 1, 2, 4 or 8 (the products' token
// count); T: the KV cache's values.
template <int B, class T>
__global__ void __launch_bounds__(kPersistentThreads, 1) persistent_step_kernel(PProgram P) {
  extern __shared__ float smem[];
  __shared__ uint32_t round;
  __shared__ int failed;
  if (threadIdx.x == 0) {
    round = *P.epoch + 1;
    failed = 0;
  }
  __syncthreads();
  const int end = P.queue_begin[blockIdx.x + 1];
  for (int k = P.queue_begin[blockIdx.x]; k < end; ++k) {
    const int32_t i = P.queue[k];
    const PInstr in = P.instrs[i];
    if (threadIdx.x == 0) {
      for (int w = 0; w < in.waits; ++w)
        if (!wait_counter(P.counters + in.wait[w], round * uint32_t(P.producers[in.wait[w]]), P.timeout_ns)) {
          atomicCAS(P.error, 0, i + 1);
          failed = 1;
          break;
        }
      __threadfence();  // what the producers wrote, for every thread of the block after the barrier
    }
    __syncthreads();
    if (failed) return;
    run_instr<B, T>(P, in, smem);
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      add_release(P.counters + in.signal, 1u);
    }
  }
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(P.blocks_done, 1u) == gridDim.x - 1) {
      *P.blocks_done = 0;
      __threadfence();
      *P.epoch = round;
    }
  }
}

template <class T>
T* device_copy(const std::vector<T>& v, std::vector<void*>& owned) {
  void* p = nullptr;
  KESTREL_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(1, v.size() * sizeof(T))));
  if (!v.empty()) KESTREL_CUDA_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  owned.push_back(p);
  return static_cast<T*>(p);
}

template <class T>
T* device_zeros(size_t n, std::vector<void*>& owned) {
  void* p = nullptr;
  KESTREL_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(1, n * sizeof(T))));
  KESTREL_CUDA_CHECK(cudaMemset(p, 0, std::max<size_t>(1, n * sizeof(T))));
  owned.push_back(p);
  return static_cast<T*>(p);
}

}  // namespace

struct PersistentStep::Device {
  PProgram program;
  std::vector<void*> owned;
  size_t smem = 0;
  int blocks = 0, counters = 0;
  void (*kernel)(PProgram) = nullptr;
  ~Device() {
    for (void* p : owned) cudaFree(p);
  }
};

PersistentStep::PersistentStep(const DeviceModel& model, Decoder& kv, StepPlan plan)
    : plan_(std::move(plan)), d_(std::make_unique<Device>()) {
  const ModelConfig& c = model.config();
  const StepPlan& p = plan_;
  const int B = p.options.batch;
  if (p.layers != c.num_layers || p.hidden != c.hidden_size || p.vocab != c.vocab_size)
    fail("persistent step: the plan is for another model (", p.architecture, ")");
  if (B < 1 || B > 8) fail("persistent step: 1 to 8 sequences, not ", B);
  if (p.mla) fail("persistent step: the CUDA interpreter has no MLA ops yet (", p.architecture, ")");
  if (B > kv.max_batch()) fail("persistent step: a plan of ", B, " sequences over a decoder of ", kv.max_batch());
  if (int(p.queues.size()) > sm_count())
    fail("persistent step: the plan has ", p.queues.size(), " queues; this GPU has ", sm_count(), " SMs");
  if (p.hidden % 4 != 0 || p.hidden > kRowNormMax) fail("persistent step: hidden size ", p.hidden, " (a multiple of 4 up to ", kRowNormMax, ")");
  if (c.experts_per_token > 32) fail("persistent step: at most 32 experts per token, not ", c.experts_per_token);
  std::vector<void*>& owned = d_->owned;
  PProgram& P = d_->program;

  // Instructions and queues.
  std::vector<PInstr> instrs;
  instrs.reserve(p.instrs.size());
  for (int32_t i = 0; i < int32_t(p.instrs.size()); ++i) {
    const StepInstr& in = p.instrs[size_t(i)];
    if (in.waits.size() > size_t(kMaxWaits))
      fail("persistent step: ", describe_instr(p, i), " waits on ", in.waits.size(), " counters (at most ", kMaxWaits, ")");
    PInstr o{};
    o.op = uint8_t(in.op);
    o.waits = uint8_t(in.waits.size());
    o.layer = int16_t(in.layer);
    o.a = int32_t(in.a), o.b = int32_t(in.b), o.c = int32_t(in.c);
    for (size_t w = 0; w < in.waits.size(); ++w) o.wait[w] = in.waits[w];
    o.signal = in.signal;
    instrs.push_back(o);
  }
  std::vector<int32_t> queue, begin{0};
  for (const auto& q : p.queues) {
    queue.insert(queue.end(), q.begin(), q.end());
    begin.push_back(int32_t(queue.size()));
  }
  std::vector<int32_t> producers;
  for (const StepCounter& k : p.counters) producers.push_back(k.producers);
  P.instrs = device_copy(instrs, owned);
  P.queue = device_copy(queue, owned);
  P.queue_begin = device_copy(begin, owned);
  P.producers = device_copy(producers, owned);
  P.counters = device_zeros<uint32_t>(producers.size(), owned);
  P.epoch = device_zeros<uint32_t>(1, owned);
  P.blocks_done = device_zeros<uint32_t>(1, owned);
  P.error = device_zeros<int32_t>(1, owned);
  d_->blocks = int(p.queues.size());
  d_->counters = int(producers.size());

  // The model and the cache.
  P.layers = device_copy(model.layers(), owned);
  std::vector<KvLayer> layers_kv;
  for (int l = 0; l < int(c.num_layers); ++l) layers_kv.push_back(kv.kv(l));
  P.kv = device_copy(layers_kv, owned);
  P.kv_bf16 = kv.kv_type() == KvType::BF16;
  P.embed = model.embed();
  P.lm_head = model.lm_head();
  P.final_norm = model.final_norm();
  P.rope.inv_freq = model.rope_inv_freq();
  P.rope.scaling = c.rope.attention_scaling();
  P.rope.rotary_dim = int(c.rope.rotary_dim);
  P.rope.interleaved = c.rope.interleaved;
  P.eps = c.rms_norm_eps;
  P.scale = 1.0f / std::sqrt(float(c.head_dim));
  P.batch = B;
  P.hidden = int(p.hidden);
  P.heads = int(p.heads);
  P.kv_heads = int(p.kv_heads);
  P.head_dim = int(p.head_dim);
  P.qkv_rows = int(p.qkv_rows);
  P.splits = int(p.splits);
  P.chunk_max = (kv.max_context() + P.splits - 1) / P.splits;
  P.positions = int(p.expert_positions);
  P.expert_rows = int(p.expert_rows);
  P.shared_rows = int(p.shared_rows);
  P.mlp_rows = int(p.mlp_rows);
  P.vocab = int(p.vocab);
  P.experts = int(c.num_experts);
  P.top_k = int(c.experts_per_token);

  // Buffers: inputs of products hold 8 rows (the products read the B rows of their template).
  const size_t H = size_t(p.hidden), G = size_t(p.heads / p.kv_heads), hd = size_t(p.head_dim);
  P.tokens = kv.tokens();
  P.pos = kv.positions();
  P.x = device_zeros<float>(8 * H, owned);
  P.qkv = device_zeros<float>(8 * size_t(p.qkv_rows), owned);
  P.part = device_zeros<float>(8 * size_t(p.kv_heads) * size_t(p.splits) * G * (hd + 2), owned);
  P.att = device_zeros<float>(8 * size_t(p.heads) * hd, owned);
  P.router = device_zeros<float>(8 * size_t(std::max<int64_t>(c.num_experts, 1)), owned);
  P.route_e = device_zeros<int32_t>(8 * size_t(std::max<int64_t>(c.experts_per_token, 1)), owned);
  P.route_w = device_zeros<float>(8 * size_t(std::max<int64_t>(c.experts_per_token, 1)), owned);
  P.position_expert = device_zeros<int32_t>(size_t(std::max<int64_t>(p.expert_positions, 1)), owned);
  P.expert_position = device_zeros<int32_t>(size_t(std::max<int64_t>(c.num_experts, 1)), owned);
  P.expert_mid = device_zeros<float>(8 * size_t(p.expert_positions) * size_t(p.expert_rows), owned);
  P.shared_mid = device_zeros<float>(8 * size_t(p.shared_rows), owned);
  P.mid = device_zeros<float>(8 * size_t(p.mlp_rows), owned);
  P.logits = device_zeros<float>(size_t(B) * size_t(p.vocab), owned);
  P.xn = device_zeros<float>(size_t(d_->blocks) * 8 * H, owned);
  logits_ = P.logits;

  // Shared memory: the largest of the ops' needs.
  d_->smem = 4 * std::max({2 * hd, G * hd + G * size_t(P.chunk_max), size_t(8) * size_t(P.experts + 64)});
  if (d_->smem > 200u * 1024)
    fail("persistent step: ", d_->smem, " bytes of shared memory (context ", kv.max_context(), " over ", P.splits,
         " splits)");
  const int Bt = B == 1 ? 1 : B == 2 ? 2 : B <= 4 ? 4 : 8;
  auto pick = [&](auto bt) {
    constexpr int R = decltype(bt)::value;
    d_->kernel = P.kv_bf16 ? persistent_step_kernel<R, __nv_bfloat16> : persistent_step_kernel<R, float>;
  };
  if (Bt == 1) pick(std::integral_constant<int, 1>{});
  else if (Bt == 2) pick(std::integral_constant<int, 2>{});
  else if (Bt == 4) pick(std::integral_constant<int, 4>{});
  else pick(std::integral_constant<int, 8>{});
  KESTREL_CUDA_CHECK(cudaFuncSetAttribute(d_->kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(d_->smem)));
  int per_sm = 0;
  KESTREL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, d_->kernel, kPersistentThreads, d_->smem));
  if (per_sm < 1) fail("persistent step: a block of ", kPersistentThreads, " threads and ", d_->smem, " bytes does not fit an SM");
}

PersistentStep::~PersistentStep() = default;

void PersistentStep::run(cudaStream_t s) {
  // Cooperative: every block resident at once, or the launch fails (a block waiting on a counter
  // that an unscheduled block advances would wait forever).
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(d_->blocks));
  cfg.blockDim = dim3(kPersistentThreads);
  cfg.dynamicSmemBytes = d_->smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  KESTREL_CUDA_CHECK(cudaLaunchKernelEx(&cfg, d_->kernel, d_->program));
}

void PersistentStep::check() const {
  int32_t error = 0;
  KESTREL_CUDA_CHECK(cudaMemcpy(&error, d_->program.error, sizeof error, cudaMemcpyDeviceToHost));
  if (error > 0)
    fail("persistent step: ", describe_instr(plan_, error - 1), " waited past ",
         double(d_->program.timeout_ns) / 1e9, " s for a counter (a wrong plan, or a block not resident)");
}

void PersistentStep::reset() {
  const PProgram& P = d_->program;
  KESTREL_CUDA_CHECK(cudaMemset(P.counters, 0, size_t(d_->counters) * 4));
  KESTREL_CUDA_CHECK(cudaMemset(P.epoch, 0, 4));
  KESTREL_CUDA_CHECK(cudaMemset(P.blocks_done, 0, 4));
  KESTREL_CUDA_CHECK(cudaMemset(P.error, 0, 4));
}

}  // namespace kestrel::cuda
