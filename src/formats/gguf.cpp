#include "formats/gguf.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <limits>

#include "common/error.h"

namespace kestrel {
namespace {

constexpr uint64_t kMaxName = 65535;      // GGUF keys are at most 2^16 - 1 bytes; tensor names too here
constexpr int kMaxArrayDepth = 8;         // arrays of arrays nest this deep at most
constexpr uint32_t kMaxDims = 4;          // GGML_MAX_DIMS
constexpr uint64_t kMaxAlignment = 1u << 20;

size_t scalar_size(GgufType t) {
  switch (t) {
    case GgufType::U8: case GgufType::I8: case GgufType::BOOL: return 1;
    case GgufType::U16: case GgufType::I16: return 2;
    case GgufType::U32: case GgufType::I32: case GgufType::F32: return 4;
    case GgufType::U64: case GgufType::I64: case GgufType::F64: return 8;
    default: return 0;  // STRING, ARRAY: variable
  }
}

bool known_type(uint32_t t) { return t <= uint32_t(GgufType::F64); }

uint64_t le(const uint8_t* p, size_t n) {
  uint64_t v = 0;
  for (size_t k = n; k-- > 0;) v = (v << 8) | p[k];
  return v;
}

// Decodes one little-endian scalar of a numeric or bool type into a value.
void decode_scalar(GgufType t, const uint8_t* p, GgufValue& v) {
  const uint64_t bits = le(p, scalar_size(t));
  switch (t) {
    case GgufType::U8: case GgufType::U16: case GgufType::U32: case GgufType::U64: v.u = bits; break;
    case GgufType::BOOL: v.u = bits != 0; break;
    case GgufType::I8: v.i = int8_t(bits); break;
    case GgufType::I16: v.i = int16_t(bits); break;
    case GgufType::I32: v.i = int32_t(bits); break;
    case GgufType::I64: v.i = int64_t(bits); break;
    case GgufType::F32: {
      float f;
      const uint32_t b32 = uint32_t(bits);
      std::memcpy(&f, &b32, 4);
      v.f = f;
      break;
    }
    case GgufType::F64: std::memcpy(&v.f, &bits, 8); break;
    default: break;
  }
}

class Cursor {
 public:
  Cursor(std::span<const uint8_t> b, const std::string& label) : b_(b), label_(label) {}

  size_t pos() const { return pos_; }
  size_t left() const { return b_.size() - pos_; }

  const uint8_t* take(uint64_t n, const std::string& what) {
    if (n > left())
      fail(label_, ": truncated GGUF file: ", what, " at byte ", pos_, " needs ", n, " bytes but only ", left(),
           " remain");
    const uint8_t* p = b_.data() + pos_;
    pos_ += size_t(n);
    return p;
  }
  uint32_t u32(const std::string& what) { return uint32_t(le(take(4, what), 4)); }
  uint64_t u64(const std::string& what) { return le(take(8, what), 8); }
  std::string str(const std::string& what, uint64_t max_len = std::numeric_limits<uint64_t>::max()) {
    const uint64_t n = u64(what + " (string length)");
    if (n > max_len) fail(label_, ": ", what, ": length ", n, " exceeds the limit of ", max_len, " bytes");
    if (n > left())
      fail(label_, ": truncated GGUF file: ", what, ": string of ", n, " bytes at byte ", pos_,
           " runs past the end of the file (", left(), " bytes remain)");
    const uint8_t* p = take(n, what);
    return std::string(reinterpret_cast<const char*>(p), size_t(n));
  }

 private:
  std::span<const uint8_t> b_;
  const std::string& label_;
  size_t pos_ = 0;
};

GgufValue read_value(Cursor& c, uint32_t type, const std::string& where, int depth) {
  if (!known_type(type)) fail(where, ": unknown value type ", type);
  GgufValue v;
  v.type = GgufType(type);
  if (v.type == GgufType::STRING) {
    v.str = c.str(where);
    return v;
  }
  if (v.type != GgufType::ARRAY) {
    decode_scalar(v.type, c.take(scalar_size(v.type), where), v);
    return v;
  }
  if (depth >= kMaxArrayDepth) fail(where, ": arrays nested deeper than ", kMaxArrayDepth, " levels");
  const uint32_t et = c.u32(where + " (array element type)");
  if (!known_type(et)) fail(where, ": unknown array element type ", et);
  v.elem = GgufType(et);
  v.count = c.u64(where + " (array length)");
  // Every element takes at least this many bytes, which bounds the count by what is left.
  const size_t min_elem = v.elem == GgufType::STRING ? 8 : v.elem == GgufType::ARRAY ? 12 : scalar_size(v.elem);
  if (v.count > c.left() / min_elem)
    fail(where, ": array of ", v.count, " ", gguf_type_name(v.elem), " elements cannot fit in the ", c.left(),
         " bytes that remain");
  if (v.elem == GgufType::STRING) {
    v.strings.reserve(size_t(v.count));
    for (uint64_t k = 0; k < v.count; ++k) v.strings.push_back(c.str(cat(where, "[", k, "]")));
  } else if (v.elem == GgufType::ARRAY) {
    v.arrays.reserve(size_t(v.count));
    for (uint64_t k = 0; k < v.count; ++k)
      v.arrays.push_back(read_value(c, uint32_t(GgufType::ARRAY), cat(where, "[", k, "]"), depth + 1));
  } else {
    const uint64_t n = v.count * min_elem;
    v.raw = {c.take(n, where), size_t(n)};
  }
  return v;
}

}  // namespace

const char* gguf_type_name(GgufType t) {
  switch (t) {
    case GgufType::U8: return "u8";
    case GgufType::I8: return "i8";
    case GgufType::U16: return "u16";
    case GgufType::I16: return "i16";
    case GgufType::U32: return "u32";
    case GgufType::I32: return "i32";
    case GgufType::F32: return "f32";
    case GgufType::BOOL: return "bool";
    case GgufType::STRING: return "string";
    case GgufType::ARRAY: return "array";
    case GgufType::U64: return "u64";
    case GgufType::I64: return "i64";
    case GgufType::F64: return "f64";
  }
  return "?";
}

bool GgufValue::is_int() const {
  switch (type) {
    case GgufType::U8: case GgufType::I8: case GgufType::U16: case GgufType::I16: case GgufType::U32:
    case GgufType::I32: case GgufType::U64: case GgufType::I64: return true;
    default: return false;
  }
}

bool GgufValue::is_float() const { return type == GgufType::F32 || type == GgufType::F64; }

std::string GgufValue::describe() const {
  if (type != GgufType::ARRAY) return gguf_type_name(type);
  return cat("array of ", count, " ", gguf_type_name(elem));
}

int64_t GgufTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

std::string GgufTensor::dims_str() const {
  std::string s = "[";
  for (size_t k = 0; k < dims.size(); ++k) s += (k ? ", " : "") + std::to_string(dims[k]);
  return s + "]";
}

GgufIndex::GgufIndex(std::span<const uint8_t> bytes, const std::string& label) : label_(label) {
  Cursor c(bytes, label_);
  if (bytes.size() < 4 || std::memcmp(bytes.data(), "GGUF", 4) != 0)
    fail(label_, ": not a GGUF file (the first 4 bytes are not \"GGUF\")");
  c.take(4, "magic");
  version_ = c.u32("version");
  if (version_ == 0x02000000u || version_ == 0x03000000u)
    fail(label_, ": big-endian GGUF files are not supported");
  if (version_ != 2 && version_ != 3)
    fail(label_, ": GGUF version ", version_, " is not supported (versions 2 and 3 are)");
  const uint64_t n_tensors = c.u64("tensor count");
  const uint64_t n_kv = c.u64("metadata count");
  // Smallest encodings: a key/value pair is 8 + 4 + 1 bytes, a tensor info 8 + 4 + 4 + 8.
  if (n_kv > c.left() / 13)
    fail(label_, ": header claims ", n_kv, " metadata entries, more than the ", c.left(), " remaining bytes can hold");
  if (n_tensors > c.left() / 24)
    fail(label_, ": header claims ", n_tensors, " tensors, more than the ", c.left(), " remaining bytes can hold");

  for (uint64_t k = 0; k < n_kv; ++k) {
    const std::string key = c.str(cat("metadata key #", k), kMaxName);
    const std::string where = cat(label_, ": metadata '", key, "'");
    const uint32_t type = c.u32(where + " (value type)");
    GgufValue v = read_value(c, type, where, 0);
    if (!kv_.emplace(key, std::move(v)).second) fail(where, ": key appears twice");
  }

  if (const GgufValue* a = find("general.alignment")) {
    if (a->type != GgufType::U32) fail(where("general.alignment"), ": must be u32, found ", a->describe());
    if (a->u == 0 || (a->u & (a->u - 1)) != 0 || a->u > kMaxAlignment)
      fail(where("general.alignment"), ": ", a->u, " is not a power of two up to ", kMaxAlignment);
    alignment_ = a->u;
  }

  tensors_.reserve(size_t(n_tensors));
  for (uint64_t k = 0; k < n_tensors; ++k) {
    GgufTensor t;
    t.name = c.str(cat("name of tensor #", k), kMaxName);
    const std::string where = where_tensor(t.name);
    const uint32_t nd = c.u32(where + " (dimension count)");
    if (nd == 0 || nd > kMaxDims) fail(where, ": ", nd, " dimensions (1 to ", kMaxDims, " are allowed)");
    uint64_t numel = 1;
    for (uint32_t d = 0; d < nd; ++d) {
      const uint64_t v = c.u64(where + " (dimension)");
      if (v > (1ull << 40) || (v && numel > (1ull << 50) / v))
        fail(where, ": dimension ", d, " of ", v, " makes the tensor implausibly large");
      numel *= v;
      t.dims.push_back(int64_t(v));
    }
    const uint32_t type = c.u32(where + " (type)");
    const GgmlTypeInfo* info = ggml_type_info(type);
    if (!info) fail(where, ": unknown ggml type id ", type);
    t.type = GgmlType(type);
    t.offset = c.u64(where + " (data offset)");
    if (t.dims[0] % info->block != 0)
      fail(where, ": rows of ", t.dims[0], " values are not whole ", info->name, " blocks of ", info->block);
    t.nbytes = size_t(numel / info->block * info->bytes);
    if (t.offset % alignment_ != 0)
      fail(where, ": data offset ", t.offset, " is not a multiple of the alignment ", alignment_);
    if (!by_name_.emplace(t.name, tensors_.size()).second) fail(where, ": tensor name appears twice");
    tensors_.push_back(std::move(t));
  }

  data_offset_ = (c.pos() + alignment_ - 1) / alignment_ * alignment_;
  const uint64_t data_size = data_offset_ <= bytes.size() ? bytes.size() - data_offset_ : 0;
  for (auto& t : tensors_) {
    if (t.offset > data_size || t.nbytes > data_size - t.offset)
      fail(where_tensor(t.name), ": ", ggml_type_name(uint32_t(t.type)), " ", t.dims_str(), " needs ", t.nbytes,
           " bytes at data offset ", t.offset, " but the data section holds ", data_size, " bytes: file truncated?");
    t.data = bytes.data() + data_offset_ + t.offset;
  }
  std::vector<const GgufTensor*> order;
  for (const auto& t : tensors_)
    if (t.nbytes) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->offset < b->offset; });
  for (size_t k = 1; k < order.size(); ++k)
    if (order[k]->offset < order[k - 1]->offset + order[k - 1]->nbytes)
      fail(label_, ": tensors '", order[k - 1]->name, "' and '", order[k]->name, "' overlap in the data section");
}

const GgufValue* GgufIndex::find(const std::string& key) const {
  auto it = kv_.find(key);
  return it == kv_.end() ? nullptr : &it->second;
}

const GgufTensor* GgufIndex::find_tensor(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

const GgufTensor& GgufIndex::tensor(const std::string& name) const {
  const GgufTensor* t = find_tensor(name);
  if (!t) fail(label_, ": missing tensor '", name, "'");
  return *t;
}

namespace {

int64_t as_int(const GgufValue& v, const std::string& where) {
  if (!v.is_int()) fail(where, ": must be an integer, found ", v.describe());
  const bool is_unsigned = v.type == GgufType::U8 || v.type == GgufType::U16 || v.type == GgufType::U32 ||
                           v.type == GgufType::U64;
  if (!is_unsigned) return v.i;
  if (v.u > uint64_t(std::numeric_limits<int64_t>::max())) fail(where, ": value ", v.u, " is too large");
  return int64_t(v.u);
}

double as_float(const GgufValue& v, const std::string& where) {
  if (v.is_float()) return v.f;
  if (v.is_int()) return double(as_int(v, where));
  fail(where, ": must be a number, found ", v.describe());
}

GgufValue element(const GgufValue& a, uint64_t k) {
  GgufValue e;
  e.type = a.elem;
  decode_scalar(a.elem, a.raw.data() + k * scalar_size(a.elem), e);
  return e;
}

}  // namespace

int64_t GgufIndex::get_int(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) fail(label_, ": missing metadata '", key, "'");
  return as_int(*v, where(key));
}

int64_t GgufIndex::get_int(const std::string& key, int64_t def) const { return has(key) ? get_int(key) : def; }

double GgufIndex::get_float(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) fail(label_, ": missing metadata '", key, "'");
  return as_float(*v, where(key));
}

double GgufIndex::get_float(const std::string& key, double def) const { return has(key) ? get_float(key) : def; }

bool GgufIndex::get_bool(const std::string& key, bool def) const {
  const GgufValue* v = find(key);
  if (!v) return def;
  if (v->type != GgufType::BOOL) fail(where(key), ": must be a bool, found ", v->describe());
  return v->u != 0;
}

std::string GgufIndex::get_str(const std::string& key, const std::string& def) const {
  const GgufValue* v = find(key);
  if (!v) return def;
  if (v->type != GgufType::STRING) fail(where(key), ": must be a string, found ", v->describe());
  return v->str;
}

std::vector<int64_t> GgufIndex::get_int_array(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) return {};
  if (v->type != GgufType::ARRAY) return {as_int(*v, where(key))};
  if (scalar_size(v->elem) == 0 || v->elem == GgufType::BOOL || v->elem == GgufType::F32 || v->elem == GgufType::F64)
    fail(where(key), ": must be integers, found ", v->describe());
  std::vector<int64_t> out;
  out.reserve(size_t(v->count));
  for (uint64_t k = 0; k < v->count; ++k) out.push_back(as_int(element(*v, k), cat(where(key), "[", k, "]")));
  return out;
}

std::vector<double> GgufIndex::get_float_array(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) return {};
  if (v->type != GgufType::ARRAY) return {as_float(*v, where(key))};
  if (scalar_size(v->elem) == 0 || v->elem == GgufType::BOOL)
    fail(where(key), ": must be numbers, found ", v->describe());
  std::vector<double> out;
  out.reserve(size_t(v->count));
  for (uint64_t k = 0; k < v->count; ++k) out.push_back(as_float(element(*v, k), cat(where(key), "[", k, "]")));
  return out;
}

const std::vector<std::string>& GgufIndex::get_str_array(const std::string& key) const {
  static const std::vector<std::string> kEmpty;
  const GgufValue* v = find(key);
  if (!v) return kEmpty;
  if (v->type != GgufType::ARRAY || v->elem != GgufType::STRING)
    fail(where(key), ": must be an array of strings, found ", v->describe());
  return v->strings;
}

GgufFile::GgufFile(const std::string& path) : file_(path) {
  index_ = std::make_unique<GgufIndex>(file_.bytes(), path);
}

bool is_gguf_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  char magic[4] = {};
  return f.read(magic, 4) && std::memcmp(magic, "GGUF", 4) == 0;
}

}  // namespace kestrel
