// One model reply, shared by `generate` and `chat`: run the new prompt tokens after what the
// runner holds, then sample token by token until an end-of-sequence token, a stop string or
// max_tokens, streaming text as it settles.
#pragma once
#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "apps/runner.h"
#include "runtime/sampler.h"
#include "runtime/speculative.h"
#include "text/tokenizer.h"

namespace kestrel::apps {

struct ReplyOptions {
  SamplerOptions sampling;
  std::vector<std::string> stops;
  int max_tokens = 128;
  SpeculationOptions speculation;
};

struct Reply {
  std::string text;                  // what was emitted
  std::vector<int32_t> ran;          // tokens run through the model (new prompt tokens + generated ones fed back)
  int generated = 0;
  double prefill_s = 0, decode_s = 0;
  int decode_steps = 0;              // tokens made after the prefill's
  SpeculationStats speculation;
};

// Writes text to stdout at once (the streaming `emit` of generate and chat).
void write_stdout(const std::string& s);

// The sampling, stop and length options of `generate` and `chat`.
void add_reply_options(CLI::App& app, ReplyOptions& o);

// `history` is everything the runner holds followed by `fresh` (the new prompt tokens, already
// appended); `prompt_len` is where the output for penalties starts. Generated tokens are appended to
// history. `emit` receives text as it becomes final. With o.speculation (prompt lookup, or the MTP
// layer on a runner made with mtp_drafts), drafted tokens are checked in runs of several; greedy
// output is the same token for token, sampled output has the same distribution (Sampler::verify).

Reply reply(Runner& runner, const text::Tokenizer& tok, const std::vector<int64_t>& eos, std::span<const int32_t> fresh,
            std::vector<int32_t>& history, size_t prompt_len, const ReplyOptions& o,
            const std::function<void(const std::string&)>& emit);

}  // namespace kestrel::apps
