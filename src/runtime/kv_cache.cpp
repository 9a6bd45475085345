#include "runtime/kv_cache.h"

#include <algorithm>

namespace kestrel {

KvBlockPool::KvBlockPool(int64_t layers, const KvLayout& layout, int64_t max_blocks, bool prefix_cache)
    : layout_(layout), max_blocks_(max_blocks), ids_(max_blocks, prefix_cache), blocks_(size_t(max_blocks)) {
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
  const int32_t b = ids_.take();
  if (!blocks_[size_t(b)]) blocks_[size_t(b)] = std::make_unique<float[]>(size_t(block_floats_));  // zeroed
  return b;
}

void KvBlockPool::release(int64_t block) {
  std::lock_guard lock(mu_);
  ids_.release(int32_t(block));
}

int64_t KvBlockPool::in_use() const {
  std::lock_guard lock(mu_);
  return ids_.held();
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
  if (pool_)  // the last block first: a chain's first blocks stay cached longest
    for (size_t i = table_.size(); i-- > 0;) pool_->release(table_[i]);
}

void KvCache::adopt(std::span<const int32_t> blocks) {
  if (!pool_ || length_ != 0 || !table_.empty() || int64_t(blocks.size()) * KvBlockPool::kBlock > capacity_) {
    if (pool_)
      for (size_t i = blocks.size(); i-- > 0;) pool_->release(blocks[i]);
    fail("internal: a KV cache of ", length_, " positions (capacity ", capacity_, ") cannot take over ", blocks.size(),
         " cached blocks");
  }
  table_.assign(blocks.begin(), blocks.end());
  length_ = int64_t(blocks.size()) * KvBlockPool::kBlock;
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
