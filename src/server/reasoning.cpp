#include "server/reasoning.h"

#include <algorithm>

namespace kestrel::server {
namespace {

constexpr std::string_view kOpen = "<think>", kClose = "</think>";

bool space(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

// The length of the longest tail of `s` that is a proper prefix of `marker`.
size_t partial_marker(std::string_view s, std::string_view marker) {
  for (size_t n = std::min(marker.size() - 1, s.size()); n > 0; --n)
    if (s.substr(s.size() - n) == marker.substr(0, n)) return n;
  return 0;
}

size_t trailing_space(std::string_view s) {
  size_t n = 0;
  while (n < s.size() && space(s[s.size() - 1 - n])) ++n;
  return n;
}

}  // namespace

bool template_reasons(std::string_view t) {
  return t.find(kOpen) != std::string_view::npos || t.find("reasoning_content") != std::string_view::npos;
}

bool prompt_opens_thinking(std::string_view prompt) {
  prompt.remove_suffix(trailing_space(prompt));
  return prompt.size() >= kOpen.size() && prompt.substr(prompt.size() - kOpen.size()) == kOpen;
}

ReasoningSplitter::ReasoningSplitter(bool in_thinking) : state_(in_thinking ? State::Thinking : State::Start) {}

void ReasoningSplitter::push(std::string_view text, std::string& reasoning, std::string& content) {
  pending_ += text;
  for (;;) {
    switch (state_) {
      case State::Start: {
        // Reasoning only when the reply opens with <think>; anything else makes it all content.
        const size_t first = pending_.find_first_not_of(" \n\r\t");
        if (first == std::string::npos) return;
        const std::string_view t = std::string_view(pending_).substr(first);
        if (t.substr(0, kOpen.size()) == kOpen) {
          pending_.erase(0, first + kOpen.size());
          state_ = State::Thinking;
          continue;
        }
        if (t.size() < kOpen.size() && kOpen.substr(0, t.size()) == t) return;
        state_ = State::Content;
        continue;
      }
      case State::Thinking: {
        if (!reasoning_started_) {
          const size_t first = pending_.find_first_not_of(" \n\r\t");
          pending_.erase(0, first == std::string::npos ? pending_.size() : first);
          if (pending_.empty()) return;
          reasoning_started_ = true;
        }
        const size_t close = pending_.find(kClose);
        if (close != std::string::npos) {
          const std::string_view r = std::string_view(pending_).substr(0, close);
          reasoning.append(r.substr(0, r.size() - trailing_space(r)));
          pending_.erase(0, close + kClose.size());
          state_ = State::AfterThinking;
          continue;
        }
        // Held back: a possible start of </think>, and the whitespace before it (dropped if it comes).
        const std::string_view p = pending_;
        const size_t marker = partial_marker(p, kClose);
        const size_t keep = marker + trailing_space(p.substr(0, p.size() - marker));
        reasoning.append(p.substr(0, p.size() - keep));
        pending_.erase(0, pending_.size() - keep);
        return;
      }
      case State::AfterThinking: {
        const size_t first = pending_.find_first_not_of(" \n\r\t");
        if (first == std::string::npos) {
          pending_.clear();
          return;
        }
        pending_.erase(0, first);
        state_ = State::Content;
        continue;
      }
      case State::Content:
        content += pending_;
        pending_.clear();
        return;
    }
  }
}

void ReasoningSplitter::finish(std::string& reasoning, std::string& content) {
  if (state_ == State::Thinking) reasoning.append(pending_.substr(0, pending_.size() - trailing_space(pending_)));
  else if (state_ != State::AfterThinking) content += pending_;
  pending_.clear();
}

}  // namespace kestrel::server
