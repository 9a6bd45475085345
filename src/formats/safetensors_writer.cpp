#include "formats/safetensors_writer.h"

#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "common/error.h"

namespace kestrel {

size_t TensorSpec::nbytes() const {
  size_t n = dtype_size(dtype);
  for (int64_t d : shape) n *= size_t(d);
  return n;
}

SafetensorsWriter::SafetensorsWriter(const std::string& path, std::vector<TensorSpec> tensors,
                                     const std::map<std::string, std::string>& metadata)
    : path_(path), tensors_(std::move(tensors)) {
  nlohmann::json h = nlohmann::json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  size_t off = 0;
  for (const TensorSpec& t : tensors_) {
    if (t.name.empty() || t.name == "__metadata__") fail(path, ": invalid tensor name '", t.name, "'");
    if (h.contains(t.name)) fail(path, ": tensor '", t.name, "' declared twice");
    const size_t n = t.nbytes();
    h[t.name] = {{"dtype", std::string(dtype_name(t.dtype))}, {"shape", t.shape}, {"data_offsets", {off, off + n}}};
    off += n;
  }
  std::string js = h.dump();
  while (js.size() % 8) js += ' ';  // data starts 8-byte aligned, as the reference writer pads
  f_ = std::fopen(path.c_str(), "wb");
  if (!f_) fail(path, ": cannot create: ", std::strerror(errno));
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = uint8_t(uint64_t(js.size()) >> (8 * i));
  if (std::fwrite(len, 1, 8, f_) != 8 || std::fwrite(js.data(), 1, js.size(), f_) != js.size())
    fail(path, ": write failed: ", std::strerror(errno));
}

SafetensorsWriter::~SafetensorsWriter() {
  if (f_) std::fclose(f_);
}

void SafetensorsWriter::write(const std::string& name, const void* data, size_t n) {
  // Zero-byte tensors need no call.
  while (written_ == 0 && next_ < tensors_.size() && tensors_[next_].nbytes() == 0 && tensors_[next_].name != name)
    ++next_;
  if (next_ >= tensors_.size()) fail(path_, ": tensor '", name, "' written past the declared ones");
  const TensorSpec& t = tensors_[next_];
  if (t.name != name) fail(path_, ": tensor '", name, "' written where '", t.name, "' comes next");
  if (written_ + n > t.nbytes()) fail(path_, ": tensor '", name, "' given more than its ", t.nbytes(), " bytes");
  if (n && std::fwrite(data, 1, n, f_) != n) fail(path_, ": write failed: ", std::strerror(errno));
  written_ += n;
  if (written_ == t.nbytes()) {
    ++next_;
    written_ = 0;
  }
}

void SafetensorsWriter::finish() {
  while (next_ < tensors_.size() && tensors_[next_].nbytes() == 0) ++next_;
  if (next_ != tensors_.size()) fail(path_, ": tensor '", tensors_[next_].name, "' was not written");
  const int rc = std::fclose(f_);
  f_ = nullptr;
  if (rc != 0) fail(path_, ": write failed: ", std::strerror(errno));
}

}  // namespace kestrel
