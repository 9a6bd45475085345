// Builds safetensors images in memory for tests, including deliberately broken ones.
#pragma once
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace kestrel::test {

struct StTensor {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

inline std::vector<uint8_t> safetensors_image(const std::vector<StTensor>& ts, const nlohmann::json& extra = {}) {
  nlohmann::json h = nlohmann::json::object();
  uint64_t off = 0;
  for (const auto& t : ts) {
    h[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {off, off + t.bytes.size()}}};
    off += t.bytes.size();
  }
  for (auto it = extra.begin(); extra.is_object() && it != extra.end(); ++it) h[it.key()] = it.value();
  std::string js = h.dump();
  while (js.size() % 8) js += ' ';
  std::vector<uint8_t> out(8);
  uint64_t n = js.size();
  for (int i = 0; i < 8; ++i) out[size_t(i)] = uint8_t(n >> (8 * i));
  out.insert(out.end(), js.begin(), js.end());
  for (const auto& t : ts) out.insert(out.end(), t.bytes.begin(), t.bytes.end());
  return out;
}

inline std::vector<uint8_t> raw_image(const std::string& header_json, size_t data_bytes) {
  std::vector<uint8_t> out(8);
  uint64_t n = header_json.size();
  for (int i = 0; i < 8; ++i) out[size_t(i)] = uint8_t(n >> (8 * i));
  out.insert(out.end(), header_json.begin(), header_json.end());
  out.resize(out.size() + data_bytes);
  return out;
}

inline void write_file(const std::filesystem::path& p, const std::vector<uint8_t>& bytes) {
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

inline std::vector<uint8_t> f32_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// A fresh empty folder under the system temp dir, removed when the object dies.
class TempDir {
 public:
  TempDir() {
    path_ = std::filesystem::temp_directory_path() /
            ("kestrel-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter()++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::filesystem::path& path() const { return path_; }

 private:
  static int& counter() {
    static int c = 0;
    return c;
  }
  std::filesystem::path path_;
};

}  // namespace kestrel::test
