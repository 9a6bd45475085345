// A chat reply split into reasoning, content and tool calls (server/chat_reply.h): a Qwen3 reply
// that thinks then calls, a DeepSeek-R1 reply that starts inside its thinking, tool markers inside
// the thinking staying reasoning, GLM values typed by the request's tool schemas; each fed whole,
// split in two at every byte and byte by byte gives the same pieces.
#include <gtest/gtest.h>

#include "server/chat_reply.h"

namespace kestrel::server {
namespace {

struct Pieces {
  std::string reasoning, content;
  std::vector<std::pair<std::string, std::string>> calls;
  bool operator==(const Pieces&) const = default;
};

Pieces run(const ChatReply& proto, const std::vector<std::string>& parts) {
  ChatReply r = proto;
  Pieces out;
  auto add = [&](ReplyPieces p) {
    out.reasoning += p.reasoning;
    out.content += p.content;
    for (const ToolCall& c : p.calls) out.calls.emplace_back(c.name, c.arguments);
  };
  for (const std::string& s : parts) add(r.push(s));
  add(r.finish());
  return out;
}

void expect_everywhere(const ChatReply& proto, const std::string& reply, const Pieces& want) {
  EXPECT_EQ(run(proto, {reply}), want) << "whole";
  for (size_t i = 0; i <= reply.size(); ++i)
    ASSERT_EQ(run(proto, {reply.substr(0, i), reply.substr(i)}), want) << "split at byte " << i;
  std::vector<std::string> bytes;
  for (char c : reply) bytes.emplace_back(1, c);
  EXPECT_EQ(run(proto, bytes), want) << "byte by byte";
}

TEST(ChatReply, ThinksThenCalls) {
  const std::string reply =
      "<think>\nThe user wants the weather. <tool_call> is how I call.\n</think>\n\nLet me check.\n<tool_call>\n"
      "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
  expect_everywhere(ChatReply(false, ToolFormat::Hermes), reply,
                    {"The user wants the weather. <tool_call> is how I call.", "Let me check.\n",
                     {{"get_weather", R"({"city":"Paris"})"}}});
  // Without tools the call is content; without reasoning the thinking is too.
  expect_everywhere(ChatReply(false, ToolFormat::None), "<think>a</think>b<tool_call>{}</tool_call>",
                    {"a", "b<tool_call>{}</tool_call>", {}});
  expect_everywhere(ChatReply(std::nullopt, ToolFormat::None), "<think>a</think>b", {"", "<think>a</think>b", {}});
}

TEST(ChatReply, StartsInsideThinking) {
  const std::string reply =
      "Need the weather.\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
      "```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
  expect_everywhere(ChatReply(true, ToolFormat::DeepSeek), reply, {"Need the weather.", "", {{"get_weather", R"({"city":"Paris"})"}}});
}

TEST(ChatReply, GlmValuesTypedByTheToolSchemas) {
  const nlohmann::ordered_json tools = nlohmann::ordered_json::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
      "city": {"type": "string"}, "days": {"type": ["integer", "null"]}, "zip": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "now"}}])");
  const auto types = tool_parameter_types(tools);
  EXPECT_EQ(types.at("get_weather").at("days"), "integer");
  EXPECT_TRUE(types.at("now").empty());
  expect_everywhere(ChatReply(false, ToolFormat::Glm, types),
                    "\n<think>Plan.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
                    "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>zip</arg_key>\n<arg_value>75001</arg_value>\n"
                    "</tool_call>",
                    {"Plan.", "", {{"get_weather", R"({"city":"Paris","days":3,"zip":"75001"})"}}});
}

}  // namespace
}  // namespace kestrel::server
