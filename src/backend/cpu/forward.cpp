#include "backend/cpu/forward.h"

#include <cmath>

#include "backend/cpu/attention.h"
#include "backend/cpu/linear.h"
#include "backend/cpu/mla.h"
#include "backend/cpu/moe.h"
#include "common/error.h"

namespace kestrel::cpu {
namespace {

RopeTables index_rope_of(const ModelConfig& c) {
  RopeTables t(c.rope);
  t.interleaved = c.indexer.rope_interleaved;
  return t;
}

}  // namespace

Forward::Forward(const Model& model, ThreadPool& pool)
    : model_(model), c_(model.config), pool_(pool), rope_(model.config.rope), index_rope_(index_rope_of(model.config)) {}

KvCache Forward::make_cache(int64_t capacity) const {
  if (!c_.is_mla()) return KvCache(c_.num_layers, c_.num_kv_heads, c_.head_dim, capacity);
  KvLayout layout{c_.mla.latent(), 0, 0, {}};
  if (c_.indexer.enabled()) {
    layout.index_row = c_.indexer.head_dim;
    layout.index_layer = c_.indexer.own;
  }
  return KvCache(c_.num_layers, layout, capacity);
}

void Forward::gqa_attention(const LayerWeights& L, int64_t l, const float* xn, int64_t T, int64_t start,
                            KvCache& cache, float* out) {
  const LinearObserver* obs = observe_ ? &observe_ : nullptr;
  const int64_t hd = c_.head_dim, nq = c_.num_heads, nkv = c_.num_kv_heads;
  std::vector<float> q(static_cast<size_t>(T * nq * hd)), k(static_cast<size_t>(T * nkv * hd)),
      v(static_cast<size_t>(T * nkv * hd)), att(static_cast<size_t>(T * nq * hd));
  linear(L.q, xn, T, q.data(), pool_, obs);
  linear(L.k, xn, T, k.data(), pool_, obs);
  linear(L.v, xn, T, v.data(), pool_, obs);
  if (c_.qk_norm) {
    rms_norm(q.data(), L.q_norm.data(), T * nq, hd, c_.rms_norm_eps, q.data());
    rms_norm(k.data(), L.k_norm.data(), T * nkv, hd, c_.rms_norm_eps, k.data());
  }
  for (int64_t t = 0; t < T; ++t) {
    apply_rope(q.data() + t * nq * hd, nq, hd, start + t, rope_);
    apply_rope(k.data() + t * nkv * hd, nkv, hd, start + t, rope_);
    std::copy_n(k.data() + t * nkv * hd, nkv * hd, cache.k(l, start + t));
    std::copy_n(v.data() + t * nkv * hd, nkv * hd, cache.v(l, start + t));
  }
  attention(q.data(), T, start, nq, nkv, hd, 1.0f / std::sqrt(float(hd)), cache, l, att.data(), pool_);
  linear(L.o, att.data(), T, out, pool_, obs);
}

void Forward::run(std::span<const int32_t> tokens, KvCache& cache, float* logits) {
  const int64_t T = int64_t(tokens.size()), H = c_.hidden_size, start = cache.length();
  if (T == 0) return;
  cache.check_room(T);
  for (int32_t id : tokens)
    if (id < 0 || id >= c_.vocab_size) fail("token id ", id, " is outside the vocabulary [0, ", c_.vocab_size, ")");
  const ModelWeights& w = model_.weights;

  std::vector<float> x(static_cast<size_t>(T * H)), xn(static_cast<size_t>(T * H)), tmp(static_cast<size_t>(T * H));
  for (int64_t t = 0; t < T; ++t) w.embed.dequant_row(tokens[size_t(t)], x.data() + t * H);

  const LinearObserver* obs = observe_ ? &observe_ : nullptr;
  Selection selection;  // DSA: carried from a layer that selects to the layers that reuse it
  for (int64_t l = 0; l < c_.num_layers; ++l) {
    const LayerWeights& L = w.layers[size_t(l)];
    rms_norm(x.data(), L.attn_norm.data(), T, H, c_.rms_norm_eps, xn.data());
    if (c_.is_mla()) mla_attention(c_, L, l, xn.data(), T, start, cache, rope_, index_rope_, selection, tmp.data(), pool_, obs);
    else gqa_attention(L, l, xn.data(), T, start, cache, tmp.data());
    for (int64_t i = 0; i < T * H; ++i) x[size_t(i)] += tmp[size_t(i)];

    rms_norm(x.data(), L.ffn_norm.data(), T, H, c_.rms_norm_eps, xn.data());
    if (L.is_moe) moe_forward(c_, L.moe, xn.data(), T, tmp.data(), pool_, obs);
    else gated_ffn(L.mlp, xn.data(), T, tmp.data(), pool_, obs);
    for (int64_t i = 0; i < T * H; ++i) x[size_t(i)] += tmp[size_t(i)];
  }
  cache.commit(T);
  if (!logits) return;
  rms_norm(x.data(), w.final_norm.data(), T, H, c_.rms_norm_eps, xn.data());
  linear(w.lm_head, xn.data(), T, logits, pool_, obs);
}

}  // namespace kestrel::cpu
