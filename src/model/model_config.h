// One plain description of every supported model family. Families differ by fields, not by
// subclasses: the forward pass is written once and reads these.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "formats/quant_config.h"
#include "model/rope.h"

namespace kestrel {

enum class RouterKind {
  Softmax,      // softmax over all experts, then top-k (Mixtral, Qwen3-MoE)
  SigmoidBias,  // sigmoid scores, top-k on score + correction bias, group-limited (GLM-4.5, DeepSeek-V3)
};

// How expert weights are laid out in the checkpoint.
enum class ExpertLayout {
  PerExpert,  // prefix.experts.N.gate_proj.weight ... (hub layout)
  Fused,      // prefix.experts.gate_up_proj [E, 2I, H] and prefix.experts.down_proj [E, H, I]
};

struct ModelConfig {
  std::string architecture;  // Hugging Face class name, e.g. "Qwen3MoeForCausalLM"
  std::string model_type;    // config.json model_type
  std::string source;        // path of config.json

  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_layers = 0;
  float rms_norm_eps = 1e-6f;
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 0;

  // Attention (grouped-query).
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  bool qkv_bias = false;
  bool o_bias = false;
  bool qk_norm = false;  // RMSNorm over head_dim on q and k before rotary
  RopeConfig rope;

  // Dense feed-forward (SiLU-gated).
  int64_t intermediate_size = 0;

  // Mixture of experts. moe_layer[i] says whether layer i is sparse.
  std::vector<bool> moe_layer;
  int64_t num_experts = 0;
  int64_t experts_per_token = 0;
  int64_t moe_intermediate_size = 0;
  int64_t num_shared_experts = 0;  // shared expert width = moe_intermediate_size * this
  RouterKind router = RouterKind::Softmax;
  bool norm_topk_prob = true;
  float routed_scaling_factor = 1.0f;
  int64_t n_group = 1;
  int64_t topk_group = 1;

  // Checkpoint naming that differs between families.
  std::string moe_prefix = "mlp";            // "block_sparse_moe" for Mixtral
  std::string expert_gate = "gate_proj";     // "w1" for Mixtral
  std::string expert_up = "up_proj";         // "w3"
  std::string expert_down = "down_proj";     // "w2"
  ExpertLayout expert_layout = ExpertLayout::PerExpert;  // decided from the tensors at load

  QuantConfig quant;

  // generation_config.json
  std::vector<int64_t> eos_token_ids;
  int64_t bos_token_id = -1;

  bool is_moe_layer(int64_t i) const { return moe_layer.at(size_t(i)); }
  int64_t num_moe_layers() const;
  std::string summary() const;  // multi-line, for `kestrel inspect`
};

// Reads config.json (+ generation_config.json, quantization settings) from a model folder and
// maps the family's keys onto ModelConfig. Unknown architectures and inconsistent values fail
// with the file and the field named.
ModelConfig load_model_config(const std::string& dir);

// Same, from an already parsed config.json (used by the fuzzer and tests).
ModelConfig parse_model_config(const nlohmann::json& config, const std::string& config_path);
// parse_model_config plus the quantization settings (from the file, or hf_quant_config.json
// beside it): a config file of any name, e.g. configs/qwen3-30b-a3b-nvfp4.json.
ModelConfig parse_model_config_and_quant(const nlohmann::json& config, const std::string& config_path);

std::vector<std::string> supported_architectures();

}  // namespace kestrel
