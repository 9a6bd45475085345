// GGUF (versions 2 and 3, little-endian): "GGUF", version, tensor and metadata counts, the
// metadata key/value pairs, the tensor infos, then the tensor data section at the next multiple of
// general.alignment (default 32). Everything is validated before use: counts and lengths against
// the bytes that remain, tensor types known, rows whole blocks, data ranges aligned, inside the
// file and not overlapping. Tensor data is never copied.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/mapped_file.h"
#include "formats/ggml_quants.h"

namespace kestrel {

enum class GgufType : uint32_t {
  U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, BOOL = 7, STRING = 8, ARRAY = 9,
  U64 = 10, I64 = 11, F64 = 12,
};
const char* gguf_type_name(GgufType t);

// One metadata value. Scalars keep their value in the field that fits; arrays of numbers or bools
// keep a view of their little-endian elements, arrays of strings and of arrays are decoded.
struct GgufValue {
  GgufType type = GgufType::U8;
  uint64_t u = 0;   // unsigned integers and bool
  int64_t i = 0;    // signed integers
  double f = 0;     // floats
  std::string str;  // STRING
  GgufType elem = GgufType::U8;            // ARRAY: element type
  uint64_t count = 0;                      // ARRAY: element count
  std::span<const uint8_t> raw;            // ARRAY of numbers or bools
  std::vector<std::string> strings;        // ARRAY of STRING
  std::vector<GgufValue> arrays;           // ARRAY of ARRAY

  bool is_int() const;    // any integer type
  bool is_float() const;  // F32 or F64
  std::string describe() const;  // "u32", "array of 3 string", ... for error messages
};

struct GgufTensor {
  std::string name;
  GgmlType type = GgmlType::F32;
  std::vector<int64_t> dims;  // ggml order: dims[0] is the contiguous (row) dimension
  uint64_t offset = 0;        // from the start of the data section
  const uint8_t* data = nullptr;
  size_t nbytes = 0;

  int64_t numel() const;
  int64_t rows() const { return dims.empty() || dims[0] == 0 ? 0 : numel() / dims[0]; }
  std::string dims_str() const;  // "[576, 49152]" (ggml order)
};

// Parses a GGUF image in memory. `label` names it in errors. Never reads outside `bytes`.
class GgufIndex {
 public:
  GgufIndex(std::span<const uint8_t> bytes, const std::string& label);

  const std::string& label() const { return label_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }  // start of the data section in the file

  const std::map<std::string, GgufValue>& metadata() const { return kv_; }
  const std::vector<GgufTensor>& tensors() const { return tensors_; }  // file order
  const GgufValue* find(const std::string& key) const;
  const GgufTensor* find_tensor(const std::string& name) const;
  const GgufTensor& tensor(const std::string& name) const;  // throws naming the file and tensor

  // Typed metadata access; errors name the file and the key.
  bool has(const std::string& key) const { return find(key) != nullptr; }
  int64_t get_int(const std::string& key) const;
  int64_t get_int(const std::string& key, int64_t def) const;
  double get_float(const std::string& key) const;  // accepts integers too
  double get_float(const std::string& key, double def) const;
  bool get_bool(const std::string& key, bool def) const;
  std::string get_str(const std::string& key, const std::string& def) const;
  std::vector<int64_t> get_int_array(const std::string& key) const;  // [] if absent
  std::vector<double> get_float_array(const std::string& key) const;  // [] if absent
  const std::vector<std::string>& get_str_array(const std::string& key) const;  // empty if absent

  std::string where(const std::string& key) const { return label_ + ": metadata '" + key + "'"; }
  std::string where_tensor(const std::string& name) const { return label_ + ": tensor '" + name + "'"; }

 private:
  std::string label_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::map<std::string, GgufValue> kv_;
  std::vector<GgufTensor> tensors_;
  std::map<std::string, size_t> by_name_;
};

// A mapped GGUF file.
class GgufFile {
 public:
  explicit GgufFile(const std::string& path);
  const GgufIndex& index() const { return *index_; }
  const std::string& path() const { return file_.path(); }
  size_t size() const { return file_.bytes().size(); }

 private:
  MappedFile file_;
  std::unique_ptr<GgufIndex> index_;
};

// Whether the file at `path` starts with the GGUF magic.
bool is_gguf_file(const std::string& path);

}  // namespace kestrel
