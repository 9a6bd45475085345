// Tool calls parsed from generated text (server/tool_calls.h), for every family's format: content
// around the calls, several calls, a call that does not parse left as written, one that never
// ends, GLM's typed values; each reply fed whole, split at every byte, and one byte at a time
// gives the same content and calls.
#include <gtest/gtest.h>

#include "server/tool_calls.h"

namespace kestrel {
namespace {

struct Parsed {
  std::string content;
  std::vector<std::pair<std::string, std::string>> calls;  // name, arguments
  bool operator==(const Parsed&) const = default;
};

Parsed parse(ToolFormat f, const std::vector<std::string>& pieces,
             std::map<std::string, std::map<std::string, std::string>> types = {}) {
  ToolCallParser p(f, types);
  std::vector<ToolCall> calls;
  Parsed r;
  for (const std::string& s : pieces) r.content += p.push(s, calls);
  r.content += p.finish(calls);
  for (const ToolCall& c : calls) r.calls.emplace_back(c.name, c.arguments);
  return r;
}

// The reply whole, then split in two at every byte, then byte by byte: all the same as `want`.
void expect_everywhere(ToolFormat f, const std::string& reply, const Parsed& want,
                       std::map<std::string, std::map<std::string, std::string>> types = {}) {
  EXPECT_EQ(parse(f, {reply}, types), want) << "whole";
  for (size_t i = 0; i <= reply.size(); ++i)
    ASSERT_EQ(parse(f, {reply.substr(0, i), reply.substr(i)}, types), want) << "split at byte " << i;
  std::vector<std::string> bytes;
  for (char c : reply) bytes.emplace_back(1, c);
  EXPECT_EQ(parse(f, bytes, types), want) << "byte by byte";
}

TEST(ToolCalls, Hermes) {
  const std::string reply =
      "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n</tool_call>\n"
      "<tool_call>\n{\"name\": \"get_time\", \"arguments\": \"{\\\"zone\\\": \\\"CET\\\"}\"}\n</tool_call>";
  expect_everywhere(ToolFormat::Hermes, reply,
                    {"Let me check.\n\n", {{"get_weather", R"({"city":"Paris","days":3})"}, {"get_time", R"({"zone":"CET"})"}}});
  // Not JSON, or no name: left as written.
  const std::string bad = "a <tool_call>{\"name\": 3}</tool_call> b <tool_call>not json</tool_call>";
  expect_everywhere(ToolFormat::Hermes, bad, {bad, {}});
  // Never closed: content as written.
  expect_everywhere(ToolFormat::Hermes, "x <tool_call>{\"name\": \"f\"", {"x <tool_call>{\"name\": \"f\"", {}});
  // Text that only looks like the start of a marker is content.
  expect_everywhere(ToolFormat::Hermes, "a <tool b <tool_cal", {"a <tool b <tool_cal", {}});
}

TEST(ToolCalls, GlmWithNewlinesOrWithout) {
  const std::map<std::string, std::map<std::string, std::string>> types = {
      {"get_weather", {{"city", "string"}, {"days", "integer"}, {"zip", "string"}}}};
  const std::string v45 =
      "Checking.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
      "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>zip</arg_key>\n<arg_value>75001</arg_value>\n</tool_call>";
  const Parsed want{"Checking.", {{"get_weather", R"({"city":"Paris","days":3,"zip":"75001"})"}}};
  expect_everywhere(ToolFormat::Glm, v45, want, types);
  const std::string v47 =
      "Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key>"
      "<arg_value>3</arg_value><arg_key>zip</arg_key><arg_value>75001</arg_value></tool_call>";
  expect_everywhere(ToolFormat::Glm, v47, want, types);
  // Without a schema every value is a string; a call without arguments has none.
  expect_everywhere(ToolFormat::Glm, v47, {"Checking.", {{"get_weather", R"({"city":"Paris","days":"3","zip":"75001"})"}}});
  expect_everywhere(ToolFormat::Glm, "<tool_call>now\n</tool_call>", {"", {{"now", "{}"}}});
  // A value of no declared type loses the spaces around it; a string's keep theirs.
  expect_everywhere(ToolFormat::Glm, "<tool_call>get_weather<arg_key>mode</arg_key><arg_value> on\n</arg_value>"
                    "<arg_key>city</arg_key><arg_value> Paris </arg_value></tool_call>",
                    {"", {{"get_weather", R"({"city":" Paris ","mode":"on"})"}}}, types);
  // Bytes that are not UTF-8 in a value become U+FFFD in the arguments' JSON.
  expect_everywhere(ToolFormat::Glm, "<tool_call>f<arg_key>a</arg_key><arg_value>x\xff</arg_value></tool_call>",
                    {"", {{"f", "{\"a\":\"x\xef\xbf\xbd\"}"}}});
  // An unclosed key: as written.
  const std::string bad = "<tool_call>f<arg_key>a<arg_value>1</arg_value></tool_call>";
  expect_everywhere(ToolFormat::Glm, bad, {bad, {}});
}

TEST(ToolCalls, DeepSeekV3AndV31) {
  const std::string v3 =
      "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```"
      "<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜>"
      "<｜tool▁calls▁end｜>";
  expect_everywhere(ToolFormat::DeepSeek, v3, {"Sure.\n", {{"get_weather", R"({"city":"Paris"})"}, {"get_time", "{}"}}});
  const std::string v31 =
      "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}<｜tool▁call▁end｜>"
      "<｜tool▁calls▁end｜>";
  expect_everywhere(ToolFormat::DeepSeek, v31, {"", {{"get_weather", R"({"city":"Paris"})"}}});
  // Multi-byte markers split inside a character still hold back, and other wide text passes.
  expect_everywhere(ToolFormat::DeepSeek, "｜ is wide ▁", {"｜ is wide ▁", {}});
}

TEST(ToolCalls, LlamaJsonIsTheWholeReply) {
  expect_everywhere(ToolFormat::LlamaJson, R"({"name": "get_weather", "parameters": {"city": "Paris"}})",
                    {"", {{"get_weather", R"({"city":"Paris"})"}}});
  expect_everywhere(ToolFormat::LlamaJson, "<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"x\": 1}}",
                    {"", {{"a", "{}"}, {"b", R"({"x":1})"}}});
  // A ';' inside a string (escaped quotes too) does not separate calls.
  expect_everywhere(ToolFormat::LlamaJson, R"({"name": "a", "parameters": {"q": "x; \"y;\""}}; {"name": "b", "parameters": {}})",
                    {"", {{"a", R"({"q":"x; \"y;\""})"}, {"b", "{}"}}});
  // Text, or JSON that is not a call: content.
  expect_everywhere(ToolFormat::LlamaJson, "It is {sunny}.", {"It is {sunny}.", {}});
  expect_everywhere(ToolFormat::LlamaJson, "  {\"answer\": 4}", {"  {\"answer\": 4}", {}});
}

TEST(ToolCalls, FormatFromTheChatTemplate) {
  EXPECT_EQ(tool_format_of_template("{% if tools %}<tool_call>{{ tool_call | tojson }}</tool_call>{% endif %}"), ToolFormat::Hermes);
  EXPECT_EQ(tool_format_of_template("<tool_call>{{ name }}<arg_key>{{ k }}</arg_key>"), ToolFormat::Glm);
  EXPECT_EQ(tool_format_of_template("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'}}"), ToolFormat::DeepSeek);
  EXPECT_EQ(tool_format_of_template("{{- '<|python_tag|>' }}"), ToolFormat::LlamaJson);
  EXPECT_EQ(tool_format_of_template("{{ messages }}"), ToolFormat::None);
  EXPECT_EQ(parse(ToolFormat::None, {"<tool_call>{}</tool_call>"}), (Parsed{"<tool_call>{}</tool_call>", {}}));
}

}  // namespace
}  // namespace kestrel
