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
    const std::string a = p + "self_attn.";
    if (c.is_mla()) {
      MlaWeights& w = L.mla;
      const int in = group++;  // q_a (or q) and kv_a read the same normed hidden state
      if (w.q_a.data) {
        add(a + "q_a_proj", w.q_a, in);
        add(a + "q_b_proj", w.q_b, group++);
      } else {
        add(a + "q_proj", w.q, in);
      }
      add(a + "kv_a_proj_with_mqa", w.kv_a, in);
      add(a + "kv_b_proj", w.kv_b, group++);
      if (w.has_indexer) {
        add(a + "indexer.wq_b", w.indexer.wq_b, group++);
        add(a + "indexer.wk", w.indexer.wk, in);
        add(a + "indexer.weights_proj", w.indexer.weights_proj, in);
      }
    } else {
      const int qkv = group++;
      add(a + "q_proj", L.q, qkv);
      add(a + "k_proj", L.k, qkv);
      add(a + "v_proj", L.v, qkv);
    }
    add(a + "o_proj", L.o, group++);
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
  // NVIDIA's DeepSeek-R1 and GLM-5 NVFP4 checkpoints keep multi-head latent attention (and its
  // indexer) in BF16; kestrel's GPU path reads kv_b_proj as BF16.
  if (c.is_mla()) e.push_back("model.layers.*.self_attn*");
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

QuantConfig fp8_settings(const std::vector<std::string>& extra, const std::string& source) {
  QuantConfig q;
  q.method = QuantMethod::Fp8;
  q.source = source;
  q.algo = "FP8";
  q.fp8_scaling = Fp8Scaling::Block;
  q.exclude = {"lm_head"};
  for (const auto& e : extra) {
    if (e.empty()) fail(source, ": an empty modules_to_not_convert entry");
    q.exclude.push_back(e);
  }
  return q;
}

}  // namespace kestrel
