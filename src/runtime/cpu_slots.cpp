#include <algorithm>

#include "backend/cpu/forward.h"
#include "common/error.h"
#include "runtime/kv_cache.h"
#include "runtime/sequence_slots.h"

namespace kestrel {
namespace {

class CpuSlots final : public SequenceSlots {
 public:
  CpuSlots(const Model& m, int slots, int threads, const Layout& layout, int64_t kv_positions, bool prefix_cache)
      : pool_(threads), fwd_(m, pool_, layout), caches_(size_t(slots)), chains_(size_t(slots)), vocab_(m.config.vocab_size),
        layout_(layout) {
    if (!fwd_.split())
      blocks_ = std::make_shared<KvBlockPool>(m.config.num_layers, fwd_.kv_layout(), KvBlockPool::blocks_for(kv_positions),
                                              prefix_cache);
  }

  int slots() const override { return int(caches_.size()); }
  int64_t max_chunk() const override { return INT64_MAX; }

  Opened open(int64_t positions, std::span<const int32_t> prompt) override {
    for (size_t i = 0; i < caches_.size(); ++i)
      if (!caches_[i]) {
        if (!blocks_) {
          caches_[i] = std::make_unique<KvCache>(fwd_.make_cache(positions));
          return {int(i), 0};
        }
        std::vector<uint64_t> hashes;
        const std::vector<int32_t> cached = blocks_->with_ids([&](KvBlocks& ids) {
          return ids.match(prompt, (int64_t(prompt.size()) - 1) / KvBlocks::kBlock, &hashes);
        });
        caches_[i] = std::make_unique<KvCache>(blocks_, positions);
        caches_[i]->adopt(cached);
        chains_[i].start(prompt, hashes);
        return {int(i), caches_[i]->length()};
      }
    fail("internal: no free sequence slot of ", caches_.size());
  }
  void close(int slot) override { caches_.at(size_t(slot)).reset(); }
  bool prefix_cache() const override {
    return blocks_ && blocks_->with_ids([](KvBlocks& ids) { return ids.prefix_cache(); });
  }
  PrefixCacheStats prefix_stats() const override {
    return blocks_ ? blocks_->with_ids([](KvBlocks& ids) { return ids.stats(); }) : PrefixCacheStats{};
  }

  void run(std::span<const Job> jobs) override {
    for (const Job& j : jobs) {
      KvCache& cache = *caches_.at(size_t(j.slot));
      if (!j.logits || j.tokens.size() == 1 || j.all_logits) {
        fwd_.run(j.tokens, cache, j.logits);  // the forward pass writes every token's logits
      } else {
        all_.resize(j.tokens.size() * size_t(vocab_));
        fwd_.run(j.tokens, cache, all_.data());
        std::copy(all_.end() - vocab_, all_.end(), j.logits);
      }
      // A verification's blocks are published by the rewind that follows it.
      if (blocks_)
        blocks_->with_ids(
            [&](KvBlocks& ids) { chains_[size_t(j.slot)].wrote(j.tokens, cache.block_ids(), ids, !j.all_logits); });
    }
  }

  bool can_verify() const override { return true; }
  void rewind(int slot, int64_t position) override {
    KvCache& cache = *caches_.at(size_t(slot));
    cache.truncate(position);
    if (blocks_)
      blocks_->with_ids([&](KvBlocks& ids) {
        PrefixChain& chain = chains_[size_t(slot)];
        chain.rewind(size_t(cache.length()));
        chain.publish(cache.block_ids(), ids);
      });
  }
  int64_t kv_blocks_held() const override {
    return blocks_ ? blocks_->with_ids([](KvBlocks& ids) { return ids.held(); }) : -1;
  }

  std::string describe() const override {
    return "cpu, " + std::to_string(pool_.size()) + " threads" + (layout_.split() ? ", " + layout_.str() + " over threads" : "");
  }

 private:
  ThreadPool pool_;
  cpu::Forward fwd_;
  std::shared_ptr<KvBlockPool> blocks_;  // shared by the sequences' caches (unsplit models)
  std::vector<std::unique_ptr<KvCache>> caches_;
  std::vector<PrefixChain> chains_;  // per slot
  int64_t vocab_;
  Layout layout_;
  std::vector<float> all_;
};

}  // namespace

std::unique_ptr<SequenceSlots> make_cpu_slots(const Model& model, int slots, int threads, const Layout& layout,
                                              int64_t kv_positions, bool prefix_cache) {
  return std::make_unique<CpuSlots>(model, slots, threads, layout, kv_positions, prefix_cache);
}

}  // namespace kestrel
