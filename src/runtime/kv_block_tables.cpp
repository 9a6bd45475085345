#include "runtime/kv_block_tables.h"

#include <algorithm>
#include <limits>

#include "common/error.h"
#include "runtime/kv_cache.h"

namespace kestrel {

KvBlockTables::KvBlockTables(int64_t blocks, int slots, int64_t context)
    : blocks_(blocks), stride_(KvBlockPool::blocks_for(context)) {
  if (blocks < 1 || blocks >= std::numeric_limits<int32_t>::max())
    fail("a KV pool of ", blocks, " blocks: expected 1 to ", std::numeric_limits<int32_t>::max() - 1);
  if (slots < 1 || context < 1) fail("internal: KV block tables for ", slots, " slots of ", context, " positions");
  table_.assign(size_t(slots) * size_t(stride_), spare());
  free_.resize(size_t(blocks));
  for (int64_t i = 0; i < blocks; ++i) free_[size_t(i)] = int32_t(blocks - 1 - i);  // block 0 first
  held_.assign(size_t(slots), -1);
  changed_.assign(size_t(slots), true);
}

void KvBlockTables::open(int slot, int64_t positions) {
  if (is_open(slot)) fail("internal: KV slot ", slot, " is already open");
  const int64_t need = KvBlockPool::blocks_for(positions);
  if (positions < 0 || need > stride_)
    fail("a sequence of ", positions, " positions does not fit the context of ", stride_ * KvBlockPool::kBlock,
         " positions of a KV block table");
  if (need > free_blocks())
    fail("the KV pool has ", free_blocks(), " of its ", blocks_, " blocks of ", KvBlockPool::kBlock,
         " positions free; a sequence of ", positions, " positions needs ", need);
  int32_t* row = table_.data() + size_t(slot) * size_t(stride_);
  for (int64_t i = 0; i < need; ++i) {
    row[i] = free_.back();
    free_.pop_back();
  }
  held_[size_t(slot)] = need;
  changed_[size_t(slot)] = true;
}

void KvBlockTables::close(int slot) {
  if (!is_open(slot)) return;
  int32_t* row = table_.data() + size_t(slot) * size_t(stride_);
  for (int64_t i = 0; i < held_[size_t(slot)]; ++i) {
    free_.push_back(row[i]);
    row[i] = spare();
  }
  held_[size_t(slot)] = -1;
  changed_[size_t(slot)] = true;
}

size_t KvBlockTables::check(int slot) const {
  if (slot < 0 || slot >= slots()) fail("internal: KV slot ", slot, " outside 0..", slots() - 1);
  return size_t(slot);
}

std::span<const int32_t> KvBlockTables::row(int slot) const {
  check(slot);
  return {table_.data() + size_t(slot) * size_t(stride_), size_t(stride_)};
}

std::vector<int> KvBlockTables::changed() const {
  std::vector<int> out;
  for (size_t i = 0; i < changed_.size(); ++i)
    if (changed_[i]) out.push_back(int(i));
  return out;
}

}  // namespace kestrel
