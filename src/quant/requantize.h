// `--quant nvfp4`: a loaded model's linears requantized to NVFP4 in memory, by the same quantizer
// `kestrel quantize` writes checkpoints with (so the weights are identical to that checkpoint's).
#pragma once
#include "common/thread_pool.h"
#include "formats/quant_config.h"
#include "model/weights.h"

namespace kestrel {

// Replaces every quant_targets() linear that `settings` quantizes and that is not NVFP4 already
// by its NVFP4 form, held in m.owned; fusion groups share their per-tensor scale. Sets
// m.config.quant to `settings`. Returns how many linears were requantized.
int requantize_nvfp4(Model& m, const QuantConfig& settings, ThreadPool& pool, bool progress = false);

}  // namespace kestrel
