// ggml tensor types as stored in GGUF files: block sizes of every known type (so that any file's
// layout can be validated) and exact float32 row dequantization for the types kestrel computes with.
// Quantized types pack a row of n values into n / block blocks of `bytes` bytes each.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kestrel {

// Type ids as written in GGUF tensor infos (ggml's enum ggml_type).
enum class GgmlType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15,
  IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22, IQ4_XS = 23,
  I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28, IQ1_M = 29, BF16 = 30,
  TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39, NVFP4 = 40, Q1_0 = 41,
};

struct GgmlTypeInfo {
  std::string_view name;
  uint32_t block;  // values per block (1 for plain types)
  uint32_t bytes;  // bytes per block
  bool dequant;    // ggml_dequant_row supports it
};

// Null for ids that are not (or no longer) ggml types.
const GgmlTypeInfo* ggml_type_info(uint32_t type);
std::string ggml_type_name(uint32_t type);  // "Q4_K", or "type 99" for unknown ids

// Writes n floats (n a multiple of the type's block) decoded from `src`, bit-exact with ggml's
// reference dequantization. The type must have `dequant` set.
void ggml_dequant_row(GgmlType type, const uint8_t* src, int64_t n, float* out);

}  // namespace kestrel
