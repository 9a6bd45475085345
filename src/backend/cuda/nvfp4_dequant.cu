#include "backend/cuda/nvfp4_dequant.h"

#include <cuda_fp8.h>

namespace kestrel::cuda {
namespace {

__device__ __forceinline__ float e2m1(uint32_t code) {
  // Magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 for the three low bits; bit 3 is the sign.
  const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float m = mag[code & 7u];
  return (code & 8u) ? -m : m;
}

// One thread per block of 16 weights: 8 bytes of codes and one scale.
__global__ void nvfp4_dequant_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales,
                                     float scale2, int64_t blocks, float* __restrict__ out) {
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= blocks) return;
  __nv_fp8_e4m3 s8;
  s8.__x = scales[b];
  const float s = float(s8) * scale2;
  const uint2 packed = *reinterpret_cast<const uint2*>(codes + b * 8);
  float* o = out + b * 16;
  #pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t byte = ((i < 4 ? packed.x : packed.y) >> (8 * (i & 3))) & 0xffu;
    o[2 * i] = e2m1(byte & 0xfu) * s;
    o[2 * i + 1] = e2m1(byte >> 4) * s;
  }
}

}  // namespace

cudaError_t nvfp4_dequant(const uint8_t* codes, const uint8_t* scales, float scale2, int64_t rows, int64_t k,
                          float* out, cudaStream_t stream) {
  if (k % 16 != 0) return cudaErrorInvalidValue;
  const int64_t blocks = rows * (k / 16);
  if (blocks == 0) return cudaSuccess;
  const int threads = 256;
  nvfp4_dequant_kernel<<<unsigned((blocks + threads - 1) / threads), threads, 0, stream>>>(codes, scales, scale2,
                                                                                          blocks, out);
  return cudaGetLastError();
}

}  // namespace kestrel::cuda
