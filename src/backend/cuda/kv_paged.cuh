// The address of a position in the paged KV cache (kv_layer.h), for every kernel that reads or
// writes it.
#pragma once
#include <cuda_bf16.h>

#include <cstddef>

#include "backend/cuda/kv_layer.h"

namespace kestrel::cuda {

// The layer's keys (or values) as values of T, the type the kernel was instantiated for
// (cache.type, checked at launch).
template <class T>
__host__ __device__ __forceinline__ T* kv_rows(void* p) {
  return static_cast<T*>(p);
}

// A cached value as a float, and a float as a cached value (round to nearest).
__device__ __forceinline__ float kv_float(float v) { return v; }
__device__ __forceinline__ float kv_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <class T>
__device__ __forceinline__ T kv_value(float v) {
  if constexpr (sizeof(T) == 2) return __float2bfloat16_rn(v);
  else return v;
}

// p[i] as a float where ok, else 0 (BF16 widened with a shift).
template <class T>
__device__ __forceinline__ float kv_load(const T* p, size_t i, bool ok) {
  if constexpr (sizeof(T) == 2) {
    const unsigned short bits = ok ? reinterpret_cast<const unsigned short*>(p)[i] : 0;
    return __uint_as_float(uint32_t(bits) << 16);
  } else {
    return ok ? p[i] : 0.0f;
  }
}

// BF16 p[i] and p[i + 1] (i even) as floats where ok, else 0: one 4-byte load.
__device__ __forceinline__ void kv_load_pair(const __nv_bfloat16* p, size_t i, bool ok, float& lo, float& hi) {
  const uint32_t w = ok ? *reinterpret_cast<const uint32_t*>(p + i) : 0u;
  lo = __uint_as_float(w << 16);
  hi = __uint_as_float(w & 0xFFFF0000u);
}

// Values from the layer's base to the row of (sequence seq, position pos). The table does not
// change while a kernel runs (it is copied in between steps), so it goes through the read-only
// cache.
__device__ __forceinline__ size_t kv_offset(const KvLayer& c, int seq, int pos) {
  const int32_t block = __ldg(c.table + size_t(seq) * size_t(c.table_stride) + size_t(pos >> kKvBlockShift));
  return (size_t(block) * kKvBlock + size_t(pos & (kKvBlock - 1))) * size_t(c.row);
}

}  // namespace kestrel::cuda
