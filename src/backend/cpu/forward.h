// The forward pass of every supported family on the CPU: the reference the other backends are
// checked against. float32 activations and accumulation; weights dequantized on the fly.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "backend/cpu/linear.h"
#include "backend/cpu/mla.h"
#include "backend/cpu/ops.h"
#include "common/thread_pool.h"
#include "model/weights.h"
#include "parallel/communicator.h"
#include "parallel/layout.h"
#include "runtime/kv_cache.h"

namespace kestrel::cpu {

// What the KV cache holds per position and layer for a model of this configuration.
KvLayout kv_layout_of(const ModelConfig& c);

class Forward {
 public:
  // A split `layout` runs the model's ranks (parallel/shard.h) on threads of their own that talk
  // through thread communicators: the CPU twin of a multi-GPU split, with the same collectives.
  Forward(const Model& model, ThreadPool& pool, const Layout& layout = {});
  ~Forward();

  // A KV cache sized for this model (one per rank when split).
  KvCache make_cache(int64_t capacity) const;
  // What a position holds per layer (unsplit models: the layout of a shared KvBlockPool).
  KvLayout kv_layout() const;
  bool split() const { return split_ != nullptr; }

  // Runs `tokens` at the positions after those already in `cache` (all at once: the prefill
  // path; one at a time: the decode path), appends their keys and values, and writes the logits
  // of every token to `logits` ([tokens, vocab]) when it is not null, and the final normed
  // hidden states (what the LM head reads, [tokens, hidden]) to `hidden` when it is not null.
  void run(std::span<const int32_t> tokens, KvCache& cache, float* logits, float* hidden = nullptr);

  // Multi-token prediction with MTP layer `k` (unsplit models). A cache of one layer, its own.
  KvCache make_mtp_cache(int64_t capacity, size_t k = 0) const;
  // Runs the MTP layer at the positions after those already in `cache`: `hidden` [T, hidden] are
  // the main model's final normed hidden states at those positions, `next` [T] the token that
  // follows each position. Writes the MTP logits ([T, vocab], predictions two tokens ahead) to
  // `logits` unless null, and the layer's output normed by shared_head.norm (what its head reads,
  // [T, hidden]) to `out` unless null: the `hidden` of a draft chained after this one.
  void run_mtp(std::span<const int32_t> next, const float* hidden, KvCache& cache, float* logits, size_t k = 0,
               float* out = nullptr);
  // The MTP head over `T` rows of run_mtp's `out`: logits [T, vocab].
  void mtp_logits(const float* out, int64_t T, float* logits, size_t k = 0);

  // Shows every later run's linear inputs to `observe` (calibration); an empty function stops it.
  // Costs nothing while unset.
  void set_observer(LinearObserver observe);

 private:
  struct Split;
  // One rank of a split model: `shard` is its part, `comm` reaches the other ranks.
  Forward(const Model& shard, ThreadPool& pool, Communicator* comm);
  // The forward pass of the whole model or of one rank.
  void run_rank(std::span<const int32_t> tokens, KvCache& cache, float* logits, float* hidden);
  const MtpLayer& mtp_layer(size_t k) const;  // fails when there is none or the model is split
  // One decoder layer on the residual stream x [T, hidden]; `l` is the layer's slot in `cache`.
  // xn and tmp are scratch of the same size.
  void decoder_layer(const LayerWeights& L, int64_t l, float* x, float* xn, float* tmp, int64_t T, int64_t start,
                     KvCache& cache, Selection& selection);
  // The ranks' LM head rows -> every rank's logits [tokens, vocab].
  void gather_logits(const float* local, int64_t tokens, float* logits);

  // GQA attention block of one layer: appends the tokens' keys and values, writes o_proj(attention).
  void gqa_attention(const LayerWeights& L, int64_t layer, const float* xn, int64_t T, int64_t start, KvCache& cache,
                     float* out);

  const Model& model_;
  const ModelConfig& c_;
  ThreadPool& pool_;
  RopeTables rope_;
  RopeTables index_rope_;  // the DSA indexer's rotary (its own interleaving)
  LinearObserver observe_;
  Communicator* comm_ = nullptr;  // a rank of a split model
  std::unique_ptr<Split> split_;  // a split model: its ranks
};

}  // namespace kestrel::cpu
