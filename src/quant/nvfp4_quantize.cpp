#include "quant/nvfp4_quantize.h"

#include <algorithm>
#include <cmath>
#include <mutex>

#include "common/error.h"
#include "common/numeric.h"
#include "formats/nvfp4.h"

namespace kestrel {

void nvfp4_quantize_row(const float* w, int64_t k, float scale2, uint8_t* packed, uint8_t* scales) {
  for (int64_t g = 0; g < k / kNvfp4Block; ++g) {
    const float* x = w + g * kNvfp4Block;
    float bmax = 0.0f;
    for (int i = 0; i < kNvfp4Block; ++i) bmax = std::max(bmax, std::fabs(x[i]));
    uint8_t* p = packed + g * (kNvfp4Block / 2);
    if (bmax == 0.0f) {
      // ModelOpt stores 1.0 for an all-zero block; its codes are all zero.
      scales[g] = f32_to_e4m3(1.0f);
      std::fill(p, p + kNvfp4Block / 2, uint8_t(0));
      continue;
    }
    const float s = std::min(bmax / (kE2M1Max * scale2), kE4M3Max);
    scales[g] = f32_to_e4m3(s);
    const float d = e4m3_to_f32(scales[g]) * scale2;
    if (!(d > 0.0f)) {
      // The block scale underflowed E4M3 (block amax below ~2e-6 of the tensor's): whatever the
      // codes, the block dequantizes to zero, so write zero codes.
      std::fill(p, p + kNvfp4Block / 2, uint8_t(0));
      continue;
    }
    for (int i = 0; i < kNvfp4Block / 2; ++i)
      p[i] = uint8_t(f32_to_e2m1(x[2 * i] / d) | (f32_to_e2m1(x[2 * i + 1] / d) << 4));
  }
}

namespace {

size_t row_grain(const Linear& w) { return size_t(std::max<int64_t>(1, 65536 / std::max<int64_t>(w.in, 1))); }

}  // namespace

float weight_amax(const Linear& w, ThreadPool& pool) {
  std::mutex mu;
  float amax = 0.0f;
  int64_t bad_row = -1;
  pool.parallel_for(size_t(w.out), row_grain(w), [&](size_t begin, size_t end) {
    thread_local std::vector<float> row;
    row.resize(size_t(w.in));
    float m = 0.0f;
    int64_t bad = -1;
    for (size_t r = begin; r < end && bad < 0; ++r) {
      w.dequant_row(int64_t(r), row.data());
      for (float v : row) {
        if (!std::isfinite(v)) {
          bad = int64_t(r);
          break;
        }
        m = std::max(m, std::fabs(v));
      }
    }
    std::lock_guard<std::mutex> lock(mu);
    amax = std::max(amax, m);
    if (bad >= 0 && (bad_row < 0 || bad < bad_row)) bad_row = bad;
  });
  if (bad_row >= 0) fail(w.name, ": weight row ", bad_row, " holds a NaN or infinity, which NVFP4 cannot represent");
  return amax;
}

Nvfp4Matrix quantize_linear(const Linear& w, float amax, ThreadPool& pool) {
  if (w.in % kNvfp4Block != 0)
    fail(w.name, ": NVFP4 needs the input dimension to be a multiple of 16, but it is ", w.in);
  Nvfp4Matrix q;
  q.scale2 = nvfp4_scale2(amax);
  q.packed.resize(size_t(w.out) * size_t(w.in / 2));
  q.scales.resize(size_t(w.out) * size_t(w.in / kNvfp4Block));
  pool.parallel_for(size_t(w.out), row_grain(w), [&](size_t begin, size_t end) {
    thread_local std::vector<float> row;
    row.resize(size_t(w.in));
    for (size_t r = begin; r < end; ++r) {
      w.dequant_row(int64_t(r), row.data());
      nvfp4_quantize_row(row.data(), w.in, q.scale2, q.packed.data() + r * size_t(w.in / 2),
                         q.scales.data() + r * size_t(w.in / kNvfp4Block));
    }
  });
  return q;
}

}  // namespace kestrel
