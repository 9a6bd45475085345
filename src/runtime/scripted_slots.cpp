#include "runtime/scripted_slots.h"

namespace kestrel {

ScriptedSlots::ScriptedSlots(std::unique_ptr<SequenceSlots> inner, int64_t vocab, int32_t eos, std::vector<int32_t> script)
    : inner_(std::move(inner)), vocab_(size_t(vocab)), eos_(eos), by_slot_(size_t(inner_->slots())) {
  set_script(std::move(script));
}

void ScriptedSlots::set_script(std::vector<int32_t> script) {
  std::lock_guard<std::mutex> lock(mu_);
  current_ = std::make_shared<const std::vector<int32_t>>(std::move(script));
}

SequenceSlots::Opened ScriptedSlots::open(int64_t positions, std::span<const int32_t> prompt) {
  const Opened o = inner_->open(positions, prompt);
  if (o.slot >= 0) {
    std::lock_guard<std::mutex> lock(mu_);
    by_slot_.at(size_t(o.slot)) = current_;
  }
  return o;
}

void ScriptedSlots::close(int slot) {
  by_slot_.at(size_t(slot)).reset();
  inner_->close(slot);
}

void ScriptedSlots::run(std::span<const Job> jobs) {
  std::vector<Job> js(jobs.begin(), jobs.end());
  std::vector<float> scratch(js.size() * vocab_);
  for (size_t i = 0; i < js.size(); ++i) {
    if (!js[i].sample) continue;
    const auto& script = by_slot_.at(size_t(js[i].slot));
    const uint64_t k = js[i].sample->draw;
    *js[i].sample->token = script && k < script->size() ? (*script)[k] : eos_;
    js[i].logits = scratch.data() + i * vocab_;  // a backend that draws leaves the caller's logits alone
  }
  inner_->run(js);
}

}  // namespace kestrel
