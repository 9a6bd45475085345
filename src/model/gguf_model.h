// GGUF checkpoints (llama.cpp's format) mapped onto the same ModelConfig and weight views as
// Hugging Face folders: general.architecture llama (also with experts, as Mixtral), qwen2, qwen3,
// qwen3moe and glm4moe (GLM-4.5/4.6/4.7: sigmoid router with correction bias, shared experts,
// leading dense layers, partial rotary; its NextN/MTP blocks are skipped). Tensors stay in the
// mapped file in their ggml formats, except the Q and K rows of llama, which llama.cpp's converter
// permutes and which are put back in Hugging Face order in owned memory so that the half-split
// rotary applies unchanged. MXFP4 and NVFP4 weights take their per-tensor scale from llama.cpp's
// NAME.scale tensor.
#pragma once
#include <memory>
#include <string>

#include "formats/gguf.h"
#include "model/model_config.h"
#include "model/weights.h"

namespace kestrel {

// The configuration a GGUF file's metadata (and tensor list: biases, QK norm, MoE layers, tied
// output) describes. Errors name the file and the metadata key.
ModelConfig gguf_model_config(const GgufIndex& g);

// Maps and loads a .gguf file.
std::unique_ptr<Model> load_gguf_model(const std::string& path);

// The weight views of a parsed GGUF image for configuration `c` (from gguf_model_config). Rows
// rewritten at load go to `owned`, which must outlive the result. Every tensor of the file must be
// used. For files in memory (the fuzzer); load_gguf_model wraps it.
ModelWeights gguf_model_weights(const GgufIndex& g, const ModelConfig& c, std::vector<std::vector<uint8_t>>& owned);

// Row i of a llama Q or K projection in Hugging Face order is row gguf_unpermuted_row(i) of the
// GGUF tensor (heads of head_dim rows each; llama.cpp interleaves the two rotary halves).
int64_t gguf_unpermuted_row(int64_t i, int64_t head_dim);

}  // namespace kestrel
