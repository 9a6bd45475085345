#include <algorithm>

#include "backend/cuda/check.h"
#include "backend/cuda/dequant.cuh"
#include "backend/cuda/weights_bf16.h"

namespace kestrel::cuda {
namespace {

constexpr int kThreads = 256;

// Element i of a dense matrix as float.
__device__ __forceinline__ float dense_at(const DLinear& w, int64_t i) {
  switch (w.format) {
    case DFormat::F32: return reinterpret_cast<const float*>(w.data)[i];
    case DFormat::F16: return __half2float(reinterpret_cast<const __half*>(w.data)[i]);
    default: return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(w.data)[i]);
  }
}

// Each thread converts 16 consecutive weights: one NVFP4 block (8 bytes of codes and their scale)
// or 16 dense values.
__global__ void to_bf16_kernel(const DLinear w, __nv_bfloat16* const y) {
  const int64_t n = int64_t(w.out) * w.in, g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g * 16 >= n) return;
  __nv_bfloat16* dst = y + g * 16;
  if (w.format == DFormat::NVFP4) {
    // The codes are row-major [out, in / 2] and the scales [out, in / 16]: block g's 8 bytes sit
    // at g * 8 and its scale at g, whatever the row.
    const uint2 c = reinterpret_cast<const uint2*>(w.data)[g];
    const float scale = e4m3_to_float(w.scales[g]) * kE2M1Unscale;
    float lo[8], hi[8];
    e2m1x8_scaled(c.x, lo);
    e2m1x8_scaled(c.y, hi);
    __align__(16) __nv_bfloat16 out[16];
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
      out[i] = __float2bfloat16_rn(lo[i] * scale);  // exact: at most 6 significant bits
      out[i + 8] = __float2bfloat16_rn(hi[i] * scale);
    }
    reinterpret_cast<uint4*>(dst)[0] = reinterpret_cast<const uint4*>(out)[0];
    reinterpret_cast<uint4*>(dst)[1] = reinterpret_cast<const uint4*>(out)[1];
    return;
  }
  const int64_t end = min(n, g * 16 + 16);
  for (int64_t i = g * 16; i < end; ++i) y[i] = __float2bfloat16_rn(dense_at(w, i));
}

__global__ void to_f32_kernel(DLinear w, float* __restrict__ dst) {
  const int64_t n = int64_t(w.out) * w.in;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    if (w.format != DFormat::NVFP4) {
      dst[i] = dense_at(w, i);
    } else {
      const uint32_t byte = w.data[i / 2];
      const float2 pair = e2m1x2_scaled(byte);
      const float code = (i & 1) ? pair.y : pair.x;
      dst[i] = code * kE2M1Unscale * e4m3_to_float(w.scales[i / 16]) * w.scale2;
    }
  }
}

__global__ void f32_to_bf16_kernel(const float* __restrict__ x, int64_t n, __nv_bfloat16* __restrict__ y) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = __float2bfloat16_rn(x[i]);
}

__global__ void silu_mul_kernel(const float* __restrict__ h, int64_t rows, int width, bool mma_order,
                                __nv_bfloat16* __restrict__ act) {
  const int64_t n = rows * width;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / width;
    int64_t c = i - r * width;
    if (mma_order) c = (c & ~int64_t(15)) + 4 * (c & 3) + ((c >> 2) & 3);  // act[16b + 4i + j] = value 16b + 4j + i
    const float g = h[r * 2 * width + c], u = h[r * 2 * width + width + c];
    act[i] = __float2bfloat16_rn(g / (1.0f + expf(-g)) * u);
  }
}

__global__ void add_bias_kernel(float* __restrict__ y, const float* __restrict__ bias, int n, int ld) {
  float* row = y + size_t(blockIdx.x) * size_t(ld);
  for (int c = threadIdx.x; c < n; c += blockDim.x) row[c] += bias[c];
}

__global__ void iota_kernel(int32_t* positions, int first, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) positions[i] = first + i;
}

// Blocks for an element-wise loop over n values (grid-stride beyond that).
unsigned elementwise_blocks(int64_t n) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, 65536)));
}

}  // namespace

void launch_to_bf16(const DLinear& w, __nv_bfloat16* dst, cudaStream_t s) {
  const int64_t groups = (int64_t(w.out) * w.in + 15) / 16;
  if (groups == 0) return;
  to_bf16_kernel<<<unsigned((groups + kThreads - 1) / kThreads), kThreads, 0, s>>>(w, dst);
  KESTREL_CUDA_LAUNCHED();
}

void launch_to_f32(const DLinear& w, float* dst, cudaStream_t s) {
  to_f32_kernel<<<elementwise_blocks(int64_t(w.out) * w.in), kThreads, 0, s>>>(w, dst);
  KESTREL_CUDA_LAUNCHED();
}

void launch_f32_to_bf16(const float* x, int64_t n, __nv_bfloat16* y, cudaStream_t s) {
  f32_to_bf16_kernel<<<elementwise_blocks(n), kThreads, 0, s>>>(x, n, y);
  KESTREL_CUDA_LAUNCHED();
}

void launch_silu_mul_bf16(const float* h, int64_t rows, int width, bool mma_order, __nv_bfloat16* act,
                          cudaStream_t s) {
  if (rows <= 0) return;
  if (mma_order && width % 16 != 0) fail("internal: activations of width ", width, " in the MMA order");
  silu_mul_kernel<<<elementwise_blocks(rows * width), kThreads, 0, s>>>(h, rows, width, mma_order, act);
  KESTREL_CUDA_LAUNCHED();
}

void launch_add_bias(float* y, const float* bias, int rows, int n, int ld, cudaStream_t s) {
  if (!bias || rows <= 0) return;
  add_bias_kernel<<<unsigned(rows), kThreads, 0, s>>>(y, bias, n, ld);
  KESTREL_CUDA_LAUNCHED();
}

void launch_iota(int32_t* positions, int first, int n, cudaStream_t s) {
  iota_kernel<<<unsigned((n + kThreads - 1) / kThreads), kThreads, 0, s>>>(positions, first, n);
  KESTREL_CUDA_LAUNCHED();
}

}  // namespace kestrel::cuda
