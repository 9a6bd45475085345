#include "formats/quant_config.h"

#include <filesystem>
#include <regex>

#include "common/error.h"
#include "formats/json_file.h"

namespace kestrel {
namespace fs = std::filesystem;

bool glob_match(const std::string& p, const std::string& t) {
  // Iterative matcher with backtracking to the last '*'.
  size_t pi = 0, ti = 0, star = std::string::npos, mark = 0;
  auto match_one = [&](size_t& pj, char c) -> bool {  // pj at a non-'*' pattern char; advances it
    if (p[pj] == '?') { ++pj; return true; }
    if (p[pj] == '[') {
      size_t j = pj + 1;
      bool neg = j < p.size() && (p[j] == '!' || p[j] == '^');
      if (neg) ++j;
      bool hit = false;
      size_t start = j;
      while (j < p.size() && (p[j] != ']' || j == start)) {
        if (j + 2 < p.size() && p[j + 1] == '-' && p[j + 2] != ']') {
          if (c >= p[j] && c <= p[j + 2]) hit = true;
          j += 3;
        } else {
          if (c == p[j]) hit = true;
          ++j;
        }
      }
      if (j >= p.size()) {  // no closing ']': a literal '['
        if (c != '[') return false;
        ++pj;
        return true;
      }
      pj = j + 1;
      return hit != neg;
    }
    if (p[pj] != c) return false;
    ++pj;
    return true;
  };
  while (ti < t.size()) {
    if (pi < p.size() && p[pi] == '*') {
      star = pi++;
      mark = ti;
      continue;
    }
    size_t pj = pi;
    if (pi < p.size() && match_one(pj, t[ti])) {
      pi = pj;
      ++ti;
      continue;
    }
    if (star == std::string::npos) return false;
    pi = star + 1;
    ti = ++mark;
  }
  while (pi < p.size() && p[pi] == '*') ++pi;
  return pi == p.size();
}

bool QuantConfig::quantizes(const std::string& module) const {
  if (method == QuantMethod::None) return false;
  for (const auto& e : exclude) {
    if (method == QuantMethod::CompressedTensors) {
      if (e.rfind("re:", 0) == 0) {
        // Python's re.match: anchored at the start only.
        try {
          if (std::regex_search(module, std::regex(e.substr(3)), std::regex_constants::match_continuous)) return false;
        } catch (const std::regex_error&) {
          fail(source, ": ignore entry '", e, "' is not a valid regular expression");
        }
      } else if (e == module) {
        return false;
      }
    } else if (glob_match(e, module) || glob_match(e + ".*", module)) {
      return false;
    }
  }
  return true;
}

std::string QuantConfig::describe() const {
  if (method == QuantMethod::None) return "none";
  std::string s = cat(method == QuantMethod::ModelOpt ? "ModelOpt " : "compressed-tensors ", algo,
                      " (group ", group_size, ", from ", fs::path(source).filename().string(), ")");
  if (!exclude.empty()) {
    s += method == QuantMethod::ModelOpt ? ", excluded:" : ", ignored:";
    for (const auto& e : exclude) s += " " + e;
  }
  return s;
}

namespace {

std::vector<std::string> string_list(const nlohmann::json& j, const std::string& key, const std::string& file) {
  std::vector<std::string> out;
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return out;
  if (!it->is_array()) fail(file, ": '", key, "' must be a list of strings");
  for (const auto& v : *it) {
    if (!v.is_string()) fail(file, ": '", key, "' must be a list of strings");
    out.push_back(v.get<std::string>());
  }
  return out;
}

QuantConfig modelopt(const nlohmann::json& q, const std::string& file) {
  QuantConfig c;
  c.method = QuantMethod::ModelOpt;
  c.source = file;
  JsonFields f(q, file);
  c.algo = f.get_str("quant_algo", "");
  if (c.algo != "NVFP4")
    fail(file, ": quant_algo '", c.algo, "' is not supported (kestrel reads NVFP4 ModelOpt checkpoints)");
  c.group_size = int(f.get_int("group_size", 16));
  if (c.group_size != 16) fail(file, ": NVFP4 group_size must be 16, got ", c.group_size);
  c.exclude = string_list(q, "exclude_modules", file);
  for (const auto& e : string_list(q, "ignore", file)) c.exclude.push_back(e);
  return c;
}

QuantConfig compressed_tensors(const nlohmann::json& q, const std::string& file) {
  QuantConfig c;
  c.method = QuantMethod::CompressedTensors;
  c.source = file;
  JsonFields f(q, file);
  const std::string format = f.get_str("format", "");
  if (format != "nvfp4-pack-quantized")
    fail(file, ": compressed-tensors format '", format, "' is not supported (only nvfp4-pack-quantized)");
  c.algo = "NVFP4";
  auto groups = q.find("config_groups");
  if (groups == q.end() || !groups->is_object() || groups->empty())
    fail(file, ": compressed-tensors quantization_config has no config_groups");
  for (const auto& [gname, g] : groups->items()) {
    const std::string where = cat(file, ": config_groups.", gname);
    auto w = g.find("weights");
    if (w == g.end() || !w->is_object()) fail(where, ": missing 'weights'");
    JsonFields wf(*w, where);
    if (wf.get_int("num_bits", 0) != 4 || wf.get_str("type", "") != "float")
      fail(where, ".weights: only 4-bit float (NVFP4) weights are supported");
    c.group_size = int(wf.get_int("group_size", 16));
    if (c.group_size != 16) fail(where, ".weights: group_size must be 16, got ", c.group_size);
    auto targets = string_list(g, "targets", where);
    for (const auto& t : targets)
      if (t != "Linear") fail(where, ": target '", t, "' is not supported (only \"Linear\")");
  }
  c.exclude = string_list(q, "ignore", file);
  return c;
}

}  // namespace

QuantConfig load_quant_config(const std::string& dir, const nlohmann::json& config, const std::string& config_path) {
  const fs::path hqc = fs::path(dir) / "hf_quant_config.json";
  if (fs::exists(hqc)) {
    const nlohmann::json j = read_json_file(hqc.string());
    auto q = j.find("quantization");
    if (q == j.end() || !q->is_object()) fail(hqc.string(), ": missing object 'quantization'");
    return modelopt(*q, hqc.string());
  }
  auto q = config.find("quantization_config");
  if (q == config.end() || q->is_null()) return {};
  if (!q->is_object()) fail(config_path, ": quantization_config must be an object");
  const std::string method = JsonFields(*q, config_path).get_str("quant_method", "");
  if (method == "modelopt") return modelopt(*q, config_path);
  if (method == "compressed-tensors") return compressed_tensors(*q, config_path);
  fail(config_path, ": quantization_config.quant_method '", method, "' is not supported (modelopt or compressed-tensors)");
}

}  // namespace kestrel
