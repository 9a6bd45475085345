// Element k of an embedding table's row, in any storage format (the launched embedding and the
// stage step's).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "backend/cuda/dequant.cuh"
#include "backend/cuda/dlinear.h"

namespace kestrel::cuda {

__device__ __forceinline__ float embed_value(const DLinear& t, int row, int k) {
  const int H = t.in;
  switch (t.format) {
    case DFormat::F32: return reinterpret_cast<const float*>(t.data)[size_t(row) * H + k];
    case DFormat::F16: return __half2float(reinterpret_cast<const __half*>(t.data)[size_t(row) * H + k]);
    case DFormat::BF16: return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(t.data)[size_t(row) * H + k]);
    default: {
      const uint8_t byte = t.data[size_t(row) * (H / 2) + k / 2];
      const float2 w = e2m1x2_scaled(byte);
      return (k & 1 ? w.y : w.x) * kE2M1Unscale * e4m3_to_float(t.scales[size_t(row) * (H / 16) + k / 16]) * t.scale2;
    }
  }
}

}  // namespace kestrel::cuda
