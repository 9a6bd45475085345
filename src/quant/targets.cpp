#include "quant/targets.h"

#include "common/error.h"

namespace kestrel {

std::vector<QuantTarget> quant_targets(Model& m) {
  const ModelConfig& c = m.config;
  std::vector<QuantTarget> out;
  int group = 0;
  auto add = [&](const std::string& module, Linear& l, int g, std::string fused = "") {
    out.push_back({module, &l, g, std::move(fused)});
  };
  auto ffn = [&](const std::string& p, GatedFfn& f, const std::string& g, const std::string& u, const std::string& d,
                 const std::string& fused_prefix = "") {
    const int gu = group++;
    add(p + "." + g, f.gate, gu, fused_prefix.empty() ? "" : fused_prefix + ".gate_up_proj");
    add(p + "." + u, f.up, gu, fused_prefix.empty() ? "" : fused_prefix + ".gate_up_proj");
    add(p + "." + d, f.down, group++, fused_prefix.empty() ? "" : fused_prefix + ".down_proj");
  };
  for (int64_t i = 0; i < c.num_layers; ++i) {
    LayerWeights& L = m.weights.layers[size_t(i)];
    const std::string p = cat("model.layers.", i, ".");
    const int qkv = group++;
    add(p + "self_attn.q_proj", L.q, qkv);
    add(p + "self_attn.k_proj", L.k, qkv);
    add(p + "self_attn.v_proj", L.v, qkv);
    add(p + "self_attn.o_proj", L.o, group++);
    if (!L.is_moe) {
      ffn(p + "mlp", L.mlp, "gate_proj", "up_proj", "down_proj");
      continue;
    }
    const std::string mp = p + c.moe_prefix;
    const bool fused = m.checkpoint && m.checkpoint->has(mp + ".experts.gate_up_proj");
    for (size_t e = 0; e < L.moe.experts.size(); ++e)
      ffn(cat(mp, ".experts.", e), L.moe.experts[e], c.expert_gate, c.expert_up, c.expert_down,
          fused ? mp + ".experts" : "");
    if (L.moe.has_shared) ffn(mp + ".shared_experts", L.moe.shared, "gate_proj", "up_proj", "down_proj");
  }
  return out;
}

std::vector<std::string> default_nvfp4_exclude(const ModelConfig& c) {
  std::vector<std::string> e = {"lm_head"};
  if (c.num_moe_layers() > 0) e.push_back("model.layers.*." + c.moe_prefix + ".gate");
  return e;
}

QuantConfig nvfp4_settings(const ModelConfig& c, const std::vector<std::string>& extra, const std::string& source) {
  QuantConfig q;
  q.method = QuantMethod::ModelOpt;
  q.source = source;
  q.algo = "NVFP4";
  q.group_size = 16;
  q.exclude = default_nvfp4_exclude(c);
  for (const auto& p : extra) {
    if (p.empty()) fail(source, ": an empty exclude pattern");
    q.exclude.push_back(p);
  }
  return q;
}

}  // namespace kestrel
