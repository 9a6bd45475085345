// The reasoning of models that think in <think>...</think> before they answer (Qwen3, GLM-4.5 and
// later, DeepSeek-R1 and V3.1), split from the reply as it streams so that the API returns it as
// reasoning_content apart from the content. A reply that begins (after whitespace) with <think>,
// or whose prompt already opened it, is reasoning up to </think>; the rest is content. Whitespace
// around the reasoning and before the content that follows it is dropped, as the templates put it
// back when they render the turn again. push() returns only what is settled, so a reply fed split
// at any byte gives the same reasoning and content.
#pragma once
#include <string>
#include <string_view>

namespace kestrel::server {

// Whether a chat template is a reasoning model's: it writes <think> or reads reasoning_content.
bool template_reasons(std::string_view chat_template);

// Whether a rendered prompt leaves the model inside its thinking: its generation prompt ends with
// <think> (DeepSeek-R1; V3.1 with thinking on), so the reply starts as reasoning.
bool prompt_opens_thinking(std::string_view prompt);

class ReasoningSplitter {
 public:
  explicit ReasoningSplitter(bool in_thinking);

  // The next piece of the reply: appends what is settled to `reasoning` and `content`.
  void push(std::string_view text, std::string& reasoning, std::string& content);
  // The end of the reply: what was held back. A reply cut inside its thinking is all reasoning.
  void finish(std::string& reasoning, std::string& content);

 private:
  enum class State { Start, Thinking, AfterThinking, Content };
  State state_;
  bool reasoning_started_ = false;  // a non-space byte of reasoning was seen
  std::string pending_;             // text not yet settled
};

}  // namespace kestrel::server
