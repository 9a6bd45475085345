// The engine loop of a server: requests (token ids in, token ids out) join a running set between
// steps (continuous batching), prompts are prefilled in chunks so that a long prompt does not
// stall the sequences already decoding (at most step_tokens prompt tokens per step over all
// sequences, the earliest admitted first, while every decoding sequence advances), and admission is bounded by the KV cache: a request
// reserves prompt + max_tokens positions, waits while they are not free, and is refused at once
// when it could never fit. A request with n choices is n sequences of one prompt, admitted
// together and streamed through one RequestStream. Every step advances every running sequence
// (sequence_slots.h: one after another on the CPU, one batched decode step on the GPU); each has
// its own KV cache and sampler, so a request yields the same tokens alone or among many (on the
// GPU to rounding). With speculation (EngineOptions::speculation, where the backend can verify), a
// decoding sequence drafts tokens by prompt lookup over its prompt and output, or with the
// model's MTP layer (the CPU slots: SequenceSlots::draft_mtp), and runs its last token and the
// drafts in one job of every row's logits; the drafts the check accepts stream
// as tokens, the rest are rewound (the same greedy tokens as without; sampled ones from the same
// distribution, but other draws of the seed's stream). A backend that samples itself (the GPU, for requests without penalties or
// log-probabilities) draws from the same distribution as the host's sampler with a random stream
// of its own, so a seeded request is reproducible on one backend, not across them.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "common/thread_pool.h"
#include "model/weights.h"
#include "parallel/layout.h"
#include "runtime/sampler.h"
#include "runtime/sequence_slots.h"
#include "runtime/speculative.h"
#include "runtime/token_constraint.h"

namespace kestrel {

struct EngineOptions {
  int max_batch = 16;          // sequences running at once
  int64_t kv_tokens = 0;       // KV positions shared by all running sequences (0: 32 x context)
  int64_t context = 0;         // most positions one sequence may use (0: the model's, capped at 8192)
  int prefill_chunk = 64;      // prompt tokens run per sequence and step
  // Prompt tokens run per step over all sequences: a step's time, so the decoding sequences'
  // time between tokens, is bounded by one decode and this many prompt tokens.
  int step_tokens = 256;
  bool prefix_cache = true;    // the CPU slots' (sequence_slots.h); the GPU's are made with their own
  int threads = 0;             // CPU threads (0: all cores)
  Layout layout;               // the model split over threads (parallel/layout.h)
  // Speculation of decoding sequences without a constraint, by prompt lookup or with the MTP
  // layer (runtime/speculative.h; the backend must verify: SequenceSlots::can_verify, and for mtp
  // draft: can_draft_mtp, the CPU slots, which then run prompts without the prefix cache). Drafted
  // tokens are not prompt tokens: they leave step_tokens to the prompts, and a step runs at most
  // draft_tokens more rows per decoding sequence.
  SpeculationOptions speculation;
};

struct GenerationRequest {
  std::vector<int32_t> prompt;
  int max_tokens = 16;
  SamplerOptions sampling;
  int top_logprobs = -1;  // -1: no log-probabilities; n >= 0: the chosen token's and the n best
  bool ignore_eos = false;
  int n = 1;              // choices: sequences of this prompt; choice i samples with choice_seed(seed, i)
  // Grammar-constrained decoding (token_constraint.h): each choice's tokens are masked by a
  // constraint of its own, sampled on the host, and the choice ends (Finish::Eos) once the
  // constraint is complete. Empty: unconstrained.
  ConstraintFactory constraint;
};

// The seed of choice `index` of a request seeded with `seed`: choice 0 keeps the seed (so it
// gives what the same request with n = 1 gives), the others get well-mixed seeds of their own.
uint64_t choice_seed(uint64_t seed, int index);

// A request the engine can never run, with the request field to blame ("prompt", "max_tokens",
// "n"); a server answers 400 naming it.
class RequestError : public Error {
 public:
  RequestError(std::string field, const std::string& message) : Error(message), field(std::move(field)) {}
  std::string field;
};

enum class Finish { None, Length, Eos, Cancelled, Error };

struct TokenLogprob {
  int32_t token;
  float logprob;
};

// One event of a request's stream: a token of choice `index`, or the end of that choice
// (finish != None) with no token.
struct TokenEvent {
  int index = 0;
  int32_t token = -1;
  float logprob = 0.0f;
  std::vector<TokenLogprob> top;  // best alternatives, most likely first
  Finish finish = Finish::None;
  std::string error;              // with Finish::Error
  // With speculation: the tokens drafted by the check that made this token (on the check's first
  // token only, 0 on the others), and whether this token is a draft the check accepted.
  int drafted = 0;
  bool accepted_draft = false;
};

// The consumer side of one request: the events of its choices, interleaved in the order they
// were made. next() blocks for the next event; an event-driven consumer instead sets a notify
// function (called on the engine's thread after each event is queued: it must only schedule
// work) and takes events with try_next(). cancel() ends every choice at the next step and
// frees their KV positions (a client that went away), cancel(i) only choice i (a stop string).
class RequestStream {
 public:
  explicit RequestStream(int choices = 1);
  bool next(TokenEvent& e);  // false once every choice's end event has been taken
  // The next event if one is queued; `ended` is set once every choice's end event was taken.
  bool try_next(TokenEvent& e, bool& ended);
  // Called after each push from then on (and once at once when events are already queued).
  void set_notify(std::function<void()> f);
  void cancel() { cancelled_ = true; }
  void cancel(int choice) { choice_cancelled_.at(size_t(choice)) = true; }
  bool cancelled() const { return cancelled_; }
  bool cancelled(int choice) const { return cancelled_ || choice_cancelled_.at(size_t(choice)); }
  // Prompt positions whose KV came from the prefix cache (choice 0's), set when it starts.
  int64_t cached_tokens() const { return cached_tokens_; }
  void set_cached_tokens(int64_t n) { cached_tokens_ = n; }
  int choices() const { return int(choice_cancelled_.size()); }
  void push(TokenEvent e);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<TokenEvent> events_;
  int ended_ = 0;  // end events taken
  std::atomic<bool> cancelled_{false};
  std::atomic<int64_t> cached_tokens_{0};
  std::vector<std::atomic<bool>> choice_cancelled_;
  std::function<void()> notify_;  // under mu_
};

// submit() on an engine that is shutting down (a server answers 503, not 400).
class EngineStopped : public Error {
 public:
  EngineStopped() : Error("the server is shutting down") {}
};

struct EngineStats {
  int running = 0, waiting = 0;  // sequences (a request with n choices counts n)
  int64_t kv_used = 0, kv_capacity = 0;
  int64_t prompt_tokens = 0, generated_tokens = 0;  // totals since start
  int64_t cached_tokens = 0;                        // of the prompt tokens, from the prefix cache
  PrefixCacheStats prefix;                          // the backend's prefix cache
  bool speculating = false;                         // EngineOptions::speculation is on
  SpeculationStats speculation;                     // totals since start
};

// The most positions one sequence may use: --context, else the model's, at most 8192.
int64_t engine_context(const Model& model, const EngineOptions& o);

class Engine {
 public:
  // Runs the sequences on `slots` (runtime/sequence_slots.h), or on the CPU when null; at most
  // slots->slots() run at once.
  Engine(const Model& model, const EngineOptions& o, std::unique_ptr<SequenceSlots> slots = nullptr);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a request's n sequences, admitted together. Fails when it can never run
  // (RequestError naming the field: an empty prompt, a token outside the vocabulary, more
  // positions than the context or the KV cache holds, more choices than run at once or than the
  // KV cache holds side by side) or when the engine is shutting down (EngineStopped).
  std::shared_ptr<RequestStream> submit(GenerationRequest r);
  // Stops admitting, lets running and queued requests finish for up to `grace_s` seconds, then
  // cancels what is left and joins the loop.
  void shutdown(double grace_s);
  EngineStats stats() const;
  int64_t context() const { return context_; }
  int max_batch() const { return o_.max_batch; }
  bool speculating() const { return o_.speculation.method != "none"; }
  std::string describe() const { return slots_->describe(); }  // where the sequences run
  const Model& model() const { return model_; }

 private:
  struct Sequence;
  // The sequences of one request, admitted together.
  struct Group {
    std::vector<std::unique_ptr<Sequence>> seqs;
    int64_t reserved = 0;  // KV positions of all of them
  };
  void loop();
  // One step of every running sequence: the next prompt chunk or the last sampled token.
  void step_all();
  // k drafts after the sequence's last token (EngineOptions::speculation's method).
  std::vector<int32_t> drafts(Sequence& s, int k);
  // After a step that produced the sequence's next token: `drawn` when the backend sampled it
  // (SequenceSlots::Sample), else -1 and the host samples from the logits; stream, finish.
  void emit(Sequence& s, int32_t drawn);
  // After a verification step: the drafts the check accepts, then the token drawn in place of
  // the first rejected one or after the last; the rejected rows rewound.
  void emit_checked(Sequence& s);
  // Streams `token`, drawn from `logits` (its log-probabilities, when asked, from them), and ends
  // the sequence where it ends (Taken, speculative.h).
  Taken take(Sequence& s, int32_t token, std::span<const float> logits, int drafted = 0, bool accepted_draft = false);
  // Sends the end event and frees the sequence's KV positions (`locked`: mu_ is held).
  void finish(Sequence& s, Finish f, const std::string& error = "", bool locked = false);

  const Model& model_;
  EngineOptions o_;
  int64_t context_;
  std::unique_ptr<SequenceSlots> slots_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Group> waiting_;
  int waiting_seqs_ = 0;
  std::vector<std::unique_ptr<Sequence>> running_;
  int64_t kv_used_ = 0, prompt_tokens_ = 0, generated_tokens_ = 0, cached_tokens_ = 0;
  PrefixCacheStats prefix_;
  SpeculationStats speculation_;
  bool accepting_ = true, stop_ = false;
  std::thread thread_;
};

}  // namespace kestrel
