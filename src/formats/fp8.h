// FP8 weights: E4M3 (FN) codes [out, in], one byte a weight, and float scales over blocks of
// rows x columns: w[r][c] = e4m3(code) x scale[r / rows][c / cols], computed in float32. Every
// checkpoint layout is such a grid: DeepSeek's weight_scale_inv per 128 x 128 block (the blocks at
// the bottom and right edges partial, so the scales are [ceil(out/128), ceil(in/128)]),
// compressed-tensors' weight_scale per output channel (1 x in, stored [out, 1]) or per tensor
// (out x in, stored [1] or as a scalar), as AutoFP8's weight_scale (quant_method "fp8" without
// weight_block_size).
#pragma once
#include <cstdint>

#include "formats/safetensors.h"

namespace kestrel {

inline constexpr int64_t kFp8Block = 128;  // DeepSeek's weight_block_size, also kestrel quantize's
inline constexpr float kFp8Max = 448.0f;   // the largest finite E4M3 value

// The weights one scale covers.
struct Fp8Blocks {
  int64_t rows = kFp8Block, cols = kFp8Block;
  int64_t scale_rows(int64_t out) const { return (out + rows - 1) / rows; }
  int64_t scale_cols(int64_t in) const { return (in + cols - 1) / cols; }
};

// A checked FP8 matrix: views of its codes and scales.
struct Fp8Matrix {
  const uint8_t* codes = nullptr;   // [out, in]
  const uint8_t* scales = nullptr;  // [scale_rows, scale_cols], F32 or BF16
  bool bf16_scales = false;
};

// Checks the codes `w` (F8_E4M3, [out, in], no NaN code: E4M3FN has no infinity, and 0x7f/0xff
// are NaN) and their scales `s` (F32 or BF16, finite, [scale_rows, scale_cols]; a single column may
// also be stored as a vector, a single scale as a scalar). Fails naming the tensor at fault.
Fp8Matrix read_fp8_matrix(const TensorView& w, const TensorView& s, int64_t out, int64_t in, Fp8Blocks b);

// Dequantizes k weights of one row: its codes, and the row of scales of its row block.
void fp8_dequant_row(const uint8_t* codes, const uint8_t* scale_row, bool bf16_scales, int64_t block_cols, int64_t k,
                     float* out);

// The index of the first NaN code among n, or -1.
int64_t fp8_find_nan(const uint8_t* codes, int64_t n);

}  // namespace kestrel
