// Weight-only matrix-vector products for decode (batch 1-8 per pass; more in passes of 8):
// y = x W^T (+ bias) (+ residual), for all storage formats, float32 accumulation.
#pragma once
#include <cuda_runtime.h>

#include "backend/cuda/dlinear.h"

namespace kestrel::cuda {

// Up to three matrices that read the same input (q, k and v), in one launch.
struct LinearJob {
  DLinear w;
  float* y = nullptr;  // [batch, w.out]
};

// x: [batch, in] float32. If `accumulate`, y += result (residual add), else y = result.
void launch_linear(const LinearJob* jobs, int njobs, const float* x, int batch, bool accumulate, cudaStream_t s);

// out[b, n] = silu(gate[n] . x[b]) * (up[n] . x[b]): dense MLP or shared expert, first half.
void launch_gated(const DLinear& gate, const DLinear& up, const float* x, int batch, float* out, cudaStream_t s);

}  // namespace kestrel::cuda
