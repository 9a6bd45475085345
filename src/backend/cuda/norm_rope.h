// RMSNorm, and the per-head step between the QKV projection and attention: QK norm, rotary
// embedding at each sequence's position, and the write of keys and values into the cache.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/kv_layer.h"

namespace kestrel::cuda {

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, for `rows` rows of n floats.
void launch_rms_norm(const float* x, const float* w, int rows, int n, float eps, float* out, cudaStream_t s);

// The same rows into out (unless null) and as fragment rows (slot_mma.cuh) into xf [rows, n]
// words, for a tensor-core product that takes them; n % 128 == 0, n <= kRowNormMax.
void launch_rms_norm_frag(const float* x, const float* w, int rows, int n, float eps, float* out, uint32_t* xf,
                          cudaStream_t s);

struct RopeArgs {
  const float* inv_freq = nullptr;  // [rotary_dim / 2]
  float scaling = 1.0f;
  int rotary_dim = 0;
  int interleaved = 0;
};

// q: [B, nq, hd] in place; k, v: [B, nkv, hd], normalized/rotated and stored to the cache (rows
// of nkv * hd) at positions[b]. q_norm / k_norm may be null (no QK norm).
void launch_qk_rope_store(float* q, const float* k, const float* v, int batch, int nq, int nkv, int hd,
                          const float* q_norm, const float* k_norm, float eps, const RopeArgs& rope,
                          const int32_t* positions, KvLayer cache, cudaStream_t s);

}  // namespace kestrel::cuda
