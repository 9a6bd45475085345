#include "formats/safetensors.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "common/error.h"

namespace kestrel {

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorView::shape_str() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string TensorView::where() const { return cat(file, ": tensor '", name, "'"); }

SafetensorsIndex::SafetensorsIndex(std::span<const uint8_t> bytes, const std::string& label) {
  if (bytes.size() < 8) fail(label, ": truncated safetensors file (", bytes.size(), " bytes, no header length)");
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; --i) hlen = (hlen << 8) | bytes[size_t(i)];
  if (hlen > kMaxHeader) fail(label, ": safetensors header of ", hlen, " bytes is larger than the limit of ", kMaxHeader);
  if (hlen > bytes.size() - 8)
    fail(label, ": truncated safetensors file: header claims ", hlen, " bytes but only ", bytes.size() - 8, " follow");
  const char* hbegin = reinterpret_cast<const char*>(bytes.data() + 8);
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(hbegin, hbegin + hlen);
  } catch (const nlohmann::json::exception& e) {
    fail(label, ": safetensors header is not valid JSON: ", e.what());
  }
  if (!header.is_object()) fail(label, ": safetensors header is not a JSON object");

  const uint8_t* data = bytes.data() + 8 + hlen;
  const uint64_t data_size = bytes.size() - 8 - hlen;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;

  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") {
      if (!info.is_object()) fail(label, ": __metadata__ is not an object");
      for (const auto& [k, v] : info.items())
        metadata_[k] = v.is_string() ? v.get<std::string>() : v.dump();
      continue;
    }
    const std::string where = cat(label, ": tensor '", name, "'");
    if (!info.is_object()) fail(where, ": entry is not an object");
    auto dt = info.find("dtype");
    auto sh = info.find("shape");
    auto off = info.find("data_offsets");
    if (dt == info.end() || !dt->is_string()) fail(where, ": missing or non-string 'dtype'");
    if (sh == info.end() || !sh->is_array()) fail(where, ": missing or non-array 'shape'");
    if (off == info.end() || !off->is_array() || off->size() != 2) fail(where, ": 'data_offsets' must be [begin, end]");
    auto dtype = parse_dtype(dt->get<std::string>());
    if (!dtype) fail(where, ": unsupported dtype '", dt->get<std::string>(), "'");

    TensorView t;
    t.name = name;
    t.file = label;
    t.dtype = *dtype;
    uint64_t numel = 1;
    bool overflow = false;
    for (const auto& d : *sh) {
      if (!d.is_number_unsigned() && !(d.is_number_integer() && d.get<int64_t>() >= 0))
        fail(where, ": shape entries must be non-negative integers");
      uint64_t v = d.get<uint64_t>();
      if (v > (1ull << 40)) overflow = true;
      if (v && numel > (1ull << 62) / v) overflow = true;
      numel *= v;
      t.shape.push_back(int64_t(v));
    }
    if (overflow) fail(where, ": shape ", t.shape_str(), " is too large");
    for (const auto& o : *off)
      if (!o.is_number_unsigned() && !(o.is_number_integer() && o.get<int64_t>() >= 0))
        fail(where, ": data_offsets must be non-negative integers");
    uint64_t b = (*off)[0].get<uint64_t>(), e = (*off)[1].get<uint64_t>();
    if (b > e) fail(where, ": data_offsets [", b, ", ", e, "] are reversed");
    if (e > data_size)
      fail(where, ": data_offsets [", b, ", ", e, "] run past the end of the data (", data_size, " bytes): file truncated?");
    const uint64_t expect = numel * dtype_size(*dtype);
    if (e - b != expect)
      fail(where, ": ", dtype_name(*dtype), " ", t.shape_str(), " needs ", expect, " bytes but data_offsets span ", e - b);
    t.data = data + b;
    t.nbytes = size_t(e - b);
    ranges.emplace_back(b, e);
    tensors_.emplace(name, std::move(t));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second && ranges[i].first != ranges[i].second &&
        ranges[i - 1].first != ranges[i - 1].second) {
      std::string a, b2;
      for (const auto& [n, t] : tensors_) {
        uint64_t tb = uint64_t(t.data - data);
        if (tb == ranges[i - 1].first && a.empty()) a = n;
        else if (tb == ranges[i].first) b2 = n;
      }
      fail(label, ": tensors '", a, "' and '", b2, "' overlap in the data section");
    }
  }
}

SafetensorsFile::SafetensorsFile(const std::string& path) : file_(path) {
  index_ = std::make_unique<SafetensorsIndex>(file_.bytes(), path);
}

}  // namespace kestrel
