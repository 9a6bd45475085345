// The Hugging Face config.json and generation_config.json that describe a model read from GGUF,
// for writing it as a Hugging Face folder (kestrel quantize). parse_model_config of the result
// gives back the same ModelConfig.
#pragma once
#include <nlohmann/json.hpp>

#include "model/model_config.h"

namespace kestrel {

// Llama, Qwen2, Qwen3 and Qwen3-MoE; other families, and settings the family's config cannot
// express (e.g. Llama with Q/K/V biases but no output bias), fail naming what is missing.
nlohmann::ordered_json hf_config_json(const ModelConfig& c);
nlohmann::ordered_json hf_generation_config_json(const ModelConfig& c);

}  // namespace kestrel
