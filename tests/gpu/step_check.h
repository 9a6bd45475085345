// What the stage step's GPU tests use: copying device results back, setting a decoder's
// tokens and positions, and the comparison of a step with the launched decoder and the CPU.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <vector>

#include "../unit/fixture.h"
#include "backend/cpu/forward.h"
#include "backend/cuda/check.h"
#include "backend/cuda/decoder.h"

namespace kestrel::test {

inline std::vector<float> copy_back(const float* d, size_t n) {
  std::vector<float> v(n);
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  KESTREL_CUDA_CHECK(cudaMemcpy(v.data(), d, n * 4, cudaMemcpyDeviceToHost));
  return v;
}

inline void set_inputs(cuda::Decoder& d, const std::vector<int32_t>& tokens, const std::vector<int32_t>& positions) {
  KESTREL_CUDA_CHECK(cudaMemcpy(d.tokens(), tokens.data(), tokens.size() * 4, cudaMemcpyHostToDevice));
  KESTREL_CUDA_CHECK(cudaMemcpy(d.positions(), positions.data(), positions.size() * 4, cudaMemcpyHostToDevice));
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
}

// Sequences b = 0..batch-1 decode `steps` tokens each with the launched decoder `dec` and the
// CPU (a vocabulary of V); the last `checked` steps also run `step` (after the launched one, on the same cache: it
// stores the same key and value again), whose logits [batch, vocab] (as it returns them) must be
// within tol_cpu of the CPU's and tol_launched of the launched step's. Prints the worst errors.
inline void check_step(const char* name, cpu::Forward& fwd, int64_t V, cuda::Decoder& dec, int batch, int steps,
                       int checked, const std::function<std::vector<float>()>& step, double tol_cpu,
                       double tol_launched) {
  std::vector<KvCache> caches;
  for (int b = 0; b < batch; ++b) caches.push_back(fwd.make_cache(steps));
  double worst_cpu = 0, worst_launched = 0;
  for (int t = 0; t < steps; ++t) {
    std::vector<int32_t> tokens, positions;
    for (int b = 0; b < batch; ++b) {
      tokens.push_back(int32_t((3 + 29 * t + 13 * b) % V));
      positions.push_back(t);
    }
    set_inputs(dec, tokens, positions);
    dec.step(batch, nullptr);
    const auto launched = copy_back(dec.logits(), size_t(batch * V));
    std::vector<float> cpu(static_cast<size_t>(V));
    std::vector<std::vector<float>> want;
    for (int b = 0; b < batch; ++b) {
      fwd.run({&tokens[size_t(b)], 1}, caches[size_t(b)], cpu.data());
      want.push_back(cpu);
    }
    if (t < steps - checked) continue;
    const auto got = step();
    for (int b = 0; b < batch; ++b) {
      const double ec = rel_l2(got.data() + b * V, want[size_t(b)].data(), V);
      const double el = rel_l2(got.data() + b * V, launched.data() + b * V, V);
      EXPECT_LE(ec, tol_cpu) << "step " << t << " sequence " << b;
      EXPECT_LE(el, tol_launched) << "step " << t << " sequence " << b;
      worst_cpu = std::max(worst_cpu, ec);
      worst_launched = std::max(worst_launched, el);
    }
  }
  std::printf("  %s, batch %d: worst rel L2 %.2e vs CPU, %.2e vs the launched step\n", name, batch, worst_cpu,
              worst_launched);
}

}  // namespace kestrel::test
