#include "runtime/kv_cache.h"

#include <algorithm>

namespace kestrel {

KvBlockPool::KvBlockPool(int64_t layers, const KvLayout& layout, int64_t max_blocks)
    : layout_(layout), max_blocks_(max_blocks) {
  for (int64_t l = 0; l < layers; ++l) {
    k_off_.push_back(block_floats_);
    block_floats_ += kBlock * layout.k_row;
    v_off_.push_back(block_floats_);
    block_floats_ += kBlock * layout.v_row;
    index_off_.push_back(block_floats_);
    if (size_t(l) < layout.index_layer.size() && layout.index_layer[size_t(l)]) block_floats_ += kBlock * layout.index_row;
  }
}

int64_t KvBlockPool::acquire() {
  std::lock_guard lock(mu_);
  if (!free_.empty()) {
    const int64_t b = free_.back();
    free_.pop_back();
    return b;
  }
  if (int64_t(blocks_.size()) >= max_blocks_)
    fail("KV cache full: all ", max_blocks_, " blocks of ", kBlock, " positions are in use");
  blocks_.push_back(std::make_unique<float[]>(size_t(block_floats_)));  // zeroed
  return int64_t(blocks_.size()) - 1;
}

void KvBlockPool::release(int64_t block) {
  std::lock_guard lock(mu_);
  free_.push_back(block);
}

int64_t KvBlockPool::in_use() const {
  std::lock_guard lock(mu_);
  return int64_t(blocks_.size() - free_.size());
}

KvCache::KvCache(int64_t layers, const KvLayout& layout, int64_t capacity)
    : KvCache(std::make_shared<KvBlockPool>(layers, layout, KvBlockPool::blocks_for(capacity)), capacity) {}

KvCache::KvCache(std::shared_ptr<KvBlockPool> pool, int64_t capacity) : pool_(std::move(pool)), capacity_(capacity) {}

KvCache::KvCache(std::vector<KvCache> ranks) : capacity_(ranks.at(0).capacity()), ranks_(std::move(ranks)) {}

KvCache::KvCache(KvCache&& o) noexcept
    : pool_(std::move(o.pool_)), capacity_(o.capacity_), length_(o.length_), table_(std::move(o.table_)),
      ranks_(std::move(o.ranks_)) {
  o.table_.clear();
  o.length_ = 0;
}

KvCache::~KvCache() {
  if (pool_)
    for (int64_t b : table_) pool_->release(b);
}

void KvCache::reserve(int64_t n) {
  if (length_ + n > capacity_)
    fail("KV cache full: ", length_, " positions used, ", n, " more requested, capacity ", capacity_);
  if (!pool_) return;  // a split model's ranks hold the positions
  while (int64_t(table_.size()) < KvBlockPool::blocks_for(length_ + n)) table_.push_back(pool_->acquire());
}

void KvCache::truncate(int64_t n) {
  length_ = std::min(length_, n);
  for (KvCache& r : ranks_) r.truncate(n);
  if (!pool_) return;
  while (int64_t(table_.size()) > KvBlockPool::blocks_for(length_)) {
    pool_->release(table_.back());
    table_.pop_back();
  }
}

}  // namespace kestrel
