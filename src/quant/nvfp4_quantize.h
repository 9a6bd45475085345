// NVFP4 quantization as NVIDIA ModelOpt does it (docs/QUANTIZE.md states every rounding rule):
//   scale_2     = amax / (6 x 448)                    per tensor (or per fusion group), F32
//   block scale = E4M3(block_amax / (6 x scale_2))    per 16 weights along K, clamped to 448
//   code        = E2M1(w / (block scale x scale_2))   round to nearest, ties to even, saturating
// One implementation serves `kestrel quantize` and `--quant nvfp4` at load.
#pragma once
#include <cstdint>
#include <vector>

#include "common/thread_pool.h"
#include "model/weights.h"

namespace kestrel {

inline constexpr float kE2M1Max = 6.0f;
inline constexpr float kE4M3Max = 448.0f;

// The per-tensor scale of weights whose largest magnitude is `amax`.
inline float nvfp4_scale2(float amax) { return amax / (kE2M1Max * kE4M3Max); }

// Quantizes one row of k weights (k % 16 == 0) with per-tensor scale `scale2`: k/2 packed code
// bytes (element 2i in the low nibble) and k/16 E4M3 block scales. The weights must be finite.
void nvfp4_quantize_row(const float* w, int64_t k, float scale2, uint8_t* packed, uint8_t* scales);

// The largest |weight| of a linear, dequantized from its stored format. Fails naming the module
// when a weight is NaN or infinite.
float weight_amax(const Linear& w, ThreadPool& pool);

struct Nvfp4Matrix {
  std::vector<uint8_t> packed;  // [out, in/2]
  std::vector<uint8_t> scales;  // [out, in/16] E4M3
  float scale2 = 0.0f;
};

// Quantizes a whole linear whose per-tensor scale comes from `amax` (its own weight_amax, or the
// largest of the modules a server fuses with it). Fails naming the module when in % 16 != 0.
Nvfp4Matrix quantize_linear(const Linear& w, float amax, ThreadPool& pool);

}  // namespace kestrel
