// Mixture-of-experts feed-forward: routing (which experts, with what weights) and the weighted
// sum of the selected experts' outputs.
#pragma once
#include <cstdint>
#include <vector>

#include "backend/cpu/linear.h"
#include "common/thread_pool.h"
#include "model/model_config.h"
#include "model/weights.h"

namespace kestrel::cpu {

struct Routing {
  std::vector<int32_t> experts;  // [tokens, top_k]
  std::vector<float> weights;    // [tokens, top_k]
};

// Selects experts for each token from router logits [tokens, num_experts], as the family's
// router does (softmax or sigmoid with correction bias, group-limited top-k, renormalization,
// routed scaling).
Routing route(const ModelConfig& c, const float* logits, int64_t tokens, const std::vector<float>& correction_bias);

// out[t] = sum over selected experts of weight * expert(x[t]) (+ shared experts). x, out: [tokens, hidden].
// `observe`, when given, sees the input of every linear applied.
void moe_forward(const ModelConfig& c, const MoeWeights& w, const float* x, int64_t tokens, float* out,
                 ThreadPool& pool, const LinearObserver* observe = nullptr);

// out = down(silu(gate x) * up x) for `tokens` rows.
void gated_ffn(const GatedFfn& f, const float* x, int64_t tokens, float* out, ThreadPool& pool,
               const LinearObserver* observe = nullptr);

}  // namespace kestrel::cpu
