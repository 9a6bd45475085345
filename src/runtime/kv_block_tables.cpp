#include "runtime/kv_block_tables.h"

#include <algorithm>
#include <limits>

#include "common/error.h"
#include "runtime/kv_cache.h"

namespace kestrel {
namespace {

int64_t checked(int64_t blocks) {
  if (blocks < 1 || blocks >= std::numeric_limits<int32_t>::max())
    fail("a KV pool of ", blocks, " blocks: expected 1 to ", std::numeric_limits<int32_t>::max() - 1);
  return blocks;
}

}  // namespace

KvBlockTables::KvBlockTables(int64_t blocks, int slots, int64_t context, bool prefix_cache)
    : ids_(checked(blocks), prefix_cache), stride_(KvBlockPool::blocks_for(context)) {
  if (slots < 1 || context < 1) fail("internal: KV block tables for ", slots, " slots of ", context, " positions");
  table_.assign(size_t(slots) * size_t(stride_), spare());
  held_.assign(size_t(slots), -1);
  changed_.assign(size_t(slots), true);
}

void KvBlockTables::open(int slot, int64_t positions, std::span<const int32_t> cached) {
  auto give_back = [&] {
    for (size_t i = cached.size(); i-- > 0;) ids_.release(cached[i]);
  };
  const int64_t need = KvBlockPool::blocks_for(positions), own = need - int64_t(cached.size());
  if (slot < 0 || slot >= slots()) give_back();
  if (is_open(slot)) {  // (is_open fails for a slot outside the tables)
    give_back();
    fail("internal: KV slot ", slot, " is already open");
  }
  if (positions < 0 || need > stride_ || own < 0) {
    give_back();
    fail("a sequence of ", positions, " positions does not fit the context of ", stride_ * KvBlockPool::kBlock,
         " positions of a KV block table");
  }
  if (own > free_blocks()) {
    give_back();
    fail("the KV pool has ", free_blocks(), " of its ", blocks(), " blocks of ", KvBlockPool::kBlock,
         " positions free; a sequence of ", positions, " positions needs ", own, " of its own");
  }
  int32_t* row = table_.data() + size_t(slot) * size_t(stride_);
  for (size_t i = 0; i < cached.size(); ++i) row[i] = cached[i];
  for (int64_t i = int64_t(cached.size()); i < need; ++i) row[i] = ids_.take();
  held_[size_t(slot)] = need;
  changed_[size_t(slot)] = true;
}

void KvBlockTables::close(int slot) {
  if (!is_open(slot)) return;
  int32_t* row = table_.data() + size_t(slot) * size_t(stride_);
  for (int64_t i = held_[size_t(slot)]; i-- > 0;) {
    ids_.release(row[i]);
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
