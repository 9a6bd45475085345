// What a sequence keeps of the positions it has seen, per layer, in float32. Contiguous per
// sequence; the paged cache of the server builds on the same interface.
//   GQA: k and v rows of kv_heads * head_dim.
//   MLA: k rows hold the compressed latent (kv_lora_rank normed values, then qk_rope_head_dim rotated
//        key values); there is no v; layers that run a DSA indexer also keep its key (index rows).
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/error.h"

namespace kestrel {

struct KvLayout {
  int64_t k_row = 0, v_row = 0;  // floats per position and layer
  int64_t index_row = 0;         // indexer key floats per position, in the layers with index_layer set
  std::vector<bool> index_layer;  // empty: no indexer keys anywhere
};

class KvCache {
 public:
  KvCache(int64_t layers, const KvLayout& layout, int64_t capacity)
      : layout_(layout), capacity_(capacity), k_(size_t(layers)), v_(size_t(layers)), index_(size_t(layers)) {
    for (size_t l = 0; l < size_t(layers); ++l) {
      k_[l].assign(size_t(capacity * layout.k_row), 0.0f);
      v_[l].assign(size_t(capacity * layout.v_row), 0.0f);
      if (l < layout.index_layer.size() && layout.index_layer[l]) index_[l].assign(size_t(capacity * layout.index_row), 0.0f);
    }
  }
  // GQA: a key and a value of kv_heads * head_dim per position.
  KvCache(int64_t layers, int64_t kv_heads, int64_t head_dim, int64_t capacity)
      : KvCache(layers, KvLayout{kv_heads * head_dim, kv_heads * head_dim, 0, {}}, capacity) {}

  // A split model's cache: one per rank (its KV heads, or its copy of the MLA latent), filled by
  // the ranks; this one only counts positions.
  explicit KvCache(std::vector<KvCache> ranks)
      : capacity_(ranks.at(0).capacity()), ranks_(std::move(ranks)) {}
  int ranks() const { return ranks_.empty() ? 1 : int(ranks_.size()); }
  KvCache& rank(int r) { return ranks_.at(size_t(r)); }

  int64_t length() const { return length_; }
  int64_t capacity() const { return capacity_; }
  int64_t row() const { return layout_.k_row; }  // floats per position in k
  const KvLayout& layout() const { return layout_; }
  float* k(int64_t layer, int64_t pos) { return k_[size_t(layer)].data() + pos * layout_.k_row; }
  float* v(int64_t layer, int64_t pos) { return v_[size_t(layer)].data() + pos * layout_.v_row; }
  float* index_key(int64_t layer, int64_t pos) { return index_[size_t(layer)].data() + pos * layout_.index_row; }
  const float* k(int64_t layer, int64_t pos) const { return k_[size_t(layer)].data() + pos * layout_.k_row; }
  const float* v(int64_t layer, int64_t pos) const { return v_[size_t(layer)].data() + pos * layout_.v_row; }
  const float* index_key(int64_t layer, int64_t pos) const {
    return index_[size_t(layer)].data() + pos * layout_.index_row;
  }

  // Reserves n more positions; the forward pass fills them and then calls commit.
  void check_room(int64_t n) const {
    if (length_ + n > capacity_)
      fail("KV cache full: ", length_, " positions used, ", n, " more requested, capacity ", capacity_);
  }
  void commit(int64_t n) { length_ += n; }
  void clear() {
    length_ = 0;
    for (KvCache& r : ranks_) r.clear();
  }
  // Forgets the positions from n on (a step that failed part way).
  void truncate(int64_t n) {
    length_ = std::min(length_, n);
    for (KvCache& r : ranks_) r.truncate(n);
  }

 private:
  KvLayout layout_;
  int64_t capacity_, length_ = 0;
  std::vector<std::vector<float>> k_, v_, index_;
  std::vector<KvCache> ranks_;
};

}  // namespace kestrel
