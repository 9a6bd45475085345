// The address of a position in the paged KV cache (kv_layer.h), for every kernel that reads or
// writes it.
#pragma once
#include <cstddef>

#include "backend/cuda/kv_layer.h"

namespace kestrel::cuda {

// Floats from the layer's base to the row of (sequence seq, position pos). The table does not
// change while a kernel runs (it is copied in between steps), so it goes through the read-only
// cache.
__device__ __forceinline__ size_t kv_offset(const KvLayer& c, int seq, int pos) {
  const int32_t block = __ldg(c.table + size_t(seq) * size_t(c.table_stride) + size_t(pos >> kKvBlockShift));
  return (size_t(block) * kKvBlock + size_t(pos & (kKvBlock - 1))) * size_t(c.row);
}

}  // namespace kestrel::cuda
