// The reasoning of thinking models split from their replies (server/reasoning.h): a reply that
// opens <think>, one whose prompt opened it, one that never thinks, one cut inside its thinking,
// markers in the content after the thinking; each fed whole, split in two at every byte and byte
// by byte gives the same reasoning and content. And which templates and prompts think.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "server/reasoning.h"

namespace kestrel::server {
namespace {

struct Split {
  std::string reasoning, content;
  bool operator==(const Split&) const = default;
};

std::ostream& operator<<(std::ostream& os, const Split& s) {
  return os << "{reasoning: \"" << s.reasoning << "\", content: \"" << s.content << "\"}";
}

Split split(bool in_thinking, const std::vector<std::string>& pieces) {
  ReasoningSplitter r(in_thinking);
  Split s;
  for (const std::string& p : pieces) r.push(p, s.reasoning, s.content);
  r.finish(s.reasoning, s.content);
  return s;
}

void expect_everywhere(bool in_thinking, const std::string& reply, const Split& want) {
  EXPECT_EQ(split(in_thinking, {reply}), want) << "whole";
  for (size_t i = 0; i <= reply.size(); ++i)
    ASSERT_EQ(split(in_thinking, {reply.substr(0, i), reply.substr(i)}), want) << "split at byte " << i;
  std::vector<std::string> bytes;
  for (char c : reply) bytes.emplace_back(1, c);
  EXPECT_EQ(split(in_thinking, bytes), want) << "byte by byte";
}

TEST(Reasoning, ReplyThatOpensThinking) {
  // Qwen3 and GLM write <think> themselves; whitespace around the reasoning and before the content goes.
  expect_everywhere(false, "<think>\nThe user greets.\nBe kind.\n</think>\n\nHello!", {"The user greets.\nBe kind.", "Hello!"});
  expect_everywhere(false, "\n<think>a</think>b", {"a", "b"});
  expect_everywhere(false, "<think>\n\n</think>\n\nHi", {"", "Hi"});  // empty thinking
  // After the thinking, markers are content as written.
  expect_everywhere(false, "<think>x</think>y <think>z</think>", {"x", "y <think>z</think>"});
  // Text that only looks like the start of the marker.
  expect_everywhere(false, "<thin", {"", "<thin"});
  expect_everywhere(false, "<think>a </thin b", {"a </thin b", ""});
}

TEST(Reasoning, ReplyThatNeverThinks) {
  // Content as written, leading whitespace included; <think> later on is content.
  expect_everywhere(false, "  Hello <think>no</think>", {"", "  Hello <think>no</think>"});
  expect_everywhere(false, "", {"", ""});
  expect_everywhere(false, " \n ", {"", " \n "});
}

TEST(Reasoning, PromptOpenedThinking) {
  // DeepSeek-R1's generation prompt ends with <think>\n: the reply starts as reasoning.
  expect_everywhere(true, "Think hard.\n</think>\n\nParis.", {"Think hard.", "Paris."});
  // Cut inside the thinking (max_tokens): all reasoning, trailing whitespace dropped.
  expect_everywhere(true, "Still thinking \n", {"Still thinking", ""});
  expect_everywhere(true, "</think>Paris", {"", "Paris"});
  // Multi-byte text on both sides.
  expect_everywhere(true, "Zürich — 東京\n</think>\n«Paris»", {"Zürich — 東京", "«Paris»"});
}

std::string read(const std::string& name) {
  std::ifstream f(std::string(KESTREL_FIXTURES) + "/../text/data/chat/templates/" + name);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

TEST(Reasoning, WhichTemplatesAndPromptsThink) {
  for (const char* t : {"qwen3.jinja", "glm-4.5.jinja", "deepseek-r1.jinja", "deepseek-v3.1.jinja"})
    EXPECT_TRUE(template_reasons(read(t))) << t;
  for (const char* t : {"qwen2.5.jinja", "llama3.1.jinja", "mixtral.jinja"}) {
    ASSERT_FALSE(read(t).empty()) << t;
    EXPECT_FALSE(template_reasons(read(t))) << t;
  }
  EXPECT_TRUE(prompt_opens_thinking("<｜User｜>Hi<｜Assistant｜><think>\n"));
  EXPECT_TRUE(prompt_opens_thinking("<｜Assistant｜><think>"));
  EXPECT_FALSE(prompt_opens_thinking("<|im_start|>assistant\n"));
  EXPECT_FALSE(prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n"));  // Qwen3, enable_thinking false
  EXPECT_FALSE(prompt_opens_thinking("<｜Assistant｜></think>"));                         // DeepSeek-V3.1, thinking off
}

}  // namespace
}  // namespace kestrel::server
