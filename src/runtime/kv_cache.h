// Keys and values of the positions a sequence has seen, per layer, in float32.
// Contiguous per sequence; the paged cache of the server builds on the same interface.
#pragma once
#include <cstdint>
#include <vector>

#include "common/error.h"

namespace kestrel {

class KvCache {
 public:
  KvCache(int64_t layers, int64_t kv_heads, int64_t head_dim, int64_t capacity)
      : row_(kv_heads * head_dim), capacity_(capacity), k_(size_t(layers)), v_(size_t(layers)) {
    for (auto& x : k_) x.assign(size_t(capacity * row_), 0.0f);
    for (auto& x : v_) x.assign(size_t(capacity * row_), 0.0f);
  }

  int64_t length() const { return length_; }
  int64_t capacity() const { return capacity_; }
  int64_t row() const { return row_; }  // floats per position: kv_heads * head_dim
  float* k(int64_t layer, int64_t pos) { return k_[size_t(layer)].data() + pos * row_; }
  float* v(int64_t layer, int64_t pos) { return v_[size_t(layer)].data() + pos * row_; }
  const float* k(int64_t layer, int64_t pos) const { return k_[size_t(layer)].data() + pos * row_; }
  const float* v(int64_t layer, int64_t pos) const { return v_[size_t(layer)].data() + pos * row_; }

  // Reserves n more positions; the forward pass fills them and then calls commit.
  void check_room(int64_t n) const {
    if (length_ + n > capacity_)
      fail("KV cache full: ", length_, " positions used, ", n, " more requested, capacity ", capacity_);
  }
  void commit(int64_t n) { length_ += n; }
  void clear() { length_ = 0; }

 private:
  int64_t row_, capacity_, length_ = 0;
  std::vector<std::vector<float>> k_, v_;
};

}  // namespace kestrel
