// NVFP4: 4-bit E2M1 values in blocks of 16 along K, each block with an FP8 E4M3 scale, and one
// FP32 scale per tensor: w = e2m1(code) * e4m3(block scale) * scale2. Two codes per byte, the
// even element in the low nibble.
#pragma once
#include <cstdint>

namespace kestrel {

inline constexpr int kNvfp4Block = 16;

// Dequantizes k weights (k % 16 == 0) of one row into out.
void nvfp4_dequant_row(const uint8_t* packed, const uint8_t* scales, float scale2, int64_t k, float* out);

}  // namespace kestrel
