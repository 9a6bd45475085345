#include "server/openai_api.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <set>

#include "server/json_scan.h"

namespace kestrel::server {
namespace {

ApiError bad(const std::string& param, const std::string& what) {
  return ApiError(400, param.empty() ? what : "'" + param + "': " + what, param);
}

const char* type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::string: return "a string";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    case json::value_t::number_float: return "a number";
    default: return "an integer";
  }
}

// Field readers: absent or null leaves the default.
bool present(const json& j, const char* key) { return j.contains(key) && !j[key].is_null(); }

double get_number(const json& j, const char* key, double lo, double hi) {
  const json& v = j[key];
  if (!v.is_number()) throw bad(key, std::string("expected a number, got ") + type_name(v));
  const double d = v.get<double>();
  if (!std::isfinite(d) || d < lo || d > hi)
    throw bad(key, "must be between " + json(lo).dump() + " and " + json(hi).dump() + ", got " + v.dump());
  return d;
}

int64_t get_int(const json& j, const char* key, int64_t lo, int64_t hi) {
  const json& v = j[key];
  if (!v.is_number_integer() && !(v.is_number_float() && std::floor(v.get<double>()) == v.get<double>()))
    throw bad(key, std::string("expected an integer, got ") + type_name(v));
  const double d = v.get<double>();
  if (d < double(lo) || d > double(hi))
    throw bad(key, "must be between " + std::to_string(lo) + " and " + std::to_string(hi) + ", got " + v.dump());
  return int64_t(d);
}

bool get_bool(const json& j, const char* key) {
  const json& v = j[key];
  if (!v.is_boolean()) throw bad(key, std::string("expected a boolean, got ") + type_name(v));
  return v.get<bool>();
}

std::string get_string(const json& j, const char* key) {
  const json& v = j[key];
  if (!v.is_string()) throw bad(key, std::string("expected a string, got ") + type_name(v));
  return v.get<std::string>();
}

// Message content: a string, or an array of {"type": "text", "text": ...} parts joined.
std::string message_content(const json& m, size_t i) {
  const std::string where = "messages[" + std::to_string(i) + "].content";
  if (!m.contains("content") || m["content"].is_null()) return "";
  const json& c = m["content"];
  if (c.is_string()) return c.get<std::string>();
  if (!c.is_array()) throw bad(where, std::string("expected a string or an array of parts, got ") + type_name(c));
  std::string out;
  for (size_t k = 0; k < c.size(); ++k) {
    const json& part = c[k];
    if (!part.is_object() || !part.contains("type") || part["type"] != "text" || !part.contains("text") ||
        !part["text"].is_string())
      throw bad(where, "part " + std::to_string(k) + " is not a {\"type\": \"text\", \"text\": ...} part (only text is supported)");
    out += part["text"].get<std::string>();
  }
  return out;
}

// A string field of a nested object, named by its path (`where`).
std::string need_string(const json& obj, const char* key, const std::string& where) {
  const std::string field = where + "." + key;
  if (!present(obj, key)) throw bad(field, "is required");
  if (!obj[key].is_string()) throw bad(field, std::string("expected a string, got ") + type_name(obj[key]));
  return obj[key].get<std::string>();
}

// A function name as OpenAI allows it: 1 to 64 letters, digits, '_' and '-'.
bool function_name_ok(const std::string& n) {
  if (n.empty() || n.size() > 64) return false;
  for (const char c : n)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-') return false;
  return true;
}

// `tools`: [{type: "function", function: {name, description?, parameters?, strict?}}], returned
// as written (templates print the client's schemas); the names in `names`.
json parse_tools(const json& t, std::set<std::string>& names) {
  if (!t.is_array() || t.empty()) throw bad("tools", "expected a non-empty array of tools");
  for (size_t i = 0; i < t.size(); ++i) {
    const std::string where = "tools[" + std::to_string(i) + "]";
    const json& tool = t[i];
    if (!tool.is_object()) throw bad(where, std::string("expected an object, got ") + type_name(tool));
    if (need_string(tool, "type", where) != "function") throw bad(where + ".type", "must be \"function\"");
    if (!present(tool, "function") || !tool["function"].is_object())
      throw bad(where + ".function", "is required and must be an object");
    const json& f = tool["function"];
    const std::string name = need_string(f, "name", where + ".function");
    if (!function_name_ok(name))
      throw bad(where + ".function.name", "must be 1 to 64 letters, digits, underscores or dashes, got '" + name + "'");
    if (!names.insert(name).second) throw bad(where + ".function.name", "'" + name + "' names two tools");
    if (present(f, "description") && !f["description"].is_string())
      throw bad(where + ".function.description", std::string("expected a string, got ") + type_name(f["description"]));
    if (present(f, "parameters") && !f["parameters"].is_object())
      throw bad(where + ".function.parameters", std::string("expected a JSON schema object, got ") + type_name(f["parameters"]));
    if (present(f, "strict") && !f["strict"].is_boolean())
      throw bad(where + ".function.strict", std::string("expected a boolean, got ") + type_name(f["strict"]));
  }
  return t;
}

ToolChoice parse_tool_choice(const json& c, const std::set<std::string>& names, std::string& name) {
  if (c.is_string()) {
    const std::string v = c.get<std::string>();
    if (v == "none") return ToolChoice::None;
    if (v == "auto") return ToolChoice::Auto;
    if (v == "required") return ToolChoice::Required;
    throw bad("tool_choice", "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}, got '" + v + "'");
  }
  if (!c.is_object()) throw bad("tool_choice", std::string("expected a string or an object, got ") + type_name(c));
  if (need_string(c, "type", "tool_choice") != "function") throw bad("tool_choice.type", "must be \"function\"");
  if (!present(c, "function") || !c["function"].is_object())
    throw bad("tool_choice.function", "is required and must be an object");
  name = need_string(c["function"], "name", "tool_choice.function");
  if (!names.count(name)) throw bad("tool_choice.function.name", "names the function '" + name + "', which is not in tools");
  return ToolChoice::Named;
}

// response_format: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema",
// "json_schema": {"name", "schema", "strict"?, "description"?}}.
void parse_response_format(const json& f, ApiRequest& r) {
  if (!f.is_object()) throw bad("response_format", std::string("expected an object, got ") + type_name(f));
  const std::string type = need_string(f, "type", "response_format");
  if (type == "text") return;
  if (type == "json_object") {
    r.response_format = ResponseFormat::JsonObject;
    return;
  }
  if (type != "json_schema")
    throw bad("response_format.type", "must be \"text\", \"json_object\" or \"json_schema\", got '" + type + "'");
  if (!present(f, "json_schema") || !f["json_schema"].is_object())
    throw bad("response_format.json_schema", "is required with type \"json_schema\" and must be an object");
  const json& js = f["json_schema"];
  const std::string name = need_string(js, "name", "response_format.json_schema");
  if (!function_name_ok(name))
    throw bad("response_format.json_schema.name", "must be 1 to 64 letters, digits, underscores or dashes, got '" + name + "'");
  if (!present(js, "schema")) throw bad("response_format.json_schema.schema", "is required");
  if (!js["schema"].is_object())
    throw bad("response_format.json_schema.schema", std::string("expected a JSON schema object, got ") + type_name(js["schema"]));
  if (present(js, "strict") && !js["strict"].is_boolean())
    throw bad("response_format.json_schema.strict", std::string("expected a boolean, got ") + type_name(js["strict"]));
  r.response_format = ResponseFormat::JsonSchema;
  r.response_schema = js["schema"];
  r.schema_strict = present(js, "strict") && js["strict"].get<bool>();
}

// An assistant message's tool_calls: [{id, type: "function", function: {name, arguments (a string)}}].
json parse_tool_calls(const json& calls, const std::string& where) {
  if (!calls.is_array()) throw bad(where, std::string("expected an array, got ") + type_name(calls));
  json out = json::array();
  for (size_t k = 0; k < calls.size(); ++k) {
    const std::string at = where + "[" + std::to_string(k) + "]";
    const json& call = calls[k];
    if (!call.is_object()) throw bad(at, std::string("expected an object, got ") + type_name(call));
    const std::string id = need_string(call, "id", at);
    if (need_string(call, "type", at) != "function") throw bad(at + ".type", "must be \"function\"");
    if (!present(call, "function") || !call["function"].is_object())
      throw bad(at + ".function", "is required and must be an object");
    const std::string name = need_string(call["function"], "name", at + ".function");
    const std::string arguments = need_string(call["function"], "arguments", at + ".function");
    out.push_back({{"id", id}, {"type", "function"}, {"function", {{"name", name}, {"arguments", arguments}}}});
  }
  return out;
}

}  // namespace

ApiError::ApiError(int s, std::string message, std::string p, std::string t)
    : std::runtime_error(std::move(message)), status(s), param(std::move(p)), type(std::move(t)) {
  if (type.empty())
    type = status == 401 ? "authentication_error"
           : status == 404 ? "not_found_error"
           : status >= 500 ? "server_error"
                           : "invalid_request_error";
}

std::string error_body(const ApiError& e) {
  json err = {{"message", e.what()}, {"type", e.type}, {"param", nullptr}, {"code", nullptr}};
  if (!e.param.empty()) err["param"] = e.param;
  if (e.status == 404) err["code"] = "model_not_found";
  return dump(json{{"error", err}});
}

size_t json_nesting(std::string_view text) {
  size_t depth = 0, deepest = 0;
  JsonStringScan scan;
  for (const char c : text) {
    if (!scan.outside(c)) continue;
    if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return deepest;
}

ApiRequest parse_request(Endpoint endpoint, const std::string& body) {
  // Deep nesting costs the parser memory and stack far beyond the body's size, and no request
  // needs it.
  if (json_nesting(body) > kMaxJsonNesting)
    throw ApiError(400, "the request body nests arrays and objects deeper than " + std::to_string(kMaxJsonNesting) + " levels");
  json j = json::parse(body, nullptr, false);
  if (j.is_discarded()) throw ApiError(400, "the request body is not valid JSON");
  if (!j.is_object()) throw ApiError(400, std::string("the request body must be a JSON object, got ") + type_name(j));
  ApiRequest r;
  r.endpoint = endpoint;
  if (!present(j, "model")) throw bad("model", "is required");
  r.model = get_string(j, "model");

  if (endpoint == Endpoint::Completions) {
    if (!present(j, "prompt")) throw bad("prompt", "is required");
    const json& p = j["prompt"];
    auto token_list = [&](const json& a) {
      for (const json& t : a) {
        if (!t.is_number_integer()) throw bad("prompt", "a token list must hold only integers");
        const int64_t id = t.get<int64_t>();
        if (id < 0 || id > std::numeric_limits<int32_t>::max()) throw bad("prompt", "token id " + t.dump() + " is out of range");
        r.prompt_tokens.push_back(int32_t(id));
      }
      if (r.prompt_tokens.empty()) throw bad("prompt", "the token list is empty");
    };
    if (p.is_string()) {
      r.prompt = p.get<std::string>();
    } else if (p.is_array() && p.size() == 1 && p[0].is_string()) {
      r.prompt = p[0].get<std::string>();
    } else if (p.is_array() && !p.empty() && p[0].is_number()) {
      token_list(p);
    } else if (p.is_array() && p.size() == 1 && p[0].is_array()) {
      token_list(p[0]);
    } else if (p.is_array() && p.size() > 1) {
      throw bad("prompt", "several prompts in one request are not supported; send one request per prompt");
    } else {
      throw bad("prompt", std::string("expected a string or a list of token ids, got ") + type_name(p));
    }
    if (present(j, "suffix")) throw bad("suffix", "is not supported");
    if (present(j, "echo") && get_bool(j, "echo")) throw bad("echo", "is not supported");
    if (present(j, "logprobs")) r.top_logprobs = int(get_int(j, "logprobs", 0, 20));
  } else {
    if (!present(j, "messages")) throw bad("messages", "is required");
    const json& m = j["messages"];
    if (!m.is_array() || m.empty()) throw bad("messages", "expected a non-empty array of messages");
    for (size_t i = 0; i < m.size(); ++i) {
      const json& msg = m[i];
      const std::string where = "messages[" + std::to_string(i) + "]";
      if (!msg.is_object()) throw bad(where, std::string("expected an object, got ") + type_name(msg));
      if (!msg.contains("role") || !msg["role"].is_string()) throw bad(where + ".role", "is required and must be a string");
      const std::string role = msg["role"].get<std::string>();
      if (role != "system" && role != "user" && role != "assistant" && role != "developer" && role != "tool")
        throw bad(where + ".role", "must be system, developer, user, assistant or tool, got '" + role + "'");
      json out = {{"role", role == "developer" ? "system" : role}, {"content", message_content(msg, i)}};
      if (present(msg, "tool_calls")) {
        if (role != "assistant") throw bad(where + ".tool_calls", "only assistant messages have tool calls");
        out["tool_calls"] = parse_tool_calls(msg["tool_calls"], where + ".tool_calls");
      }
      if (role == "assistant" && present(msg, "reasoning_content"))
        out["reasoning_content"] = need_string(msg, "reasoning_content", where);
      if (role == "tool") out["tool_call_id"] = need_string(msg, "tool_call_id", where);
      r.messages.push_back(std::move(out));
    }
    std::set<std::string> names;
    if (present(j, "tools")) r.tools = parse_tools(j["tools"], names);
    if (present(j, "tool_choice")) {
      r.tool_choice = parse_tool_choice(j["tool_choice"], names, r.tool_name);
      if (r.tool_choice != ToolChoice::None && names.empty()) throw bad("tool_choice", "needs tools");
    } else if (!names.empty()) {
      r.tool_choice = ToolChoice::Auto;
    }
    if (present(j, "parallel_tool_calls")) r.parallel_tool_calls = get_bool(j, "parallel_tool_calls");
    for (const char* k : {"functions", "function_call"})
      if (present(j, k)) throw bad(k, "is not supported (the legacy function calling); use tools");
    if (r.tool_choice == ToolChoice::Required || r.tool_choice == ToolChoice::Named)
      if (present(j, "response_format") && j["response_format"].is_object() && j["response_format"].value("type", "") != "text")
        throw bad("response_format", "cannot be combined with tool_choice \"required\" or a named function (the reply is the call)");
    const bool lp = present(j, "logprobs") && get_bool(j, "logprobs");
    if (present(j, "top_logprobs")) {
      const int n = int(get_int(j, "top_logprobs", 0, 20));
      if (!lp) throw bad("top_logprobs", "needs 'logprobs': true");
      r.top_logprobs = n;
    } else if (lp) {
      r.top_logprobs = 0;
    }
  }

  if (present(j, "response_format")) parse_response_format(j["response_format"], r);

  const int64_t kMaxTokens = 1 << 30;
  if (present(j, "max_completion_tokens")) r.max_tokens = int(get_int(j, "max_completion_tokens", 0, kMaxTokens));
  else if (present(j, "max_tokens")) r.max_tokens = int(get_int(j, "max_tokens", 0, kMaxTokens));
  if (present(j, "n")) r.n = int(get_int(j, "n", 1, kMaxChoices));
  // best_of = n returns every choice generated, which is what n does; choosing among more is not supported.
  if (endpoint == Endpoint::Completions && present(j, "best_of") && get_int(j, "best_of", 1, kMaxChoices) != r.n)
    throw bad("best_of", "only best_of = n is supported");
  if (present(j, "stream")) r.stream = get_bool(j, "stream");
  if (present(j, "stream_options")) {
    const json& so = j["stream_options"];
    if (!so.is_object()) throw bad("stream_options", std::string("expected an object, got ") + type_name(so));
    if (!r.stream) throw bad("stream_options", "is only allowed with 'stream': true");
    if (present(so, "include_usage")) r.include_usage = get_bool(so, "include_usage");
  }
  SamplerOptions& s = r.sampling;
  s.temperature = 1.0f;  // the API's default
  if (present(j, "temperature")) s.temperature = float(get_number(j, "temperature", 0, 2));
  if (present(j, "top_p")) s.top_p = float(get_number(j, "top_p", 0, 1));
  if (s.top_p == 0.0f) throw bad("top_p", "must be greater than 0");
  if (present(j, "top_k")) {
    const int64_t k = get_int(j, "top_k", -1, 1 << 30);
    s.top_k = k < 0 ? 0 : int(k);
  }
  if (present(j, "min_p")) s.min_p = float(get_number(j, "min_p", 0, 1));
  if (present(j, "presence_penalty")) s.presence_penalty = float(get_number(j, "presence_penalty", -2, 2));
  if (present(j, "frequency_penalty")) s.frequency_penalty = float(get_number(j, "frequency_penalty", -2, 2));
  if (present(j, "repetition_penalty")) s.repetition_penalty = float(get_number(j, "repetition_penalty", 0.01, 100));
  if (present(j, "seed")) {
    s.seed = uint64_t(get_int(j, "seed", std::numeric_limits<int64_t>::min() / 2, std::numeric_limits<int64_t>::max() / 2));
    r.seeded = true;
  }
  if (present(j, "ignore_eos")) r.ignore_eos = get_bool(j, "ignore_eos");
  if (present(j, "stop")) {
    const json& st = j["stop"];
    if (st.is_string()) {
      r.stop.push_back(st.get<std::string>());
    } else if (st.is_array()) {
      if (st.size() > 4) throw bad("stop", "at most 4 stop sequences");
      for (const json& x : st) {
        if (!x.is_string()) throw bad("stop", "expected strings");
        r.stop.push_back(x.get<std::string>());
      }
    } else {
      throw bad("stop", std::string("expected a string or an array of strings, got ") + type_name(st));
    }
    for (const std::string& x : r.stop)
      if (x.empty()) throw bad("stop", "a stop sequence must not be empty");
  }
  return r;
}

json template_messages(const json& messages, bool arguments_as_objects) {
  json out = messages;
  if (!arguments_as_objects) return out;
  for (json& m : out) {
    if (!m.contains("tool_calls")) continue;
    for (json& call : m["tool_calls"]) {
      json& args = call["function"]["arguments"];
      json parsed = json::parse(args.get<std::string>(), nullptr, false);
      if (parsed.is_object()) args = std::move(parsed);
    }
  }
  return out;
}

namespace {

json usage_json(const Usage& u) {
  json j = {{"prompt_tokens", u.prompt_tokens},
            {"completion_tokens", u.completion_tokens},
            {"total_tokens", u.prompt_tokens + u.completion_tokens},
            {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}}};
  if (u.speculating)
    j["speculation"] = {{"drafted_tokens", u.drafted_tokens}, {"accepted_tokens", u.accepted_tokens}};
  return j;
}

json logprobs_json(Endpoint endpoint, const std::vector<TokenInfo>& tokens) {
  if (endpoint == Endpoint::Chat) {
    json content = json::array();
    for (const TokenInfo& t : tokens) {
      json top = json::array();
      for (const auto& [text, lp] : t.top) top.push_back({{"token", text}, {"logprob", lp}});
      content.push_back({{"token", t.text}, {"logprob", t.logprob}, {"top_logprobs", top}});
    }
    return {{"content", content}};
  }
  json toks = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
  size_t offset = 0;
  for (const TokenInfo& t : tokens) {
    toks.push_back(t.text);
    lps.push_back(t.logprob);
    json top = json::object();
    for (const auto& [text, lp] : t.top) top[text] = lp;
    tops.push_back(top);
    offsets.push_back(offset);
    offset += t.text.size();
  }
  return {{"tokens", toks}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

json envelope(Endpoint endpoint, const Completion& c, bool chunk) {
  const char* object = endpoint == Endpoint::Chat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion";
  return {{"id", c.id}, {"object", object}, {"created", c.created}, {"model", c.model}};
}

}  // namespace

json response_json(Endpoint endpoint, const Completion& c, bool logprobs) {
  json r = envelope(endpoint, c, false);
  json choices = json::array();
  for (size_t i = 0; i < c.choices.size(); ++i) {
    const Choice& ch = c.choices[i];
    json choice = {{"index", i}};
    if (endpoint == Endpoint::Chat) {
      json m = {{"role", "assistant"}, {"content", ch.text.empty() && !ch.tool_calls.empty() ? json(nullptr) : json(ch.text)}};
      if (!ch.reasoning.empty()) m["reasoning_content"] = ch.reasoning;
      if (!ch.tool_calls.empty()) {
        json calls = json::array();
        for (const ToolCall& t : ch.tool_calls)
          calls.push_back({{"id", t.id}, {"type", "function"}, {"function", {{"name", t.name}, {"arguments", t.arguments}}}});
        m["tool_calls"] = std::move(calls);
      }
      choice["message"] = std::move(m);
    } else {
      choice["text"] = ch.text;
    }
    choice["logprobs"] = logprobs ? logprobs_json(endpoint, ch.tokens) : json(nullptr);
    choice["finish_reason"] = ch.finish_reason;
    choices.push_back(std::move(choice));
  }
  r["choices"] = std::move(choices);
  r["usage"] = usage_json(c.usage);
  return r;
}

json chunk_json(Endpoint endpoint, const Completion& c, int index, const std::string& delta,
                const std::vector<TokenInfo>& tokens, bool logprobs, const std::string& finish_reason, bool first,
                const std::string& reasoning) {
  json r = envelope(endpoint, c, true);
  json choice = {{"index", index}};
  if (endpoint == Endpoint::Chat) {
    json d = json::object();
    if (first) d["role"] = "assistant";
    if (!reasoning.empty()) d["reasoning_content"] = reasoning;
    if (!delta.empty() || (first && finish_reason.empty())) d["content"] = delta;
    choice["delta"] = d;
  } else {
    choice["text"] = delta;
  }
  choice["logprobs"] = logprobs && !tokens.empty() ? logprobs_json(endpoint, tokens) : json(nullptr);
  choice["finish_reason"] = finish_reason.empty() ? json(nullptr) : json(finish_reason);
  r["choices"] = json::array({choice});
  return r;
}

json tool_call_chunk_json(const Completion& c, int index, int call_index, const ToolCall& call, bool head) {
  json r = envelope(Endpoint::Chat, c, true);
  json item = {{"index", call_index}};
  if (head) {
    item["id"] = call.id;
    item["type"] = "function";
    item["function"] = {{"name", call.name}, {"arguments", ""}};
  } else {
    item["function"] = {{"arguments", call.arguments}};
  }
  r["choices"] = json::array({{{"index", index}, {"delta", {{"tool_calls", json::array({item})}}}, {"logprobs", nullptr},
                               {"finish_reason", nullptr}}});
  return r;
}

json usage_chunk_json(Endpoint endpoint, const Completion& c) {
  json r = envelope(endpoint, c, true);
  r["choices"] = json::array();
  r["usage"] = usage_json(c.usage);
  return r;
}

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string sse(const json& j) { return "data: " + dump(j) + "\n\n"; }

}  // namespace kestrel::server
