// Writes a loaded model as a Hugging Face checkpoint, tensor by tensor and shard by shard:
// NVFP4 in the NVIDIA ModelOpt layout or block-scaled FP8 in DeepSeek-V3's for the linears the
// settings quantize, everything else as stored (a Hugging Face source) or dequantized to BF16 (a
// GGUF source).
#pragma once
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "model/weights.h"

namespace kestrel {

// Bf16: no linear is quantized.
enum class WriteFormat { Nvfp4, Fp8, Bf16 };

struct WriteOptions {
  WriteFormat format = WriteFormat::Nvfp4;
  // NVFP4: patterns added to ModelOpt's default exclusions; FP8: modules_to_not_convert entries
  // added to lm_head
  std::vector<std::string> exclude;
  // NVFP4: largest |input| of each linear (calibrate_input_amax); input_scale = amax / (6 x 448).
  const std::map<const Linear*, float>* input_amax = nullptr;
  uint64_t shard_bytes = 5'000'000'000ull;
  bool progress = false;
};

struct WriteSummary {
  int tensors = 0, shards = 0, quantized = 0;
  uint64_t bytes = 0;                  // tensor bytes written
  std::vector<std::string> exclude;    // exclude_modules (modules_to_not_convert) as written
};

// Writes `m` into the folder `out` (created; it must not exist or be empty): model-NNNNN-of-NNNNN
// shards of at most shard_bytes (a quantized module's tensors stay together), the index
// model.safetensors.index.json, `config` as config.json with quantization_config added when
// quantizing, and for NVFP4 hf_quant_config.json. Modules stored densely that the settings would
// otherwise quantize (e.g. the embeddings) are added to exclude_modules (modules_to_not_convert),
// so the settings describe the tensors exactly. Fails for a source that is already quantized.
WriteSummary write_checkpoint(Model& m, nlohmann::ordered_json config, const std::string& out, const WriteOptions& o,
                              ThreadPool& pool);

}  // namespace kestrel
