// Quantization settings of a checkpoint: NVIDIA ModelOpt NVFP4 (hf_quant_config.json or
// quantization_config with quant_method "modelopt") and compressed-tensors
// "nvfp4-pack-quantized". They say which linear modules are stored as NVFP4; the loader then
// checks that the tensors agree.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace kestrel {

enum class QuantMethod { None, ModelOpt, CompressedTensors };

struct QuantConfig {
  QuantMethod method = QuantMethod::None;
  std::string source;                 // file the settings came from
  std::string algo;                   // "NVFP4"
  int group_size = 16;
  std::vector<std::string> exclude;   // ModelOpt fnmatch patterns, or compressed-tensors ignore entries

  bool is_quantized() const { return method != QuantMethod::None; }
  // Whether the linear module with this full name (e.g. "model.layers.0.self_attn.q_proj") is
  // stored as NVFP4 under these settings.
  bool quantizes(const std::string& module) const;
  std::string describe() const;
};

// Reads hf_quant_config.json in `dir` if present, else config.json's quantization_config.
QuantConfig load_quant_config(const std::string& dir, const nlohmann::json& config, const std::string& config_path);

// fnmatch-style wildcard match: '*' any run (dots included), '?' one character, '[...]' a set.
bool glob_match(const std::string& pattern, const std::string& text);

}  // namespace kestrel
