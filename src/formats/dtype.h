// Element types of tensors stored in checkpoints.
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace kestrel {

enum class DType : uint8_t { F64, F32, F16, BF16, F8_E4M3, F8_E5M2, I64, I32, I16, I8, U8, BOOL };

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);            // safetensors spelling: "BF16", "F8_E4M3", ...
std::optional<DType> parse_dtype(std::string_view s);

}  // namespace kestrel
