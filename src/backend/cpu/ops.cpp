#include "backend/cpu/ops.h"

#include <algorithm>
#include <cmath>

namespace kestrel::cpu {

void rms_norm(const float* x, const float* w, int64_t rows, int64_t n, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* o = out + r * n;
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += double(xr[i]) * double(xr[i]);
    const float inv = 1.0f / std::sqrt(float(ss / double(n)) + eps);
    for (int64_t i = 0; i < n; ++i) o[i] = w[i] * (xr[i] * inv);
  }
}

void layer_norm(const float* x, const float* w, const float* b, int64_t rows, int64_t n, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* o = out + r * n;
    double sum = 0, ss = 0;
    for (int64_t i = 0; i < n; ++i) sum += xr[i];
    const double mean = sum / double(n);
    for (int64_t i = 0; i < n; ++i) ss += (xr[i] - mean) * (xr[i] - mean);
    const float inv = 1.0f / std::sqrt(float(ss / double(n)) + eps), m = float(mean);
    for (int64_t i = 0; i < n; ++i) o[i] = (xr[i] - m) * inv * w[i] + b[i];
  }
}

void silu_mul(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void softmax(float* x, int64_t n) {
  const float mx = *std::max_element(x, x + n);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += x[i];
  }
  const float inv = float(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

void apply_rope(float* x, int64_t heads, int64_t head_dim, int64_t pos, const RopeTables& t) {
  const int64_t half = t.rotary_dim / 2;
  thread_local std::vector<float> cs, sn;
  cs.resize(size_t(half));
  sn.resize(size_t(half));
  for (int64_t i = 0; i < half; ++i) {
    const float f = float(pos) * t.inv_freq[size_t(i)];  // float32 product, as the reference does
    cs[size_t(i)] = float(std::cos(double(f))) * t.scaling;
    sn[size_t(i)] = float(std::sin(double(f))) * t.scaling;
  }
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const int64_t a = t.interleaved ? 2 * i : i, b = t.interleaved ? 2 * i + 1 : i + half;
      const float x1 = v[a], x2 = v[b];
      v[a] = x1 * cs[size_t(i)] - x2 * sn[size_t(i)];
      v[b] = x2 * cs[size_t(i)] + x1 * sn[size_t(i)];
    }
  }
}

}  // namespace kestrel::cpu
