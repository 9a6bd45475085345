// A MoE layer's routed-expert products for a prefill chunk as one grouped GEMM (the GEMM
// prefill, prefill_gemm.h): the rows are sorted by expert (expert_sort.h), NVFP4 weights are
// dequantized to BF16 inside an mma.sync main loop (m16n8k16, float32 accumulation; BF16 weights
// go in as they are), and the tiles are counted from the per-expert counts on the device, so the
// host never reads them.
// The kernel won lab/moe_gemm's comparison (variant v3 there, docs/PERF.md v39-v40: the design,
// the fragment layouts in moe_gemm.cu, the measurements in PERF.md).
//
// Its activations are in the MMA order: every 16-value block of a row 4x4 transposed,
// xp[16 b + 4 i + j] = x[16 b + 4 j + i], so that the two values each half of a B register
// pairs (k and k + 4 of the block, the order in which the weights' codes are turned into BF16
// pairs) are neighbours and a lane's fragments come straight from two 16-byte shared loads
// (measured ~7% faster than the plain order and a byte permute per register). The order
// costs nothing where the rows are written anyway: launch_gather_rows writes the gathered input
// in it, launch_silu_mul_bf16 the activations for down (both with mma_order).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/dlinear.h"

namespace kestrel::cuda {

// One grouped product: expert e's output row is parts[0][e]'s `out` outputs, then parts[1][e]'s
// (gate then up: two matrices with their own scale2; down alone: one part). Every matrix is
// [out, in] in `format`, with `in` a multiple of 32: NVFP4 with 16-byte aligned codes and 4-byte
// aligned scales, or BF16 16-byte aligned (what upload gives); any `out`.
struct MoeGemm {
  const DLinear* parts[2] = {nullptr, nullptr};  // device arrays [experts] (DMoe::gate, up, down)
  DFormat format = DFormat::NVFP4;               // NVFP4 or BF16
  int num_parts = 1;
  int experts = 0;  // at most 1024
  int out = 0, in = 0;
};

// The int scratch launch_moe_gemm needs for `experts`: each expert's first tile and first row.
inline int moe_gemm_scratch_ints(int experts) { return 2 * experts + 1; }

// y [rows, num_parts * out] (float32) = each row of x [rows, in] (BF16, MMA order, sorted by
// expert: expert e's rows follow those of experts 0 .. e - 1) times its expert's matrices^T,
// scale2 included. counts [experts] on the device (ExpertSort::counts, summing to rows). The
// tile shape follows the mean rows per expert (rows / experts): 128 weight rows x 128 tokens at
// 96 and more, else 256 x 64.
void launch_moe_gemm(const MoeGemm& m, const __nv_bfloat16* x, int rows, const int32_t* counts, int32_t* scratch,
                     float* y, cudaStream_t s);

}  // namespace kestrel::cuda
