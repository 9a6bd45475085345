#include <algorithm>
#include "apps/model_options.h"

#include <cstdio>

#include "common/error.h"
#include "common/thread_pool.h"
#include "quant/requantize.h"
#include "quant/targets.h"

namespace kestrel::apps {

std::vector<int32_t> parse_token_ids(const std::string& s, const std::string& option) {
  std::vector<int32_t> out;
  size_t i = 0;
  while (i < s.size()) {
    size_t j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    const std::string item = s.substr(i, j - i);
    try {
      size_t used = 0;
      long long v = std::stoll(item, &used);
      if (used != item.size() || v < 0 || v > INT32_MAX) throw std::invalid_argument(item);
      out.push_back(int32_t(v));
    } catch (const std::exception&) {
      fail(option, ": '", item, "' is not a token id (expected comma-separated non-negative integers)");
    }
    i = j + 1;
  }
  if (out.empty()) fail(option, ": no token ids given");
  return out;
}

uint64_t parse_size(const std::string& s, const std::string& option) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {
    fail(option, ": '", s, "' is not a size (e.g. 5GB, 500MB, 16K, 1000000)");
  }
  std::string unit = s.substr(used);
  std::transform(unit.begin(), unit.end(), unit.begin(), [](unsigned char c) { return char(std::toupper(c)); });
  static const std::pair<const char*, double> units[] = {
      {"", 1},         {"B", 1},           {"KB", 1e3},          {"MB", 1e6},    {"GB", 1e9},
      {"KIB", 1024.0}, {"MIB", 1048576.0}, {"GIB", 1073741824.0}, {"K", 1024.0}, {"M", 1048576.0},
      {"G", 1073741824.0}};
  for (const auto& [name, mult] : units)
    if (unit == name) {
      if (!(v * mult >= 1)) fail(option, ": '", s, "' must be at least one byte");
      return uint64_t(v * mult);
    }
  fail(option, ": unknown unit in '", s, "' (B, KB, MB, GB, KiB, MiB, GiB; K, M, G are binary)");
}

void add_quant_option(CLI::App& app, std::string& quant) {
  app.add_option("--quant", quant,
                 "none (weights as stored) or nvfp4 (requantize the linears to NVFP4 at load, as kestrel quantize "
                 "would; LM head, routers and embeddings stay as stored)");
}

void add_speculation_options(CLI::App& app, SpeculationOptions& o) {
  app.add_option("--speculative", o.method,
                 "none (default), ngram (draft tokens by prompt lookup) or mtp (with the model's MTP layer: "
                 "DeepSeek-V3/R1, GLM-5; CPU, unsplit), checked in one run (same greedy output, same sampling "
                 "distribution)");
  app.add_option("--draft-tokens", o.draft_tokens,
                 "The most tokens drafted per check with --speculative (1..16, default 8; with mtp 1 to 4 make sense)");
}

void add_layout_options(CLI::App& app, Layout& layout) {
  app.add_option("--tp", layout.tp,
                 "Tensor-parallel ranks: GPUs, or threads on the CPU (default 1). Heads, FFNs and the LM head are "
                 "split, norms, routers and embeddings replicated");
  app.add_option("--ep", layout.ep, "Expert parallelism: 1 (each expert split by --tp) or --tp (whole experts per rank)");
}

void add_kv_dtype_option(CLI::App& app, std::string& kv) {
  app.add_option("--kv-dtype", kv,
                 "The GPU's KV cache: auto (bf16, float32 for MLA models), bf16 (half the memory and reads of f32) "
                 "or f32; the CPU caches f32");
}

void check_kv_dtype_option(const std::string& kv) {
  if (kv != "auto" && kv != "f32" && kv != "bf16") fail("--kv-dtype: expected auto, f32 or bf16, got '", kv, "'");
}

cuda::KvType kv_type_for(const ModelConfig& c, const std::string& kv) {
  check_kv_dtype_option(kv);
  if (kv == "f32" || (kv == "auto" && c.is_mla())) return cuda::KvType::F32;
  if (c.is_mla()) fail("--kv-dtype bf16: ", c.architecture, " uses MLA, whose latents the GPU caches as float32");
  return cuda::KvType::BF16;
}

void check_quant_option(const std::string& quant) {
  if (quant != "none" && quant != "nvfp4") fail("--quant: expected none or nvfp4, got '", quant, "'");
}

std::unique_ptr<Model> load_model_as(const std::string& path, const std::string& quant, Progress progress) {
  check_quant_option(quant);
  auto m = load_model(path, progress);
  if (quant == "nvfp4") {
    const bool shown = progress_shown(progress);
    const int n = requantize_nvfp4(*m, nvfp4_settings(m->config, {}, "--quant nvfp4"), ThreadPool::global(), shown);
    if (shown) std::fprintf(stderr, "requantized %d linears to NVFP4\n", n);
  }
  return m;
}

}  // namespace kestrel::apps
