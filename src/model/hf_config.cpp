#include "model/hf_config.h"

#include <cstdio>
#include <string>

#include "common/error.h"

namespace kestrel {
namespace {

// A float32 value as the shortest decimal that reads back as the same float (1e-05, not
// 9.999999747378752e-06).
double shortest(float v) {
  char buf[32];
  for (int digits = 6; digits <= 9; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*g", digits, double(v));
    if (std::stof(buf) == v) break;
  }
  return std::stod(buf);
}

nlohmann::ordered_json eos_json(const ModelConfig& c) {
  if (c.eos_token_ids.size() == 1) return c.eos_token_ids[0];
  return c.eos_token_ids;
}

}  // namespace

nlohmann::ordered_json hf_config_json(const ModelConfig& c) {
  std::string arch = c.architecture;
  if (const size_t p = arch.find(" (GGUF)"); p != std::string::npos) arch.erase(p);
  std::string model_type;
  if (arch == "LlamaForCausalLM") model_type = "llama";
  else if (arch == "Qwen2ForCausalLM") model_type = "qwen2";
  else if (arch == "Qwen3ForCausalLM") model_type = "qwen3";
  else if (arch == "Qwen3MoeForCausalLM") model_type = "qwen3_moe";
  else fail(c.source, ": writing ", arch, " as a Hugging Face folder is not supported (Llama, Qwen2, Qwen3, Qwen3-MoE)");
  if (c.num_shared_experts > 0) fail(c.source, ": shared experts cannot be written for ", arch);

  nlohmann::ordered_json j;
  j["architectures"] = {arch};
  j["model_type"] = model_type;
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_layers;
  j["num_attention_heads"] = c.num_heads;
  j["num_key_value_heads"] = c.num_kv_heads;
  j["head_dim"] = c.head_dim;
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = shortest(c.rms_norm_eps);
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["rope_theta"] = c.rope.theta;
  if (c.rope.rotary_dim != c.head_dim) fail(c.source, ": partial rotary cannot be written for ", arch);
  if (c.rope.type == "default") {
    j["rope_scaling"] = nullptr;
  } else if (c.rope.type == "linear") {
    j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", c.rope.factor}};
  } else {
    fail(c.source, ": rope scaling '", c.rope.type, "' cannot be written yet (default or linear)");
  }
  if (c.bos_token_id >= 0) j["bos_token_id"] = c.bos_token_id;
  if (!c.eos_token_ids.empty()) j["eos_token_id"] = eos_json(c);
  j["torch_dtype"] = "bfloat16";

  const bool all_bias = c.qkv_bias && c.o_bias, no_bias = !c.qkv_bias && !c.o_bias;
  if (model_type == "qwen2") {
    if (!c.qkv_bias || c.o_bias || c.qk_norm) fail(c.source, ": Qwen2 has Q/K/V biases, no output bias and no QK norm");
    j["use_sliding_window"] = false;
  } else {
    if (!all_bias && !no_bias)
      fail(c.source, ": ", arch, " has biases on all of q/k/v/o or on none (attention_bias)");
    if (c.qk_norm != (model_type == "qwen3" || model_type == "qwen3_moe"))
      fail(c.source, ": QK norm ", c.qk_norm ? "present" : "absent", ", which ", arch, " cannot express");
    j["attention_bias"] = all_bias;
    if (model_type == "llama") j["mlp_bias"] = false;
  }
  if (model_type == "qwen3_moe") {
    j["num_experts"] = c.num_experts;
    j["num_experts_per_tok"] = c.experts_per_token;
    j["moe_intermediate_size"] = c.moe_intermediate_size;
    j["norm_topk_prob"] = c.norm_topk_prob;
    j["decoder_sparse_step"] = 1;
    nlohmann::ordered_json dense = nlohmann::ordered_json::array();
    for (int64_t i = 0; i < c.num_layers; ++i)
      if (!c.is_moe_layer(i)) dense.push_back(i);
    j["mlp_only_layers"] = dense;
    if (c.intermediate_size <= 0) j["intermediate_size"] = c.moe_intermediate_size;
  } else if (c.num_moe_layers() > 0) {
    fail(c.source, ": ", arch, " with experts cannot be written");
  }
  return j;
}

nlohmann::ordered_json hf_generation_config_json(const ModelConfig& c) {
  nlohmann::ordered_json g = nlohmann::ordered_json::object();
  if (c.bos_token_id >= 0) g["bos_token_id"] = c.bos_token_id;
  if (!c.eos_token_ids.empty()) g["eos_token_id"] = eos_json(c);
  return g;
}

}  // namespace kestrel
