#include "apps/reply.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "apps/model_options.h"
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
  add_speculation_options(app, o.speculation);
}

namespace {

using clock_type = std::chrono::steady_clock;

// The speculative loop: each round runs the token the previous round left unrun (if any) and the
// drafts after it in one run, checks the drafts in order against the logits before each, keeps
// the accepted ones in the cache and rewinds the rest. `logits` holds the prefill's last logits.
// Prompt lookup drafts from the history alone, so after a round that accepted every draft it
// drafts again at once; the MTP layer drafts after a chosen token, so the target's own token is
// drawn first.
template <class Emit>
void speculate(Runner& runner, std::vector<float>& logits, std::vector<int32_t>& history, size_t prompt_len,
               const ReplyOptions& o, Sampler& sampler, Reply& r, Emit&& emit) {
  const SpeculationOptions& so = o.speculation;
  const bool mtp = so.method == "mtp";
  const size_t V = size_t(runner.vocab());
  std::vector<float> rows;
  std::vector<int32_t> pending;  // emitted, not yet run
  DraftLength length(so.draft_tokens);
  while (r.generated < o.max_tokens) {
    if (mtp && pending.empty()) {
      const int32_t next = sampler.sample(logits, history, prompt_len);
      if (emit(next) != Taken::More) return;
      pending = {next};
    }
    const int room = o.max_tokens - r.generated;  // the target's own token always fits
    const int k = std::min(length.next(), room - 1);
    std::vector<int32_t> draft;
    if (k > 0) draft = mtp ? runner.draft_mtp(pending[0], k) : ngram_draft(history, k, so.max_match, so.min_match);
    std::vector<int32_t> run = pending;
    run.insert(run.end(), draft.begin(), draft.end());
    const int64_t base = runner.position();
    const size_t offset = pending.size();
    if (!run.empty()) {
      const auto t = clock_type::now();
      rows.resize(run.size() * V);
      runner.run(run, rows.data(), true);
      r.decode_s += std::chrono::duration<double>(clock_type::now() - t).count();
      r.ran.insert(r.ran.end(), run.begin(), run.end());
      if (offset) std::copy_n(rows.begin(), V, logits.begin());
    }
    pending.clear();
    if (draft.empty()) {
      const int32_t next = sampler.sample(logits, history, prompt_len);
      if (emit(next) != Taken::More) return;
      pending = {next};
      continue;
    }
    ++r.speculation.verifications;
    r.speculation.drafted += int64_t(draft.size());
    auto before = [&](size_t j) {
      return std::span<const float>(j == 0 ? logits.data() : rows.data() + (offset + j - 1) * V, V);
    };
    const DraftCheck c = check_drafts(sampler, draft, before, history, prompt_len,
                                      [&](const Sampler::Verdict& v, size_t) { return emit(v.token); });
    const size_t accepted = c.accepted;
    const bool ended = c.ended;
    if (c.rejected) pending = {history.back()};
    r.speculation.accepted += int64_t(accepted);
    length.checked(int(draft.size()), int(accepted));
    // The cache keeps what was run up to the last accepted draft.
    const size_t keep = offset + accepted;
    runner.rewind(base + int64_t(keep));
    r.ran.resize(r.ran.size() - (run.size() - keep));
    if (ended) return;
    if (pending.empty()) std::copy_n(rows.begin() + (keep - 1) * V, V, logits.begin());
  }
}

}  // namespace

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
  check_speculation_options(o.speculation);
  if (o.speculation.method != "none") {
    // Sampled on the host: the check needs the logits of every drafted position.
    runner.run(fresh, logits.data(), false);
    r.prefill_s = std::chrono::duration<double>(clock::now() - t0).count();
    // Emits one token; false when generation ends with it (not emitted for an end-of-sequence token).
    auto take = [&](int32_t next) {
      if (is_eos(next)) return Taken::Nothing;
      history.push_back(next);
      ++r.generated;
      out(stop.push(stream.push(next)));
      return !stop.stopped() && r.generated < o.max_tokens ? Taken::More : Taken::Last;
    };
    speculate(runner, logits, history, prompt_len, o, sampler, r, take);
    r.decode_steps = std::max(0, r.generated - 1);
    if (!stop.stopped()) {
      out(stop.push(stream.flush()));
      out(stop.flush());
    }
    return r;
  }
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
