#include "backend/cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "backend/cpu/linear.h"
#include "backend/cpu/ops.h"

namespace kestrel::cpu {
namespace {

// Indices of the k largest values (ties: lower index first), in descending order of value.
std::vector<int32_t> top_k(const float* v, int64_t n, int64_t k) {
  std::vector<int32_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                    [&](int32_t a, int32_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); });
  idx.resize(size_t(k));
  return idx;
}

}  // namespace

Routing route(const ModelConfig& c, const float* logits, int64_t tokens, const std::vector<float>& bias) {
  const int64_t E = c.num_experts, K = c.experts_per_token;
  Routing r;
  r.experts.resize(size_t(tokens * K));
  r.weights.resize(size_t(tokens * K));
  std::vector<float> scores(static_cast<size_t>(E)), choice(static_cast<size_t>(E));
  for (int64_t t = 0; t < tokens; ++t) {
    const float* l = logits + t * E;
    std::vector<int32_t> sel;
    if (c.router == RouterKind::Softmax) {
      std::copy(l, l + E, scores.begin());
      softmax(scores.data(), E);
      sel = top_k(scores.data(), E, K);
    } else {
      for (int64_t e = 0; e < E; ++e) {
        scores[size_t(e)] = 1.0f / (1.0f + std::exp(-l[e]));
        choice[size_t(e)] = scores[size_t(e)] + bias[size_t(e)];
      }
      if (c.n_group > 1) {
        // A group's score is the sum of its two best experts; experts outside the best
        // topk_group groups cannot be chosen.
        const int64_t per = E / c.n_group;
        std::vector<float> gscore(static_cast<size_t>(c.n_group));
        for (int64_t g = 0; g < c.n_group; ++g) {
          auto best = top_k(choice.data() + g * per, per, 2);
          gscore[size_t(g)] = choice[size_t(g * per + best[0])] + choice[size_t(g * per + best[1])];
        }
        auto keep = top_k(gscore.data(), c.n_group, c.topk_group);
        std::vector<bool> kept(size_t(c.n_group), false);
        for (int32_t g : keep) kept[size_t(g)] = true;
        for (int64_t e = 0; e < E; ++e)
          if (!kept[size_t(e / per)]) choice[size_t(e)] = -std::numeric_limits<float>::infinity();
      }
      sel = top_k(choice.data(), E, K);
    }
    float sum = 0;
    for (int64_t j = 0; j < K; ++j) sum += scores[size_t(sel[size_t(j)])];
    for (int64_t j = 0; j < K; ++j) {
      float w = scores[size_t(sel[size_t(j)])];
      if (c.norm_topk_prob) w /= c.router == RouterKind::SigmoidBias ? sum + 1e-20f : sum;
      r.experts[size_t(t * K + j)] = sel[size_t(j)];
      r.weights[size_t(t * K + j)] = w * c.routed_scaling_factor;
    }
  }
  return r;
}

void gated_ffn(const GatedFfn& f, const float* x, int64_t tokens, float* out, ThreadPool& pool,
               const LinearObserver* observe) {
  const int64_t w = f.gate.out;
  std::vector<float> g(static_cast<size_t>(tokens * w)), u(static_cast<size_t>(tokens * w));
  linear(f.gate, x, tokens, g.data(), pool, observe);
  linear(f.up, x, tokens, u.data(), pool, observe);
  silu_mul(g.data(), u.data(), tokens * w, g.data());
  linear(f.down, g.data(), tokens, out, pool, observe);
}

void moe_forward(const ModelConfig& c, const MoeWeights& w, const float* x, int64_t tokens, float* out,
                 ThreadPool& pool, const LinearObserver* observe) {
  const int64_t E = c.num_experts, K = c.experts_per_token, H = c.hidden_size;
  std::vector<float> logits(static_cast<size_t>(tokens * E));
  linear(w.router, x, tokens, logits.data(), pool, observe);
  const Routing r = route(c, logits.data(), tokens, w.correction_bias);

  std::fill(out, out + tokens * H, 0.0f);
  // Experts in index order, each over the tokens that chose it; an expert-parallel rank holds
  // experts first_expert .. first_expert + experts.size() - 1.
  std::vector<float> xs, ys;
  const int64_t first = w.first_expert, last = first + int64_t(w.experts.size());
  for (int64_t e = first; e < last; ++e) {
    std::vector<int64_t> rows;
    std::vector<float> weights;
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t j = 0; j < K; ++j)
        if (r.experts[size_t(t * K + j)] == e) {
          rows.push_back(t);
          weights.push_back(r.weights[size_t(t * K + j)]);
        }
    if (rows.empty()) continue;
    const int64_t n = int64_t(rows.size());
    xs.resize(size_t(n * H));
    ys.resize(size_t(n * H));
    for (int64_t i = 0; i < n; ++i) std::copy(x + rows[size_t(i)] * H, x + (rows[size_t(i)] + 1) * H, xs.begin() + i * H);
    gated_ffn(w.experts[size_t(e - first)], xs.data(), n, ys.data(), pool, observe);
    for (int64_t i = 0; i < n; ++i) {
      float* o = out + rows[size_t(i)] * H;
      for (int64_t d = 0; d < H; ++d) o[d] += weights[size_t(i)] * ys[size_t(i * H + d)];
    }
  }
  if (w.has_shared) {
    ys.resize(size_t(tokens * H));
    gated_ffn(w.shared, x, tokens, ys.data(), pool, observe);
    for (int64_t i = 0; i < tokens * H; ++i) out[i] += ys[size_t(i)];
  }
}

}  // namespace kestrel::cpu
