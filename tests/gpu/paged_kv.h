// A paged KV cache layer for op tests (backend/cuda/kv_layer.h): `seqs` sequences of `capacity`
// positions in a pool with `unused` blocks more than they need. The block tables are the
// identity or a shuffle of the pool's blocks, and every row of the pool starts as NaN, so a
// kernel that reads a row it was not given (another sequence's, an unused block's, one never
// written) fails the comparison.
#pragma once
#include <algorithm>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "backend/cuda/kv_layer.h"
#include "device_buffer.h"

namespace kestrel::test {

class PagedKv {
 public:
  PagedKv(int seqs, int capacity, int row, bool shuffled, std::mt19937& rng, int unused = 5)
      : per_seq_((capacity + cuda::kKvBlock - 1) / cuda::kKvBlock), row_(row),
        blocks_(seqs * per_seq_ + unused),
        host_k_(size_t(blocks_) * cuda::kKvBlock * size_t(row), std::numeric_limits<float>::quiet_NaN()),
        host_v_(host_k_), dk_(host_k_.size()), dv_(host_k_.size()), dt_(size_t(seqs) * size_t(per_seq_)) {
    std::vector<int32_t> ids(static_cast<size_t>(blocks_));
    std::iota(ids.begin(), ids.end(), 0);
    if (shuffled) std::shuffle(ids.begin(), ids.end(), rng);
    table_.assign(ids.begin(), ids.begin() + size_t(seqs) * size_t(per_seq_));
    dt_.upload(table_);
    upload();
  }

  // Host rows of (sequence, position), sent to the device by upload().
  float* k(int seq, int pos) { return host_k_.data() + offset(seq, pos); }
  float* v(int seq, int pos) { return host_v_.data() + offset(seq, pos); }
  void upload() {
    dk_.upload(host_k_);
    dv_.upload(host_v_);
  }
  // Rows 0 .. n - 1 of a sequence as the device holds them, one after another.
  std::vector<float> k_rows(int seq, int n) const { return rows(dk_.download(), seq, n); }
  std::vector<float> v_rows(int seq, int n) const { return rows(dv_.download(), seq, n); }

  // Each batch row its own sequence, or (one_sequence) all of them positions of sequence 0.
  cuda::KvLayer layer(bool one_sequence = false) const {
    cuda::KvLayer l;
    l.k = dk_.get();
    l.v = dv_.get();
    l.table = dt_.get();
    l.table_stride = one_sequence ? 0 : per_seq_;
    l.row = row_;
    return l;
  }

 private:
  size_t offset(int seq, int pos) const {
    const int32_t block = table_[size_t(seq) * size_t(per_seq_) + size_t(pos / cuda::kKvBlock)];
    return (size_t(block) * cuda::kKvBlock + size_t(pos % cuda::kKvBlock)) * size_t(row_);
  }
  std::vector<float> rows(const std::vector<float>& pool, int seq, int n) const {
    std::vector<float> out;
    for (int p = 0; p < n; ++p) out.insert(out.end(), pool.begin() + offset(seq, p), pool.begin() + offset(seq, p) + row_);
    return out;
  }

  int per_seq_, row_, blocks_;
  std::vector<int32_t> table_;
  std::vector<float> host_k_, host_v_;
  DeviceBuffer<float> dk_, dv_;
  DeviceBuffer<int32_t> dt_;
};

}  // namespace kestrel::test
