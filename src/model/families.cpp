#include "model/families.h"

#include <algorithm>
#include <cmath>

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

// The DeepSeek-V3 style MoE (GLM-4.5, DeepSeek-V3, GLM-5): sigmoid router with a correction bias,
// group-limited top-k, routed scaling, shared experts, the first layers dense.
void sigmoid_moe(const JsonFields& cfg, ModelConfig& m, int64_t default_first_dense, double default_scaling) {
  const std::string scoring = cfg.get_str("scoring_func", "sigmoid"), method = cfg.get_str("topk_method", "noaux_tc");
  if (scoring != "sigmoid") fail(cfg.file(), ": scoring_func '", scoring, "' is not supported (sigmoid)");
  if (method != "noaux_tc") fail(cfg.file(), ": topk_method '", method, "' is not supported (noaux_tc)");
  m.num_experts = first_int(cfg, {"n_routed_experts", "num_local_experts"});
  m.experts_per_token = cfg.get_int("num_experts_per_tok");
  m.moe_intermediate_size = cfg.get_int("moe_intermediate_size");
  m.num_shared_experts = cfg.get_int("n_shared_experts", 1);
  m.router = RouterKind::SigmoidBias;
  m.norm_topk_prob = cfg.get_bool("norm_topk_prob", true);
  m.routed_scaling_factor = float(cfg.get_num("routed_scaling_factor", default_scaling));
  m.n_group = cfg.get_int("n_group", 1);
  m.topk_group = cfg.get_int("topk_group", 1);
  if (cfg.get_int("moe_layer_freq", 1) != 1) fail(cfg.file(), ": moe_layer_freq other than 1 is not supported");
  m.moe_layer.assign(size_t(m.num_layers), false);
  if (cfg.has("mlp_layer_types")) {
    const auto& types = cfg.raw().at("mlp_layer_types");
    if (!types.is_array() || int64_t(types.size()) != m.num_layers)
      fail(cfg.file(), ": 'mlp_layer_types' must list one entry per layer (", m.num_layers, ")");
    for (int64_t i = 0; i < m.num_layers; ++i) {
      const auto& t = types[size_t(i)];
      if (t != "dense" && t != "sparse")
        fail(cfg.file(), ": mlp_layer_types[", i, "] is ", t.dump(), " (expected \"dense\" or \"sparse\")");
      m.moe_layer[size_t(i)] = t == "sparse";
    }
    return;
  }
  const int64_t first_dense = cfg.get_int("first_k_dense_replace", default_first_dense);
  if (first_dense < 0) fail(cfg.file(), ": first_k_dense_replace must not be negative");
  for (int64_t i = first_dense; i < m.num_layers; ++i) m.moe_layer[size_t(i)] = true;
}

void glm4_moe(const JsonFields& cfg, ModelConfig& m) {
  m.qkv_bias = cfg.get_bool("attention_bias", false);
  m.o_bias = false;
  m.qk_norm = cfg.get_bool("use_qk_norm", false);
  sigmoid_moe(cfg, m, 1, 1.0);
}

// Multi-head latent attention fields (DeepSeek-V3 and GLM-5). The rotary embedding covers the
// qk_rope_head_dim part of each head only.
void mla(const JsonFields& cfg, ModelConfig& m, bool interleaved) {
  m.attention = AttentionKind::Mla;
  MlaConfig& a = m.mla;
  a.q_lora_rank = cfg.get_int("q_lora_rank", 0);  // null in DeepSeek-V2-Lite style configs
  a.kv_lora_rank = cfg.get_int("kv_lora_rank");
  a.qk_nope_head_dim = cfg.get_int("qk_nope_head_dim");
  a.qk_rope_head_dim = cfg.get_int("qk_rope_head_dim");
  a.v_head_dim = cfg.get_int("v_head_dim");
  if (a.q_lora_rank < 0) fail(cfg.file(), ": q_lora_rank must not be negative");
  for (auto [key, v] : {std::pair{"kv_lora_rank", a.kv_lora_rank}, {"qk_nope_head_dim", a.qk_nope_head_dim},
                        {"qk_rope_head_dim", a.qk_rope_head_dim}, {"v_head_dim", a.v_head_dim}})
    if (v <= 0 || v > 65536) fail(cfg.file(), ": '", key, "' must be positive and plausible, got ", v);
  m.num_kv_heads = m.num_heads;
  m.head_dim = a.qk_head_dim();
  m.qkv_bias = m.o_bias = cfg.get_bool("attention_bias", false);  // q_a_proj, kv_a_proj_with_mqa, o_proj
  m.rope = parse_rope(cfg.raw(), cfg.file(), a.qk_rope_head_dim, m.max_position_embeddings);
  m.rope.interleaved = interleaved;
  // YaRN lengthens the softmax scale by mscale^2 when mscale_all_dim is set.
  double scale = 1.0 / std::sqrt(double(a.qk_head_dim()));
  if (m.rope.type != "default" && m.rope.mscale_all_dim != 0 && m.rope.factor > 1) {
    const double mscale = 0.1 * m.rope.mscale_all_dim * std::log(m.rope.factor) + 1.0;
    scale *= mscale * mscale;
  }
  a.softmax_scale = float(scale);
}

void deepseek_v3(const JsonFields& cfg, ModelConfig& m) {
  mla(cfg, m, cfg.get_bool("rope_interleave", true));
  sigmoid_moe(cfg, m, 3, 1.0);
}

// GLM-5: MLA with interleaved rotary and the DSA indexer. indexer_types (or index_topk_pattern, or
// index_topk_freq / index_skip_topk_offset) says which layers run their own indexer.
void glm_moe_dsa(const JsonFields& cfg, ModelConfig& m) {
  mla(cfg, m, true);
  sigmoid_moe(cfg, m, 3, 1.0);
  IndexerConfig& ix = m.indexer;
  ix.topk = cfg.get_int("index_topk", 2048);
  ix.heads = cfg.get_int("index_n_heads", 32);
  ix.head_dim = cfg.get_int("index_head_dim", 128);
  ix.rope_interleaved = cfg.get_bool("indexer_rope_interleave", true);
  if (ix.topk <= 0) fail(cfg.file(), ": index_topk must be positive, got ", ix.topk);
  if (ix.heads <= 0 || ix.heads > 4096) fail(cfg.file(), ": index_n_heads must be positive and plausible, got ", ix.heads);
  if (ix.head_dim < m.mla.qk_rope_head_dim || ix.head_dim > 65536)
    fail(cfg.file(), ": index_head_dim (", ix.head_dim, ") must be at least qk_rope_head_dim (", m.mla.qk_rope_head_dim, ")");
  if (m.mla.q_lora_rank == 0) fail(cfg.file(), ": the DSA indexer needs q_lora_rank (its queries read the q latent)");
  ix.own.assign(size_t(m.num_layers), true);
  const nlohmann::json& j = cfg.raw();
  if (cfg.has("indexer_types") || cfg.has("index_topk_pattern")) {
    const char* key = cfg.has("indexer_types") ? "indexer_types" : "index_topk_pattern";
    const auto& v = j.at(key);
    std::vector<std::string> types;
    if (v.is_string()) {
      for (char ch : v.get<std::string>()) types.push_back(ch == 'F' ? "full" : ch == 'S' ? "shared" : std::string(1, ch));
    } else if (v.is_array()) {
      for (const auto& e : v) types.push_back(e.is_string() ? e.get<std::string>() : e.dump());
    } else {
      fail(cfg.file(), ": '", key, "' must be a list or a string");
    }
    if (int64_t(types.size()) != m.num_layers)
      fail(cfg.file(), ": '", key, "' has ", types.size(), " entries for ", m.num_layers, " layers");
    for (int64_t i = 0; i < m.num_layers; ++i) {
      const std::string& t = types[size_t(i)];
      if (t != "full" && t != "shared") fail(cfg.file(), ": ", key, "[", i, "] is '", t, "' (expected full or shared)");
      ix.own[size_t(i)] = t == "full";
    }
  } else {
    const int64_t freq = std::max<int64_t>(cfg.get_int("index_topk_freq", 1), 1);
    const int64_t offset = cfg.get_int("index_skip_topk_offset", 2);
    for (int64_t i = 0; i < m.num_layers; ++i) ix.own[size_t(i)] = std::max<int64_t>(i - offset + 1, 0) % freq == 0;
  }
  if (!ix.own[0]) fail(cfg.file(), ": layer 0 cannot reuse an earlier layer's indexer selection (it is 'shared')");
}

}  // namespace

const std::map<std::string, FamilyAdapter>& family_adapters() {
  static const std::map<std::string, FamilyAdapter> table = {
      {"LlamaForCausalLM", llama},     {"Qwen2ForCausalLM", qwen2},
      {"Qwen3ForCausalLM", qwen3},     {"MixtralForCausalLM", mixtral},     {"Qwen3MoeForCausalLM", qwen3_moe},
      {"Glm4MoeForCausalLM", glm4_moe},  {"DeepseekV3ForCausalLM", deepseek_v3},
      {"GlmMoeDsaForCausalLM", glm_moe_dsa},
  };
  return table;
}

}  // namespace kestrel
