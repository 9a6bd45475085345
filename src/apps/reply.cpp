#include "apps/reply.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "text/detokenize.h"

namespace kestrel::apps {

void write_stdout(const std::string& s) {
  if (s.empty()) return;
  std::fwrite(s.data(), 1, s.size(), stdout);
  std::fflush(stdout);
}

void add_reply_options(CLI::App& app, ReplyOptions& o) {
  app.add_option("--max-tokens", o.max_tokens, "Most tokens to generate (default 128)");
  app.add_option("--temperature", o.sampling.temperature, "Sampling temperature; 0 is greedy (default 0)");
  app.add_option("--top-k", o.sampling.top_k, "Keep the k most likely tokens (0: off)");
  app.add_option("--top-p", o.sampling.top_p, "Keep the smallest set of tokens whose probability reaches p (1: off)");
  app.add_option("--min-p", o.sampling.min_p, "Drop tokens less likely than p times the most likely (0: off)");
  app.add_option("--repetition-penalty", o.sampling.repetition_penalty, "Penalty for tokens already seen (1: off)");
  app.add_option("--presence-penalty", o.sampling.presence_penalty, "Subtracted from tokens already generated (0: off)");
  app.add_option("--frequency-penalty", o.sampling.frequency_penalty,
                 "Subtracted per occurrence of a token already generated (0: off)");
  app.add_option("--seed", o.sampling.seed, "Random seed (default 0)");
  app.add_option("--stop", o.stops, "Stop when this text appears (repeatable)");
}

Reply reply(Runner& runner, const text::Tokenizer& tok, const std::vector<int64_t>& eos, std::span<const int32_t> fresh,
            std::vector<int32_t>& history, size_t prompt_len, const ReplyOptions& o,
            const std::function<void(const std::string&)>& emit) {
  using clock = std::chrono::steady_clock;
  auto is_eos = [&](int32_t id) { return std::find(eos.begin(), eos.end(), int64_t(id)) != eos.end(); };
  Reply r;
  Sampler sampler(o.sampling);
  text::StreamDecoder stream(tok, true);
  StopMatcher stop(o.stops);
  auto out = [&](const std::string& s) {
    if (s.empty()) return;
    r.text += s;
    emit(s);
  };
  r.ran.assign(fresh.begin(), fresh.end());
  std::vector<float> logits;
  const auto t0 = clock::now();
  logits.resize(static_cast<size_t>(runner.vocab()));
  // The device's own draw where it samples (the GPU), else -1 and the logits for the host's.
  int32_t drawn = runner.run_sample(fresh, logits.data(), o.sampling, 0);
  r.prefill_s = std::chrono::duration<double>(clock::now() - t0).count();
  while (r.generated < o.max_tokens) {
    const int32_t next = drawn >= 0 ? drawn : sampler.sample(logits, history, prompt_len);
    if (is_eos(next)) break;
    history.push_back(next);
    ++r.generated;
    out(stop.push(stream.push(next)));
    if (stop.stopped() || r.generated == o.max_tokens) break;
    const auto t = clock::now();
    drawn = runner.run_sample({&next, 1}, logits.data(), o.sampling, uint64_t(r.generated));
    r.ran.push_back(next);
    r.decode_s += std::chrono::duration<double>(clock::now() - t).count();
    ++r.decode_steps;
  }
  if (!stop.stopped()) {
    out(stop.push(stream.flush()));
    out(stop.flush());
  }
  return r;
}

}  // namespace kestrel::apps
