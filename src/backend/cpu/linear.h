// y = x W^T (+ bias) for any stored weight format, float32 accumulation. Rows of W are
// dequantized once into a per-thread buffer and applied to every token of the batch.
#pragma once
#include <cstdint>
#include <functional>

#include "common/thread_pool.h"
#include "model/weights.h"

namespace kestrel::cpu {

// Sees the input x [tokens, W.in] of a linear before it is applied (calibration).
using LinearObserver = std::function<void(const Linear& W, const float* x, int64_t tokens)>;

// x: [tokens, W.in] row-major; y: [tokens, W.out]. `observe`, when given, sees x first.
void linear(const Linear& W, const float* x, int64_t tokens, float* y, ThreadPool& pool,
            const LinearObserver* observe = nullptr);

// Dot product with 8 independent float accumulators (vectorizable, deterministic order).
float dot(const float* a, const float* b, int64_t n);

}  // namespace kestrel::cpu
