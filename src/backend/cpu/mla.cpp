#include "backend/cpu/mla.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "backend/cpu/linear.h"

namespace kestrel::cpu {

void select_positions(const ModelConfig& c, const IndexerWeights& w, int64_t layer, const float* xn,
                      const float* q_latent, int64_t T, int64_t start, KvCache& cache, const RopeTables& rope,
                      Selection& selection, ThreadPool& pool, const LinearObserver* observe) {
  const IndexerConfig& ix = c.indexer;
  const int64_t nh = ix.heads, d = ix.head_dim;
  std::vector<float> q(static_cast<size_t>(T * nh * d)), k(static_cast<size_t>(T * d)), wts(static_cast<size_t>(T * nh));
  linear(w.wq_b, q_latent, T, q.data(), pool, observe);
  linear(w.wk, xn, T, k.data(), pool, observe);
  layer_norm(k.data(), w.k_norm.data(), w.k_norm_bias.data(), T, d, 1e-6f, k.data());
  linear(w.weights_proj, xn, T, wts.data(), pool, observe);
  const float head_weight = 1.0f / std::sqrt(float(nh)), scale = 1.0f / std::sqrt(float(d));
  for (int64_t t = 0; t < T; ++t) {
    apply_rope(q.data() + t * nh * d, nh, d, start + t, rope);
    apply_rope(k.data() + t * d, 1, d, start + t, rope);
    std::copy_n(k.data() + t * d, d, cache.index_key(layer, start + t));
  }
  selection.rows.assign(size_t(T), {});
  pool.parallel_for(size_t(T), 1, [&](size_t begin, size_t end) {
    std::vector<float> score;
    for (size_t t = begin; t < end; ++t) {
      const int64_t seen = start + int64_t(t) + 1;
      if (seen <= ix.topk) continue;  // every position is selected
      score.assign(size_t(seen), 0.0f);
      for (int64_t j = 0; j < seen; ++j) {
        const float* key = cache.index_key(layer, j);
        float s = 0;
        for (int64_t h = 0; h < nh; ++h) {
          const float qk = dot(q.data() + (int64_t(t) * nh + h) * d, key, d) * scale;
          s += wts[size_t(int64_t(t) * nh + h)] * head_weight * std::max(qk, 0.0f);
        }
        score[size_t(j)] = s;
      }
      std::vector<int32_t>& row = selection.rows[t];
      row.resize(size_t(seen));
      std::iota(row.begin(), row.end(), 0);
      std::partial_sort(row.begin(), row.begin() + ix.topk, row.end(), [&](int32_t a, int32_t b) {
        return score[size_t(a)] > score[size_t(b)] || (score[size_t(a)] == score[size_t(b)] && a < b);
      });
      row.resize(size_t(ix.topk));
      std::sort(row.begin(), row.end());
    }
  });
}

void mla_attention(const ModelConfig& c, const LayerWeights& L, int64_t layer, const float* xn, int64_t T,
                   int64_t start, KvCache& cache, const RopeTables& rope, const RopeTables& index_rope,
                   Selection& selection, float* out, ThreadPool& pool, const LinearObserver* observe) {
  const MlaConfig& m = c.mla;
  const MlaWeights& w = L.mla;
  const int64_t heads = c.num_heads, qk = m.qk_head_dim(), nope = m.qk_nope_head_dim, vd = m.v_head_dim;
  const int64_t r = m.kv_lora_rank, lat = m.latent(), kvb_row = heads * (nope + vd);

  // Queries: [T, heads, nope | rope], from the hidden state or through the q latent.
  std::vector<float> q(static_cast<size_t>(T * heads * qk)), q_latent;
  if (m.q_lora_rank > 0) {
    q_latent.resize(size_t(T * m.q_lora_rank));
    linear(w.q_a, xn, T, q_latent.data(), pool, observe);
    rms_norm(q_latent.data(), w.q_a_norm.data(), T, m.q_lora_rank, m.latent_norm_eps, q_latent.data());
    linear(w.q_b, q_latent.data(), T, q.data(), pool, observe);
  } else {
    linear(w.q, xn, T, q.data(), pool, observe);
  }

  // Latents: normed kv part, rotated shared key part; appended to the cache.
  std::vector<float> kv(static_cast<size_t>(T * lat));
  linear(w.kv_a, xn, T, kv.data(), pool, observe);
  for (int64_t t = 0; t < T; ++t) {
    float* row = kv.data() + t * lat;
    rms_norm(row, w.kv_a_norm.data(), 1, r, m.latent_norm_eps, row);
    apply_rope(row + r, 1, m.qk_rope_head_dim, start + t, rope);
    apply_rope(q.data() + t * heads * qk + nope, heads, qk, start + t, rope);
    std::copy_n(row, lat, cache.k(layer, start + t));
  }
  if (w.has_indexer)
    select_positions(c, w.indexer, layer, xn, q_latent.data(), T, start, cache, index_rope, selection, pool, observe);
  const bool sparse = c.indexer.enabled();

  // Every cached position's per-head key (nope part) and value.
  const int64_t len = start + T;
  std::vector<float> latents(static_cast<size_t>(len * r)), kvb(static_cast<size_t>(len * kvb_row));
  for (int64_t j = 0; j < len; ++j) std::copy_n(cache.k(layer, j), r, latents.data() + j * r);
  linear(w.kv_b, latents.data(), len, kvb.data(), pool, observe);

  std::vector<float> att(static_cast<size_t>(T * heads * vd));
  pool.parallel_for(size_t(T * heads), 1, [&](size_t begin, size_t end) {
    std::vector<float> p;
    std::vector<int32_t> all;
    for (size_t job = begin; job < end; ++job) {
      const int64_t t = int64_t(job) / heads, h = int64_t(job) % heads;
      const std::vector<int32_t>* pos = sparse ? &selection.rows[size_t(t)] : nullptr;
      if (!pos || pos->empty()) {
        all.resize(size_t(start + t + 1));
        std::iota(all.begin(), all.end(), 0);
        pos = &all;
      }
      const float* qh = q.data() + (t * heads + h) * qk;
      p.resize(pos->size());
      for (size_t i = 0; i < pos->size(); ++i) {
        const int64_t j = (*pos)[i];
        const float s = dot(qh, kvb.data() + j * kvb_row + h * (nope + vd), nope) +
                        dot(qh + nope, cache.k(layer, j) + r, m.qk_rope_head_dim);
        p[i] = s * m.softmax_scale;
      }
      softmax(p.data(), int64_t(p.size()));
      float* o = att.data() + (t * heads + h) * vd;
      std::fill(o, o + vd, 0.0f);
      for (size_t i = 0; i < pos->size(); ++i) {
        const float* v = kvb.data() + (*pos)[i] * kvb_row + h * (nope + vd) + nope;
        for (int64_t e = 0; e < vd; ++e) o[e] += p[i] * v[e];
      }
    }
  });
  linear(L.o, att.data(), T, out, pool, observe);
}

}  // namespace kestrel::cpu
