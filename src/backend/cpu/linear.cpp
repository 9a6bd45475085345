#include "backend/cpu/linear.h"

#include <vector>

namespace kestrel::cpu {

float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
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
