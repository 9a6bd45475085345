#include "model/model_config.h"

#include <filesystem>
#include <sstream>

#include "common/error.h"
#include "formats/json_file.h"
#include "model/families.h"

namespace kestrel {
namespace fs = std::filesystem;

int64_t ModelConfig::num_moe_layers() const {
  int64_t n = 0;
  for (bool b : moe_layer) n += b;
  return n;
}

std::vector<std::string> supported_architectures() {
  std::vector<std::string> out;
  for (const auto& [name, _] : family_adapters()) out.push_back(name);
  return out;
}

namespace {

void check_positive(const std::string& file, const char* key, int64_t v) {
  if (v <= 0) fail(file, ": '", key, "' must be positive, got ", v);
}

}  // namespace

ModelConfig parse_model_config(const nlohmann::json& j, const std::string& path) {
  if (!j.is_object()) fail(path, ": config is not a JSON object");
  JsonFields cfg(j, path);
  ModelConfig m;
  m.source = path;
  auto arch = j.find("architectures");
  if (arch == j.end() || !arch->is_array() || arch->empty() || !(*arch)[0].is_string())
    fail(path, ": missing 'architectures' (a list naming the model class)");
  m.architecture = (*arch)[0].get<std::string>();
  const auto& adapters = family_adapters();
  auto adapter = adapters.find(m.architecture);
  if (adapter == adapters.end()) {
    std::string known;
    for (const auto& [n, _] : adapters) known += (known.empty() ? "" : ", ") + n;
    fail(path, ": architecture '", m.architecture, "' is not supported (supported: ", known, ")");
  }
  m.model_type = cfg.get_str("model_type", "");

  m.vocab_size = cfg.get_int("vocab_size");
  m.hidden_size = cfg.get_int("hidden_size");
  m.num_layers = cfg.get_int("num_hidden_layers");
  m.num_heads = cfg.get_int("num_attention_heads");
  check_positive(path, "vocab_size", m.vocab_size);
  check_positive(path, "hidden_size", m.hidden_size);
  check_positive(path, "num_hidden_layers", m.num_layers);
  check_positive(path, "num_attention_heads", m.num_heads);
  m.num_kv_heads = cfg.get_int("num_key_value_heads", m.num_heads);
  check_positive(path, "num_key_value_heads", m.num_kv_heads);
  if (m.num_heads % m.num_kv_heads != 0)
    fail(path, ": num_attention_heads (", m.num_heads, ") is not a multiple of num_key_value_heads (", m.num_kv_heads, ")");
  m.head_dim = cfg.get_int("head_dim", m.hidden_size / m.num_heads);
  check_positive(path, "head_dim", m.head_dim);
  if (!cfg.has("head_dim") && m.hidden_size % m.num_heads != 0)
    fail(path, ": hidden_size is not a multiple of num_attention_heads and no head_dim is given");
  m.rms_norm_eps = float(cfg.get_num("rms_norm_eps", 1e-6));
  if (!(m.rms_norm_eps > 0)) fail(path, ": rms_norm_eps must be positive");
  m.tie_word_embeddings = cfg.get_bool("tie_word_embeddings", false);
  m.max_position_embeddings = cfg.get_int("max_position_embeddings", 4096);
  check_positive(path, "max_position_embeddings", m.max_position_embeddings);
  m.intermediate_size = cfg.get_int("intermediate_size", 0);
  const std::string act = cfg.get_str("hidden_act", cfg.get_str("hidden_activation", "silu"));
  if (act != "silu") fail(path, ": hidden_act '", act, "' is not supported (silu)");
  // Hard limits keep a malformed config from asking for absurd allocations.
  if (m.hidden_size > (1 << 17) || m.num_layers > 1024 || m.num_heads > 4096 || m.head_dim > 4096 ||
      m.vocab_size > (1 << 24))
    fail(path, ": model dimensions are implausibly large");

  m.num_nextn_predict_layers = cfg.get_int("num_nextn_predict_layers", 0);
  if (m.num_nextn_predict_layers < 0 || m.num_nextn_predict_layers > 64)
    fail(path, ": num_nextn_predict_layers must be between 0 and 64, got ", m.num_nextn_predict_layers);
  m.rope = parse_rope(j, path, m.head_dim, m.max_position_embeddings);
  adapter->second(cfg, m);

  if (m.moe_layer.size() != size_t(m.num_layers)) fail(path, ": internal: layer layout not set");
  const bool any_dense = m.num_moe_layers() < m.num_layers;
  if (any_dense) check_positive(path, "intermediate_size", m.intermediate_size);
  if (m.num_moe_layers() > 0) {
    check_positive(path, "number of experts", m.num_experts);
    check_positive(path, "num_experts_per_tok", m.experts_per_token);
    check_positive(path, "moe_intermediate_size", m.moe_intermediate_size);
    if (m.experts_per_token > m.num_experts)
      fail(path, ": num_experts_per_tok (", m.experts_per_token, ") exceeds the number of experts (", m.num_experts, ")");
    if (m.num_experts > 4096) fail(path, ": number of experts is implausibly large");
    if (m.router == RouterKind::SigmoidBias) {
      check_positive(path, "n_group", m.n_group);
      check_positive(path, "topk_group", m.topk_group);
      if (m.num_experts % m.n_group != 0)
        fail(path, ": number of experts (", m.num_experts, ") is not a multiple of n_group (", m.n_group, ")");
      if (m.topk_group > m.n_group) fail(path, ": topk_group (", m.topk_group, ") exceeds n_group (", m.n_group, ")");
      if (m.num_experts / m.n_group < 2 && m.n_group > 1)
        fail(path, ": group-limited routing needs at least 2 experts per group");
      if (m.topk_group * (m.num_experts / m.n_group) < m.experts_per_token)
        fail(path, ": topk_group x experts per group is smaller than num_experts_per_tok");
    }
    if (m.num_shared_experts < 0) fail(path, ": n_shared_experts must not be negative");
  }
  return m;
}

ModelConfig parse_model_config_and_quant(const nlohmann::json& config, const std::string& config_path) {
  ModelConfig m = parse_model_config(config, config_path);
  m.quant = load_quant_config(fs::path(config_path).parent_path().string(), config, config_path);
  return m;
}

ModelConfig load_model_config(const std::string& dir) {
  const std::string path = (fs::path(dir) / "config.json").string();
  if (!fs::exists(path)) fail(dir, ": no config.json in this folder");
  const nlohmann::json j = read_json_file(path);
  ModelConfig m = parse_model_config_and_quant(j, path);

  // EOS/BOS: generation_config.json wins over config.json.
  JsonFields cfg(j, path);
  m.eos_token_ids = cfg.get_int_list("eos_token_id");
  m.bos_token_id = cfg.has("bos_token_id") && j.at("bos_token_id").is_number_integer() ? cfg.get_int("bos_token_id") : -1;
  const std::string gen_path = (fs::path(dir) / "generation_config.json").string();
  if (fs::exists(gen_path)) {
    const nlohmann::json g = read_json_file(gen_path);
    if (!g.is_object()) fail(gen_path, ": not a JSON object");
    JsonFields gen(g, gen_path);
    if (gen.has("eos_token_id")) m.eos_token_ids = gen.get_int_list("eos_token_id");
    if (gen.has("bos_token_id")) m.bos_token_id = gen.get_int("bos_token_id");
  }
  return m;
}

std::string ModelConfig::summary() const {
  std::ostringstream s;
  s << "architecture      " << architecture << " (model_type " << model_type << ")\n"
    << "layers            " << num_layers << " (" << num_moe_layers() << " MoE, " << num_layers - num_moe_layers()
    << " dense)\n"
    << "hidden            " << hidden_size << ", vocab " << vocab_size
    << (tie_word_embeddings ? ", tied embeddings" : "") << "\n"
    << "attention         ";
  if (is_mla()) {
    s << "MLA " << num_heads << " heads, latent " << mla.kv_lora_rank << " + rope " << mla.qk_rope_head_dim
      << ", qk " << mla.qk_nope_head_dim << "+" << mla.qk_rope_head_dim << ", v " << mla.v_head_dim;
    if (mla.q_lora_rank) s << ", q latent " << mla.q_lora_rank;
    if (indexer.enabled()) {
      int64_t own = 0;
      for (bool b : indexer.own) own += b;
      s << "\n                  DSA indexer: top " << indexer.topk << " positions, " << indexer.heads << " heads of "
        << indexer.head_dim << ", " << own << " of " << num_layers << " layers select (others reuse)";
    }
  } else {
    s << "GQA " << num_heads << " heads / " << num_kv_heads << " KV heads, head_dim " << head_dim;
  }
  s << (qkv_bias ? ", QKV bias" : "") << (o_bias ? ", O bias" : "") << (qk_norm ? ", QK norm" : "") << "\n"
    << "rotary            " << rope.type << ", theta " << rope.theta << ", rotary dim " << rope.rotary_dim
    << (rope.interleaved ? " (interleaved)" : "") << "\n";
  if (num_layers - num_moe_layers() > 0) s << "dense FFN         SiLU-gated, intermediate " << intermediate_size << "\n";
  if (num_moe_layers() > 0) {
    s << "experts           " << num_experts << " routed, top-" << experts_per_token << ", width "
      << moe_intermediate_size;
    if (num_shared_experts) s << ", " << num_shared_experts << " shared";
    s << "\nrouter            " << (router == RouterKind::Softmax ? "softmax" : "sigmoid + correction bias");
    if (router == RouterKind::SigmoidBias && n_group > 1) s << ", groups " << n_group << " (top " << topk_group << ")";
    s << (norm_topk_prob ? ", renormalized" : "");
    if (routed_scaling_factor != 1.0f) s << ", scaled x" << routed_scaling_factor;
    s << "\n";
  }
  if (num_nextn_predict_layers > 0)
    s << "MTP (NextN)       " << num_nextn_predict_layers << " layer" << (num_nextn_predict_layers > 1 ? "s" : "")
      << " announced (model.layers." << num_layers << (num_nextn_predict_layers > 1 ? "..." : "") << ")\n";
  // GGUF files carry a format per tensor instead of settings: the storage lines tell those.
  if (quant.is_quantized() || architecture.find("GGUF") == std::string::npos)
    s << "quantization      " << quant.describe() << "\n";
  return s.str();
}

}  // namespace kestrel
