#include "backend/cpu/linear.h"

#include <cstring>
#include <vector>

namespace kestrel::cpu {

float dot(const float* a, const float* b, int64_t n) {
  // Eight accumulators, lane j summing the products j, j + 8, ... in order, written as one
  // vector so that it compiles to vector instructions (compilers left the scalar form scalar);
  // the bits are those of eight scalar accumulators.
  typedef float v8 __attribute__((vector_size(32)));
  v8 acc = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    v8 x, y;
    std::memcpy(&x, a + i, sizeof x);
    std::memcpy(&y, b + i, sizeof y);
    acc += x * y;
  }
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

void linear(const Linear& W, const float* x, int64_t tokens, float* y, ThreadPool& pool,
            const LinearObserver* observe) {
  if (observe) (*observe)(W, x, tokens);
  const int64_t in = W.in, out = W.out;
  // About 64K weights per task keeps the pool busy without drowning in scheduling.
  const size_t grain = size_t(std::max<int64_t>(1, 65536 / std::max<int64_t>(in, 1)));
  pool.parallel_for(size_t(out), grain, [&](size_t begin, size_t end) {
    thread_local std::vector<float> row;
    row.resize(size_t(in));
    for (size_t n = begin; n < end; ++n) {
      W.dequant_row(int64_t(n), row.data());
      const float b = W.bias.empty() ? 0.0f : W.bias[n];
      for (int64_t t = 0; t < tokens; ++t) y[t * out + int64_t(n)] = dot(x + t * in, row.data(), in) + b;
    }
  });
}

}  // namespace kestrel::cpu
