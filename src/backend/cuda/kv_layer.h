// One layer of the GPU's paged KV cache as the kernels see it. Rows of `row` floats (one per
// position) live in blocks of kKvBlock positions in a pool; a block table per sequence says which
// block holds its positions [16 i, 16 i + 16), so sequences take memory as they need it and the
// server's sequences share one pool (runtime/kv_block_tables.h keeps the tables on the host).
// The tables are read from device memory, so a captured graph stays valid when they change.
#pragma once
#include <cstdint>

#include "runtime/kv_cache.h"

namespace kestrel::cuda {

constexpr int kKvBlockShift = 4, kKvBlock = 1 << kKvBlockShift;  // positions per block
static_assert(kKvBlock == KvBlockPool::kBlock, "the GPU's KV blocks are the CPU's");

// Sequence s, position p: k + (table[s * table_stride + p / 16] * 16 + p % 16) * row (v alike).
// table_stride 0: the batch rows are consecutive positions of one sequence, all in table row 0.
struct KvLayer {
  float* k = nullptr;
  float* v = nullptr;  // MLA: the same rows as k
  const int32_t* table = nullptr;
  int table_stride = 0;
  int row = 0;
};

}  // namespace kestrel::cuda
