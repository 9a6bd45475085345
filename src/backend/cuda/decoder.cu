#include <algorithm>
#include <cmath>

#include "backend/cuda/attention.h"
#include "backend/cuda/check.h"
#include "backend/cuda/decoder.h"
#include "backend/cuda/gemv.h"
#include "backend/cuda/misc.h"
#include "backend/cuda/moe.h"
#include "plan/decode_cost.h"

namespace kestrel::cuda {
namespace {

__global__ void advance_kernel(int32_t* tokens, const int32_t* next, int32_t* positions, int batch) {
  const int b = threadIdx.x;
  if (b < batch) {
    tokens[b] = next[b];
    positions[b] += 1;
  }
}

}  // namespace

template <typename T>
T* Decoder::buffer(size_t n) {
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T));
  if (e != cudaSuccess) fail("out of GPU memory for decode buffers (", (n * sizeof(T)) >> 20, " MiB)");
  buffers_.push_back(p);
  return static_cast<T*>(p);
}

Decoder::Decoder(const DeviceModel& model, int max_batch, int max_context, bool one_sequence)
    : m_(model), max_batch_(max_batch), max_context_(max_context), one_sequence_(one_sequence) {
  const ModelConfig& c = m_.config();
  const size_t B = size_t(max_batch), H = size_t(c.hidden_size), hd = size_t(c.head_dim);
  const size_t nq = size_t(c.num_heads), nkv = size_t(c.num_kv_heads);
  x_ = buffer<float>(B * H);
  xn_ = buffer<float>(B * H);
  q_ = buffer<float>(B * nq * hd);
  k_ = buffer<float>(B * nkv * hd);
  v_ = buffer<float>(B * nkv * hd);
  att_ = buffer<float>(B * nq * hd);
  split_ = attention_split(max_context);
  att_scratch_ = buffer<float>(attention_scratch_floats(max_batch, int(nq), int(hd), split_));
  act_ = buffer<float>(B * size_t(std::max<int64_t>(c.intermediate_size, 1)));
  logits_ = buffer<float>(B * size_t(c.vocab_size));
  const size_t kv = (one_sequence ? 1 : B) * size_t(c.num_layers) * size_t(max_context) * nkv * hd;
  kv_k_ = buffer<float>(kv);
  kv_v_ = buffer<float>(kv);
  tokens_ = buffer<int32_t>(B);
  positions_ = buffer<int32_t>(B);
  next_ = buffer<int32_t>(B);
  uint8_t* am = buffer<uint8_t>(argmax_scratch_bytes(max_batch));
  KESTREL_CUDA_CHECK(cudaMemset(am, 0, argmax_scratch_bytes(max_batch)));
  argmax_ = argmax_scratch(am, max_batch);
  KESTREL_CUDA_CHECK(cudaMemset(tokens_, 0, B * 4));
  KESTREL_CUDA_CHECK(cudaMemset(positions_, 0, B * 4));
  if (c.num_moe_layers() > 0) {
    const size_t slots = B * size_t(c.experts_per_token + (c.num_shared_experts > 0 ? 1 : 0));
    moe_.act_stride = int(std::max(c.moe_intermediate_size, c.moe_intermediate_size * c.num_shared_experts));
    moe_.experts = buffer<int32_t>(B * size_t(c.experts_per_token));
    moe_.weights = buffer<float>(B * size_t(c.experts_per_token));
    moe_.act = buffer<float>(slots * size_t(moe_.act_stride));
    moe_.logits = buffer<float>(B * size_t(c.num_experts));
  }
}

Decoder::~Decoder() {
  for (auto& [key, g] : graphs_) cudaGraphExecDestroy(g);
  for (void* p : buffers_) cudaFree(p);
}

KvLayer Decoder::kv(int layer) const {
  const ModelConfig& c = m_.config();
  const int64_t per_layer = int64_t(max_context_) * c.num_kv_heads * c.head_dim;
  KvLayer l;
  l.k = kv_k_ + layer * per_layer;
  l.v = kv_v_ + layer * per_layer;
  l.seq_stride = one_sequence_ ? 0 : per_layer * c.num_layers;
  return l;
}

void Decoder::step(int batch, cudaStream_t s, OpTimer* timer) {
  if (batch < 1 || batch > max_batch_) fail("decode batch ", batch, " outside 1..", max_batch_);
  const ModelConfig& c = m_.config();
  const int H = int(c.hidden_size), hd = int(c.head_dim), nq = int(c.num_heads), nkv = int(c.num_kv_heads);
  const float eps = c.rms_norm_eps, scale = 1.0f / std::sqrt(float(hd));
  RopeArgs rope;
  rope.inv_freq = m_.rope_inv_freq();
  rope.scaling = c.rope.attention_scaling();
  rope.rotary_dim = int(c.rope.rotary_dim);
  rope.interleaved = c.rope.interleaved;
  int n = 0;
  // Counts launches and, when timing, marks the end of an op with the bytes it must move.
  auto op = [&](const char* name, int launches, double bytes) {
    n += launches;
    if (timer) timer->mark(name, bytes, s);
  };
  const double act = 4.0 * batch;  // bytes per activation element of the batch
  if (timer) timer->begin(s);
  launch_embed(m_.embed(), tokens_, batch, x_, s);
  op("embed", 1, double(m_.embed().bytes()) / double(c.vocab_size) * batch + act * H);
  const double expected_experts = expected_distinct_experts(c, batch);
  for (size_t l = 0; l < m_.layers().size(); ++l) {
    const DLayer& L = m_.layers()[l];
    const KvLayer kvl = kv(int(l));
    launch_rms_norm(x_, L.attn_norm, batch, H, eps, xn_, s);
    op("rms_norm", 1, 2 * act * H);
    const LinearJob qkv[3] = {{L.q, q_}, {L.k, k_}, {L.v, v_}};
    launch_linear(qkv, 3, xn_, batch, false, s);
    op("qkv_proj", 1, double(L.q.bytes() + L.k.bytes() + L.v.bytes()));
    launch_qk_rope_store(q_, k_, v_, batch, nq, nkv, hd, L.q_norm, L.k_norm, eps, rope, positions_, kvl, s);
    op("qk_norm_rope", 1, act * (nq + 2 * nkv) * hd);
    launch_decode_attention(q_, batch, nq, nkv, hd, scale, positions_, kvl, split_, att_scratch_, att_, s);
    op("attention", 2, 0.0);  // KV bytes depend on the positions: the caller adds them
    const LinearJob o[1] = {{L.o, x_}};
    launch_linear(o, 1, att_, batch, true, s);
    op("o_proj", 1, double(L.o.bytes()));
    launch_rms_norm(x_, L.ffn_norm, batch, H, eps, xn_, s);
    op("rms_norm", 1, 2 * act * H);
    if (L.is_moe) {
      launch_route(L.moe.router, xn_, batch, moe_.logits, moe_.experts, moe_.weights, s);
      op("router", 2, double(L.moe.router.w.bytes()));
      launch_moe_experts(L.moe, xn_, batch, x_, moe_, s);
      const double eb = double(m_.expert_bytes(l)) * expected_experts;
      const double shared = L.moe.has_shared
                                ? double(L.moe.shared_gate.bytes() + L.moe.shared_up.bytes() + L.moe.shared_down.bytes())
                                : 0.0;
      op("experts", 2, eb + shared);
    } else {
      launch_gated(L.gate, L.up, xn_, batch, act_, s);
      op("mlp_gate_up", 1, double(L.gate.bytes() + L.up.bytes()));
      const LinearJob d[1] = {{L.down, x_}};
      launch_linear(d, 1, act_, batch, true, s);
      op("mlp_down", 1, double(L.down.bytes()));
    }
  }
  launch_rms_norm(x_, m_.final_norm(), batch, H, eps, xn_, s);
  op("rms_norm", 1, 2 * act * H);
  const LinearJob head[1] = {{m_.lm_head(), logits_}};
  launch_linear(head, 1, xn_, batch, false, s);
  op("lm_head", 1, double(m_.lm_head().bytes()));
  launch_argmax(logits_, batch, int(c.vocab_size), next_, argmax_, s);
  op("argmax", 1, act * double(c.vocab_size));
  launches_ = n;
}

void Decoder::advance(int batch, cudaStream_t s) {
  advance_kernel<<<1, 32 * ((batch + 31) / 32), 0, s>>>(tokens_, next_, positions_, batch);
  KESTREL_CUDA_LAUNCHED();
}

void Decoder::step_graph(int batch, bool adv, cudaStream_t s) {
  auto key = std::make_pair(batch, adv);
  auto it = graphs_.find(key);
  if (it == graphs_.end()) {
    if (s == nullptr) fail("internal: CUDA graphs need a stream other than the legacy default stream");
    cudaGraph_t g;
    KESTREL_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    try {
      step(batch, s);
      if (adv) advance(batch, s);
    } catch (...) {
      cudaStreamEndCapture(s, &g);
      throw;
    }
    KESTREL_CUDA_CHECK(cudaStreamEndCapture(s, &g));
    cudaGraphExec_t exec;
    KESTREL_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
    KESTREL_CUDA_CHECK(cudaGraphDestroy(g));
    it = graphs_.emplace(key, exec).first;
  }
  KESTREL_CUDA_CHECK(cudaGraphLaunch(it->second, s));
}

}  // namespace kestrel::cuda
