#include <algorithm>

#include "backend/cpu/forward.h"
#include "common/error.h"
#include "runtime/kv_cache.h"
#include "runtime/mtp_drafter.h"
#include "runtime/sequence_slots.h"

namespace kestrel {
namespace {

class CpuSlots final : public SequenceSlots {
 public:
  CpuSlots(const Model& m, int slots, int threads, const Layout& layout, int64_t kv_positions, bool prefix_cache,
           bool mtp_drafts)
      : pool_(threads), fwd_(m, pool_, layout), caches_(size_t(slots)), chains_(size_t(slots)), drafters_(size_t(slots)),
        config_(m.config), layout_(layout), mtp_(mtp_drafts) {
    if (mtp_) check_mtp_drafting(m, layout);
    // With MTP drafters prompts run whole, without the prefix cache: the MTP layer needs the
    // target's hidden state at every position, and cached blocks keep none.
    if (!fwd_.split())
      blocks_ = std::make_shared<KvBlockPool>(m.config.num_layers, fwd_.kv_layout(), KvBlockPool::blocks_for(kv_positions),
                                              prefix_cache && !mtp_);
  }

  int slots() const override { return int(caches_.size()); }
  int64_t max_chunk() const override { return INT64_MAX; }

  Opened open(int64_t positions, std::span<const int32_t> prompt) override {
    for (size_t i = 0; i < caches_.size(); ++i)
      if (!caches_[i]) {
        if (mtp_) drafters_[i] = std::make_unique<MtpDrafter>(fwd_, config_, positions);
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
  void close(int slot) override {
    caches_.at(size_t(slot)).reset();
    drafters_.at(size_t(slot)).reset();
  }
  bool prefix_cache() const override {
    return blocks_ && blocks_->with_ids([](KvBlocks& ids) { return ids.prefix_cache(); });
  }
  PrefixCacheStats prefix_stats() const override {
    return blocks_ ? blocks_->with_ids([](KvBlocks& ids) { return ids.stats(); }) : PrefixCacheStats{};
  }

  void run(std::span<const Job> jobs) override {
    const int64_t V = config_.vocab_size;
    for (const Job& j : jobs) {
      KvCache& cache = *caches_.at(size_t(j.slot));
      MtpDrafter* drafter = drafters_.at(size_t(j.slot)).get();
      float* hidden = nullptr;  // what the MTP drafter reads
      if (drafter) {
        hidden_.resize(j.tokens.size() * size_t(config_.hidden_size));
        hidden = hidden_.data();
      }
      if (!j.logits || j.tokens.size() == 1 || j.all_logits) {
        fwd_.run(j.tokens, cache, j.logits, hidden);  // the forward pass writes every token's logits
      } else {
        all_.resize(j.tokens.size() * size_t(V));
        fwd_.run(j.tokens, cache, all_.data(), hidden);
        std::copy(all_.end() - V, all_.end(), j.logits);
      }
      if (drafter) drafter->ran(j.tokens, hidden);
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
    if (MtpDrafter* drafter = drafters_.at(size_t(slot)).get()) drafter->rewind(position);
    if (blocks_)
      blocks_->with_ids([&](KvBlocks& ids) {
        PrefixChain& chain = chains_[size_t(slot)];
        chain.rewind(size_t(cache.length()));
        chain.publish(cache.block_ids(), ids);
      });
  }
  bool can_draft_mtp() const override { return mtp_; }
  std::vector<int32_t> draft_mtp(int slot, int32_t next, int k) override {
    MtpDrafter* drafter = drafters_.at(size_t(slot)).get();
    return drafter ? drafter->draft(next, k) : SequenceSlots::draft_mtp(slot, next, k);
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
  std::vector<std::unique_ptr<MtpDrafter>> drafters_;  // per slot, with mtp_
  const ModelConfig& config_;
  Layout layout_;
  bool mtp_;
  std::vector<float> all_, hidden_;
};

}  // namespace

std::unique_ptr<SequenceSlots> make_cpu_slots(const Model& model, int slots, int threads, const Layout& layout,
                                              int64_t kv_positions, bool prefix_cache, bool mtp_drafts) {
  return std::make_unique<CpuSlots>(model, slots, threads, layout, kv_positions, prefix_cache, mtp_drafts);
}

}  // namespace kestrel
