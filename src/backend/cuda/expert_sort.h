// The routed tokens of a prefill chunk sorted by expert on the device, so that each expert's
// tokens are consecutive rows and its products are one GEMM over them (prefill_gemm.h).
// A pair is (token t, slot j), numbered t * top_k + j; the sort is stable (pairs of one expert
// in pair order), so the rows and the results do not depend on scheduling.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/route.h"

namespace kestrel::cuda {

struct ExpertSort {
  int32_t* counts = nullptr;    // [experts]: the pairs that chose each expert
  int32_t* row_pair = nullptr;  // [pairs]: the pair each sorted row holds (expert e's rows from
                                // counts[0] + .. + counts[e - 1] on)
  int32_t* pair_row = nullptr;  // [pairs]: the sorted row of each pair
};

// Each token's experts and weights [tokens, top_k] from its router logits [tokens, experts], one
// warp per token, with the decode step's selection (route_select.cuh): the same choices.
void launch_select_experts(const DRouter& r, const float* logits, int tokens, int32_t* experts, float* weights,
                           cudaStream_t s);

// Counts per expert, then the stable order: one block per expert each time.
void launch_expert_sort(const int32_t* experts, int pairs, int num_experts, const ExpertSort& out, cudaStream_t s);

// xs[r] = x[token of row_pair[r]] for r < pairs (BF16 rows of `width`); with mma_order, in the
// grouped expert GEMM's order (moe_gemm.h: each 16-value block 4x4 transposed; width % 16 == 0).
void launch_gather_rows(const __nv_bfloat16* x, int width, const int32_t* row_pair, int pairs, int top_k,
                        bool mma_order, __nv_bfloat16* xs, cudaStream_t s);

// residual[t] += sum over slots j in slot order of weights[t, j] * ys[pair_row[t * top_k + j]],
// for t < tokens (float32 rows of `width`).
void launch_combine_experts(const float* ys, int width, const int32_t* pair_row, const float* weights, int tokens,
                            int top_k, float* residual, cudaStream_t s);

}  // namespace kestrel::cuda
