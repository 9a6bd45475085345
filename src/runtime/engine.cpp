#include "runtime/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "common/error.h"
#include "runtime/kv_cache.h"
#include "runtime/sequence_slots.h"

namespace kestrel {

RequestStream::RequestStream(int choices) : choice_cancelled_(size_t(std::max(choices, 1))) {}

bool RequestStream::next(TokenEvent& e) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !events_.empty() || ended_ == choices(); });
  if (events_.empty()) return false;
  e = std::move(events_.front());
  events_.pop_front();
  if (e.finish != Finish::None) ++ended_;
  return true;
}

bool RequestStream::try_next(TokenEvent& e, bool& ended) {
  std::lock_guard<std::mutex> lock(mu_);
  ended = events_.empty() && ended_ == choices();
  if (events_.empty()) return false;
  e = std::move(events_.front());
  events_.pop_front();
  if (e.finish != Finish::None) ++ended_;
  ended = events_.empty() && ended_ == choices();
  return true;
}

void RequestStream::set_notify(std::function<void()> f) {
  std::function<void()> now;
  {
    std::lock_guard<std::mutex> lock(mu_);
    notify_ = std::move(f);
    if (!events_.empty()) now = notify_;
  }
  if (now) now();
}

void RequestStream::push(TokenEvent e) {
  std::function<void()> notify;
  {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::move(e));
    notify = notify_;
  }
  cv_.notify_all();
  if (notify) notify();
}

uint64_t choice_seed(uint64_t seed, int index) {
  if (index == 0) return seed;
  // splitmix64 of the seed advanced by `index` steps: neighbouring seeds and indices give
  // unrelated generator states.
  uint64_t z = seed + uint64_t(index) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

struct Engine::Sequence {
  GenerationRequest req;         // sampling.seed: this choice's
  int index = 0;                 // the choice
  std::shared_ptr<RequestStream> stream;
  int slot = -1;                 // in slots_, once started
  std::unique_ptr<Sampler> sampler;
  std::unique_ptr<TokenConstraint> constraint;  // with req.constraint, made when the slot opens
  std::vector<float> masked;     // the logits with the constraint's mask, when logprobs need them raw
  std::vector<float> logits;     // of the next token, after a step that produced them
  SequenceSlots::Sample offer;   // the backend may draw the next token instead (no logprobs asked)
  int32_t drawn = -1;            // what it drew, or -1
  std::vector<int32_t> history;  // prompt, then the generated tokens
  std::unique_ptr<DraftLength> draft_length;  // with speculation (and no constraint)
  std::vector<int32_t> verifying;  // a verification step's tokens: the last generated, then the drafts
  std::vector<float> rows;         // their logits, a row per token
  bool checking = false;           // inside emit_checked: finish() leaves the slot to be rewound, then closed
  size_t prefilled = 0;          // prompt tokens already run
  int generated = 0;
  int64_t positions = 0;         // prompt + max_tokens
  int64_t reserved = 0;          // KV positions held: positions in whole blocks
  bool admitted = false;         // counted in kv_used_
  bool done = false;             // the end event was sent
  // Shared by a request's choices: choice 0 has run its prompt (or ended). With a prefix cache,
  // the other choices start only then, on the blocks it published, instead of running the
  // prompt n times.
  std::shared_ptr<bool> lead_prefilled;
};

int64_t engine_context(const Model& model, const EngineOptions& o) {
  const ModelConfig& c = model.config;
  const int64_t n = o.context > 0 ? o.context
                                  : std::min<int64_t>(c.max_position_embeddings > 0 ? c.max_position_embeddings : 8192, 8192);
  if (c.max_position_embeddings > 0 && n > c.max_position_embeddings)
    fail("--context: ", n, " is more than the model's max_position_embeddings of ", c.max_position_embeddings);
  return n;
}

Engine::Engine(const Model& model, const EngineOptions& o, std::unique_ptr<SequenceSlots> slots)
    : model_(model), o_(o), slots_(std::move(slots)) {
  if (o_.max_batch < 1) fail("--max-batch: must be at least 1, got ", o_.max_batch);
  if (o_.prefill_chunk < 1) fail("--prefill-chunk: must be at least 1, got ", o_.prefill_chunk);
  if (o_.step_tokens < 1) fail("--step-tokens: must be at least 1, got ", o_.step_tokens);
  check_speculation_options(o_.speculation);
  context_ = engine_context(model, o_);
  if (o_.kv_tokens <= 0) o_.kv_tokens = 32 * context_;
  o_.kv_tokens = std::max<int64_t>(1, o_.kv_tokens / KvBlockPool::kBlock) * KvBlockPool::kBlock;  // whole blocks
  const bool mtp = o_.speculation.method == "mtp";
  if (!slots_) slots_ = make_cpu_slots(model, o_.max_batch, o_.threads, o_.layout, o_.kv_tokens, o_.prefix_cache, mtp);
  if (slots_->slots() < o_.max_batch)
    fail("--max-batch ", o_.max_batch, ": ", slots_->describe(), " runs at most ", slots_->slots(), " sequences at once");
  if (speculating() && !slots_->can_verify())
    fail("--speculative ", o_.speculation.method, ": ", slots_->describe(),
         " cannot verify drafted tokens");
  if (mtp && !slots_->can_draft_mtp())
    fail("--speculative mtp: ", slots_->describe(), " does not draft with the MTP layer (built on the CPU only, not "
         "yet on the GPU)");
  thread_ = std::thread([this] { loop(); });
}

Engine::~Engine() { shutdown(0.0); }

std::shared_ptr<RequestStream> Engine::submit(GenerationRequest r) {
  const int64_t V = model_.config.vocab_size;
  if (r.prompt.empty()) throw RequestError("prompt", "the prompt is empty");
  for (int32_t t : r.prompt)
    if (t < 0 || t >= V) throw RequestError("prompt", cat("token id ", t, " is outside the vocabulary of ", V));
  if (r.max_tokens < 0) throw RequestError("max_tokens", cat("max_tokens must be >= 0, got ", r.max_tokens));
  check_sampler_options(r.sampling);
  const int64_t need = int64_t(r.prompt.size()) + r.max_tokens;
  if (need > context_)
    throw RequestError("max_tokens", cat("the prompt has ", r.prompt.size(), " tokens and max_tokens is ", r.max_tokens,
                                         ": ", need, " positions, more than the context of ", context_));
  const int64_t reserve = KvBlockPool::blocks_for(need) * KvBlockPool::kBlock;
  if (reserve > o_.kv_tokens)
    throw RequestError("max_tokens", cat("the request needs ", need, " KV positions (", reserve, " in blocks of ",
                                         KvBlockPool::kBlock, "); the server holds ", o_.kv_tokens, " in all"));
  // A request's choices run side by side (admitted together), so all of them must fit at once.
  if (r.n < 1) throw RequestError("n", cat("n must be at least 1, got ", r.n));
  if (r.n > o_.max_batch)
    throw RequestError("n", cat("n = ", r.n, ": a request's choices run side by side and this server runs at most ",
                                o_.max_batch, " sequences at once (--max-batch)"));
  if (r.n * reserve > o_.kv_tokens)
    throw RequestError("n", cat("n = ", r.n, ": the choices need ", r.n, " x ", reserve, " = ", r.n * reserve,
                                " KV positions at once; the server holds ", o_.kv_tokens, " in all"));
  Group g;
  auto stream = std::make_shared<RequestStream>(r.n);
  auto lead = std::make_shared<bool>(false);
  for (int i = 0; i < r.n; ++i) {
    auto s = std::make_unique<Sequence>();
    s->req = r;
    s->req.sampling.seed = choice_seed(r.sampling.seed, i);
    s->index = i;
    s->stream = stream;
    s->positions = need;
    s->reserved = reserve;
    s->lead_prefilled = lead;
    g.reserved += reserve;
    g.seqs.push_back(std::move(s));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!accepting_) throw EngineStopped();
    waiting_seqs_ += r.n;
    waiting_.push_back(std::move(g));
  }
  cv_.notify_all();
  return stream;
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  EngineStats st;
  st.running = int(running_.size());
  st.waiting = waiting_seqs_;
  st.kv_used = kv_used_;
  st.kv_capacity = o_.kv_tokens;
  st.prompt_tokens = prompt_tokens_;
  st.cached_tokens = cached_tokens_;
  st.generated_tokens = generated_tokens_;
  st.prefix = prefix_;
  st.speculating = speculating();
  st.speculation = speculation_;
  return st;
}

void Engine::shutdown(double grace_s) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    accepting_ = false;
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(grace_s);
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if ((running_.empty() && waiting_.empty()) || std::chrono::steady_clock::now() >= until) {
        stop_ = true;
        break;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Engine::finish(Sequence& s, Finish f, const std::string& error, bool locked) {
  // The positions are free before the client sees the end.
  if (s.admitted) {
    std::unique_lock<std::mutex> lock(mu_, std::defer_lock);
    if (!locked) lock.lock();
    kv_used_ -= s.reserved;
    s.admitted = false;
  }
  TokenEvent e;
  e.index = s.index;
  e.finish = f;
  e.error = error;
  s.stream->push(std::move(e));
  if (s.slot >= 0 && !s.checking) {
    slots_->close(s.slot);
    s.slot = -1;
  }
  s.done = true;
  if (s.index == 0) *s.lead_prefilled = true;  // the other choices go on without it
}

void Engine::step_all() {
  const int64_t V = model_.config.vocab_size;
  const int64_t chunk = std::min<int64_t>(o_.prefill_chunk, slots_->max_chunk());
  std::vector<SequenceSlots::Job> jobs;
  std::vector<Sequence*> seqs;
  std::vector<size_t> ran;  // prompt tokens each job runs (0: a generated token)
  // running_ is in admission order, so the budget goes to the earliest prompts first.
  size_t budget = size_t(o_.step_tokens);
  for (auto& sp : running_) {
    Sequence& s = *sp;
    if (s.done) continue;
    if (s.stream->cancelled(s.index)) {
      finish(s, Finish::Cancelled);
      continue;
    }
    try {
      if (s.slot < 0) {
        if (s.req.max_tokens == 0) {
          finish(s, Finish::Length);
          continue;
        }
        if (s.index > 0 && !*s.lead_prefilled && slots_->prefix_cache() &&
            s.req.prompt.size() > size_t(KvBlocks::kBlock))
          continue;  // choice 0's prompt blocks first
        const SequenceSlots::Opened o = slots_->open(s.positions, s.req.prompt);
        s.slot = o.slot;
        s.prefilled = size_t(o.cached);
        s.sampler = std::make_unique<Sampler>(s.req.sampling);
        if (s.req.constraint) s.constraint = s.req.constraint();
        else if (speculating()) s.draft_length = std::make_unique<DraftLength>(o_.speculation.draft_tokens);
        s.history = s.req.prompt;
        if (s.index == 0) s.stream->set_cached_tokens(o.cached);
        std::lock_guard<std::mutex> lock(mu_);
        prompt_tokens_ += int64_t(s.req.prompt.size());
        cached_tokens_ += o.cached;
      }
    } catch (const std::exception& ex) {
      finish(s, Finish::Error, ex.what());
      continue;
    }
    SequenceSlots::Job j;
    j.slot = s.slot;
    size_t n = 0;  // prompt tokens
    if (s.prefilled < s.req.prompt.size()) {
      n = std::min({s.req.prompt.size() - s.prefilled, size_t(chunk), budget});
      if (n == 0) continue;  // the step's prompt tokens are spent: its turn comes next step
      budget -= n;
      j.tokens = {s.req.prompt.data() + s.prefilled, n};
    } else {
      j.tokens = {&s.history.back(), 1};
      // Drafts, at most what max_tokens leaves after the target's own token of the check.
      const int k = s.draft_length ? std::min(s.draft_length->next(), s.req.max_tokens - s.generated - 1) : 0;
      std::vector<int32_t> draft;
      try {
        if (k > 0) draft = drafts(s, k);
      } catch (const std::exception& ex) {
        finish(s, Finish::Error, ex.what());
        continue;
      }
      s.verifying.clear();
      if (!draft.empty()) {
        s.verifying.push_back(s.history.back());
        s.verifying.insert(s.verifying.end(), draft.begin(), draft.end());
        s.rows.resize(s.verifying.size() * size_t(V));
        j.tokens = s.verifying;
        j.logits = s.rows.data();
        j.all_logits = true;
      }
    }
    // This step gives the next token's logits (a verification has its rows: emit_checked).
    if (!j.all_logits && s.prefilled + n == s.req.prompt.size()) {
      s.logits.resize(size_t(V));
      j.logits = s.logits.data();
      s.drawn = -1;
      // Log-probabilities and a constraint's mask need the logits on the host.
      if (s.req.top_logprobs < 0 && !s.constraint) {
        s.offer.options = s.req.sampling;
        s.offer.draw = uint64_t(s.generated);
        s.offer.token = &s.drawn;
        j.sample = &s.offer;
      }
    }
    jobs.push_back(j);
    seqs.push_back(&s);
    ran.push_back(n);
  }
  if (jobs.empty()) return;
  try {
    slots_->run(jobs);
  } catch (const std::exception& ex) {
    for (Sequence* s : seqs) finish(*s, Finish::Error, ex.what());
    return;
  }
  for (size_t i = 0; i < jobs.size(); ++i) {
    Sequence& s = *seqs[i];
    s.prefilled += ran[i];
    if (s.index == 0 && s.prefilled == s.req.prompt.size()) *s.lead_prefilled = true;
    if (jobs[i].all_logits) emit_checked(s);
    else if (jobs[i].logits) emit(s, s.drawn);
  }
  const PrefixCacheStats p = slots_->prefix_stats();
  std::lock_guard<std::mutex> lock(mu_);
  prefix_ = p;
}

std::vector<int32_t> Engine::drafts(Sequence& s, int k) {
  const SpeculationOptions& so = o_.speculation;
  if (so.method == "mtp") return slots_->draft_mtp(s.slot, s.history.back(), k);
  return ngram_draft(s.history, k, so.max_match, so.min_match);
}

void Engine::emit(Sequence& s, int32_t drawn) {
  int32_t token;
  if (s.constraint) {
    // Masked in place unless the log-probabilities below need the model's own logits.
    std::vector<float>& m = s.req.top_logprobs >= 0 ? s.masked : s.logits;
    if (&m == &s.masked) m = s.logits;
    apply_token_mask(m, s.constraint->allowed());
    token = s.sampler->sample(m, s.history, s.req.prompt.size());
  } else {
    token = drawn >= 0 ? drawn : s.sampler->sample(s.logits, s.history, s.req.prompt.size());
  }
  take(s, token, s.logits);
}

void Engine::emit_checked(Sequence& s) {
  const size_t V = size_t(model_.config.vocab_size);
  const std::span<const int32_t> draft = std::span<const int32_t>(s.verifying).subspan(1);
  const int64_t base = int64_t(s.history.size()) - 1;  // positions cached before the step (all but the last token)
  auto row = [&](size_t j) { return std::span<const float>(s.rows.data() + j * V, V); };
  s.checking = true;
  const DraftCheck c = check_drafts(*s.sampler, draft, row, s.history, s.req.prompt.size(),
                                    [&](const Sampler::Verdict& v, size_t j) {
                                      return take(s, v.token, row(j), j == 0 ? int(draft.size()) : 0, v.accepted);
                                    });
  // Every draft accepted: the target's own token after them, from the last row.
  if (!c.ended && !c.rejected)
    take(s, s.sampler->sample(row(draft.size()), s.history, s.req.prompt.size()), row(draft.size()));
  s.checking = false;
  s.draft_length->checked(int(draft.size()), int(c.accepted));  // take() counted the check in speculation_
  s.verifying.clear();
  // The cache keeps the last token and the accepted drafts (then publishes their full blocks).
  try {
    slots_->rewind(s.slot, base + 1 + int64_t(c.accepted));
  } catch (const std::exception& ex) {
    if (!s.done) finish(s, Finish::Error, ex.what());
  }
  if (s.done && s.slot >= 0) {
    slots_->close(s.slot);
    s.slot = -1;
  }
}

Taken Engine::take(Sequence& s, int32_t token, std::span<const float> logits, int drafted, bool accepted_draft) {
  const int64_t V = model_.config.vocab_size;
  TokenEvent e;
  e.index = s.index;
  e.token = token;
  e.drafted = drafted;
  e.accepted_draft = accepted_draft;
  if (drafted > 0) {  // a check's first token: counted before any of its tokens or the end is streamed
    std::lock_guard<std::mutex> lock(mu_);
    ++speculation_.verifications;
    speculation_.drafted += drafted;
  }
  if (s.req.top_logprobs >= 0) {
    // log-softmax of the raw logits (what the model assigns, before sampling settings).
    const float mx = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    for (float l : logits) sum += std::exp(double(l - mx));
    const float lse = mx + float(std::log(sum));
    e.logprob = logits[size_t(e.token)] - lse;
    const int k = std::min<int>(s.req.top_logprobs, int(V));
    std::vector<int32_t> ids(static_cast<size_t>(V));
    for (int32_t i = 0; i < int32_t(V); ++i) ids[size_t(i)] = i;
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
      return logits[size_t(a)] > logits[size_t(b)] || (logits[size_t(a)] == logits[size_t(b)] && a < b);
    });
    for (int i = 0; i < k; ++i) e.top.push_back({ids[size_t(i)], logits[size_t(ids[size_t(i)])] - lse});
  }
  const std::vector<int64_t>& eos = model_.config.eos_token_ids;
  const bool is_eos = std::find(eos.begin(), eos.end(), int64_t(e.token)) != eos.end();
  if (s.constraint && !s.constraint->accept(e.token)) {
    finish(s, Finish::Error, cat("the grammar refused the token ", e.token, " its own mask allowed"));
    return Taken::Nothing;
  }
  // A constrained choice ends on the end-of-sequence token only where its grammar may end (the mask
  // allows it only there), ignore_eos or not.
  if (is_eos && (!s.req.ignore_eos || s.constraint)) {
    finish(s, Finish::Eos);
    return Taken::Nothing;
  }
  s.history.push_back(e.token);
  ++s.generated;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++generated_tokens_;
    speculation_.accepted += accepted_draft;
  }
  s.stream->push(std::move(e));
  if (s.constraint && s.constraint->ended()) {  // complete: nothing may follow
    finish(s, Finish::Eos);
    return Taken::Last;
  }
  if (s.generated >= s.req.max_tokens) {
    finish(s, Finish::Length);
    return Taken::Last;
  }
  return Taken::More;
}

void Engine::loop() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !running_.empty() || !waiting_.empty(); });
      if (stop_) {
        for (auto& s : running_)
          if (!s->done) finish(*s, Finish::Cancelled, "the server shut down", true);
        for (auto& g : waiting_)
          for (auto& s : g.seqs) finish(*s, Finish::Cancelled, "the server shut down", true);
        running_.clear();
        waiting_.clear();
        waiting_seqs_ = 0;
        return;
      }
      // Admission in arrival order, a request's choices together: the first request that does
      // not fit waits, and so do those behind it (no overtaking, so a large request is not
      // starved). One whose client went away while it waited ends here.
      while (!waiting_.empty()) {
        Group& g = waiting_.front();
        if (g.seqs.front()->stream->cancelled()) {
          for (auto& s : g.seqs) finish(*s, Finish::Cancelled, "", true);
        } else if (int(running_.size() + g.seqs.size()) <= o_.max_batch && kv_used_ + g.reserved <= o_.kv_tokens) {
          for (auto& s : g.seqs) {
            s->admitted = true;
            running_.push_back(std::move(s));
          }
          kv_used_ += g.reserved;
        } else {
          break;
        }
        waiting_seqs_ -= int(g.seqs.size());
        waiting_.pop_front();
      }
    }
    step_all();
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = running_.begin(); it != running_.end();) {
      if ((*it)->done) {
        it = running_.erase(it);
      } else {
        ++it;
      }
    }
  }
}

}  // namespace kestrel
