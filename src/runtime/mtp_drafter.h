// Speculative decoding with the model's own multi-token-prediction layer as the drafter
// (`--speculative mtp`, DeepSeek-V3/R1 and GLM-5 on the CPU): one sequence's MTP state beside its
// target KV cache. The MTP layer at position p reads the target's final normed hidden state h_p
// and the token at p + 1 and predicts the token at p + 2 (backend/cpu/forward.h, run_mtp).
//
// Its KV cache follows the target's: between checks it holds exactly the positions the target
// holds, each computed from the target's own hidden state there. The target's hidden states of
// the positions it ran since the last draft (the prompt, then each check's accepted tokens) wait
// here until the next draft, which first runs the MTP layer over them (the last with the token
// chosen after them, not run yet) and then chains: draft i + 1 comes from the layer's output
// after draft i, at the next position, with draft i as its token. The chained positions hold
// guesses, so they are dropped as soon as the drafts are made; the check that follows decides
// which drafts stay, and their positions are computed again, from the target's hidden states, at
// the next draft. Drafts are the MTP logits' argmax: a draft proposed with certainty, which
// Sampler::verify's rule checks exactly (the output keeps the target's distribution).
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "backend/cpu/forward.h"
#include "model/weights.h"
#include "parallel/layout.h"
#include "runtime/kv_cache.h"

namespace kestrel {

// Fails naming the model's config when it cannot draft with an MTP layer here: it has none, or
// it is split over ranks (--tp/--ep: not built yet).
void check_mtp_drafting(const Model& model, const Layout& layout);

class MtpDrafter {
 public:
  // `capacity`: the most positions of the sequence (the target cache's). A draft catches the
  // MTP layer up with the target `chunk` positions at a time, so a long prompt's first draft
  // needs the scratch of `chunk` positions, not of the whole prompt.
  static constexpr int64_t kCatchUpChunk = 256;
  MtpDrafter(cpu::Forward& fwd, const ModelConfig& c, int64_t capacity, int64_t chunk = kCatchUpChunk);

  // The target ran `tokens` at its next positions, with final normed hidden states `hidden`
  // [tokens, hidden] (Forward::run's `hidden`).
  void ran(std::span<const int32_t> tokens, const float* hidden);
  // The target dropped its positions from `position` on (the drafts a check rejected): always
  // past the MTP cache, whose last position was computed from the token at `position`.
  void rewind(int64_t position);
  // The target starts over at position 0.
  void reset();
  // k drafts of the tokens after `next`, the token at the target's next position (chosen, not
  // run yet). Afterwards the MTP cache holds the target's positions.
  std::vector<int32_t> draft(int32_t next, int k);

  // Position p holds the MTP layer's keys and values of (h_p, token p + 1): for tests.
  const KvCache& cache() const { return cache_; }

 private:
  cpu::Forward& fwd_;
  int64_t hidden_size_, vocab_, chunk_;
  KvCache cache_;
  std::vector<int32_t> tokens_;  // the target's tokens at positions [cache_.length(), its length)
  std::vector<float> hidden_;    // its hidden states there, a row each
  std::vector<float> out_, logits_;
};

}  // namespace kestrel
