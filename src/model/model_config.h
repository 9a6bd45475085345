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

enum class AttentionKind {
  Gqa,  // grouped-query attention: q/k/v/o projections, a key and a value per KV head cached
  Mla,  // multi-head latent attention: one compressed latent per position cached (DeepSeek-V3, GLM-5)
};

// Multi-head latent attention. Per position the cache holds kv_lora_rank latent values (after
// kv_a_layernorm) and qk_rope_head_dim rotated key values shared by all heads; kv_b_proj expands the
// latent into each head's non-rotary key (qk_nope_head_dim) and value (v_head_dim).
struct MlaConfig {
  int64_t q_lora_rank = 0;  // 0: q_proj reads the hidden state directly (DeepSeek-V2-Lite style)
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  float softmax_scale = 0.0f;  // qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2
  float latent_norm_eps = 1e-6f;  // q_a_layernorm and kv_a_layernorm use the RMSNorm default, not rms_norm_eps
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  int64_t latent() const { return kv_lora_rank + qk_rope_head_dim; }  // cached values per position and layer
};

// DeepSeek sparse attention (GLM-5): a light indexer scores every earlier position and each query
// attends only to the `topk` best. With at most `topk` positions in context it equals dense attention.
struct IndexerConfig {
  int64_t topk = 0;  // 0: no indexer, dense attention
  int64_t heads = 0, head_dim = 0;
  bool rope_interleaved = true;  // rotary on the first qk_rope_head_dim values of each head
  std::vector<bool> own;         // per layer: runs its own indexer (true) or reuses the previous layer's selection
  bool enabled() const { return topk > 0; }
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

  // Attention. For MLA, num_kv_heads = num_heads and head_dim = mla.qk_head_dim().
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  bool qkv_bias = false;
  bool o_bias = false;
  bool qk_norm = false;  // RMSNorm over head_dim on q and k before rotary
  RopeConfig rope;
  AttentionKind attention = AttentionKind::Gqa;
  MlaConfig mla;          // attention == Mla
  IndexerConfig indexer;  // Mla with DeepSeek sparse attention

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

  // Multi-token prediction (DeepSeek-V3 NextN): layers num_layers .. num_layers + this - 1 of the
  // checkpoint, when it holds them (the model loads without them otherwise).
  int64_t num_nextn_predict_layers = 0;

  QuantConfig quant;

  // generation_config.json
  std::vector<int64_t> eos_token_ids;
  int64_t bos_token_id = -1;

  bool is_mla() const { return attention == AttentionKind::Mla; }
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
