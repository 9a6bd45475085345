// Multi-head latent attention (DeepSeek-V3, Kimi-K2, GLM-5) and GLM-5's sparse-attention indexer,
// in the plain form the reference computes: the cached latents are expanded into per-head keys and
// values with kv_b_proj, then ordinary softmax attention runs over the selected positions.
#pragma once
#include <cstdint>
#include <vector>

#include "backend/cpu/linear.h"
#include "backend/cpu/ops.h"
#include "common/thread_pool.h"
#include "model/weights.h"
#include "runtime/kv_cache.h"

namespace kestrel::cpu {

// The positions each token of the current run attends to under DeepSeek sparse attention, in
// ascending order. An empty row means every position up to the token's own.
struct Selection {
  std::vector<std::vector<int32_t>> rows;
};

// Scores every cached position for each of the T tokens with the layer's indexer (storing the
// tokens' indexer keys in the cache first) and keeps the index_topk best (ties: the earlier position).
// q_latent: the normed q latent [T, q_lora_rank]; xn: the normed hidden state [T, hidden].
void select_positions(const ModelConfig& c, const IndexerWeights& w, int64_t layer, const float* xn,
                      const float* q_latent, int64_t T, int64_t start, KvCache& cache, const RopeTables& rope,
                      Selection& selection, ThreadPool& pool, const LinearObserver* observe = nullptr);

// The attention block of an MLA layer for T tokens at positions start..start+T-1: appends each
// token's latent to the cache and writes o_proj(attention) to out [T, hidden]. Layers with their own
// indexer refill `selection`; layers that reuse an earlier layer's selection read it.
void mla_attention(const ModelConfig& c, const LayerWeights& L, int64_t layer, const float* xn, int64_t T,
                   int64_t start, KvCache& cache, const RopeTables& rope, const RopeTables& index_rope,
                   Selection& selection, float* out, ThreadPool& pool, const LinearObserver* observe = nullptr);

}  // namespace kestrel::cpu
