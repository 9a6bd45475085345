#include "server/tool_calls.h"

#include <nlohmann/json.hpp>

#include <algorithm>

#include "server/json_scan.h"

namespace kestrel {
namespace {

using nlohmann::json;

constexpr std::string_view kToolCallBegin = "<tool_call>", kToolCallEnd = "</tool_call>";
constexpr std::string_view kArgKey = "<arg_key>", kArgKeyEnd = "</arg_key>";
constexpr std::string_view kArgValue = "<arg_value>", kArgValueEnd = "</arg_value>";
constexpr std::string_view kDsCallsBegin = "<｜tool▁calls▁begin｜>", kDsCallsEnd = "<｜tool▁calls▁end｜>";
constexpr std::string_view kDsCallBegin = "<｜tool▁call▁begin｜>", kDsCallEnd = "<｜tool▁call▁end｜>";
constexpr std::string_view kDsSep = "<｜tool▁sep｜>";
constexpr std::string_view kPythonTag = "<|python_tag|>";

std::string_view trim(std::string_view s) {
  const auto space = [](char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; };
  while (!s.empty() && space(s.front())) s.remove_prefix(1);
  while (!s.empty() && space(s.back())) s.remove_suffix(1);
  return s;
}

// Compact JSON; bytes that are not UTF-8 (a model may write any) become U+FFFD.
std::string compact(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// A JSON object from text, or a discarded value.
json parse_object(std::string_view text) {
  json j = json::parse(text, nullptr, false);
  return j.is_object() ? j : json(json::value_t::discarded);
}

std::string_view begin_marker(ToolFormat f) { return f == ToolFormat::DeepSeek ? kDsCallBegin : kToolCallBegin; }
std::string_view end_marker(ToolFormat f) { return f == ToolFormat::DeepSeek ? kDsCallEnd : kToolCallEnd; }

// Markers that open a call or (DeepSeek's section markers) are dropped from the content.
std::vector<std::string_view> content_markers(ToolFormat f) {
  if (f == ToolFormat::DeepSeek) return {kDsCallBegin, kDsCallsBegin, kDsCallsEnd};
  return {kToolCallBegin};
}

}  // namespace

ToolFormat tool_format_of_template(std::string_view t) {
  if (t.find(kArgKey) != std::string_view::npos) return ToolFormat::Glm;
  if (t.find("tool▁call▁begin") != std::string_view::npos) return ToolFormat::DeepSeek;
  if (t.find(kToolCallBegin) != std::string_view::npos) return ToolFormat::Hermes;
  if (t.find(kPythonTag) != std::string_view::npos || t.find("ipython") != std::string_view::npos)
    return ToolFormat::LlamaJson;
  return ToolFormat::None;
}

const char* tool_format_name(ToolFormat f) {
  switch (f) {
    case ToolFormat::None: return "none";
    case ToolFormat::Hermes: return "hermes";
    case ToolFormat::Glm: return "glm";
    case ToolFormat::DeepSeek: return "deepseek";
    case ToolFormat::LlamaJson: return "llama-json";
  }
  return "?";
}

ToolCallParser::ToolCallParser(ToolFormat f, std::map<std::string, std::map<std::string, std::string>> param_types)
    : f_(f), types_(std::move(param_types)) {}

std::string ToolCallParser::flush_content(bool all) {
  size_t keep = 0;  // the longest tail of pending_ that may start a marker
  if (!all)
    for (std::string_view m : content_markers(f_))
      for (size_t n = std::min(m.size() - 1, pending_.size()); n > keep; --n)
        if (std::string_view(pending_).substr(pending_.size() - n) == m.substr(0, n)) {
          keep = n;
          break;
        }
  std::string out = pending_.substr(0, pending_.size() - keep);
  pending_.erase(0, pending_.size() - keep);
  return out;
}

std::string ToolCallParser::push(std::string_view text, std::vector<ToolCall>& calls) {
  pending_ += text;
  std::string out;
  if (f_ == ToolFormat::None) return flush_content(true);
  if (f_ == ToolFormat::LlamaJson) {
    // The reply is a call only when it starts as one: hold it from its first '{' or python tag.
    if (whole_reply_) return out;
    if (!started_) {
      const std::string_view t = trim(pending_);
      if (t.empty()) return out;
      if (t.front() == '{' || t.substr(0, kPythonTag.size()) == kPythonTag) {
        whole_reply_ = true;
        return out;
      }
      if (t.size() < kPythonTag.size() && kPythonTag.substr(0, t.size()) == t) return out;
      started_ = true;
    }
    return flush_content(true);
  }
  for (;;) {
    if (!in_call_) {
      size_t at = std::string::npos, len = 0;
      bool opens = false;
      for (std::string_view m : content_markers(f_)) {
        const size_t p = pending_.find(m);
        if (p < at) at = p, len = m.size(), opens = m == begin_marker(f_);
      }
      if (at == std::string::npos) return out + flush_content(false);
      out += pending_.substr(0, at);
      pending_.erase(0, at + len);
      in_call_ = opens;
      continue;
    }
    const std::string_view end = end_marker(f_);
    const size_t p = pending_.find(end);
    if (p == std::string::npos) return out;
    const std::string block = pending_.substr(0, p);
    pending_.erase(0, p + end.size());
    in_call_ = false;
    if (!parse_block(block, calls)) out += std::string(begin_marker(f_)) + block + std::string(end);
  }
}

std::string ToolCallParser::finish(std::vector<ToolCall>& calls) {
  if (f_ == ToolFormat::LlamaJson && whole_reply_) {
    std::string_view t = trim(pending_);
    if (t.substr(0, kPythonTag.size()) == kPythonTag) t = trim(t.substr(kPythonTag.size()));
    std::vector<ToolCall> found;
    bool ok = !t.empty();
    // Calls separated by ';' outside JSON strings.
    const auto next_semicolon = [&](size_t from) {
      server::JsonStringScan scan;
      for (size_t i = from; i < t.size(); ++i)
        if (scan.outside(t[i]) && t[i] == ';') return i;
      return std::string_view::npos;
    };
    size_t from = 0;
    while (ok && from <= t.size()) {
      const size_t semi = next_semicolon(from);
      const std::string_view piece = trim(t.substr(from, semi == std::string_view::npos ? std::string_view::npos : semi - from));
      const json j = parse_object(piece);
      ok = !j.is_discarded() && j.contains("name") && j["name"].is_string() &&
           (!j.contains("parameters") || j["parameters"].is_object()) &&
           (!j.contains("arguments") || j["arguments"].is_object());
      if (ok)
        found.push_back({j["name"].get<std::string>(),
                         compact(j.contains("parameters") ? j["parameters"] : j.value("arguments", json::object())), {}});
      if (semi == std::string_view::npos) break;
      from = semi + 1;
    }
    if (ok) {
      calls.insert(calls.end(), found.begin(), found.end());
      pending_.clear();
      return "";
    }
    return flush_content(true);
  }
  std::string out;
  if (in_call_) out = std::string(begin_marker(f_));  // a call that never ended: content, as written
  in_call_ = false;
  return out + flush_content(true);
}

bool ToolCallParser::parse_block(const std::string& block, std::vector<ToolCall>& calls) const {
  switch (f_) {
    case ToolFormat::Hermes: {
      const json j = parse_object(trim(block));
      if (j.is_discarded() || !j.contains("name") || !j["name"].is_string()) return false;
      json args = j.value("arguments", json::object());
      if (args.is_string()) args = parse_object(args.get<std::string>());
      if (!args.is_object()) return false;
      calls.push_back({j["name"].get<std::string>(), compact(args), {}});
      return true;
    }
    case ToolFormat::Glm: {
      const std::string_view b = block;
      const size_t first = b.find(kArgKey);
      const std::string name(trim(b.substr(0, first)));
      if (name.empty() || name.find('<') != std::string::npos) return false;
      const auto tool = types_.find(name);
      json args = json::object();
      size_t at = first;
      while (at != std::string_view::npos) {
        const size_t k0 = at + kArgKey.size(), k1 = b.find(kArgKeyEnd, k0);
        if (k1 == std::string_view::npos) return false;
        const size_t v = b.find(kArgValue, k1 + kArgKeyEnd.size());
        if (v == std::string_view::npos || !trim(b.substr(k1 + kArgKeyEnd.size(), v - k1 - kArgKeyEnd.size())).empty())
          return false;
        const size_t v0 = v + kArgValue.size(), v1 = b.find(kArgValueEnd, v0);
        if (v1 == std::string_view::npos) return false;
        const std::string key(trim(b.substr(k0, k1 - k0)));
        const std::string value(b.substr(v0, v1 - v0));
        std::string type;
        if (tool != types_.end())
          if (auto p = tool->second.find(key); p != tool->second.end()) type = p->second;
        json parsed = type.empty() || type == "string" ? json(json::value_t::discarded) : json::parse(value, nullptr, false);
        // A parameter of no declared type (an enum, say) loses the spaces around its value; a
        // string's are its own.
        args[key] = parsed.is_discarded() ? json(type.empty() ? std::string(trim(value)) : value) : parsed;
        at = b.find(kArgKey, v1 + kArgValueEnd.size());
        if (at == std::string_view::npos && !trim(b.substr(v1 + kArgValueEnd.size())).empty()) return false;
      }
      calls.push_back({name, compact(args), {}});
      return true;
    }
    case ToolFormat::DeepSeek: {
      const std::string_view b = block;
      const size_t sep = b.find(kDsSep);
      if (sep == std::string_view::npos) return false;
      std::string_view left = trim(b.substr(0, sep)), right = b.substr(sep + kDsSep.size());
      std::string name;
      std::string_view args_text;
      if (left == "function") {  // V3 / R1: the name, then the arguments in a json fence
        const size_t nl = right.find('\n');
        const size_t fence = right.find("```json");
        const size_t close = right.rfind("```");
        if (nl == std::string_view::npos || fence == std::string_view::npos || close <= fence) return false;
        name = std::string(trim(right.substr(0, std::min(nl, fence))));
        args_text = right.substr(fence + 7, close - fence - 7);
      } else {  // V3.1
        name = std::string(left);
        args_text = right;
      }
      const json args = parse_object(trim(args_text));
      if (name.empty() || args.is_discarded()) return false;
      calls.push_back({name, compact(args), {}});
      return true;
    }
    default: return false;
  }
}

}  // namespace kestrel
