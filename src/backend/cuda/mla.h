// Multi-head latent attention for decode, in the absorbed form: the cache holds one latent row per
// position (kv_lora_rank normed values, then qk_rope_head_dim rotated key values), each head's
// query is carried into latent space through its slice of kv_b_proj (W_UK), attention runs over the
// latent rows as a single shared KV head, and the result is carried back out through W_UV. Plus the
// DSA indexer of GLM-5: scores of every cached position, top-k selection on the device.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/attention.h"
#include "backend/cuda/dlinear.h"
#include "backend/cuda/norm_rope.h"

namespace kestrel::cuda {

struct MlaShape {
  int heads = 0, nope = 0, rope = 0, v = 0, rank = 0;  // rank: kv_lora_rank
  __host__ __device__ int latent() const { return rank + rope; }
};

// kv: [B, latent] from kv_a_proj_with_mqa. Normalizes the first `rank` values (RMSNorm with
// `norm`), rotates the rest at positions[b], and stores the row in the cache (one KV head of
// `latent` floats per position).
void launch_mla_latent_store(const float* kv, int batch, const MlaShape& m, const float* norm, float eps,
                             const RopeArgs& rope, const int32_t* positions, KvLayer cache, cudaStream_t s);

// q: [B, heads, nope + rope]. q_latent[b, h] = [q_nope W_UK_h (rank values) | rotated q_rope] with
// W_UK_h = rows h * (nope + v) .. + nope of kv_b ([heads * (nope + v), rank], BF16).
void launch_mla_query(const float* q, int batch, const MlaShape& m, const DLinear& kv_b, const RopeArgs& rope,
                      const int32_t* positions, float* q_latent, cudaStream_t s);

// Sparse attention (DSA): row b attends to the count[b] positions index[b * stride ..] only.
struct AttentionSelect {
  const int32_t* index = nullptr;  // null: every position 0..positions[b]
  const int32_t* count = nullptr;
  int stride = 0;
};

// Attention of every head over the latent rows of its sequence (keys: the whole row; values: the
// first rank values), split over positions as decode attention is (`attention_split`: chunks of
// 16 positions measured slower on the H200 at GLM-5's shape, the per-block start-up dominating);
// a block serves 8 heads so each row is read once per 8 heads. q_latent: [B, heads, latent];
// out: [B, heads, rank].
void launch_mla_attention(const float* q_latent, int batch, const MlaShape& m, float scale, const int32_t* positions,
                          KvLayer cache, const AttentionSplit& split, AttentionSelect select, float* scratch,
                          float* out, cudaStream_t s);

// att: [B, heads, rank] (attention over the latent rows).
// out[b, h * v + e] = att[b, h] . W_UV_h[e] with W_UV_h = rows h * (nope + v) + nope .. + v.
void launch_mla_output(const float* att, int batch, const MlaShape& m, const DLinear& kv_b, float* out, cudaStream_t s);

struct IndexerShape {
  int heads = 0, dim = 0, rope = 0, topk = 0;
};

// iq: [B, heads, dim] rotated in place (first `rope` values); ik: [B, dim] LayerNorm-ed with
// (w, b, eps 1e-6), rotated and stored in the index cache at positions[b].
void launch_index_prep(float* iq, const float* ik, int batch, const IndexerShape& x, const float* norm_w,
                       const float* norm_b, const RopeArgs& rope, const int32_t* positions, KvLayer index_cache,
                       cudaStream_t s);

// scores[b, j] for j <= positions[b]: sum_h iw[b, h] / sqrt(heads) * relu(iq[b, h] . key_j / sqrt(dim)).
void launch_index_scores(const float* iq, const float* iw, int batch, const IndexerShape& x,
                         const int32_t* positions, KvLayer index_cache, int max_context, float* scores,
                         cudaStream_t s);

// The topk best positions of scores[b, 0..positions[b]] (ties: the earlier position), ascending,
// into select[b * topk ..], and their number (min(topk, positions[b] + 1)) into count[b].
void launch_topk_select(const float* scores, int batch, int max_context, int topk, const int32_t* positions,
                        int32_t* select, int32_t* count, cudaStream_t s);

}  // namespace kestrel::cuda
