// A weight matrix in device memory, in its stored format (see model/weights.h): y = x W^T + b.
// Plain data, passed to kernels by value.
#pragma once
#include <cstdint>

namespace kestrel::cuda {

enum class DFormat : uint8_t { F32 = 0, F16 = 1, BF16 = 2, NVFP4 = 3 };  // same order as WeightFormat

struct DLinear {
  int32_t out = 0, in = 0;
  DFormat format = DFormat::BF16;
  const uint8_t* data = nullptr;    // dense [out, in] or NVFP4 codes [out, in/2]
  const uint8_t* scales = nullptr;  // NVFP4 E4M3 block scales [out, in/16]
  float scale2 = 1.0f;              // NVFP4 per-tensor scale
  const float* bias = nullptr;      // [out] or null

  // Stored bytes a full read of the matrix moves.
  __host__ __device__ uint64_t bytes() const {
    const uint64_t n = uint64_t(out) * uint64_t(in);
    switch (format) {
      case DFormat::F32: return n * 4;
      case DFormat::F16:
      case DFormat::BF16: return n * 2;
      case DFormat::NVFP4: return n / 2 + n / 16;
    }
    return 0;
  }
};

// An RMSNorm applied to a kernel's input rows on the fly: x -> w * (x * rsqrt(mean(x^2) + eps)).
// Kernels that take one save the launch (and the wait) of a separate normalization.
struct RowNorm {
  const float* w = nullptr;  // null: no normalization
  float eps = 0.0f;
  float* out = nullptr;      // where a kernel also leaves the normalized rows for later kernels (or null)
  uint32_t* frag = nullptr;  // room for the rows as fragment rows (slot_mma.cuh), which tensor-core kernels
                             // then read instead of splitting them per tile: launch_linear writes them where
                             // its kernel takes them, launch_route always (for one token's experts)
};

}  // namespace kestrel::cuda
