#include "backend/cpu/forward.h"

#include <cmath>

#include "backend/cpu/attention.h"
#include "backend/cpu/linear.h"
#include "backend/cpu/moe.h"
#include "common/error.h"

namespace kestrel::cpu {

Forward::Forward(const Model& model, ThreadPool& pool)
    : model_(model), c_(model.config), pool_(pool), rope_(model.config.rope) {}

KvCache Forward::make_cache(int64_t capacity) const {
  return KvCache(c_.num_layers, c_.num_kv_heads, c_.head_dim, capacity);
}

void Forward::apply_linear(const Linear& W, const float* x, int64_t tokens, float* y) {
  if (observe_) observe_(W, x, tokens);
  linear(W, x, tokens, y, pool_);
}

void Forward::run(std::span<const int32_t> tokens, KvCache& cache, float* logits) {
  const int64_t T = int64_t(tokens.size()), H = c_.hidden_size, hd = c_.head_dim;
  const int64_t nq = c_.num_heads, nkv = c_.num_kv_heads, start = cache.length();
  if (T == 0) return;
  cache.check_room(T);
  for (int32_t id : tokens)
    if (id < 0 || id >= c_.vocab_size) fail("token id ", id, " is outside the vocabulary [0, ", c_.vocab_size, ")");
  const ModelWeights& w = model_.weights;

  std::vector<float> x(static_cast<size_t>(T * H)), xn(static_cast<size_t>(T * H)), tmp(static_cast<size_t>(T * H));
  std::vector<float> q(static_cast<size_t>(T * nq * hd)), k(static_cast<size_t>(T * nkv * hd)), v(static_cast<size_t>(T * nkv * hd)),
      att(size_t(T * nq * hd));
  for (int64_t t = 0; t < T; ++t) w.embed.dequant_row(tokens[size_t(t)], x.data() + t * H);

  const float scale = 1.0f / std::sqrt(float(hd));
  for (int64_t l = 0; l < c_.num_layers; ++l) {
    const LayerWeights& L = w.layers[size_t(l)];
    // Attention block.
    rms_norm(x.data(), L.attn_norm.data(), T, H, c_.rms_norm_eps, xn.data());
    apply_linear(L.q, xn.data(), T, q.data());
    apply_linear(L.k, xn.data(), T, k.data());
    apply_linear(L.v, xn.data(), T, v.data());
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
    attention(q.data(), T, start, nq, nkv, hd, scale, cache, l, att.data(), pool_);
    apply_linear(L.o, att.data(), T, tmp.data());
    for (int64_t i = 0; i < T * H; ++i) x[size_t(i)] += tmp[size_t(i)];

    // Feed-forward block.
    rms_norm(x.data(), L.ffn_norm.data(), T, H, c_.rms_norm_eps, xn.data());
    const LinearObserver* obs = observe_ ? &observe_ : nullptr;
    if (L.is_moe) moe_forward(c_, L.moe, xn.data(), T, tmp.data(), pool_, obs);
    else gated_ffn(L.mlp, xn.data(), T, tmp.data(), pool_, obs);
    for (int64_t i = 0; i < T * H; ++i) x[size_t(i)] += tmp[size_t(i)];
  }
  cache.commit(T);
  if (!logits) return;
  rms_norm(x.data(), w.final_norm.data(), T, H, c_.rms_norm_eps, xn.data());
  apply_linear(w.lm_head, xn.data(), T, logits);
}

}  // namespace kestrel::cpu
