// Small kernels at the ends of a decode step: embedding lookup and greedy sampling.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/dlinear.h"

namespace kestrel::cuda {

// x[b] = embedding row tokens[b], dequantized to float.
void launch_embed(const DLinear& table, const int32_t* tokens, int batch, float* x, cudaStream_t s);

// next[b] = argmax over logits[b, 0..vocab) (ties: lowest id).
void launch_argmax(const float* logits, int batch, int vocab, int32_t* next, cudaStream_t s);

}  // namespace kestrel::cuda
