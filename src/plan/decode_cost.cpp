#include "plan/decode_cost.h"

#include <cmath>

namespace kestrel {

double bytes_per_weight(const ModelConfig& c, const std::string& module) {
  return c.quant.quantizes(module) ? 0.5 + 1.0 / 16.0 : 2.0;
}

double expected_distinct_experts(const ModelConfig& c, int batch) {
  if (c.num_experts <= 0) return 0.0;
  const double E = double(c.num_experts), K = double(c.experts_per_token);
  return E * (1.0 - std::pow(1.0 - K / E, double(batch)));
}

std::vector<std::pair<std::string, double>> DecodeCost::parts() const {
  return {{"attention weights", attention}, {"dense FFN", dense_ffn},       {"routed experts", routed_experts},
          {"shared experts", shared_experts}, {"router", router},          {"embedding rows", embedding},
          {"LM head", lm_head},               {"KV cache", kv_cache}};
}

DecodeCost decode_cost(const ModelConfig& c, int batch, int64_t context, double kv_bytes) {
  DecodeCost d;
  const double H = double(c.hidden_size), hd = double(c.head_dim);
  const double nq = double(c.num_heads), nkv = double(c.num_kv_heads);
  const double B = double(batch);
  auto lin = [&](const std::string& m, double out, double in) { return out * in * bytes_per_weight(c, m); };
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    d.attention += lin(p + "self_attn.q_proj", nq * hd, H) + lin(p + "self_attn.k_proj", nkv * hd, H) +
                   lin(p + "self_attn.v_proj", nkv * hd, H) + lin(p + "self_attn.o_proj", H, nq * hd);
    if (!c.is_moe_layer(i)) {
      const double I = double(c.intermediate_size);
      d.dense_ffn += lin(p + "mlp.gate_proj", I, H) + lin(p + "mlp.up_proj", I, H) + lin(p + "mlp.down_proj", H, I);
      continue;
    }
    const double E = double(c.num_experts), I = double(c.moe_intermediate_size);
    const std::string e0 = p + c.moe_prefix + ".experts.0.";
    const double expert = lin(e0 + c.expert_gate, I, H) + lin(e0 + c.expert_up, I, H) + lin(e0 + c.expert_down, H, I);
    d.expected_experts = expected_distinct_experts(c, batch);
    d.routed_experts += d.expected_experts * expert;
    d.router += E * H * 2.0;
    if (c.num_shared_experts > 0) {
      const double S = I * double(c.num_shared_experts);
      const std::string sp = p + "mlp.shared_experts.";
      d.shared_experts += lin(sp + "gate_proj", S, H) + lin(sp + "up_proj", S, H) + lin(sp + "down_proj", H, S);
    }
  }
  d.embedding = B * H * 2.0;
  d.lm_head = double(c.vocab_size) * H * 2.0;
  d.kv_cache = B * double(context) * double(c.num_layers) * nkv * hd * 2.0 * kv_bytes;
  return d;
}

}  // namespace kestrel
