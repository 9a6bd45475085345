// The linear modules of a loaded model that NVFP4 may hold, under their Hugging Face names, and
// the settings (exclude patterns) that say which of them are quantized.
#pragma once
#include <string>
#include <vector>

#include "formats/quant_config.h"
#include "model/weights.h"

namespace kestrel {

struct QuantTarget {
  std::string module;      // Hugging Face module name, e.g. "model.layers.0.self_attn.q_proj"
  Linear* linear = nullptr;
  // Modules that read the same input and that servers fuse into one matrix (q/k/v of a layer;
  // gate/up of an MLP or an expert) share a group: one per-tensor scale for all of them, as
  // ModelOpt exports them (vLLM and TensorRT-LLM keep one weight_scale_2 per fused matrix).
  int group = 0;
  // For experts held fused in the checkpoint (transformers 5: experts.gate_up_proj [E, 2I, H],
  // experts.down_proj [E, H, I]), the name of the tensor the linear is a slice of; else empty.
  std::string fused;
};

// The attention projections, dense MLPs, routed and shared experts of every layer, in layer
// order. Never the embeddings, the LM head or the routers.
std::vector<QuantTarget> quant_targets(Model& m);

// ModelOpt's default exclusions for the family: the LM head, for MoE models the routers, and for
// MLA families all attention (as NVIDIA's DeepSeek-R1 and GLM-5 NVFP4 checkpoints).
std::vector<std::string> default_nvfp4_exclude(const ModelConfig& c);

// NVFP4 ModelOpt settings with the default exclusions plus `extra` patterns. `source` names where
// they come from in messages ("--quant nvfp4", an output config.json).
QuantConfig nvfp4_settings(const ModelConfig& c, const std::vector<std::string>& extra, const std::string& source);

// Block-scaled FP8 settings (quant_method "fp8", 128 x 128 blocks, as DeepSeek-V3's) leaving
// lm_head and the `extra` modules_to_not_convert entries unquantized. Every linear of the layers is
// FP8 by default, attention included, as in DeepSeek's, Qwen3's and GLM's FP8 checkpoints.
QuantConfig fp8_settings(const std::vector<std::string>& extra, const std::string& source);

}  // namespace kestrel
