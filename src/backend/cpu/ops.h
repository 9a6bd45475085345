// Element-wise and row-wise ops of the forward pass, float32.
#pragma once
#include <cstdint>
#include <vector>

#include "model/rope.h"

namespace kestrel::cpu {

// out[i] = x[i] / sqrt(mean(x^2) + eps) * w[i], for `rows` rows of length n. In place allowed.
void rms_norm(const float* x, const float* w, int64_t rows, int64_t n, float eps, float* out);

// out = (x - mean(x)) / sqrt(var(x) + eps) * w + b per row of length n (LayerNorm). In place allowed.
void layer_norm(const float* x, const float* w, const float* b, int64_t rows, int64_t n, float eps, float* out);

// out[i] = silu(gate[i]) * up[i]
void silu_mul(const float* gate, const float* up, int64_t n, float* out);

// In-place softmax over n values.
void softmax(float* x, int64_t n);

// Rotary embedding tables for one position: cos and sin of pos * inv_freq (times the scaling).
struct RopeTables {
  std::vector<float> inv_freq;
  float scaling = 1.0f;
  int64_t rotary_dim = 0;
  bool interleaved = false;
  explicit RopeTables(const RopeConfig& r)
      : inv_freq(r.inv_freq()), scaling(r.attention_scaling()), rotary_dim(r.rotary_dim), interleaved(r.interleaved) {}
};

// Rotates the first rotary_dim entries of each of `heads` vectors of length head_dim at position pos.
void apply_rope(float* x, int64_t heads, int64_t head_dim, int64_t pos, const RopeTables& t);

}  // namespace kestrel::cpu
