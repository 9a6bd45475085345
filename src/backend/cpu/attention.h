// Causal grouped-query attention of new tokens against a sequence's KV cache.
#pragma once
#include <cstdint>

#include "common/thread_pool.h"
#include "runtime/kv_cache.h"

namespace kestrel::cpu {

// q: [tokens, heads, head_dim] for positions start..start+tokens-1, whose keys and values are
// already in the cache. out: [tokens, heads, head_dim].
void attention(const float* q, int64_t tokens, int64_t start, int64_t heads, int64_t kv_heads, int64_t head_dim,
               float scale, const KvCache& cache, int64_t layer, float* out, ThreadPool& pool);

}  // namespace kestrel::cpu
