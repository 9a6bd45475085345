// config.json (and its quantization settings) from arbitrary bytes: a ModelConfig or a
// kestrel::Error, never a crash or an absurd allocation.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "formats/quant_config.h"
#include "model/model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(data, data + size);
  } catch (const nlohmann::json::exception&) {
    return 0;
  }
  try {
    kestrel::ModelConfig m = kestrel::parse_model_config(j, "config.json");
    (void)m.rope.inv_freq();
    (void)m.summary();
    kestrel::QuantConfig q = kestrel::load_quant_config("/nonexistent", j, "config.json");
    (void)q.quantizes("model.layers.0.mlp.experts.0.gate_proj");
  } catch (const kestrel::Error&) {
  }
  return 0;
}
