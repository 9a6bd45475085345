// The engine loop of a server: requests (token ids in, token ids out) join a running set between
// steps (continuous batching), prompts are prefilled in chunks so that a long prompt does not
// stall the sequences already decoding, and admission is bounded by the KV cache: a request
// reserves prompt + max_tokens positions, waits while they are not free, and is refused at once
// when it could never fit. Every step advances every running sequence (sequence_slots.h: one
// after another on the CPU, one batched decode step on the GPU); each has its own KV cache and
// sampler, so a request yields the same tokens alone or among many (on the GPU to rounding).
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
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

namespace kestrel {

struct EngineOptions {
  int max_batch = 16;          // sequences running at once
  int64_t kv_tokens = 0;       // KV positions shared by all running sequences (0: 32 x context)
  int64_t context = 0;         // most positions one sequence may use (0: the model's, capped at 8192)
  int prefill_chunk = 64;      // prompt tokens run per sequence and step
  int threads = 0;             // CPU threads (0: all cores)
  Layout layout;               // the model split over threads (parallel/layout.h)
};

struct GenerationRequest {
  std::vector<int32_t> prompt;
  int max_tokens = 16;
  SamplerOptions sampling;
  int top_logprobs = -1;  // -1: no log-probabilities; n >= 0: the chosen token's and the n best
  bool ignore_eos = false;
};

enum class Finish { None, Length, Eos, Cancelled, Error };

struct TokenLogprob {
  int32_t token;
  float logprob;
};

// One event of a request's stream: a token, or the end (finish != None) with no token.
struct TokenEvent {
  int32_t token = -1;
  float logprob = 0.0f;
  std::vector<TokenLogprob> top;  // best alternatives, most likely first
  Finish finish = Finish::None;
  std::string error;              // with Finish::Error
};

// The consumer side of one request. next() blocks for the next event; cancel() ends the request
// at the next step and frees its KV positions (a client that went away).
class RequestStream {
 public:
  bool next(TokenEvent& e);  // false once the end event has been taken
  void cancel() { cancelled_ = true; }
  bool cancelled() const { return cancelled_; }
  void push(TokenEvent e);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<TokenEvent> events_;
  bool ended_ = false;
  std::atomic<bool> cancelled_{false};
};

// submit() on an engine that is shutting down (a server answers 503, not 400).
class EngineStopped : public Error {
 public:
  EngineStopped() : Error("the server is shutting down") {}
};

struct EngineStats {
  int running = 0, waiting = 0;
  int64_t kv_used = 0, kv_capacity = 0;
  int64_t prompt_tokens = 0, generated_tokens = 0;  // totals since start
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

  // Queues a request. Fails (kestrel::Error, a message for the client) when it can never run:
  // an empty prompt, a token outside the vocabulary, more positions than the context or the KV
  // cache holds, or an engine that is shutting down.
  std::shared_ptr<RequestStream> submit(GenerationRequest r);
  // Stops admitting, lets running and queued requests finish for up to `grace_s` seconds, then
  // cancels what is left and joins the loop.
  void shutdown(double grace_s);
  EngineStats stats() const;
  int64_t context() const { return context_; }
  std::string describe() const { return slots_->describe(); }  // where the sequences run
  const Model& model() const { return model_; }

 private:
  struct Sequence;
  void loop();
  // One step of every running sequence: the next prompt chunk or the last sampled token.
  void step_all();
  // After a step that produced the sequence's next-token logits: sample, stream, finish.
  void emit(Sequence& s, const std::vector<float>& logits);
  // Sends the end event and frees the sequence's KV positions (`locked`: mu_ is held).
  void finish(Sequence& s, Finish f, const std::string& error = "", bool locked = false);

  const Model& model_;
  EngineOptions o_;
  int64_t context_;
  std::unique_ptr<SequenceSlots> slots_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::vector<std::unique_ptr<Sequence>> running_;
  int64_t kv_used_ = 0, prompt_tokens_ = 0, generated_tokens_ = 0;
  bool accepting_ = true, stop_ = false;
  std::thread thread_;
};

}  // namespace kestrel
