// A paged KV cache layer for op tests (backend/cuda/kv_layer.h): `seqs` sequences of `capacity`
// positions in a pool with `unused` blocks more than they need. The block tables are the
// identity or a shuffle of the pool's blocks, and every row of the pool starts as NaN, so a
// kernel that reads a row it was not given (another sequence's, an unused block's, one never
// written) fails the comparison. The device pool holds float32 or BF16 values (KvType); the
// host rows are floats either way (bf16_round gives the values a BF16 pool holds).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "backend/cuda/kv_layer.h"
#include "device_buffer.h"

namespace kestrel::test {

// x rounded to the nearest BF16 value (ties to even), as __float2bfloat16_rn does; NaN stays NaN.
inline float bf16_round(float x) {
  if (x != x) return x;
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&x, &u, 4);
  return x;
}

inline std::vector<float> bf16_round(std::vector<float> v) {
  for (float& x : v) x = bf16_round(x);
  return v;
}

class PagedKv {
 public:
  PagedKv(int seqs, int capacity, int row, bool shuffled, std::mt19937& rng, int unused = 5,
          cuda::KvType type = cuda::KvType::F32)
      : per_seq_((capacity + cuda::kKvBlock - 1) / cuda::kKvBlock), row_(row),
        blocks_(seqs * per_seq_ + unused), type_(type),
        host_k_(size_t(blocks_) * cuda::kKvBlock * size_t(row), std::numeric_limits<float>::quiet_NaN()),
        host_v_(host_k_), dk_(host_k_.size() * cuda::kv_type_bytes(type)), dv_(host_k_.size() * cuda::kv_type_bytes(type)),
        dt_(size_t(seqs) * size_t(per_seq_)) {
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
    dk_.upload(bytes_of(host_k_));
    dv_.upload(bytes_of(host_v_));
  }
  // Rows 0 .. n - 1 of a sequence as the device holds them (as floats), one after another.
  std::vector<float> k_rows(int seq, int n) const { return rows(floats_of(dk_.download()), seq, n); }
  std::vector<float> v_rows(int seq, int n) const { return rows(floats_of(dv_.download()), seq, n); }

  // Each batch row its own sequence, or (one_sequence) all of them positions of sequence 0.
  cuda::KvLayer layer(bool one_sequence = false) const {
    cuda::KvLayer l;
    l.k = dk_.get();
    l.v = dv_.get();
    l.table = dt_.get();
    l.table_stride = one_sequence ? 0 : per_seq_;
    l.row = row_;
    l.type = type_;
    return l;
  }

 private:
  // Host floats as the pool's bytes (BF16: the upper half of each rounded float), and back.
  std::vector<uint8_t> bytes_of(const std::vector<float>& f) const {
    std::vector<uint8_t> b(f.size() * cuda::kv_type_bytes(type_));
    for (size_t i = 0; i < f.size(); ++i) {
      const float x = type_ == cuda::KvType::BF16 ? bf16_round(f[i]) : f[i];
      uint32_t u;
      std::memcpy(&u, &x, 4);
      if (type_ == cuda::KvType::BF16) u >>= 16;
      std::memcpy(b.data() + i * cuda::kv_type_bytes(type_), &u, cuda::kv_type_bytes(type_));
    }
    return b;
  }
  std::vector<float> floats_of(const std::vector<uint8_t>& b) const {
    std::vector<float> f(b.size() / cuda::kv_type_bytes(type_));
    for (size_t i = 0; i < f.size(); ++i) {
      uint32_t u = 0;
      std::memcpy(&u, b.data() + i * cuda::kv_type_bytes(type_), cuda::kv_type_bytes(type_));
      if (type_ == cuda::KvType::BF16) u <<= 16;
      std::memcpy(&f[i], &u, 4);
    }
    return f;
  }

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
  cuda::KvType type_;
  std::vector<int32_t> table_;
  std::vector<float> host_k_, host_v_;
  DeviceBuffer<uint8_t> dk_, dv_;
  DeviceBuffer<int32_t> dt_;
};

}  // namespace kestrel::test
