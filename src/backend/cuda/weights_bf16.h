// Weights and activations as BF16 for cuBLAS, and the small element-wise kernels around the
// prefill's GEMMs (prefill_gemm.h): cuBLAS multiplies BF16 on the tensor cores with FP32
// accumulation, so every operand of its dense products is turned into BF16 first, one matrix at
// a time into a scratch buffer, never the whole model at once (the routed experts' NVFP4 is
// dequantized inside their own GEMM instead, moe_gemm.h).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/dlinear.h"

namespace kestrel::cuda {

// The factor a GEMM over a converted matrix applies: scale2 for NVFP4, 1 otherwise.
inline float bf16_alpha(const DLinear& w) { return w.format == DFormat::NVFP4 ? w.scale2 : 1.0f; }

// w's values into dst [w.out, w.in], row-major BF16. NVFP4 weights become code x block scale,
// exact in BF16 (2 significant bits times 4); the per-tensor scale2 is left to the GEMM's alpha
// (bf16_alpha), so no weight is rounded. F16 and F32 are rounded to BF16.
void launch_to_bf16(const DLinear& w, __nv_bfloat16* dst, cudaStream_t s);

// w's values as float32 (NVFP4: with scale2, as the CPU reference computes them) into dst
// [w.out, w.in]: for the router, whose product stays in float32 so that the experts a token
// chooses are those of the decode step and the CPU reference.
void launch_to_f32(const DLinear& w, float* dst, cudaStream_t s);

// y[i] = x[i] rounded to BF16, i < n.
void launch_f32_to_bf16(const float* x, int64_t n, __nv_bfloat16* y, cudaStream_t s);

// The gated activation of `rows` rows of h [rows, 2 * width] (the gate's outputs then the up's,
// float32) into act [rows, width] BF16: silu(gate) * up; with mma_order, each row in the grouped
// expert GEMM's order (moe_gemm.h: each 16-value block 4x4 transposed; width % 16 == 0).
void launch_silu_mul_bf16(const float* h, int64_t rows, int width, bool mma_order, __nv_bfloat16* act,
                          cudaStream_t s);

// y[r, 0 .. n) += bias for r < rows, rows `ld` floats apart.
void launch_add_bias(float* y, const float* bias, int rows, int n, int ld, cudaStream_t s);

// positions[i] = first + i, i < n.
void launch_iota(int32_t* positions, int first, int n, cudaStream_t s);

}  // namespace kestrel::cuda
