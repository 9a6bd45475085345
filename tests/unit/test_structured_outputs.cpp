// Structured outputs (server/grammar.h) on the qwen3-chat fixture, whose random weights write noise
// unconstrained: a reply that parses and fits its schema is the grammar's doing. The grammars'
// matchers on the fixture's tokenizer (valid text accepted token by token and complete at its end,
// invalid text refused), schema errors naming their field, then the endpoints in process:
// response_format json_object and json_schema, tool_choice "required" and a named function in
// Qwen3's format and in the JSON form of a template without one, streamed and whole.
#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>
#include <random>
#include <thread>

#include "chat_server.h"
#include "fixture.h"
#include "model/weights.h"
#include "runtime/engine.h"
#include "server/chat_reply.h"
#include "server/grammar.h"
#include "server/http_server.h"
#include "text/model_chat.h"
#include "text/tokenizer.h"

namespace kestrel::server {
namespace {

class Grammar : public ::testing::Test {
 protected:
  void SetUp() override {
    tok_ = std::make_unique<text::Tokenizer>(text::Tokenizer::from_file(test::fixture_dir("qwen3-chat") + "/tokenizer.json"));
    grammars_ = std::make_unique<Grammars>(*tok_, 256, std::vector<int32_t>{102, 103});
  }
  // Feeds `text`'s tokens: how many were accepted, and whether the constraint was then complete.
  std::pair<size_t, bool> feed(const CompiledConstraint& c, const std::string& text) {
    auto m = c();
    const std::vector<int32_t> ids = tok_->encode(text, false, false);
    size_t n = 0;
    for (int32_t id : ids) {
      const auto mask = m->allowed();
      if (!((mask[size_t(id) / 32] >> (id % 32)) & 1u)) break;
      if (!m->accept(id)) break;
      ++n;
    }
    return {n == ids.size() ? n : n, m->ended()};
  }
  std::string field(const std::function<void()>& f) {
    try {
      f();
    } catch (const RequestError& e) {
      return e.field + " | " + e.what();
    }
    return "<accepted>";
  }
  std::unique_ptr<text::Tokenizer> tok_;
  std::unique_ptr<Grammars> grammars_;
};

const json kPerson = json::parse(R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "role": {"enum": ["admin", "user"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}
  },
  "required": ["name", "age", "role", "address"]
})");

TEST_F(Grammar, SchemaAcceptsValidTextAndRefusesTheRest) {
  const CompiledConstraint c = grammars_->json_schema(kPerson, false, "response_format.json_schema.schema");
  const std::string ok = R"({"name": "Ann", "age": 41, "role": "admin", "tags": ["a"], "address": {"city": "Oslo"}})";
  const auto [n, ended] = feed(c, ok);
  EXPECT_EQ(n, tok_->encode(ok, false, false).size());
  EXPECT_TRUE(ended);  // nothing but the end may follow the closing brace
  EXPECT_FALSE(feed(c, R"({"name": "Ann", "age": 41})").second);  // incomplete
  const std::string bad = R"({"name": "Ann", "age": "old")";
  EXPECT_LT(feed(c, bad).first, tok_->encode(bad, false, false).size());
  const std::string other = R"({"name": "Ann", "age": 41, "role": "root")";
  EXPECT_LT(feed(c, other).first, tok_->encode(other, false, false).size());  // not in the enum
  EXPECT_GT(grammars_->setup_ms(), 0.0);
}

// A raw control character (a tab) is not JSON inside a string, with length limits or without
// (an escaped one is, where the string has no length limits).
TEST_F(Grammar, StringsHoldNoRawControlCharacters) {
  for (const char* schema : {R"({"type": "string"})", R"({"type": "string", "maxLength": 8})",
                             R"({"type": "string", "minLength": 1, "maxLength": 8})"}) {
    const CompiledConstraint c = grammars_->json_schema(json::parse(schema), false, "schema");
    EXPECT_LT(feed(c, "\"a\tb\"").first, tok_->encode("\"a\tb\"", false, false).size()) << schema;
    EXPECT_TRUE(feed(c, "\"ab\"").second) << schema;
  }
  EXPECT_TRUE(feed(grammars_->json_schema(json::parse(R"({"type": "string"})"), false, "schema"), "\"a\\tb\"").second);
}

// Past every length: XGrammar's spelling of length-limited strings (a counted repetition, compiled
// in milliseconds at any bound) excludes every control character (src/CMakeLists.txt fixes its
// character class). With maxLength 1000 and 10000, after some characters no token holding a raw
// control character is allowed, and the string still ends at its limit.
TEST_F(Grammar, LongLengthLimitedStringsHoldNoRawControlCharacters) {
  for (int64_t most : {1000, 10000}) {
    const auto t0 = std::chrono::steady_clock::now();
    const CompiledConstraint c =
        grammars_->json_schema({{"type", "string"}, {"minLength", 2}, {"maxLength", most}}, false, "schema");
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2)) << most;
    auto m = c();
    for (int32_t id : tok_->encode("\"abc", false, false)) ASSERT_TRUE(m->accept(id));
    const auto mask = m->allowed();
    for (int32_t id = 0; id < int32_t(tok_->vocab_size()); ++id) {
      if (!((mask[size_t(id) / 32] >> (id % 32)) & 1u)) continue;
      const std::string text = tok_->decode(std::vector<int32_t>{id});
      EXPECT_FALSE(std::any_of(text.begin(), text.end(), [](char ch) { return static_cast<unsigned char>(ch) < 0x20; }))
          << most << ": token " << id << " allowed";
    }
    // (The fixture's vocabulary spells no other control character than these.)
    for (const char* raw : {"\"a\nb\"", "\"a\tb\""})
      EXPECT_LT(feed(c, raw).first, tok_->encode(raw, false, false).size()) << most;
    EXPECT_TRUE(feed(c, "\"" + std::string(size_t(most), 'x') + "\"").second) << most;
    const std::string longer = "\"" + std::string(size_t(most) + 1, 'x') + "\"";
    EXPECT_LT(feed(c, longer).first, tok_->encode(longer, false, false).size()) << most;
  }
}

// Schemas that would compile for seconds or more (measured: docs/ARCHITECTURE.md) are 400s naming
// the field, at once; ordinary ones within the limits still compile.
TEST_F(Grammar, PathologicalSchemasAreRefusedQuickly) {
  const std::string f = "response_format.json_schema.schema";
  const auto many = [](size_t n, const std::function<json(size_t)>& one) {
    json a = json::array();
    for (size_t i = 0; i < n; ++i) a.push_back(one(i));
    return a;
  };
  json props = json::object();
  for (size_t i = 0; i < kMaxSchemaProperties + 1; ++i) props["k" + std::to_string(i)] = {{"type", "integer"}};
  json nested = {{"type", "integer"}};
  for (int i = 0; i < 12; ++i) nested = {{"anyOf", json::array({nested, {{"type", "array"}, {"items", nested}}})}};
  const std::vector<std::pair<json, std::string>> cases = {
      {{{"enum", many(10000, [](size_t i) { return json("value_" + std::to_string(i)); })}}, f},
      {{{"anyOf", many(2000, [](size_t i) {
          return json{{"type", "object"}, {"properties", {{"k" + std::to_string(i), {{"type", "integer"}}}}}};
        })}},
       f},
      {nested, f},
      {{{"type", "object"}, {"properties", props}}, f + ".properties"},
      {{{"type", "object"}, {"properties", {{"x", {{"type", "string"}, {"pattern", "^a{1000}{1000}$"}}}}}},
       f + ".properties.x.pattern"},
      {{{"type", "string"}, {"pattern", "^(a{100}){100}$"}}, f + ".pattern"},
      {{{"type", "string"}, {"pattern", "^.{0,1000}$"}}, f + ".pattern"},
      {{{"type", "string"}, {"pattern", "^[^@]{0,64}$"}}, f + ".pattern"},  // a broad class: ~6 s
      // A property named as a keyword is a schema all the same.
      {{{"type", "object"}, {"properties", {{"enum", {{"type", "string"}, {"pattern", "^(a{100}){100}$"}}}}}},
       f + ".properties.enum.pattern"},
      {{{"type", "string"}, {"pattern", std::string(kMaxPatternLength + 1, 'a')}}, f + ".pattern"},
      {{{"type", "object"}, {"patternProperties", {{"^[a-z]{0,5000}$", {{"type", "integer"}}}}}}, f + ".patternProperties"},
  };
  for (const auto& [schema, at] : cases) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string got = field([&] { grammars_->json_schema(schema, false, f); });
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(200)) << at;
    EXPECT_EQ(got.rfind(at + " | '" + at + "': ", 0), 0u) << got;
    EXPECT_NE(got.find("the most kestrel compiles"), std::string::npos) << got;
  }
  // A request's tools count together, the error naming the tool that goes past the limit.
  json tools = json::array();
  for (int i = 0; i < 3; ++i)
    tools.push_back({{"type", "function"},
                     {"function", {{"name", "f" + std::to_string(i)},
                                   {"parameters", {{"type", "object"}, {"properties", {{"e", {{"enum", many(1500, [](size_t k) { return json(k); })}}}}}}}}}});
  EXPECT_EQ(field([&] { grammars_->tool_calls(tools, ToolFormat::Hermes, "", false); }).rfind("tools[2].function.parameters | ", 0), 0u);
  // Within the limits: large bounds XGrammar counts at run time, a pattern's short repetitions,
  // strings in enums (values, whose keys are not schemas' keywords), recursion.
  for (const char* ok : {R"({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 100000})",
                         R"({"type": "string", "minLength": 100000})",
                         R"({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 100000})",
                         R"({"type": "string", "pattern": "^[A-Za-z0-9_]{1,64}$"})",
                         R"({"type": "string", "pattern": "^\\d{3}-\\d{4}$"})",
                         R"({"type": "string", "pattern": "^[^@]+@[^@]+\\.[^@]{2,}$"})",
                         R"({"enum": [{"pattern": "a{100000}"}, "x"]})",
                         R"({"$defs": {"n": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}},
                             "$ref": "#/$defs/n"})"})
    EXPECT_EQ(field([&] { grammars_->json_schema(json::parse(ok), false, f); }), "<accepted>") << ok;
}

TEST_F(Grammar, JsonObjectAndStopTokens) {
  const CompiledConstraint c = grammars_->json_object();
  auto m = c();
  EXPECT_FALSE((m->allowed()[102 / 32] >> (102 % 32)) & 1u);  // the end only where the grammar may end
  EXPECT_TRUE(feed(c, R"({"a": [1, {"b": null}], "c": "d"})").second);
  EXPECT_LT(feed(c, "[1]").first, 1u + tok_->encode("[1]", false, false).size() - 1);  // an object, not an array
}

TEST_F(Grammar, SchemaErrorsNameTheField) {
  const std::string f = "response_format.json_schema.schema";
  auto compile = [&](const std::string& schema, bool strict = false) {
    return field([&] { grammars_->json_schema(json::parse(schema), strict, f); });
  };
  EXPECT_EQ(compile(R"({"type": "object"})"), "<accepted>");
  EXPECT_EQ(compile(R"({"type": "nonsense"})").rfind(f + " | '" + f + "': ", 0), 0u) << compile(R"({"type": "nonsense"})");
  EXPECT_EQ(compile(R"({"$ref": "#/$defs/missing"})").rfind(f + " |", 0), 0u);
  // strict: OpenAI's rules, down the nested objects.
  EXPECT_EQ(compile(R"({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]})", true).rfind(f + " |", 0), 0u);
  EXPECT_EQ(compile(R"({"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": false})", true)
                .rfind(f + ".required |", 0),
            0u);
  EXPECT_EQ(compile(R"({"type": "object", "additionalProperties": false, "required": ["a"],
                        "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}}})",
                    true)
                .rfind(f + ".properties.a |", 0),
            0u);
  EXPECT_EQ(compile(R"({"type": "object", "additionalProperties": false, "required": ["a"],
                        "properties": {"a": {"type": "string"}}})",
                    true),
            "<accepted>");
}

TEST_F(Grammar, ToolCallsInQwenFormat) {
  const json tools = json::parse(R"([{"type":"function","function":{"name":"get_weather","parameters":{"type":"object",
      "properties":{"city":{"type":"string"},"days":{"type":"integer"}},"required":["city"]}}},
      {"type":"function","function":{"name":"noop"}}])");
  const CompiledConstraint one = grammars_->tool_calls(tools, ToolFormat::Hermes, "get_weather", false);
  const std::string call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>";
  EXPECT_TRUE(feed(one, call).second);
  const std::string other = "<tool_call>\n{\"name\": \"noop\"";
  EXPECT_LT(feed(one, other).first, tok_->encode(other, false, false).size());  // named: only that one
  const CompiledConstraint any = grammars_->tool_calls(tools, ToolFormat::Hermes, "", true);
  EXPECT_FALSE(feed(any, call).second);  // parallel: another call may follow
  EXPECT_TRUE(feed(any, call + "\n<tool_call>\n{\"name\": \"noop\", \"arguments\": {}}\n</tool_call>").first > 0);
  const CompiledConstraint plain = grammars_->tool_calls(tools, ToolFormat::None, "", false);
  EXPECT_TRUE(feed(plain, R"({"name": "noop", "parameters": {}})").second);
  EXPECT_NE(field([&] { grammars_->tool_calls(tools, ToolFormat::Hermes, "missing", false); }), "<accepted>");
}

// A random walk through the grammar (a uniformly drawn allowed token at each step) until it is
// complete: the text it spells.
std::string walk(const text::Tokenizer& tok, const CompiledConstraint& c, uint64_t seed, size_t most = 4000) {
  std::mt19937_64 rng(seed);
  auto m = c();
  std::vector<int32_t> ids;
  while (!m->ended() && ids.size() < most) {
    std::vector<int32_t> allowed;
    const auto mask = m->allowed();
    for (size_t t = 0; t < mask.size() * 32; ++t)
      if ((mask[t / 32] >> (t % 32)) & 1u) allowed.push_back(int32_t(t));
    if (allowed.empty()) break;
    const int32_t t = allowed[rng() % allowed.size()];
    if (!m->accept(t)) break;
    if (!m->ended() || tok.token(t).size()) ids.push_back(t);
  }
  EXPECT_TRUE(m->ended()) << tok.decode(ids);
  return tok.decode(ids, true);
}

// Whatever a grammar of each tool-call format lets through, that format's parser reads back as
// calls whose arguments fit the tool's schema (an enum and an integer range, checked by hand).
TEST_F(Grammar, ToolCallGrammarsGiveWhatTheirParsersRead) {
  const json tools = json::parse(R"([{"type":"function","function":{"name":"set_mode","parameters":{"type":"object",
      "properties":{"mode":{"enum":["on","off"]},"level":{"type":"integer","minimum":1,"maximum":9}},
      "required":["mode","level"]}}}])");
  const auto types = tool_parameter_types(tools);
  for (ToolFormat f : {ToolFormat::Hermes, ToolFormat::Glm, ToolFormat::None}) {
    const ToolFormat parse_as = f == ToolFormat::None ? ToolFormat::LlamaJson : f;
    for (bool parallel : {false, true}) {
      const CompiledConstraint c = grammars_->tool_calls(tools, f, "", parallel);
      for (uint64_t seed = 0; seed < 6; ++seed) {
        const std::string text = walk(*tok_, c, seed);
        ToolCallParser p(parse_as, types);
        std::vector<ToolCall> calls;
        std::string content = p.push(text, calls);
        content += p.finish(calls);
        // Only the separators between calls (which the server drops for a forced call).
        EXPECT_EQ(content.find_first_not_of(" \n"), std::string::npos) << tool_format_name(f) << ": " << text;
        ASSERT_GE(calls.size(), 1u) << tool_format_name(f) << ": " << text;
        if (!parallel) {
          EXPECT_EQ(calls.size(), 1u) << text;
        }
        for (const ToolCall& call : calls) {
          EXPECT_EQ(call.name, "set_mode");
          const json a = json::parse(call.arguments);
          EXPECT_TRUE(a["mode"] == "on" || a["mode"] == "off") << tool_format_name(f) << ": " << text;
          EXPECT_TRUE(a["level"].is_number_integer() && a["level"] >= 1 && a["level"] <= 9) << text;
        }
      }
    }
  }
}

// The endpoints in process on the fixture model (unscripted: its own noise, constrained).
class StructuredServer : public ChatServerTest {
 protected:
  // A streamed reply's content and tool calls put together from its deltas, and its finish_reason.
  json streamed(const std::string& body) {
    const auto [status, text] = post(body);
    EXPECT_EQ(status, 200) << text;
    std::string content;
    json calls = json::array();
    std::string finish;
    size_t at = 0;
    while ((at = text.find("data: ", at)) != std::string::npos) {
      const size_t end = text.find("\n\n", at);
      const std::string data = text.substr(at + 6, end - at - 6);
      at = end;
      if (data == "[DONE]") break;
      const json ch = json::parse(data)["choices"][0];
      const json& d = ch["delta"];
      if (d.contains("content") && d["content"].is_string()) content += d["content"].get<std::string>();
      if (d.contains("tool_calls"))
        for (const json& t : d["tool_calls"]) {
          const size_t i = t["index"].get<size_t>();
          if (calls.size() <= i) calls.push_back({{"name", ""}, {"arguments", ""}});
          if (t["function"].contains("name")) calls[i]["name"] = t["function"]["name"];
          calls[i]["arguments"] = calls[i]["arguments"].get<std::string>() + t["function"]["arguments"].get<std::string>();
        }
      if (ch["finish_reason"].is_string()) finish = ch["finish_reason"].get<std::string>();
    }
    return {{"content", content}, {"tool_calls", calls}, {"finish_reason", finish}};
  }
  static std::string request(const std::string& more) {
    return R"({"model":"qwen3-chat","messages":[{"role":"user","content":"Who are you?"}],"max_tokens":600)" + more + "}";
  }

};

// kPerson's constraints, checked by hand.
void expect_person(const json& p) {
  ASSERT_TRUE(p.is_object()) << p.dump();
  ASSERT_TRUE(p.contains("name") && p["name"].is_string()) << p.dump();
  EXPECT_LE(p["name"].get<std::string>().size(), 8u * 4);  // maxLength counts characters
  ASSERT_TRUE(p.contains("age") && p["age"].is_number_integer()) << p.dump();
  EXPECT_GE(p["age"].get<int>(), 0);
  EXPECT_LE(p["age"].get<int>(), 99);
  EXPECT_TRUE(p["role"] == "admin" || p["role"] == "user") << p.dump();
  ASSERT_TRUE(p["address"].is_object() && p["address"]["city"].is_string()) << p.dump();
  if (p.contains("tags")) {
    ASSERT_TRUE(p["tags"].is_array());
    EXPECT_LE(p["tags"].size(), 2u);
  }
  for (auto it = p.begin(); it != p.end(); ++it) EXPECT_TRUE(kPerson["properties"].contains(it.key())) << it.key();
}

TEST_F(StructuredServer, JsonSchemaWholeStreamedAndReproducible) {
  const std::string rf = R"(,"response_format":{"type":"json_schema","json_schema":{"name":"person","schema":)" + kPerson.dump() + "}}";
  for (const char* sampling : {R"(,"temperature":0)", R"(,"temperature":1,"seed":7)"}) {
    const json r = ok(request(rf + sampling));
    const json& ch = r["choices"][0];
    EXPECT_EQ(ch["finish_reason"], "stop") << r.dump();
    const std::string text = ch["message"]["content"].get<std::string>();
    expect_person(json::parse(text, nullptr, false));
    if (HasFailure()) ADD_FAILURE() << text;
    EXPECT_EQ(ok(request(rf + sampling))["choices"][0]["message"]["content"], text);  // greedy or seeded: the same
    const json s = streamed(request(rf + sampling + R"(,"stream":true)"));
    EXPECT_EQ(s["content"], text);
    EXPECT_EQ(s["finish_reason"], "stop");
  }
  // /v1/completions too, and n choices each valid.
  const json c = ok(R"({"model":"qwen3-chat","prompt":"Person:","max_tokens":600,"n":2,"temperature":1)" + rf + "}",
                    "/v1/completions");
  ASSERT_EQ(c["choices"].size(), 2u) << c.dump();
  for (const json& ch : c["choices"]) {
    expect_person(json::parse(ch["text"].get<std::string>(), nullptr, false));
    if (HasFailure()) ADD_FAILURE() << ch.dump();
  }
}

TEST_F(StructuredServer, JsonObject) {
  const json r = ok(request(R"(,"temperature":0,"response_format":{"type":"json_object"})"));
  const std::string text = r["choices"][0]["message"]["content"].get<std::string>();
  if (r["choices"][0]["finish_reason"] == "stop") EXPECT_TRUE(json::parse(text, nullptr, false).is_object()) << text;
  else EXPECT_EQ(text.rfind("{", 0), 0u) << text;  // max_tokens ran out inside it
}

TEST_F(StructuredServer, ToolChoiceRequiredAndNamed) {
  const std::string tools = R"(,"tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object",
      "properties":{"city":{"type":"string","maxLength":10},"days":{"type":"integer","minimum":1,"maximum":7}},
      "required":["city","days"]}}},{"type":"function","function":{"name":"get_time","parameters":{"type":"object",
      "properties":{"zone":{"enum":["UTC","CET"]}},"required":["zone"]}}}])";
  auto check_call = [](const json& call) {
    const std::string name = call["name"].get<std::string>();
    const json args = json::parse(call["arguments"].get<std::string>(), nullptr, false);
    ASSERT_TRUE(args.is_object()) << call.dump();
    if (name == "get_weather") {
      EXPECT_TRUE(args["city"].is_string()) << args.dump();
      EXPECT_TRUE(args["days"].is_number_integer() && args["days"] >= 1 && args["days"] <= 7) << args.dump();
    } else {
      EXPECT_EQ(name, "get_time");
      EXPECT_TRUE(args["zone"] == "UTC" || args["zone"] == "CET") << args.dump();
    }
  };
  for (const char* choice : {R"("required")", R"({"type":"function","function":{"name":"get_time"}})"}) {
    const std::string body = request(tools + R"(,"temperature":0,"parallel_tool_calls":false,"tool_choice":)" + choice);
    const json r = ok(body);
    const json& ch = r["choices"][0];
    EXPECT_EQ(ch["finish_reason"], "tool_calls") << r.dump();
    ASSERT_EQ(ch["message"]["tool_calls"].size(), 1u) << r.dump();
    const json& call = ch["message"]["tool_calls"][0]["function"];
    check_call(call);
    if (std::string(choice).find("get_time") != std::string::npos) {
      EXPECT_EQ(call["name"], "get_time");
    }
    const json s = streamed(request(tools + R"(,"temperature":0,"parallel_tool_calls":false,"stream":true,"tool_choice":)" + choice));
    EXPECT_EQ(s["finish_reason"], "tool_calls");
    ASSERT_EQ(s["tool_calls"].size(), 1u) << s.dump();
    EXPECT_EQ(s["tool_calls"][0]["name"], call["name"]);
    EXPECT_EQ(s["tool_calls"][0]["arguments"], call["arguments"]);
  }
  // A template with no tool format: the JSON form, parsed into the same calls.
  stop();
  text::ModelChat plain;
  plain.source = "{% for m in messages %}{{ m.content }}{% endfor %}";
  start(plain);
  const json r = ok(request(tools + R"(,"temperature":1,"seed":3,"tool_choice":"required")"));
  EXPECT_EQ(r["choices"][0]["finish_reason"], "tool_calls") << r.dump();
  ASSERT_GE(r["choices"][0]["message"]["tool_calls"].size(), 1u) << r.dump();
  for (const json& call : r["choices"][0]["message"]["tool_calls"]) check_call(call["function"]);
}

TEST_F(StructuredServer, BadSchemasAre400sNamingTheField) {
  auto refused = [&](const std::string& body) {
    const auto [status, text] = post(body);
    EXPECT_EQ(status, 400) << text;
    return json::parse(text, nullptr, false)["error"];
  };
  const std::string f = "response_format.json_schema.schema";
  EXPECT_EQ(refused(request(R"(,"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{"type":"nonsense"}}})"))["param"], f);
  EXPECT_EQ(refused(request(R"(,"response_format":{"type":"json_schema","json_schema":{"name":"x","strict":true,
      "schema":{"type":"object","properties":{"a":{"type":"string"}},"required":["a"]}}})"))["param"], f);
  EXPECT_EQ(refused(request(R"(,"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"nonsense"}}}],
      "tool_choice":{"type":"function","function":{"name":"f"}})"))["param"], "tools[0].function.parameters");
  // Past kestrel's limits, at once (the request thread would otherwise compile for minutes).
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(refused(request(R"(,"response_format":{"type":"json_schema","json_schema":{"name":"x",
      "schema":{"type":"object","properties":{"x":{"type":"string","pattern":"^(a{1000}){1000}$"}}}}})"))["param"],
            f + ".properties.x.pattern");
  EXPECT_EQ(refused(request(R"(,"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object",
      "properties":{"x":{"type":"string","pattern":"^.{0,5000}$"}}}}}],"tool_choice":"required")"))["param"],
            "tools[0].function.parameters.properties.x.pattern");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
  // The server still serves.
  EXPECT_EQ(ok(request(R"(,"max_tokens":2)"))["choices"].size(), 1u);
}

}  // namespace
}  // namespace kestrel::server
