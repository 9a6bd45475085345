// For tests only: what a server makes of generated text (tool calls, reasoning, stop strings) on
// a fixture model whose own text is noise. The CPU slots run the model as usual, but every token
// the engine lets the backend draw (a request without log-probabilities) is the next of a script,
// the same for every sequence, then the end-of-sequence token. `kestrel serve
// --test-scripted-reply TEXT` and the server tests use it; it has no place in real serving.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "runtime/sequence_slots.h"

namespace kestrel {

class ScriptedSlots final : public SequenceSlots {
 public:
  ScriptedSlots(std::unique_ptr<SequenceSlots> inner, int64_t vocab, int32_t eos, std::vector<int32_t> script);
  // The script of the sequences that start generating from now on (any thread).
  void set_script(std::vector<int32_t> script);

  int slots() const override { return inner_->slots(); }
  int64_t max_chunk() const override { return inner_->max_chunk(); }
  Opened open(int64_t positions, std::span<const int32_t> prompt) override;
  void close(int slot) override;
  bool prefix_cache() const override { return inner_->prefix_cache(); }
  PrefixCacheStats prefix_stats() const override { return inner_->prefix_stats(); }
  void run(std::span<const Job> jobs) override;
  // The script stands in for the backend's draws, which a verification does not offer: no
  // speculation over scripted replies.
  bool can_verify() const override { return false; }
  int64_t kv_blocks_held() const override { return inner_->kv_blocks_held(); }
  std::string describe() const override { return inner_->describe() + ", scripted replies (a test)"; }

 private:
  std::unique_ptr<SequenceSlots> inner_;
  size_t vocab_;
  int32_t eos_;
  std::mutex mu_;
  std::shared_ptr<const std::vector<int32_t>> current_;  // under mu_
  std::vector<std::shared_ptr<const std::vector<int32_t>>> by_slot_;  // what each open slot follows (engine thread)
};

}  // namespace kestrel
