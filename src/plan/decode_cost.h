// The bytes one decode step must move on one GPU, from the model's shapes and storage formats:
// the floor that every measured step time is reported against (time >= bytes / bandwidth).
// Computed by the roofline (plan/roofline.h) for one GPU.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/model_config.h"

namespace kestrel {

struct DecodeCost {
  // Bytes read per step, by part of the model.
  double attention = 0;       // q, k, v, o projections (+ biases and norms)
  double dense_ffn = 0;       // FFN of dense layers
  double routed_experts = 0;  // the experts the batch selects (expected value under uniform routing)
  double shared_experts = 0;
  double router = 0;
  double embedding = 0;       // one row per token
  double lm_head = 0;
  double kv_cache = 0;        // keys and values read by attention at the given context
  double expected_experts = 0;  // distinct experts per MoE layer for this batch (expected value)

  double total() const {
    return attention + dense_ffn + routed_experts + shared_experts + router + embedding + lm_head + kv_cache;
  }
  std::vector<std::pair<std::string, double>> parts() const;
};

// Distinct experts a batch selects per MoE layer, expected under uniform routing:
// E * (1 - (1 - k/E)^batch). 0 for models without experts.
double expected_distinct_experts(const ModelConfig& c, int batch);

// `batch` sequences, each attending over `context` cached positions, with KV entries of
// `kv_bytes` bytes each.
DecodeCost decode_cost(const ModelConfig& c, int batch, int64_t context, double kv_bytes);

}  // namespace kestrel
