#include "model/families.h"

#include <algorithm>

#include "common/error.h"

namespace kestrel {
namespace {

int64_t first_int(const JsonFields& cfg, std::initializer_list<const char*> keys) {
  for (const char* k : keys)
    if (cfg.has(k)) return cfg.get_int(k);
  fail(cfg.file(), ": missing field '", *keys.begin(), "'");
}

void no_sliding_window(const JsonFields& cfg) {
  if (cfg.get_bool("use_sliding_window", false))
    fail(cfg.file(), ": use_sliding_window is true: sliding-window attention is not supported");
}

void all_layers(ModelConfig& m, bool moe) { m.moe_layer.assign(size_t(m.num_layers), moe); }

void llama(const JsonFields& cfg, ModelConfig& m) {
  m.qkv_bias = m.o_bias = cfg.get_bool("attention_bias", false);
  if (cfg.get_bool("mlp_bias", false)) fail(cfg.file(), ": mlp_bias is true: MLP biases are not supported");
  all_layers(m, false);
}

void qwen2(const JsonFields& cfg, ModelConfig& m) {
  no_sliding_window(cfg);
  m.qkv_bias = true;
  all_layers(m, false);
}

void qwen3(const JsonFields& cfg, ModelConfig& m) {
  no_sliding_window(cfg);
  m.qkv_bias = m.o_bias = cfg.get_bool("attention_bias", false);
  m.qk_norm = true;
  all_layers(m, false);
}

void mixtral(const JsonFields& cfg, ModelConfig& m) {
  m.num_experts = first_int(cfg, {"num_local_experts", "num_experts"});
  m.experts_per_token = cfg.get_int("num_experts_per_tok");
  m.moe_intermediate_size = m.intermediate_size;
  m.router = RouterKind::Softmax;
  m.norm_topk_prob = true;  // Mixtral always renormalizes the selected weights
  m.moe_prefix = "block_sparse_moe";
  m.expert_gate = "w1";
  m.expert_up = "w3";
  m.expert_down = "w2";
  all_layers(m, true);
}

void qwen3_moe(const JsonFields& cfg, ModelConfig& m) {
  no_sliding_window(cfg);
  m.qkv_bias = m.o_bias = cfg.get_bool("attention_bias", false);
  m.qk_norm = true;
  m.num_experts = first_int(cfg, {"num_experts", "num_local_experts"});
  m.experts_per_token = cfg.get_int("num_experts_per_tok");
  m.moe_intermediate_size = cfg.get_int("moe_intermediate_size");
  m.norm_topk_prob = cfg.get_bool("norm_topk_prob", false);
  m.router = RouterKind::Softmax;
  const int64_t step = cfg.get_int("decoder_sparse_step", 1);
  if (step <= 0) fail(cfg.file(), ": decoder_sparse_step must be positive, got ", step);
  const auto dense = cfg.get_int_list("mlp_only_layers");
  for (int64_t l : dense)
    if (l < 0 || l >= m.num_layers) fail(cfg.file(), ": mlp_only_layers entry ", l, " is not a layer index");
  m.moe_layer.assign(size_t(m.num_layers), false);
  for (int64_t i = 0; i < m.num_layers; ++i) {
    bool listed = std::find(dense.begin(), dense.end(), i) != dense.end();
    m.moe_layer[size_t(i)] = !listed && m.num_experts > 0 && (i + 1) % step == 0;
  }
}

void glm4_moe(const JsonFields& cfg, ModelConfig& m) {
  m.qkv_bias = cfg.get_bool("attention_bias", false);
  m.o_bias = false;
  m.qk_norm = cfg.get_bool("use_qk_norm", false);
  m.num_experts = first_int(cfg, {"n_routed_experts", "num_local_experts"});
  m.experts_per_token = cfg.get_int("num_experts_per_tok");
  m.moe_intermediate_size = cfg.get_int("moe_intermediate_size");
  m.num_shared_experts = cfg.get_int("n_shared_experts", 1);
  m.router = RouterKind::SigmoidBias;
  m.norm_topk_prob = cfg.get_bool("norm_topk_prob", true);
  m.routed_scaling_factor = float(cfg.get_num("routed_scaling_factor", 1.0));
  m.n_group = cfg.get_int("n_group", 1);
  m.topk_group = cfg.get_int("topk_group", 1);
  const int64_t first_dense = cfg.get_int("first_k_dense_replace", 1);
  m.moe_layer.assign(size_t(m.num_layers), false);
  for (int64_t i = first_dense; i < m.num_layers; ++i) m.moe_layer[size_t(i)] = true;
}

}  // namespace

const std::map<std::string, FamilyAdapter>& family_adapters() {
  static const std::map<std::string, FamilyAdapter> table = {
      {"LlamaForCausalLM", llama},     {"Qwen2ForCausalLM", qwen2},
      {"Qwen3ForCausalLM", qwen3},     {"MixtralForCausalLM", mixtral},     {"Qwen3MoeForCausalLM", qwen3_moe},
      {"Glm4MoeForCausalLM", glm4_moe},
  };
  return table;
}

}  // namespace kestrel
