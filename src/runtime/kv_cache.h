// What a sequence keeps of the positions it has seen, per layer, in float32, in fixed-size blocks
// of positions (a block table per sequence): a cache of its own takes its blocks from a pool of
// exactly enough; the server's sequences share one pool, so memory follows the positions in use.
//   GQA: k and v rows of kv_heads * head_dim.
//   MLA: k rows hold the compressed latent (kv_lora_rank normed values, then qk_rope_head_dim rotated
//        key values); there is no v; layers that run a DSA indexer also keep its key (index rows).
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "common/error.h"
#include "runtime/kv_blocks.h"

namespace kestrel {

struct KvLayout {
  int64_t k_row = 0, v_row = 0;  // floats per position and layer
  int64_t index_row = 0;         // indexer key floats per position, in the layers with index_layer set
  std::vector<bool> index_layer;  // empty: no indexer keys anywhere
};

// Blocks of kBlock positions for every layer, allocated on first use and reused after release.
// Within a block, layer by layer: the k rows, the v rows, the index rows of its positions. The
// ids, their references and the prefix cache are a KvBlocks (kv_blocks.h).
class KvBlockPool {
 public:
  static constexpr int64_t kBlockShift = 4, kBlock = int64_t(1) << kBlockShift;  // 16 positions per block
  static_assert(kBlock == KvBlocks::kBlock);
  KvBlockPool(int64_t layers, const KvLayout& layout, int64_t max_blocks, bool prefix_cache = false);
  static int64_t blocks_for(int64_t positions) { return (positions + kBlock - 1) >> kBlockShift; }

  int64_t acquire();  // fails when max_blocks are held
  void release(int64_t block);
  float* block(int64_t b) const { return blocks_[size_t(b)].get(); }
  int64_t in_use() const;
  int64_t max_blocks() const { return max_blocks_; }
  // The ids under the pool's lock (the prefix cache's match and publish).
  template <class F>
  auto with_ids(F f) {
    std::lock_guard lock(mu_);
    return f(ids_);
  }
  size_t block_bytes() const { return size_t(block_floats_) * sizeof(float); }
  const KvLayout& layout() const { return layout_; }
  int64_t layers() const { return int64_t(k_off_.size()); }
  int64_t k_off(int64_t layer) const { return k_off_[size_t(layer)]; }
  int64_t v_off(int64_t layer) const { return v_off_[size_t(layer)]; }
  int64_t index_off(int64_t layer) const { return index_off_[size_t(layer)]; }

 private:
  KvLayout layout_;
  int64_t max_blocks_, block_floats_ = 0;
  std::vector<int64_t> k_off_, v_off_, index_off_;
  mutable std::mutex mu_;
  KvBlocks ids_;
  std::vector<std::unique_ptr<float[]>> blocks_;  // null until first taken
};

class KvCache {
 public:
  // A cache of its own for up to `capacity` positions.
  KvCache(int64_t layers, const KvLayout& layout, int64_t capacity);
  // GQA: a key and a value of kv_heads * head_dim per position.
  KvCache(int64_t layers, int64_t kv_heads, int64_t head_dim, int64_t capacity)
      : KvCache(layers, KvLayout{kv_heads * head_dim, kv_heads * head_dim, 0, {}}, capacity) {}
  // Up to `capacity` positions in blocks of a shared pool.
  KvCache(std::shared_ptr<KvBlockPool> pool, int64_t capacity);
  // A split model's cache: one per rank (its KV heads, or its copy of the MLA latent), filled by
  // the ranks; this one only counts positions.
  explicit KvCache(std::vector<KvCache> ranks);
  ~KvCache();
  KvCache(KvCache&& o) noexcept;
  KvCache& operator=(KvCache&&) = delete;
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  int ranks() const { return ranks_.empty() ? 1 : int(ranks_.size()); }
  KvCache& rank(int r) { return ranks_.at(size_t(r)); }

  int64_t length() const { return length_; }
  int64_t capacity() const { return capacity_; }
  const KvLayout& layout() const { return pool_->layout(); }
  float* k(int64_t layer, int64_t pos) { return at(pos) + pool_->k_off(layer) + (pos & mask) * layout().k_row; }
  float* v(int64_t layer, int64_t pos) { return at(pos) + pool_->v_off(layer) + (pos & mask) * layout().v_row; }
  float* index_key(int64_t layer, int64_t pos) {
    return at(pos) + pool_->index_off(layer) + (pos & mask) * layout().index_row;
  }
  const float* k(int64_t layer, int64_t pos) const { return const_cast<KvCache*>(this)->k(layer, pos); }
  const float* v(int64_t layer, int64_t pos) const { return const_cast<KvCache*>(this)->v(layer, pos); }
  const float* index_key(int64_t layer, int64_t pos) const { return const_cast<KvCache*>(this)->index_key(layer, pos); }

  // An empty cache takes over `blocks` of its pool (references the caller held: a prefix cache
  // match) as its first positions, full.
  void adopt(std::span<const int32_t> blocks);
  // The pool's blocks this cache holds, position 16 i onwards in block i (empty for a split
  // model's cache).
  std::span<const int64_t> block_ids() const { return table_; }
  // Makes room for n more positions (taking blocks as needed); the forward pass fills them and
  // then calls commit. Fails when the capacity or the pool's blocks run out.
  void reserve(int64_t n);
  void commit(int64_t n) { length_ += n; }
  void clear() { truncate(0); }
  // Forgets the positions from n on (a step that failed part way), giving back unused blocks.
  void truncate(int64_t n);

 private:
  static constexpr int64_t mask = KvBlockPool::kBlock - 1;
  float* at(int64_t pos) const { return pool_->block(table_[size_t(pos >> KvBlockPool::kBlockShift)]); }

  std::shared_ptr<KvBlockPool> pool_;  // null for a split model's cache
  int64_t capacity_, length_ = 0;
  std::vector<int64_t> table_;  // block of positions [16 i, 16 i + 16)
  std::vector<KvCache> ranks_;
};

}  // namespace kestrel
