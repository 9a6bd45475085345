// FP8 quantization as DeepSeek-V3's block-scaled checkpoints (docs/QUANTIZE.md):
//   scale = amax / 448        per block of 128 x 128 weights (partial at the bottom and right
//                             edges), F32, stored as weight_scale_inv (the weight is code x scale)
//   code  = E4M3(w / scale)   round to nearest, ties to even, saturating at 448
// A block of zeros has scale 0 and zero codes.
#pragma once
#include <cstdint>
#include <vector>

#include "common/thread_pool.h"
#include "model/weights.h"

namespace kestrel {

struct Fp8Quantized {
  std::vector<uint8_t> codes;  // [out, in] E4M3
  std::vector<float> scales;   // [ceil(out/128), ceil(in/128)]
};

// Quantizes a whole linear, dequantized from its stored format. Fails naming the module when a
// weight is NaN or infinite.
Fp8Quantized fp8_quantize_linear(const Linear& w, ThreadPool& pool);

}  // namespace kestrel
