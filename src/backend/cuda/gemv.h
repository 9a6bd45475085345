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
// With norm.w, x is first normalized (RMSNorm): inside the product's kernel where
// linear_fuses_norm says it can be, else by a separate launch into norm.out, which must then be
// set; where norm.frag is set and linear_takes_fragment_rows, that launch also writes the rows
// into it as fragment rows, which the product then reads (norm.out may then be null).
// x_frag: x also as fragment rows (slot_mma.cuh), which the product reads where
// linear_takes_fragment_rows (not with norm).
void launch_linear(const LinearJob* jobs, int njobs, const float* x, int batch, bool accumulate, cudaStream_t s,
                   RowNorm norm = {}, const uint32_t* x_frag = nullptr);

// Whether launch_linear's tensor-core kernel reads fragment rows of the input for these jobs and
// batch: 1-7 tokens (KESTREL_LINEAR_FRAG_MIN_BATCH moves the 1), NVFP4 rows of whole 128-weight
// chunks, one K (KESTREL_LINEAR_FRAG=0: never, for A/B runs).
bool linear_takes_fragment_rows(const LinearJob* jobs, int njobs, int batch);

// Whether launch_linear applies a RowNorm inside its product kernel for these jobs and batch (one
// token on the CUDA-core kernel, rows of at most kRowNormMax floats), given whether the RowNorm has
// room for fragment rows (frag): with it, large products (12 M weights and up) take a
// normalization launch that writes those and tensor cores instead.
bool linear_fuses_norm(const LinearJob* jobs, int njobs, int batch, bool frag_room);

// out[b, n] = silu(gate[n] . x[b]) * (up[n] . x[b]): dense MLP or shared expert, first half.
void launch_gated(const DLinear& gate, const DLinear& up, const float* x, int batch, float* out, cudaStream_t s);

}  // namespace kestrel::cuda
