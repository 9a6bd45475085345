// Small kernels at the ends of a decode step: embedding lookup and greedy sampling.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/dlinear.h"

namespace kestrel::cuda {

// x[b] = embedding row tokens[b], dequantized to float.
void launch_embed(const DLinear& table, const int32_t* tokens, int batch, float* x, cudaStream_t s);

// Per-block partial results and per-row completion counters of launch_argmax, carved from
// argmax_scratch_bytes(max_batch) bytes of zeroed device memory (the kernel leaves them zeroed).
struct ArgmaxScratch {
  float* value = nullptr;
  int32_t* index = nullptr;
  uint32_t* count = nullptr;
};
size_t argmax_scratch_bytes(int max_batch);
ArgmaxScratch argmax_scratch(void* zeroed, int max_batch);

// next[b] = argmax over logits[b, 0..vocab) (ties: lowest id), b < batch <= the scratch's max_batch.
void launch_argmax(const float* logits, int batch, int vocab, int32_t* next, const ArgmaxScratch& scratch,
                   cudaStream_t s);

}  // namespace kestrel::cuda
