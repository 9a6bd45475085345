// Builds GGUF images in memory for tests, including deliberately broken ones, and rewrites
// existing files with edits (a key changed or dropped, a tensor added).
#pragma once
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "formats/gguf.h"

namespace kestrel::test {

class GgufImage {
 public:
  struct Tensor {
    std::string name;
    std::vector<uint64_t> dims;
    uint32_t type = 0;
    std::vector<uint8_t> data;
    std::optional<uint64_t> offset;  // forced data offset (default: packed, aligned)
    bool store = true;               // false: the info only, no bytes in the data section
  };

  uint32_t version = 3;
  uint64_t alignment = 32;  // layout only; write general.alignment yourself to change the reader's
  std::optional<uint64_t> kv_count, tensor_count;  // forced header counts

  void u32(const std::string& k, uint32_t v) { scalar(k, GgufType::U32, v, 4); }
  void i32(const std::string& k, int32_t v) { scalar(k, GgufType::I32, uint32_t(v), 4); }
  void u64(const std::string& k, uint64_t v) { scalar(k, GgufType::U64, v, 8); }
  void f32(const std::string& k, float v) {
    uint32_t b;
    std::memcpy(&b, &v, 4);
    scalar(k, GgufType::F32, b, 4);
  }
  void boolean(const std::string& k, bool v) { scalar(k, GgufType::BOOL, v, 1); }
  void str(const std::string& k, const std::string& v) {
    key(k, GgufType::STRING);
    put_str(kv_, v);
  }
  void str_array(const std::string& k, const std::vector<std::string>& v) {
    key(k, GgufType::ARRAY);
    put(kv_, uint32_t(GgufType::STRING), 4);
    put(kv_, v.size(), 8);
    for (const auto& s : v) put_str(kv_, s);
  }
  void i32_array(const std::string& k, const std::vector<int32_t>& v) {
    key(k, GgufType::ARRAY);
    put(kv_, uint32_t(GgufType::I32), 4);
    put(kv_, v.size(), 8);
    for (int32_t x : v) put(kv_, uint32_t(x), 4);
  }
  // Any parsed value, re-encoded.
  void value(const std::string& k, const GgufValue& v) {
    key(k, v.type);
    encode(kv_, v);
  }
  // Raw bytes after a key: for broken values.
  void raw(const std::string& k, uint32_t type, const std::vector<uint8_t>& bytes) {
    put_str(kv_, k);
    put(kv_, type, 4);
    kv_.insert(kv_.end(), bytes.begin(), bytes.end());
    ++n_kv_;
  }

  void tensor(Tensor t) { tensors_.push_back(std::move(t)); }
  void tensor(const std::string& name, std::vector<uint64_t> dims, uint32_t type, std::vector<uint8_t> data) {
    tensors_.push_back({name, std::move(dims), type, std::move(data), std::nullopt, true});
  }

  std::vector<uint8_t> build() const {
    std::vector<uint8_t> out = {'G', 'G', 'U', 'F'};
    put(out, version, 4);
    put(out, tensor_count.value_or(tensors_.size()), 8);
    put(out, kv_count.value_or(n_kv_), 8);
    out.insert(out.end(), kv_.begin(), kv_.end());
    std::vector<uint64_t> offsets;
    uint64_t off = 0;
    for (const auto& t : tensors_) {
      const uint64_t o = t.offset.value_or(off);
      offsets.push_back(o);
      if (t.store) off = std::max(off, (o + t.data.size() + alignment - 1) / alignment * alignment);
    }
    for (size_t i = 0; i < tensors_.size(); ++i) {
      const auto& t = tensors_[i];
      put_str(out, t.name);
      put(out, t.dims.size(), 4);
      for (uint64_t d : t.dims) put(out, d, 8);
      put(out, t.type, 4);
      put(out, offsets[i], 8);
    }
    const size_t data_start = (out.size() + alignment - 1) / alignment * alignment;
    out.resize(data_start, 0);
    for (size_t i = 0; i < tensors_.size(); ++i) {
      const auto& t = tensors_[i];
      if (!t.store) continue;
      const size_t at = data_start + offsets[i];
      if (out.size() < at + t.data.size()) out.resize(at + t.data.size(), 0);
      std::memcpy(out.data() + at, t.data.data(), t.data.size());
    }
    return out;
  }

  // Copies metadata and tensors of a parsed file, leaving out what `skip` names.
  static GgufImage copy_of(const GgufIndex& g, const std::vector<std::string>& skip = {}) {
    GgufImage img;
    img.version = g.version();
    img.alignment = g.alignment();
    auto skipped = [&](const std::string& n) { return std::find(skip.begin(), skip.end(), n) != skip.end(); };
    for (const auto& [k, v] : g.metadata())
      if (!skipped(k)) img.value(k, v);
    for (const auto& t : g.tensors()) {
      if (skipped(t.name)) continue;
      std::vector<uint64_t> dims(t.dims.begin(), t.dims.end());
      img.tensor(t.name, dims, uint32_t(t.type), std::vector<uint8_t>(t.data, t.data + t.nbytes));
    }
    return img;
  }

 private:
  static void put(std::vector<uint8_t>& b, uint64_t v, int n) {
    for (int i = 0; i < n; ++i) b.push_back(uint8_t(v >> (8 * i)));
  }
  static void put_str(std::vector<uint8_t>& b, const std::string& s) {
    put(b, s.size(), 8);
    b.insert(b.end(), s.begin(), s.end());
  }
  static size_t size_of(GgufType t) {
    switch (t) {
      case GgufType::U8: case GgufType::I8: case GgufType::BOOL: return 1;
      case GgufType::U16: case GgufType::I16: return 2;
      case GgufType::U32: case GgufType::I32: case GgufType::F32: return 4;
      default: return 8;
    }
  }
  static void encode(std::vector<uint8_t>& b, const GgufValue& v) {
    switch (v.type) {
      case GgufType::STRING: put_str(b, v.str); return;
      case GgufType::ARRAY:
        put(b, uint32_t(v.elem), 4);
        put(b, v.count, 8);
        if (v.elem == GgufType::STRING)
          for (const auto& s : v.strings) put_str(b, s);
        else if (v.elem == GgufType::ARRAY)
          for (const auto& a : v.arrays) encode(b, a);
        else
          b.insert(b.end(), v.raw.begin(), v.raw.end());
        return;
      case GgufType::F32: {
        const float f = float(v.f);
        uint32_t u;
        std::memcpy(&u, &f, 4);
        put(b, u, 4);
        return;
      }
      case GgufType::F64: {
        uint64_t u;
        std::memcpy(&u, &v.f, 8);
        put(b, u, 8);
        return;
      }
      case GgufType::I8: case GgufType::I16: case GgufType::I32: case GgufType::I64:
        put(b, uint64_t(v.i), int(size_of(v.type)));
        return;
      default: put(b, v.u, int(size_of(v.type))); return;
    }
  }
  void key(const std::string& k, GgufType t) {
    put_str(kv_, k);
    put(kv_, uint32_t(t), 4);
    ++n_kv_;
  }
  void scalar(const std::string& k, GgufType t, uint64_t bits, int n) {
    key(k, t);
    put(kv_, bits, n);
  }

  std::vector<uint8_t> kv_;
  uint64_t n_kv_ = 0;
  std::vector<Tensor> tensors_;
};

}  // namespace kestrel::test
