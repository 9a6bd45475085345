// Quantization settings of a checkpoint: NVIDIA ModelOpt NVFP4 (hf_quant_config.json or
// quantization_config with quant_method "modelopt"), compressed-tensors "nvfp4-pack-quantized"
// and "float-quantized" (FP8), and FP8 with quant_method "fp8" (block-scaled: DeepSeek-V3/R1,
// GLM-4.5-FP8, Qwen3-FP8; one scale per tensor: AutoFP8). They say which linear modules are
// stored quantized, and how; the loader then checks that the tensors agree.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "formats/fp8.h"

namespace kestrel {

enum class QuantMethod { None, ModelOpt, CompressedTensors, Fp8 };

// What one FP8 scale covers: a block (DeepSeek's weight_block_size), an output channel, the tensor.
enum class Fp8Scaling { Block, Channel, Tensor };

struct QuantConfig {
  QuantMethod method = QuantMethod::None;
  std::string source;                 // file the settings came from
  std::string algo;                   // "NVFP4" or "FP8"
  int group_size = 16;                // NVFP4
  Fp8Scaling fp8_scaling = Fp8Scaling::Block;
  Fp8Blocks fp8_block;                // Fp8Scaling::Block
  // ModelOpt fnmatch patterns, compressed-tensors ignore entries, or FP8 modules_to_not_convert
  std::vector<std::string> exclude;
  // quant_method "fp8": where vLLM's ignored_layers entries start in `exclude`, after
  // modules_to_not_convert's (so that errors name the entry's own field).
  size_t ignored_layers_start = SIZE_MAX;

  bool is_quantized() const { return method != QuantMethod::None; }
  bool is_fp8() const { return algo == "FP8"; }
  // Whether the linear module with this full name (e.g. "model.layers.0.self_attn.q_proj") is
  // stored quantized under these settings.
  bool quantizes(const std::string& module) const;
  // The weights each FP8 scale of a matrix [out, in] covers.
  Fp8Blocks fp8_blocks(int64_t out, int64_t in) const;
  // The settings' name for the modules left unquantized ("exclude_modules", "ignore", ...).
  const char* exclude_key() const;
  // exclude[i] named for errors: "config.json: quantization_config.modules_to_not_convert[2] 'ENTRY'".
  std::string exclude_where(size_t i) const;
  // The name of an FP8 weight's scale tensor: "weight_scale_inv" (block-scaled quant_method "fp8")
  // or "weight_scale".
  const char* fp8_scale_name() const;
  std::string describe() const;
};

// Reads hf_quant_config.json in `dir` if present, else config.json's quantization_config.
QuantConfig load_quant_config(const std::string& dir, const nlohmann::json& config, const std::string& config_path);

// fnmatch-style wildcard match: '*' any run (dots included), '?' one character, '[...]' a set.
bool glob_match(const std::string& pattern, const std::string& text);

// Whether a modules_to_not_convert entry covers the module, as transformers decides: the entry, a
// regular expression, matches from the start of the name up to a module boundary ("model.layers.1"
// covers "model.layers.1.mlp", not "model.layers.11.mlp"; "model.layers.*.mlp.gate" every router),
// or the name ends with it ("mlp.gate" covers "model.layers.3.mlp.gate", not its gate_proj).
// Regular expressions run on PCRE2 under match, depth and heap limits; a pattern that does not
// compile, or a match past the limits (catastrophic backtracking), fails naming `where` (the
// entry, its file and field: QuantConfig::exclude_where).
bool not_convert_match(const std::string& entry, const std::string& module, const std::string& where);

}  // namespace kestrel
