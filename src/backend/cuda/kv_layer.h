// One layer of the GPU's paged KV cache as the kernels see it. Rows of `row` values (one per
// position; float32 or BF16, KvType) live in blocks of kKvBlock positions in a pool; a block table per sequence says which
// block holds its positions [16 i, 16 i + 16), so sequences take memory as they need it and the
// server's sequences share one pool (runtime/kv_block_tables.h keeps the tables on the host).
// The tables are read from device memory, so a captured graph stays valid when they change.
#pragma once
#include <cstddef>
#include <cstdint>

#include "runtime/kv_cache.h"

namespace kestrel::cuda {

constexpr int kKvBlockShift = 4, kKvBlock = 1 << kKvBlockShift;  // positions per block
static_assert(kKvBlock == KvBlockPool::kBlock, "the GPU's KV blocks are the CPU's");

// The type of the cached values. BF16 halves what attention reads and doubles the positions a
// pool holds; its keys and values carry 8 significant bits (the CPU backend keeps float32).
enum class KvType : uint8_t { F32, BF16 };
inline size_t kv_type_bytes(KvType t) { return t == KvType::BF16 ? 2 : 4; }
inline const char* kv_type_name(KvType t) { return t == KvType::BF16 ? "bf16" : "f32"; }

// Sequence s, position p: k + (table[s * table_stride + p / 16] * 16 + p % 16) * row (v alike),
// in values of `type` (kv_rows in kv_paged.cuh gives the typed pointer).
// table_stride 0: the batch rows are consecutive positions of one sequence, all in table row 0.
struct KvLayer {
  void* k = nullptr;
  void* v = nullptr;  // MLA: the same rows as k
  KvType type = KvType::F32;
  const int32_t* table = nullptr;
  int table_stride = 0;
  int row = 0;
};

}  // namespace kestrel::cuda
