#include "server/grammar.h"

#include <dlpack/dlpack.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <optional>
#include <variant>
#include <xgrammar/xgrammar.h>

#include "common/error.h"
#include "runtime/engine.h"

namespace kestrel::server {

using json = nlohmann::ordered_json;

struct Grammars::Vocab {
  xgrammar::TokenizerInfo info;
  xgrammar::GrammarCompiler compiler;
  Vocab(xgrammar::TokenizerInfo i) : info(std::move(i)), compiler(info, /*max_threads=*/2) {}
};

namespace {

// How the tokenizer spells bytes in its token strings, which XGrammar decodes: sentencepiece's
// <0xHH> tokens and '▁' (byte fallback), GPT-2's byte-to-character map ('Ġ' is a space), or raw.
xgrammar::VocabType vocab_type(const text::Tokenizer& tok) {
  bool byte_level = false;
  for (int32_t id = 0; id < int32_t(tok.vocab_size()); ++id) {
    if (tok.is_byte_fallback_token(id)) return xgrammar::VocabType::BYTE_FALLBACK;
    const std::string_view t = tok.token(id);
    if (!byte_level && (t.find("\xC4\xA0") != std::string_view::npos || t.find("\xC4\x8A") != std::string_view::npos))
      byte_level = true;  // 'Ġ' or 'Ċ'
  }
  return byte_level ? xgrammar::VocabType::BYTE_LEVEL : xgrammar::VocabType::RAW;
}

// One choice's matcher and the mask for its next token.
class GrammarConstraint final : public TokenConstraint {
 public:
  GrammarConstraint(const xgrammar::CompiledGrammar& g, const std::vector<int32_t>& stop, int64_t vocab)
      : matcher_(g, stop), stop_(stop), mask_(size_t(xgrammar::GetBitmaskSize(int(vocab)))) {
    fill();
  }
  std::span<const uint32_t> allowed() const override { return mask_; }
  bool accept(int32_t token) override {
    if (ended_ || !matcher_.AcceptToken(token)) return false;
    if (matcher_.IsTerminated()) ended_ = true;
    else fill();
    return true;
  }
  bool ended() const override { return ended_; }

 private:
  void fill() {
    int64_t shape = int64_t(mask_.size());
    DLTensor t{};
    t.data = mask_.data();
    t.device = DLDevice{kDLCPU, 0};
    t.ndim = 1;
    t.dtype = xgrammar::GetBitmaskDLType();
    t.shape = &shape;
    matcher_.FillNextTokenBitmask(&t);
    // Complete when nothing but an end-of-sequence token may follow: the engine then ends the
    // choice without running the model once more for it.
    bool other = false;
    for (size_t w = 0; w < mask_.size() && !other; ++w) {
      uint32_t bits = mask_[w];
      for (int32_t s : stop_)
        if (size_t(s) / 32 == w) bits &= ~(1u << (uint32_t(s) % 32));
      other = bits != 0;
    }
    ended_ = !other;
  }

  xgrammar::GrammarMatcher matcher_;
  std::vector<int32_t> stop_;
  std::vector<uint32_t> mask_;
  bool ended_ = false;
};

// XGrammar's messages carry the time and its source file and line ("[12:00:00] path.cc:42: ...");
// the client needs the reason only.
std::string reason(const std::exception& e) {
  std::string m = e.what();
  if (!m.empty() && m[0] == '[') {
    const size_t file = m.find("] ");
    const size_t line = file == std::string::npos ? file : m.find(": ", file);
    if (line != std::string::npos) m.erase(0, line + 2);
  }
  while (!m.empty() && (m.back() == '\n' || m.back() == ' ')) m.pop_back();
  return m;
}

// The schema's nesting (schemas are the client's: a deep one would be deep recursion).
void check_schema_value(const json& schema, const std::string& field) {
  if (!schema.is_object() && !schema.is_boolean()) throw RequestError(field, "'" + field + "': expected a JSON schema object");
}

// Whether a schema limits the length of a string somewhere.
bool limits_lengths(const json& s, int depth = 0) {
  if (depth > 64) return true;
  if (s.is_object()) {
    if (s.contains("minLength") || s.contains("maxLength")) return true;
    for (const auto& [k, v] : s.items())
      if (limits_lengths(v, depth + 1)) return true;
  } else if (s.is_array()) {
    for (const json& v : s)
      if (limits_lengths(v, depth + 1)) return true;
  }
  return false;
}

// What a regular expression costs to compile: its length spelled out with its counted
// repetitions ({m}, {m,}, {m,n}) expanded, each counting its larger bound (XGrammar unrolls them
// into an automaton), where a character class that admits most characters (negated, '.', \D,
// \S, \W) counts kBroadClass: each of its copies is a state most tokens get through, ~90 ms a
// copy on a 129k-token vocabulary, where a narrow class costs a few. Characters, escapes and
// other classes count 1, groups what they hold; *, + and ? add nothing. Stops counting past `most`.
constexpr int64_t kBroadClass = 32;

int64_t spelled_length(const std::string& p, int64_t most) {
  std::vector<int64_t> open{0};  // the spelled length of each open group so far
  int64_t last = 0;              // that of the last atom, which a repetition repeats
  const auto atom = [&](int64_t n) { open.back() = std::min(most + 1, open.back() + n), last = n; };
  const auto hex = [&](size_t& i, size_t digits) {
    while (digits-- && i + 1 < p.size() && std::isxdigit(static_cast<unsigned char>(p[i + 1]))) ++i;
  };
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\') {
      const char e = ++i < p.size() ? p[i] : '\\';
      if (e == 'x') hex(i, 2);
      else if (e == 'u') hex(i, 4);
      atom(e == 'D' || e == 'S' || e == 'W' ? kBroadClass : 1);
    } else if (c == '[') {  // to the closing ']', which may come first ("[]a]", "[^]a]")
      const bool negated = i + 1 < p.size() && p[i + 1] == '^';
      size_t j = i + 1 + negated;
      for (j += j < p.size() && p[j] == ']'; j < p.size() && p[j] != ']'; ++j)
        if (p[j] == '\\') ++j;
      i = std::min(j, p.size());
      atom(negated ? kBroadClass : 1);
    } else if (c == '.') {
      atom(kBroadClass);
    } else if (c == '(') {
      open.push_back(0);
      last = 0;
    } else if (c == ')' && open.size() > 1) {
      const int64_t group = open.back();
      open.pop_back();
      atom(group);
    } else if (c == '{' && i + 1 < p.size() && std::isdigit(static_cast<unsigned char>(p[i + 1]))) {
      // {m}, {m,} or {m,n}, counting its larger bound; anything else is a literal '{'.
      size_t j = i + 1;
      int64_t bound = 0, n = 0;
      for (; j < p.size() && (std::isdigit(static_cast<unsigned char>(p[j])) || p[j] == ','); ++j)
        if (p[j] == ',') n = 0;
        else n = std::min(most + 1, n * 10 + (p[j] - '0')), bound = std::max(bound, n);
      if (j < p.size() && p[j] == '}') {
        const int64_t repeated = std::min(most + 1, last * std::max<int64_t>(bound, 1));
        open.back() = std::min(most + 1, open.back() - last + repeated);
        last = repeated;
        i = j;
      } else {
        atom(1);
      }
    } else if (c == '|') {
      last = 0;
    } else if (c != '*' && c != '+' && c != '?' && c != '^' && c != '$') {
      atom(1);
    }
  }
  int64_t total = 0;
  for (int64_t n : open) total = std::min(most + 1, total + n);
  return total;
}

void check_pattern(const json& pattern, const std::string& at) {
  if (!pattern.is_string()) return;  // XGrammar's own error
  const std::string& p = pattern.get_ref<const std::string&>();
  if (p.size() > kMaxPatternLength)
    throw RequestError(at, "'" + at + "': " + std::to_string(p.size()) + " characters, more than " +
                               std::to_string(kMaxPatternLength) + ", the most kestrel compiles in a pattern");
  if (spelled_length(p, kMaxPatternSpelled) > kMaxPatternSpelled)
    throw RequestError(at, "'" + at + "': spells out more than " + std::to_string(kMaxPatternSpelled) +
                               " characters with its counted repetitions expanded, the most kestrel compiles");
}

// The limits on what a client's schema may cost to compile (grammar.h), checked before XGrammar
// sees it. `values_left`: how many more JSON values the schemas compiled together may hold.
// What `s` is decides which keys are keywords: a property named "enum" is a schema, not values.
enum class Node { Schema, Names, Data };  // a schema, a map of names to schemas, values

void check_limits_at(const json& s, const std::string& at, const std::string& field, int64_t& values_left, int depth,
                     Node node = Node::Schema) {
  if (--values_left < 0)
    throw RequestError(field, "'" + field + "': the schema holds more than " + std::to_string(kMaxSchemaValues) +
                                  " JSON values (a request's tools: all their schemas together), the most kestrel compiles");
  if (depth > 64) throw RequestError(at, "'" + at + "': the schema nests too deeply");
  if (s.is_array()) {
    for (size_t i = 0; i < s.size(); ++i)
      check_limits_at(s[i], at + "[" + std::to_string(i) + "]", field, values_left, depth + 1, node);
    return;
  }
  if (!s.is_object()) return;
  if (node == Node::Schema) {
    if (s.contains("properties") && s["properties"].is_object() && s["properties"].size() > kMaxSchemaProperties)
      throw RequestError(at + ".properties", "'" + at + ".properties': " + std::to_string(s["properties"].size()) +
                                                 " properties, more than " + std::to_string(kMaxSchemaProperties) +
                                                 ", the most kestrel compiles in one object");
    if (s.contains("pattern")) check_pattern(s["pattern"], at + ".pattern");
    if (s.contains("patternProperties") && s["patternProperties"].is_object())
      for (auto it = s["patternProperties"].begin(); it != s["patternProperties"].end(); ++it)
        check_pattern(it.key(), at + ".patternProperties");
  }
  for (auto it = s.begin(); it != s.end(); ++it) {
    const std::string& k = it.key();
    Node child = node == Node::Names ? Node::Schema : node;
    if (node == Node::Schema && (k == "enum" || k == "const" || k == "default" || k == "examples")) child = Node::Data;
    if (node == Node::Schema && (k == "properties" || k == "patternProperties" || k == "$defs" || k == "definitions" ||
                                 k == "dependentSchemas"))
      child = Node::Names;
    check_limits_at(it.value(), at + "." + k, field, values_left, depth + 1, child);
  }
}

// The markers a tool call's argument strings must not contain, so that the template's parser
// finds the call's end where the grammar put it. XGrammar drops a string's length limits where it
// applies such exclusions, so a schema with length limits keeps its limits instead (a string
// holding a marker is then possible, if unlikely).
std::vector<std::string> excludes_of(ToolFormat f, const json& params) {
  if (limits_lengths(params)) return {};
  switch (f) {
    case ToolFormat::Hermes: return {"<tool_call>", "</tool_call>"};
    case ToolFormat::Glm: return {"<tool_call>", "</tool_call>", "<arg_key>", "</arg_value>"};
    case ToolFormat::DeepSeek: return {"```", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"};
    default: return {};  // the Llama JSON form: its parser splits calls at ';' outside strings
  }
}

}  // namespace

Grammars::Grammars(const text::Tokenizer& tok, int64_t vocab, std::vector<int32_t> stop)
    : tok_(tok), vocab_size_(vocab), stop_(std::move(stop)) {}

Grammars::~Grammars() = default;

Grammars::Vocab& Grammars::vocab() {
  std::call_once(once_, [&] {
    const auto t0 = std::chrono::steady_clock::now();
    // Special tokens are never part of constrained text (an empty string is never allowed): the
    // reply's text skips them, so a grammar's output must not rely on them. The end-of-sequence
    // tokens are the matcher's stop tokens.
    const int64_t n = std::min<int64_t>(int64_t(tok_.vocab_size()), vocab_size_);
    std::vector<std::string> encoded(static_cast<size_t>(n));
    for (int32_t id = 0; id < int32_t(n); ++id)
      if (!tok_.is_special(id)) encoded[size_t(id)] = std::string(tok_.token(id));
    std::vector<int32_t> stop;
    for (int32_t s : stop_)
      if (s >= 0 && s < vocab_size_) stop.push_back(s);
    if (stop.empty()) fail("structured outputs: the model has no end-of-sequence token");
    stop_ = stop;
    vocab_ = std::make_unique<Vocab>(xgrammar::TokenizerInfo(encoded, vocab_type(tok_), int(vocab_size_), stop));
    setup_ms_ = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  });
  return *vocab_;
}

namespace {

CompiledConstraint factory(xgrammar::CompiledGrammar g, std::vector<int32_t> stop, int64_t vocab) {
  return [g = std::move(g), stop = std::move(stop), vocab]() -> std::unique_ptr<TokenConstraint> {
    return std::make_unique<GrammarConstraint>(g, stop, vocab);
  };
}

// The reply's thinking first (it starts inside <think>), then `format`.
json after_thinking(json format, bool thinking) {
  if (!thinking) return format;
  json think = {{"type", "tag"}, {"begin", ""}, {"content", {{"type", "any_text"}}}, {"end", "</think>"}};
  return {{"type", "sequence"}, {"elements", json::array({think, std::move(format)})}};
}

}  // namespace

CompiledConstraint Grammars::structural(const json& format, const std::string& field) {
  Vocab& v = vocab();
  const json tag = {{"type", "structural_tag"}, {"format", format}};
  std::lock_guard<std::mutex> lock(mu_);
  std::string error;
  try {  // a schema XGrammar refuses is an error value here or an exception
    auto g = xgrammar::Grammar::FromStructuralTag(tag.dump());
    if (auto* err = std::get_if<xgrammar::StructuralTagError>(&g))
      std::visit([&](const auto& e) { error = reason(e); }, *err);
    else
      return factory(v.compiler.CompileGrammar(std::get<xgrammar::Grammar>(g)), stop_, vocab_size_);
  } catch (const std::exception& e) {
    error = reason(e);
  }
  throw RequestError(field, "'" + field + "': " + error);
}

CompiledConstraint Grammars::json_object(bool thinking) {
  Vocab& v = vocab();
  if (thinking)
    return structural(
        after_thinking({{"type", "json_schema"},
                        {"json_schema", {{"type", "object"}, {"additionalProperties", true}}},
                        {"max_whitespace_cnt", 1}},
                       true),
        "response_format");
  std::lock_guard<std::mutex> lock(mu_);
  // Not strict: any properties (strict would allow only {} for a schema that lists none).
  return factory(v.compiler.CompileJSONSchema(R"({"type": "object"})", /*any_whitespace=*/false, std::nullopt,
                                              std::nullopt, /*strict_mode=*/false),
                 stop_, vocab_size_);
}

CompiledConstraint Grammars::json_schema(const json& given, bool strict, const std::string& field, bool thinking) {
  check_schema_value(given, field);
  int64_t values_left = kMaxSchemaValues;
  check_limits_at(given, field, field, values_left, 0);
  if (strict) check_strict_schema(given, field);
  const json& schema = given;
  if (thinking)
    return structural(after_thinking({{"type", "json_schema"}, {"json_schema", schema}, {"max_whitespace_cnt", 1}}, true),
                      field);
  Vocab& v = vocab();
  std::lock_guard<std::mutex> lock(mu_);
  try {
    // Properties the schema does not list are not generated (XGrammar's strict mode; OpenAI's
    // strict schemas say so themselves); whitespace is the compact form's, so that a model cannot
    // spend its tokens on it.
    return factory(v.compiler.CompileJSONSchema(schema.dump(), /*any_whitespace=*/false, std::nullopt, std::nullopt,
                                                /*strict_mode=*/true),
                   stop_, vocab_size_);
  } catch (const std::exception& e) {
    throw RequestError(field, "'" + field + "': " + reason(e));
  }
}

CompiledConstraint Grammars::tool_calls(const json& tools, ToolFormat format, const std::string& name, bool parallel,
                                        bool thinking, bool deepseek_fences) {
  json tags = json::array();
  std::string field;
  int64_t values_left = kMaxSchemaValues;  // the tools compile into one grammar
  for (size_t i = 0; i < tools.size(); ++i) {
    const json& f = tools[i]["function"];
    const std::string n = f["name"].get<std::string>();
    if (!name.empty() && n != name) continue;
    field = "tools[" + std::to_string(i) + "].function.parameters";
    json params = f.contains("parameters") && f["parameters"].is_object() ? f["parameters"] : json{{"type", "object"}};
    check_limits_at(params, field, field, values_left, 0);
    if (f.contains("strict") && f["strict"].is_boolean() && f["strict"].get<bool>()) check_strict_schema(params, field);
    // At most one whitespace character between tokens of the JSON (structural tags allow any).
    json content = {{"type", "json_schema"}, {"json_schema", params}, {"excludes", excludes_of(format, params)},
                    {"max_whitespace_cnt", 1}};
    // Names are letters, digits, '_' and '-' (parse_request checks): nothing to escape.
    json tag = {{"type", "tag"}};
    switch (format) {
      case ToolFormat::Hermes:
        tag["begin"] = "<tool_call>\n{\"name\": \"" + n + "\", \"arguments\": ";
        tag["end"] = "}\n</tool_call>";
        break;
      case ToolFormat::Glm:
        content["style"] = "glm_xml";
        tag["begin"] = "<tool_call>" + n + "\n";
        tag["end"] = "</tool_call>";
        break;
      case ToolFormat::DeepSeek:
        if (deepseek_fences) {  // V3, R1
          tag["begin"] = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>" + n + "\n```json\n";
          tag["end"] = "\n```<｜tool▁call▁end｜>";
        } else {  // V3.1
          tag["begin"] = "<｜tool▁call▁begin｜>" + n + "<｜tool▁sep｜>";
          tag["end"] = "<｜tool▁call▁end｜>";
        }
        break;
      default:
        tag["begin"] = "{\"name\": \"" + n + "\", \"parameters\": ";
        tag["end"] = "}";
        break;
    }
    tag["content"] = std::move(content);
    tags.push_back(std::move(tag));
  }
  if (tags.empty()) throw RequestError("tool_choice", "'tool_choice': names the function '" + name + "', which is not in tools");
  const char* separator = format == ToolFormat::Hermes || format == ToolFormat::Glm || format == ToolFormat::DeepSeek ? "\n" : "; ";
  json calls = {{"type", "tags_with_separator"}, {"tags", std::move(tags)}, {"separator", separator},
                {"at_least_one", true}, {"stop_after_first", !parallel}};
  if (format == ToolFormat::DeepSeek)
    calls = {{"type", "sequence"},
             {"elements", json::array({{{"type", "const_string"}, {"value", "<｜tool▁calls▁begin｜>"}}, std::move(calls),
                                       {{"type", "const_string"}, {"value", "<｜tool▁calls▁end｜>"}}})}};
  return structural(after_thinking(std::move(calls), thinking), name.empty() ? "tools" : field);
}

namespace {

void check_strict_at(const json& s, const std::string& at, int depth) {
  if (depth > 64) throw RequestError(at, "'" + at + "': the schema nests too deeply");
  if (!s.is_object()) return;
  const bool is_object = s.contains("properties") || (s.contains("type") && s["type"] == "object");
  if (is_object) {
    if (!s.contains("additionalProperties") || s["additionalProperties"] != false)
      throw RequestError(at, "'" + at + "': with strict, an object schema must have \"additionalProperties\": false");
    if (s.contains("properties")) {
      const json& props = s["properties"];
      if (!props.is_object()) throw RequestError(at + ".properties", "'" + at + ".properties': expected an object");
      const json req = s.value("required", json::array());
      for (auto it = props.begin(); it != props.end(); ++it) {
        if (!req.is_array() || std::find(req.begin(), req.end(), json(it.key())) == req.end())
          throw RequestError(at + ".required",
                             "'" + at + ".required': with strict, every property must be required; '" + it.key() + "' is not");
        check_strict_at(it.value(), at + ".properties." + it.key(), depth + 1);
      }
    }
  }
  if (s.contains("items")) check_strict_at(s["items"], at + ".items", depth + 1);
  for (const char* k : {"anyOf", "allOf", "oneOf", "prefixItems"})
    if (s.contains(k) && s[k].is_array())
      for (size_t i = 0; i < s[k].size(); ++i)
        check_strict_at(s[k][i], at + "." + k + "[" + std::to_string(i) + "]", depth + 1);
  for (const char* k : {"$defs", "definitions"})
    if (s.contains(k) && s[k].is_object())
      for (auto it = s[k].begin(); it != s[k].end(); ++it)
        check_strict_at(it.value(), at + "." + k + "." + it.key(), depth + 1);
}

}  // namespace

void check_strict_schema(const json& schema, const std::string& field) { check_strict_at(schema, field, 0); }

}  // namespace kestrel::server
