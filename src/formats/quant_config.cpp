#include "formats/quant_config.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

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

namespace {

// Patterns come from config files, which may be hostile: a pattern such as "(a+)+$" backtracks
// exponentially on a name it almost matches. PCRE2 stops a match past these limits (module names
// are short: honest patterns stay orders of magnitude below them) and the match then fails.
constexpr uint32_t kMatchLimit = 1'000'000;  // calls of PCRE2's internal match function, ~15 ms
constexpr uint32_t kDepthLimit = 10'000;     // nested backtracking points
constexpr uint32_t kHeapLimitKib = 20 * 1024;  // their frames, which grow with the capture groups

// Shared by every thread: pcre2_match only reads it (its parameter is not const, though).
pcre2_match_context* limits() {
  static pcre2_match_context* const ctx = [] {
    pcre2_match_context* c = pcre2_match_context_create(nullptr);
    pcre2_set_match_limit(c, kMatchLimit);
    pcre2_set_depth_limit(c, kDepthLimit);
    pcre2_set_heap_limit(c, kHeapLimitKib);
    return c;
  }();
  return ctx;
}

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  return pcre2_get_error_message(code, buf, sizeof buf) < 0 ? cat("PCRE2 error ", code)
                                                            : std::string(reinterpret_cast<const char*>(buf));
}

// A pattern compiled by PCRE2, anchored at the start of the subject as Python's re.match is; $
// matches only at the very end.
struct Regex {
  pcre2_code* code = nullptr;
  std::string error;  // why it did not compile
  ~Regex() { pcre2_code_free(code); }
};

// prefix + entry + suffix compiled once per thread (a model has thousands of linears, the settings
// a few patterns), a few hundred kept. Fails naming `where` (file, field and entry) when it does
// not compile, the offset counted in the entry.
std::shared_ptr<const Regex> compiled(const std::string& prefix, const std::string& entry, const std::string& suffix,
                                      const std::string& where) {
  thread_local std::map<std::string, std::shared_ptr<const Regex>> cache;
  const std::string pattern = prefix + entry + suffix;
  auto it = cache.find(pattern);
  if (it == cache.end()) {
    if (cache.size() >= 256) cache.clear();
    auto re = std::make_shared<Regex>();
    int code = 0;
    PCRE2_SIZE offset = 0;
    re->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                             PCRE2_ANCHORED | PCRE2_DOLLAR_ENDONLY, &code, &offset, nullptr);
    if (!re->code) {
      const size_t at = offset > prefix.size() ? std::min<size_t>(offset - prefix.size(), entry.size()) : 0;
      re->error = cat(pcre2_message(code), " at offset ", at);
    }
    it = cache.emplace(pattern, std::move(re)).first;
  }
  if (!it->second->code) fail(where, " is not a valid regular expression: ", it->second->error);
  return it->second;
}

// Where the pattern's match from the start of `text` ends, or -1 when there is none.
long match_end(const Regex& re, const std::string& text, const std::string& where) {
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(re.code, nullptr);
  const int rc = pcre2_match(re.code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), 0, 0, md, limits());
  const long n = rc >= 0 ? long(pcre2_get_ovector_pointer(md)[1]) : -1;
  pcre2_match_data_free(md);
  if (rc == PCRE2_ERROR_MATCHLIMIT || rc == PCRE2_ERROR_DEPTHLIMIT || rc == PCRE2_ERROR_HEAPLIMIT)
    fail(where, " backtracks too much on '", text, "' (", pcre2_message(rc), ")");
  if (rc < 0 && rc != PCRE2_ERROR_NOMATCH) fail(where, " cannot match '", text, "': ", pcre2_message(rc));
  return n;
}

// Whether a compressed-tensors "re:" ignore entry covers the module: Python's re.match, anchored
// at the start only.
bool ignore_regex_match(const std::string& pattern, const std::string& module, const std::string& where) {
  return match_end(*compiled("", pattern, "", where), module, where) >= 0;
}

}  // namespace

bool not_convert_match(const std::string& entry, const std::string& module, const std::string& where) {
  if (entry.empty()) return false;
  const size_t n = entry.size();
  if (module.size() >= n && module.compare(module.size() - n, n, entry) == 0) return true;
  // The boundary: the match ends the name, is followed by '.', or its last character is '.'.
  auto boundary = [&](size_t end) { return end == module.size() || module[end] == '.' || module[end - 1] == '.'; };
  if (entry.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.") == std::string::npos) {
    // Names (the usual entries) need no regex engine: as a pattern, '.' matches any character.
    if (module.size() < n) return false;
    for (size_t i = 0; i < n; ++i)
      if (entry[i] != '.' && entry[i] != module[i]) return false;
    return boundary(n);
  }
  // Any match that ends before a '.' or at the end (backtracking finds one if there is); else the
  // first match, when it ends in '.'. The entry alone compiles first, so that its errors point
  // into the entry and the group around it cannot be broken out of.
  const auto alone = compiled("", entry, "", where);
  if (match_end(*compiled("(?:", entry, ")(?=\\.|$)", where), module, where) >= 0) return true;
  const long m = match_end(*alone, module, where);
  return m > 0 && boundary(size_t(m));
}

bool QuantConfig::quantizes(const std::string& module) const {
  if (method == QuantMethod::None) return false;
  for (size_t i = 0; i < exclude.size(); ++i) {
    const std::string& e = exclude[i];
    if (method == QuantMethod::Fp8) {
      if (not_convert_match(e, module, exclude_where(i))) return false;
    } else if (method == QuantMethod::CompressedTensors) {
      if (e.rfind("re:", 0) == 0 ? ignore_regex_match(e.substr(3), module, exclude_where(i)) : e == module)
        return false;
    } else if (glob_match(e, module) || glob_match(e + ".*", module)) {
      return false;
    }
  }
  return true;
}

Fp8Blocks QuantConfig::fp8_blocks(int64_t out, int64_t in) const {
  switch (fp8_scaling) {
    case Fp8Scaling::Block: return fp8_block;
    case Fp8Scaling::Channel: return {1, std::max<int64_t>(in, 1)};
    case Fp8Scaling::Tensor: return {std::max<int64_t>(out, 1), std::max<int64_t>(in, 1)};
  }
  return fp8_block;
}

const char* QuantConfig::exclude_key() const {
  switch (method) {
    case QuantMethod::ModelOpt: return "exclude_modules";
    case QuantMethod::CompressedTensors: return "ignore";
    case QuantMethod::Fp8: return "modules_to_not_convert";
    case QuantMethod::None: break;
  }
  return "the exclusions";
}

std::string QuantConfig::exclude_where(size_t i) const {
  const std::string field = method == QuantMethod::Fp8 && i >= ignored_layers_start
                                ? cat("ignored_layers[", i - ignored_layers_start, "]")
                                : cat(exclude_key(), "[", i, "]");
  return cat(source, ": quantization_config.", field, " '", exclude[i], "'");
}

const char* QuantConfig::fp8_scale_name() const {
  return method == QuantMethod::Fp8 && fp8_scaling == Fp8Scaling::Block ? "weight_scale_inv" : "weight_scale";
}

std::string QuantConfig::describe() const {
  if (method == QuantMethod::None) return "none";
  const std::string from = fs::path(source).filename().string();
  std::string s;
  if (is_fp8()) {
    const std::string scaling = fp8_scaling == Fp8Scaling::Channel ? "per channel"
                                : fp8_scaling == Fp8Scaling::Tensor ? "per tensor"
                                                                    : cat("blocks ", fp8_block.rows, " x ", fp8_block.cols);
    s = cat(method == QuantMethod::Fp8 ? "" : "compressed-tensors ", "FP8 E4M3 (", scaling, ", from ", from, ")");
  } else {
    s = cat(method == QuantMethod::ModelOpt ? "ModelOpt " : "compressed-tensors ", algo, " (group ", group_size,
            ", from ", from, ")");
  }
  if (!exclude.empty()) {
    s += method == QuantMethod::ModelOpt ? ", excluded:" : method == QuantMethod::Fp8 ? ", not converted:" : ", ignored:";
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

// Compiles the settings' regular expressions, so that one that does not compile fails at load
// rather than at the first module it is matched against.
void compile_patterns(const QuantConfig& c) {
  for (size_t i = 0; i < c.exclude.size(); ++i) {
    const std::string& e = c.exclude[i];
    if (c.method == QuantMethod::Fp8) (void)not_convert_match(e, "", c.exclude_where(i));
    else if (e.rfind("re:", 0) == 0) (void)compiled("", e.substr(3), "", c.exclude_where(i));
  }
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

// A [rows, cols] block size of positive integers.
Fp8Blocks block_size(const nlohmann::json& j, const std::string& where) {
  if (!j.is_array() || j.size() != 2 || !j[0].is_number_integer() || !j[1].is_number_integer() ||
      j[0].get<int64_t>() < 1 || j[1].get<int64_t>() < 1)
    fail(where, ": expected [rows, columns] of positive integers, got ", j.dump());
  return {j[0].get<int64_t>(), j[1].get<int64_t>()};
}

// The FP8 weight settings of one compressed-tensors group: 8-bit float, symmetric, static scales
// per tensor, channel or block. Activation settings are not read: kestrel computes weight-only.
void ct_fp8_weights(const nlohmann::json& w, const std::string& where, QuantConfig& c, bool first) {
  JsonFields wf(w, where);
  if (wf.get_int("num_bits", 0) != 8 || wf.get_str("type", "") != "float")
    fail(where, ": float-quantized weights must be 8-bit float (FP8 E4M3)");
  if (auto sym = w.find("symmetric"); sym != w.end() && !sym->is_null() && *sym != true)
    fail(where, ": asymmetric FP8 weights are not supported");
  if (auto dyn = w.find("dynamic"); dyn != w.end() && !dyn->is_null() && *dyn != false)
    fail(where, ": dynamic weight scales are not supported");
  const std::string strategy = wf.get_str("strategy", "");
  Fp8Scaling scaling;
  Fp8Blocks block;
  if (strategy == "tensor") {
    scaling = Fp8Scaling::Tensor;
  } else if (strategy == "channel") {
    scaling = Fp8Scaling::Channel;
  } else if (strategy == "block") {
    scaling = Fp8Scaling::Block;
    auto bs = w.find("block_structure");
    if (bs == w.end()) fail(where, ": strategy 'block' without block_structure");
    block = block_size(*bs, where + ".block_structure");
  } else {
    fail(where, ": FP8 weight strategy '", strategy, "' is not supported (tensor, channel or block)");
  }
  if (!first && (scaling != c.fp8_scaling || block.rows != c.fp8_block.rows || block.cols != c.fp8_block.cols))
    fail(where, ": config groups with different FP8 weight scales are not supported");
  c.fp8_scaling = scaling;
  c.fp8_block = block;
}

QuantConfig compressed_tensors(const nlohmann::json& q, const std::string& file) {
  QuantConfig c;
  c.method = QuantMethod::CompressedTensors;
  c.source = file;
  JsonFields f(q, file);
  const std::string format = f.get_str("format", "");
  if (format != "nvfp4-pack-quantized" && format != "float-quantized")
    fail(file, ": compressed-tensors format '", format,
         "' is not supported (nvfp4-pack-quantized or float-quantized)");
  c.algo = format == "float-quantized" ? "FP8" : "NVFP4";
  auto groups = q.find("config_groups");
  if (groups == q.end() || !groups->is_object() || groups->empty())
    fail(file, ": compressed-tensors quantization_config has no config_groups");
  bool first = true;
  for (const auto& [gname, g] : groups->items()) {
    const std::string where = cat(file, ": config_groups.", gname);
    if (!g.is_object()) fail(where, ": must be an object");
    auto w = g.find("weights");
    if (w == g.end() || !w->is_object()) fail(where, ": missing 'weights'");
    if (c.is_fp8()) {
      ct_fp8_weights(*w, where + ".weights", c, first);
    } else {
      JsonFields wf(*w, where);
      if (wf.get_int("num_bits", 0) != 4 || wf.get_str("type", "") != "float")
        fail(where, ".weights: only 4-bit float (NVFP4) weights are supported");
      c.group_size = int(wf.get_int("group_size", 16));
      if (c.group_size != 16) fail(where, ".weights: group_size must be 16, got ", c.group_size);
    }
    first = false;
    auto targets = string_list(g, "targets", where);
    for (const auto& t : targets)
      if (t != "Linear") fail(where, ": target '", t, "' is not supported (only \"Linear\")");
  }
  c.exclude = string_list(q, "ignore", file);
  compile_patterns(c);
  return c;
}

// quant_method "fp8": E4M3 weights with weight_scale_inv per block of weight_block_size
// (DeepSeek-V3/R1: [128, 128]), or without weight_block_size one F32 weight_scale per tensor
// (AutoFP8, early llm-compressor; an input_scale beside it under the static activation scheme).
// GPU servers quantize the activations, which kestrel does not do (weight-only).
// modules_to_not_convert (or vLLM's ignored_layers) stay unquantized.
QuantConfig fp8(const nlohmann::json& q, const std::string& file) {
  QuantConfig c;
  c.method = QuantMethod::Fp8;
  c.source = file;
  c.algo = "FP8";
  JsonFields f(q, file);
  const std::string fmt = f.get_str("fmt", "e4m3");
  if (fmt != "e4m3") fail(file, ": quantization_config.fmt '", fmt, "' is not supported (only e4m3)");
  const std::string act = f.get_str("activation_scheme", "dynamic");
  if (act != "dynamic" && act != "static")
    fail(file, ": quantization_config.activation_scheme '", act, "' is not supported (dynamic or static)");
  if (auto bs = q.find("weight_block_size"); bs != q.end() && !bs->is_null()) {
    c.fp8_scaling = Fp8Scaling::Block;
    c.fp8_block = block_size(*bs, file + ": quantization_config.weight_block_size");
  } else {
    c.fp8_scaling = Fp8Scaling::Tensor;
  }
  c.exclude = string_list(q, "modules_to_not_convert", file);
  c.ignored_layers_start = c.exclude.size();
  for (const auto& e : string_list(q, "ignored_layers", file)) c.exclude.push_back(e);
  compile_patterns(c);
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
  if (method == "fp8") return fp8(*q, config_path);
  fail(config_path, ": quantization_config.quant_method '", method,
       "' is not supported (modelopt, compressed-tensors or fp8)");
}

}  // namespace kestrel
