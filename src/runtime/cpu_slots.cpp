#include <algorithm>

#include "backend/cpu/forward.h"
#include "common/error.h"
#include "runtime/kv_cache.h"
#include "runtime/sequence_slots.h"

namespace kestrel {
namespace {

class CpuSlots final : public SequenceSlots {
 public:
  CpuSlots(const Model& m, int slots, int threads, const Layout& layout, int64_t kv_positions)
      : pool_(threads), fwd_(m, pool_, layout), caches_(size_t(slots)), vocab_(m.config.vocab_size), layout_(layout) {
    if (!fwd_.split())
      blocks_ = std::make_shared<KvBlockPool>(m.config.num_layers, fwd_.kv_layout(), KvBlockPool::blocks_for(kv_positions));
  }

  int slots() const override { return int(caches_.size()); }
  int64_t max_chunk() const override { return INT64_MAX; }

  int open(int64_t positions) override {
    for (size_t i = 0; i < caches_.size(); ++i)
      if (!caches_[i]) {
        caches_[i] = blocks_ ? std::make_unique<KvCache>(blocks_, positions)
                             : std::make_unique<KvCache>(fwd_.make_cache(positions));
        return int(i);
      }
    fail("internal: no free sequence slot of ", caches_.size());
  }
  void close(int slot) override { caches_.at(size_t(slot)).reset(); }

  void run(std::span<const Job> jobs) override {
    for (const Job& j : jobs) {
      KvCache& cache = *caches_.at(size_t(j.slot));
      if (!j.logits || j.tokens.size() == 1) {
        fwd_.run(j.tokens, cache, j.logits);
        continue;
      }
      all_.resize(j.tokens.size() * size_t(vocab_));
      fwd_.run(j.tokens, cache, all_.data());
      std::copy(all_.end() - vocab_, all_.end(), j.logits);
    }
  }

  std::string describe() const override {
    return "cpu, " + std::to_string(pool_.size()) + " threads" + (layout_.split() ? ", " + layout_.str() + " over threads" : "");
  }

 private:
  ThreadPool pool_;
  cpu::Forward fwd_;
  std::shared_ptr<KvBlockPool> blocks_;  // shared by the sequences' caches (unsplit models)
  std::vector<std::unique_ptr<KvCache>> caches_;
  int64_t vocab_;
  Layout layout_;
  std::vector<float> all_;
};

}  // namespace

std::unique_ptr<SequenceSlots> make_cpu_slots(const Model& model, int slots, int threads, const Layout& layout,
                                              int64_t kv_positions) {
  return std::make_unique<CpuSlots>(model, slots, threads, layout, kv_positions);
}

}  // namespace kestrel
