#include "plan/decode_cost.h"

#include "plan/roofline.h"

namespace kestrel {

double expected_distinct_experts(const ModelConfig& c, int batch) {
  if (c.num_experts <= 0) return 0.0;
  const double E = double(c.num_experts);
  return expected_distinct_experts(E, E, double(c.experts_per_token), batch);
}

std::vector<std::pair<std::string, double>> DecodeCost::parts() const {
  return {{"attention weights", attention}, {"dense FFN", dense_ffn},       {"routed experts", routed_experts},
          {"shared experts", shared_experts}, {"router", router},          {"embedding rows", embedding},
          {"LM head", lm_head},               {"KV cache", kv_cache}};
}

DecodeCost decode_cost(const ModelConfig& c, int batch, int64_t context, double kv_bytes) {
  // The one-GPU roofline (bandwidth and link do not change bytes).
  const Roofline r = roofline(step_shapes(c), Layout{}, batch, context, kv_bytes, 1.0, gpu_table().front());
  DecodeCost d;
  for (const RooflinePart& p : r.parts) {
    double* slot = nullptr;
    switch (p.part) {
      case Part::Attention: slot = &d.attention; break;
      case Part::DenseFfn: slot = &d.dense_ffn; break;
      case Part::RoutedExperts: slot = &d.routed_experts; break;
      case Part::SharedExperts: slot = &d.shared_experts; break;
      case Part::Router: slot = &d.router; break;
      case Part::Embedding: slot = &d.embedding; break;
      case Part::LmHead: slot = &d.lm_head; break;
    }
    *slot += p.bytes;
  }
  d.kv_cache = r.kv_bytes;
  d.expected_experts = r.expected_experts;
  return d;
}

}  // namespace kestrel
