// Access to the committed fixtures: tiny random checkpoints with transformers' logits.
#pragma once
#include <cctype>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "formats/json_file.h"

namespace kestrel::test {

// Grouped-query attention families.
inline const std::vector<std::string>& gqa_fixture_names() {
  static const std::vector<std::string> names = {
      "llama-bf16",    "llama-nvfp4",    "qwen2-bf16",    "qwen2-nvfp4",    "qwen3-bf16",   "qwen3-nvfp4-ct",
      "mixtral-bf16",  "mixtral-nvfp4",  "qwen3moe-bf16", "qwen3moe-nvfp4", "glm4moe-bf16", "glm4moe-nvfp4"};
  return names;
}

// Multi-head latent attention families (DeepSeek-V3, GLM-5 with its sparse-attention indexer).
inline const std::vector<std::string>& mla_fixture_names() {
  static const std::vector<std::string> names = {"deepseekv3-bf16", "deepseekv3-nvfp4", "glm5-bf16", "glm5-nvfp4"};
  return names;
}

// FP8 checkpoints (CPU only: not among fixture_names(), which the GPU tests run).
inline const std::vector<std::string>& fp8_fixture_names() {
  static const std::vector<std::string> names = {"deepseekv3-fp8", "glm4moe-fp8", "qwen3moe-fp8", "qwen3-fp8-ct",
                                                 "llama-fp8-tensor"};
  return names;
}

inline const std::vector<std::string>& fixture_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> all = gqa_fixture_names();
    all.insert(all.end(), mla_fixture_names().begin(), mla_fixture_names().end());
    return all;
  }();
  return names;
}

inline std::string fixture_dir(const std::string& name) { return std::string(KESTREL_FIXTURES) + "/" + name; }

// A test name for a fixture parameter (gtest allows only letters, digits and '_'): pass
// `test::fixture_test_name` as INSTANTIATE_TEST_SUITE_P's name generator.
inline std::string fixture_test_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string n = info.param;
  for (char& ch : n)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return n;
}

struct Reference {
  std::vector<int32_t> tokens;
  int64_t vocab = 0;
  std::vector<float> logits;  // [tokens, vocab]
};

inline Reference load_reference(const std::string& dir) {
  const nlohmann::json j = read_json_file(dir + "/reference.json");
  Reference r;
  for (const auto& t : j.at("tokens")) r.tokens.push_back(t.get<int32_t>());
  r.vocab = j.at("shape").at(1).get<int64_t>();
  const std::string path = dir + "/" + j.at("logits").get<std::string>();
  std::ifstream f(path, std::ios::binary);
  r.logits.resize(r.tokens.size() * size_t(r.vocab));
  f.read(reinterpret_cast<char*>(r.logits.data()), std::streamsize(r.logits.size() * 4));
  if (!f) fail(path, ": short read");
  return r;
}

// ||a - b|| / ||b|| over one row.
inline double rel_l2(const float* a, const float* b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

}  // namespace kestrel::test
