// NVFP4 -> float dequantization on the GPU, the building block of the prefill path (dequantize
// a layer's weights once, then multiply with dense GEMMs) and the GPU test of the format.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

namespace kestrel::cuda {

// codes: [rows, k/2] packed E2M1, scales: [rows, k/16] E4M3, out: [rows, k] float. k % 16 == 0.
cudaError_t nvfp4_dequant(const uint8_t* codes, const uint8_t* scales, float scale2, int64_t rows, int64_t k,
                          float* out, cudaStream_t stream);

}  // namespace kestrel::cuda
