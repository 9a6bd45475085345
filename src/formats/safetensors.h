// safetensors: 8-byte little-endian header length, a JSON header, then the tensor bytes.
// The header is validated in full (dtype known, shape consistent with the byte range, ranges
// inside the data section and not overlapping) before any tensor is handed out.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/mapped_file.h"
#include "formats/dtype.h"

namespace kestrel {

// A tensor inside a mapped file. `file` names where it came from, for error messages.
struct TensorView {
  std::string name;
  std::string file;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t nbytes = 0;

  int64_t numel() const;
  int64_t dim(size_t i) const { return shape.at(i); }
  std::string shape_str() const;  // "[4, 8]"
  std::string where() const;      // "file: tensor 'name'"
};

// Parses a safetensors image already in memory. `label` names it in errors. Never reads outside
// `bytes`; throws kestrel::Error on any inconsistency.
class SafetensorsIndex {
 public:
  static constexpr uint64_t kMaxHeader = 100ull << 20;  // 100 MiB, as the reference library
  SafetensorsIndex(std::span<const uint8_t> bytes, const std::string& label);

  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A mapped safetensors file.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  const std::map<std::string, TensorView>& tensors() const { return index_->tensors(); }
  const std::string& path() const { return file_.path(); }

 private:
  MappedFile file_;
  std::unique_ptr<SafetensorsIndex> index_;
};

}  // namespace kestrel
