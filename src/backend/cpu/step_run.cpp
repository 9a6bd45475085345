#include "backend/cpu/step_run.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "backend/cpu/linear.h"
#include "backend/cpu/moe.h"
#include "backend/cpu/ops.h"
#include "common/error.h"

namespace kestrel::cpu {
namespace {

struct Step {
  const StepPlan& p;
  const ModelConfig& c;
  const ModelWeights& w;
  const int64_t B, H, hd, nq, nkv, G, qr, kr;
  std::span<KvCache* const> caches;
  float* logits;
  RopeTables rope;
  std::vector<int64_t> pos;
  // The plan's buffers, one row per token.
  std::vector<float> x, qkv, part, att, router, expert_mid, shared_mid, mid, proj, qlat, qabs, index_q;
  std::vector<std::vector<float>> index_scores;  // per token: every position's score
  std::vector<std::vector<int32_t>> selection;   // per token: the positions attended (empty: all)
  RopeTables index_rope;
  Routing routing;
  std::vector<int32_t> position_expert;  // -1: no expert at that position this step
  std::vector<float> row, xn;

  Step(const StepPlan& plan, const Model& m, std::span<KvCache* const> cs, float* out)
      : p(plan), c(m.config), w(m.weights), B(plan.options.batch), H(plan.hidden), hd(plan.head_dim), nq(plan.heads),
        nkv(plan.kv_heads), G(nq / nkv), qr(nq * hd), kr(nkv * hd), caches(cs), logits(out), rope(m.config.rope),
        index_rope(m.config.rope) {
    index_rope.interleaved = m.config.indexer.rope_interleaved;
    index_q.resize(size_t(B * p.index_rows));
    index_scores.resize(size_t(B));
    selection.resize(size_t(B));
    x.resize(size_t(B * H));
    qkv.resize(size_t(B * p.qkv_rows));
    part.resize(size_t(B * (p.mla ? p.splits * nq * (p.kv_lora + 2) : nkv * p.splits * G * (hd + 2))));
    att.resize(size_t(B * p.att_rows));
    proj.resize(size_t(B * p.proj_rows));
    qlat.resize(size_t(B * p.q_lora));
    qabs.resize(size_t(B * nq * (p.kv_lora + p.rope_dim)));
    router.resize(size_t(B * std::max<int64_t>(c.num_experts, 1)));
    expert_mid.resize(size_t(B * p.expert_positions * p.expert_rows));
    shared_mid.resize(size_t(B * p.shared_rows));
    mid.resize(size_t(B * p.mlp_rows));
    xn.resize(size_t(H));
    for (int64_t b = 0; b < B; ++b) pos.push_back(caches[size_t(b)]->length());
  }

  // Row r of W (with its bias) against each token's input x + b * stride, into y(b).
  template <class Out>
  void rows(const Linear& W, int64_t r, const float* in, int64_t stride, Out y) {
    row.resize(size_t(W.in));
    W.dequant_row(r, row.data());
    const float bias = W.bias.empty() ? 0.0f : W.bias[size_t(r)];
    for (int64_t b = 0; b < B; ++b) y(b, dot(in + b * stride, row.data(), W.in) + bias);
  }
  // RMSNorm of token b's residual row into xn.
  const float* norm(int64_t b, const std::vector<float>& weight) {
    rms_norm(x.data() + b * H, weight.data(), 1, H, c.rms_norm_eps, xn.data());
    return xn.data();
  }
  float* part_at(int64_t b, int64_t g, int64_t s, int64_t h) {
    return part.data() + (((b * nkv + g) * p.splits + s) * G + h) * (hd + 2);
  }
  int64_t position_of(int32_t expert) const {
    return std::find(position_expert.begin(), position_expert.end(), expert) - position_expert.begin();
  }

  void run(const StepInstr& in, std::span<const int32_t> tokens);
  void run_mla(const StepInstr& in);
  float* mla_part(int64_t b, int64_t s, int64_t h) { return part.data() + ((b * p.splits + s) * nq + h) * (p.kv_lora + 2); }
};

// Absorbed MLA, as the plan cuts it (StepOp's Mla* ops).
void Step::run_mla(const StepInstr& in) {
  const LayerWeights& L = w.layers[size_t(in.layer)];
  const MlaWeights& m = L.mla;
  const int64_t l = in.layer, r = p.kv_lora, rd = p.rope_dim, lat = r + rd, nope = p.nope, vd = p.v_dim;
  const int64_t first = p.proj_rows - lat, kvb_row = nope + vd;
  switch (in.op) {
    case StepOp::MlaNormProj: {
      std::vector<float> xs(static_cast<size_t>(B * H));
      for (int64_t b = 0; b < B; ++b) std::copy_n(norm(b, L.attn_norm), H, xs.begin() + b * H);
      for (int64_t row = in.a; row < in.b; ++row) {
        const Linear& W = row < first ? (p.q_lora > 0 ? m.q_a : m.q) : m.kv_a;
        rows(W, row < first ? row : row - first, xs.data(), H,
             [&](int64_t b, float v) { proj[size_t(b * p.proj_rows + row)] = v; });
      }
      return;
    }
    case StepOp::MlaLatent:
      for (int64_t b = 0; b < B; ++b) {
        float* latent = proj.data() + b * p.proj_rows + first;
        rms_norm(latent, m.kv_a_norm.data(), 1, r, c.mla.latent_norm_eps, latent);
        apply_rope(latent + r, 1, rd, pos[size_t(b)], rope);
        std::copy_n(latent, lat, caches[size_t(b)]->k(l, pos[size_t(b)]));
        if (p.q_lora > 0)
          rms_norm(proj.data() + b * p.proj_rows, m.q_a_norm.data(), 1, p.q_lora, c.mla.latent_norm_eps,
                   qlat.data() + b * p.q_lora);
      }
      return;
    case StepOp::MlaQb:
      for (int64_t row = in.a; row < in.b; ++row)
        rows(m.q_b, row, qlat.data(), p.q_lora, [&](int64_t b, float v) { qkv[size_t(b * p.qkv_rows + row)] = v; });
      return;
    case StepOp::MlaAbsorbQ: {
      const int64_t h = in.a;
      std::vector<float> q(static_cast<size_t>(hd)), k(static_cast<size_t>(r));
      for (int64_t b = 0; b < B; ++b) {
        const float* src = p.q_lora > 0 ? qkv.data() + b * p.qkv_rows : proj.data() + b * p.proj_rows;
        std::copy_n(src + h * hd, hd, q.begin());
        apply_rope(q.data() + nope, 1, hd, pos[size_t(b)], rope);
        float* out = qabs.data() + (b * nq + h) * lat;
        std::fill(out, out + r, 0.0f);
        for (int64_t d = 0; d < nope; ++d) {
          m.kv_b.dequant_row(h * kvb_row + d, k.data());
          for (int64_t e = 0; e < r; ++e) out[e] += q[size_t(d)] * k[size_t(e)];
        }
        std::copy_n(q.data() + nope, rd, out + r);
      }
      return;
    }
    case StepOp::MlaAttnSplit: {
      const int64_t s = in.a;
      std::vector<float> sc;
      for (int64_t b = 0; b < B; ++b) {
        const KvCache& cache = *caches[size_t(b)];
        // The positions attended: the indexer's selection, or every one up to the token's own;
        // the split takes its share of them.
        const std::vector<int32_t>& chosen = selection[size_t(b)];
        const int64_t len = chosen.empty() ? pos[size_t(b)] + 1 : int64_t(chosen.size());
        auto at = [&](int64_t i) { return chosen.empty() ? i : int64_t(chosen[size_t(i)]); };
        const int64_t j0 = s * len / p.splits, j1 = (s + 1) * len / p.splits;
        sc.resize(size_t(std::max<int64_t>(j1 - j0, 0)));
        for (int64_t h = 0; h < nq; ++h) {
          const float* q = qabs.data() + (b * nq + h) * lat;
          float mx = -std::numeric_limits<float>::infinity(), sum = 0.0f;
          for (int64_t j = j0; j < j1; ++j) {
            const float* row = cache.k(l, at(j));
            sc[size_t(j - j0)] = (dot(q, row, r) + dot(q + r, row + r, rd)) * c.mla.softmax_scale;
            mx = std::max(mx, sc[size_t(j - j0)]);
          }
          float* out = mla_part(b, s, h);
          std::fill(out + 2, out + 2 + r, 0.0f);
          for (int64_t j = j0; j < j1; ++j) {
            const float e = std::exp(sc[size_t(j - j0)] - mx);
            sum += e;
            const float* row = cache.k(l, at(j));
            for (int64_t d = 0; d < r; ++d) out[2 + d] += e * row[d];
          }
          out[0] = mx;
          out[1] = sum;
        }
      }
      return;
    }
    case StepOp::MlaCombineAbsorb: {
      std::vector<float> o(static_cast<size_t>(r)), v(static_cast<size_t>(r));
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = in.a; h < in.b; ++h) {
          float mx = -std::numeric_limits<float>::infinity(), sum = 0.0f;
          for (int64_t s = 0; s < p.splits; ++s)
            if (mla_part(b, s, h)[1] > 0) mx = std::max(mx, mla_part(b, s, h)[0]);
          std::fill(o.begin(), o.end(), 0.0f);
          for (int64_t s = 0; s < p.splits; ++s) {
            const float* ps = mla_part(b, s, h);
            if (ps[1] <= 0) continue;
            const float f = std::exp(ps[0] - mx);
            sum += f * ps[1];
            for (int64_t d = 0; d < r; ++d) o[size_t(d)] += f * ps[2 + d];
          }
          for (int64_t d = 0; d < r; ++d) o[size_t(d)] /= sum;
          for (int64_t e = 0; e < vd; ++e) {
            m.kv_b.dequant_row(h * kvb_row + nope + e, v.data());
            att[size_t(b * p.att_rows + h * vd + e)] = dot(o.data(), v.data(), r);
          }
        }
      return;
    }
    case StepOp::IndexProj: {
      const IndexerWeights& ix = m.indexer;
      const int64_t qrows = p.index_heads * p.index_dim, id = p.index_dim;
      std::vector<float> xs(static_cast<size_t>(B * H));
      if (in.a >= qrows)
        for (int64_t b = 0; b < B; ++b) std::copy_n(norm(b, L.attn_norm), H, xs.begin() + b * H);
      for (int64_t row = in.a; row < in.b; ++row) {
        auto put = [&](int64_t b, float v) { index_q[size_t(b * p.index_rows + row)] = v; };
        if (row < qrows) rows(ix.wq_b, row, qlat.data(), p.q_lora, put);
        else if (row < qrows + id) rows(ix.wk, row - qrows, xs.data(), H, put);
        else rows(ix.weights_proj, row - qrows - id, xs.data(), H, put);
      }
      return;
    }
    case StepOp::IndexPrep: {
      const IndexerWeights& ix = m.indexer;
      const int64_t ih = p.index_heads, id = p.index_dim;
      for (int64_t b = 0; b < B; ++b) {
        float* q = index_q.data() + b * p.index_rows;
        float* key = q + ih * id;
        layer_norm(key, ix.k_norm.data(), ix.k_norm_bias.data(), 1, id, 1e-6f, key);
        apply_rope(q, ih, id, pos[size_t(b)], index_rope);
        apply_rope(key, 1, id, pos[size_t(b)], index_rope);
        std::copy_n(key, id, caches[size_t(b)]->index_key(l, pos[size_t(b)]));
      }
      return;
    }
    case StepOp::IndexScore: {
      const int64_t s = in.a, ih = p.index_heads, id = p.index_dim;
      const float head_weight = 1.0f / std::sqrt(float(ih)), scale = 1.0f / std::sqrt(float(id));
      for (int64_t b = 0; b < B; ++b) {
        const int64_t len = pos[size_t(b)] + 1, j0 = s * len / p.splits, j1 = (s + 1) * len / p.splits;
        std::vector<float>& score = index_scores[size_t(b)];
        score.resize(size_t(len));
        const float* q = index_q.data() + b * p.index_rows;
        const float* wts = q + ih * id + id;
        for (int64_t j = j0; j < j1; ++j) {
          const float* key = caches[size_t(b)]->index_key(l, j);
          float v = 0;
          for (int64_t h = 0; h < ih; ++h) v += wts[h] * head_weight * std::max(dot(q + h * id, key, id) * scale, 0.0f);
          score[size_t(j)] = v;
        }
      }
      return;
    }
    case StepOp::IndexTopK:
      for (int64_t b = 0; b < B; ++b) {
        std::vector<int32_t>& row = selection[size_t(b)];
        const std::vector<float>& score = index_scores[size_t(b)];
        const int64_t seen = pos[size_t(b)] + 1;
        row.clear();
        if (seen <= p.index_topk) continue;  // every position
        row.resize(size_t(seen));
        std::iota(row.begin(), row.end(), 0);
        std::partial_sort(row.begin(), row.begin() + p.index_topk, row.end(), [&](int32_t a, int32_t b2) {
          return score[size_t(a)] > score[size_t(b2)] || (score[size_t(a)] == score[size_t(b2)] && a < b2);
        });
        row.resize(size_t(p.index_topk));
        std::sort(row.begin(), row.end());
      }
      return;
    default: fail("internal: ", step_op_name(in.op), " is not an MLA op");
  }
}

void Step::run(const StepInstr& in, std::span<const int32_t> tokens) {
  const LayerWeights* L = in.layer >= 0 ? &w.layers[size_t(in.layer)] : nullptr;
  const int64_t l = in.layer;
  switch (in.op) {
    case StepOp::Embed:
      for (int64_t b = 0; b < B; ++b) w.embed.dequant_row(tokens[size_t(b)], x.data() + b * H);
      return;
    case StepOp::AttnNormQkv: {
      // Each token's normed row once for the tile, then its rows of q | k | v.
      std::vector<float> xs(size_t(B * H));
      for (int64_t b = 0; b < B; ++b) std::copy_n(norm(b, L->attn_norm), H, xs.begin() + b * H);
      for (int64_t r = in.a; r < in.b; ++r) {
        const Linear& W = r < qr ? L->q : r < qr + kr ? L->k : L->v;
        const int64_t wr = r < qr ? r : r < qr + kr ? r - qr : r - qr - kr;
        rows(W, wr, xs.data(), H, [&](int64_t b, float v) { qkv[size_t(b * p.qkv_rows + r)] = v; });
      }
      return;
    }
    case StepOp::AttnSplit: {
      // The group's queries normalized and rotated for this split alone; the last split (its
      // positions end at the step's) stores the step's key and value first.
      const int64_t g = in.a, s = in.b;
      const float scale = 1.0f / std::sqrt(float(hd));
      std::vector<float> sc, q(static_cast<size_t>(G * hd)), k(static_cast<size_t>(hd));
      for (int64_t b = 0; b < B; ++b) {
        KvCache& cache = *caches[size_t(b)];
        const float* row_b = qkv.data() + b * p.qkv_rows;
        std::copy_n(row_b + g * G * hd, G * hd, q.begin());
        for (int64_t h = 0; h < G; ++h) {
          if (c.qk_norm) rms_norm(q.data() + h * hd, L->q_norm.data(), 1, hd, c.rms_norm_eps, q.data() + h * hd);
          apply_rope(q.data() + h * hd, 1, hd, pos[size_t(b)], rope);
        }
        if (s + 1 == p.splits) {
          std::copy_n(row_b + qr + g * hd, hd, k.begin());
          if (c.qk_norm) rms_norm(k.data(), L->k_norm.data(), 1, hd, c.rms_norm_eps, k.data());
          apply_rope(k.data(), 1, hd, pos[size_t(b)], rope);
          std::copy_n(k.data(), hd, cache.k(l, pos[size_t(b)]) + g * hd);
          std::copy_n(row_b + qr + kr + g * hd, hd, cache.v(l, pos[size_t(b)]) + g * hd);
        }
        const int64_t len = pos[size_t(b)] + 1, j0 = s * len / p.splits, j1 = (s + 1) * len / p.splits;
        for (int64_t h = 0; h < G; ++h) {
          const float* qh = q.data() + h * hd;
          float* out = part_at(b, g, s, h);
          float m = -std::numeric_limits<float>::infinity(), sum = 0.0f;
          std::fill(out + 2, out + 2 + hd, 0.0f);
          sc.resize(size_t(std::max<int64_t>(j1 - j0, 0)));
          for (int64_t j = j0; j < j1; ++j) {
            sc[size_t(j - j0)] = dot(qh, cache.k(l, j) + g * hd, hd) * scale;
            m = std::max(m, sc[size_t(j - j0)]);
          }
          for (int64_t j = j0; j < j1; ++j) {
            const float e = std::exp(sc[size_t(j - j0)] - m);
            sum += e;
            const float* v = cache.v(l, j) + g * hd;
            for (int64_t d = 0; d < hd; ++d) out[2 + d] += e * v[d];
          }
          out[0] = m;
          out[1] = sum;
        }
      }
      return;
    }
    case StepOp::AttnCombine: {
      const int64_t g = in.a;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < G; ++h) {
          float m = -std::numeric_limits<float>::infinity();
          for (int64_t s = 0; s < p.splits; ++s)
            if (part_at(b, g, s, h)[1] > 0) m = std::max(m, part_at(b, g, s, h)[0]);
          float* o = att.data() + b * qr + (g * G + h) * hd;
          std::fill(o, o + hd, 0.0f);
          float sum = 0.0f;
          for (int64_t s = 0; s < p.splits; ++s) {
            const float* ps = part_at(b, g, s, h);
            if (ps[1] <= 0) continue;
            const float f = std::exp(ps[0] - m);
            sum += f * ps[1];
            for (int64_t d = 0; d < hd; ++d) o[d] += f * ps[2 + d];
          }
          for (int64_t d = 0; d < hd; ++d) o[d] /= sum;
        }
      return;
    }
    case StepOp::OProj:
      for (int64_t r = in.a; r < in.b; ++r)
        rows(L->o, r, att.data(), p.att_rows, [&](int64_t b, float v) { x[size_t(b * H + r)] += v; });
      return;
    case StepOp::MlaNormProj:
    case StepOp::MlaLatent:
    case StepOp::MlaQb:
    case StepOp::MlaAbsorbQ:
    case StepOp::MlaAttnSplit:
    case StepOp::MlaCombineAbsorb:
    case StepOp::IndexProj:
    case StepOp::IndexPrep:
    case StepOp::IndexScore:
    case StepOp::IndexTopK: return run_mla(in);
    case StepOp::FfnNormRouter: {
      std::vector<float> xs(size_t(B * H));
      for (int64_t b = 0; b < B; ++b) std::copy_n(norm(b, L->ffn_norm), H, xs.begin() + b * H);
      for (int64_t r = in.a; r < in.b; ++r)
        rows(L->moe.router, r, xs.data(), H, [&](int64_t b, float v) { router[size_t(b * c.num_experts + r)] = v; });
      return;
    }
    case StepOp::Route: {
      routing = route(c, router.data(), B, L->moe.correction_bias);
      std::vector<int32_t> distinct = routing.experts;
      std::sort(distinct.begin(), distinct.end());
      distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
      if (int64_t(distinct.size()) > p.expert_positions) fail("internal: ", distinct.size(), " experts for ", p.expert_positions, " positions");
      position_expert.assign(size_t(p.expert_positions), -1);
      std::copy(distinct.begin(), distinct.end(), position_expert.begin());
      return;
    }
    case StepOp::ExpertGateUp: {
      const int32_t e = position_expert.at(size_t(in.c));
      if (e < 0) return;
      const GatedFfn& f = L->moe.experts.at(size_t(e - L->moe.first_expert));
      const int64_t K = c.experts_per_token, I = p.expert_rows;
      for (int64_t b = 0; b < B; ++b) {
        if (std::find(routing.experts.begin() + b * K, routing.experts.begin() + (b + 1) * K, e) ==
            routing.experts.begin() + (b + 1) * K)
          continue;
        const float* xb = norm(b, L->ffn_norm);
        for (int64_t r = in.a; r < in.b; ++r) {
          row.resize(size_t(H));
          f.gate.dequant_row(r, row.data());
          const float gv = dot(xb, row.data(), H);
          f.up.dequant_row(r, row.data());
          const float uv = dot(xb, row.data(), H);
          silu_mul(&gv, &uv, 1, &expert_mid[size_t((b * p.expert_positions + in.c) * I + r)]);
        }
      }
      return;
    }
    case StepOp::SharedGateUp: {
      std::vector<float> xs(static_cast<size_t>(B * H)), gv(static_cast<size_t>(B));
      for (int64_t b = 0; b < B; ++b) std::copy_n(norm(b, L->ffn_norm), H, xs.begin() + b * H);
      for (int64_t r = in.a; r < in.b; ++r) {
        rows(L->moe.shared.gate, r, xs.data(), H, [&](int64_t b, float v) { gv[size_t(b)] = v; });
        rows(L->moe.shared.up, r, xs.data(), H, [&](int64_t b, float v) {
          silu_mul(&gv[size_t(b)], &v, 1, &shared_mid[size_t(b * p.shared_rows + r)]);
        });
      }
      return;
    }
    case StepOp::ExpertDown: {
      // Experts in index order, then the shared experts, as moe_forward sums them.
      const int64_t K = c.experts_per_token, I = p.expert_rows;
      for (int64_t b = 0; b < B; ++b) {
        std::vector<std::pair<int32_t, float>> chosen;
        for (int64_t j = 0; j < K; ++j) chosen.emplace_back(routing.experts[size_t(b * K + j)], routing.weights[size_t(b * K + j)]);
        std::sort(chosen.begin(), chosen.end());
        for (int64_t r = in.a; r < in.b; ++r) {
          float acc = 0.0f;
          row.resize(size_t(I));
          for (const auto& [e, weight] : chosen) {
            const Linear& down = L->moe.experts.at(size_t(e - L->moe.first_expert)).down;
            down.dequant_row(r, row.data());
            acc += weight * dot(&expert_mid[size_t((b * p.expert_positions + position_of(e)) * I)], row.data(), I);
          }
          if (L->moe.has_shared) {
            row.resize(size_t(p.shared_rows));
            L->moe.shared.down.dequant_row(r, row.data());
            acc += dot(&shared_mid[size_t(b * p.shared_rows)], row.data(), p.shared_rows);
          }
          x[size_t(b * H + r)] += acc;
        }
      }
      return;
    }
    case StepOp::MlpGateUp: {
      std::vector<float> xs(static_cast<size_t>(B * H)), gv(static_cast<size_t>(B));
      for (int64_t b = 0; b < B; ++b) std::copy_n(norm(b, L->ffn_norm), H, xs.begin() + b * H);
      for (int64_t r = in.a; r < in.b; ++r) {
        rows(L->mlp.gate, r, xs.data(), H, [&](int64_t b, float v) { gv[size_t(b)] = v; });
        rows(L->mlp.up, r, xs.data(), H,
             [&](int64_t b, float v) { silu_mul(&gv[size_t(b)], &v, 1, &mid[size_t(b * p.mlp_rows + r)]); });
      }
      return;
    }
    case StepOp::MlpDown:
      for (int64_t r = in.a; r < in.b; ++r)
        rows(L->mlp.down, r, mid.data(), p.mlp_rows, [&](int64_t b, float v) { x[size_t(b * H + r)] += v; });
      return;
    case StepOp::HeadNormLogits: {
      std::vector<float> xs(size_t(B * H));
      for (int64_t b = 0; b < B; ++b) std::copy_n(norm(b, w.final_norm), H, xs.begin() + b * H);
      for (int64_t r = in.a; r < in.b; ++r)
        rows(w.lm_head, r, xs.data(), H, [&](int64_t b, float v) { logits[size_t(b * p.vocab + r)] = v; });
      return;
    }
  }
}

}  // namespace

void run_step_plan(const StepPlan& plan, const Model& model, std::span<const int32_t> tokens,
                   std::span<KvCache* const> caches, float* logits) {
  const int64_t B = plan.options.batch;
  if (int64_t(tokens.size()) != B || int64_t(caches.size()) != B)
    fail("run_step_plan: the plan is for ", B, " tokens; got ", tokens.size(), " tokens and ", caches.size(), " caches");
  if (model.config.num_layers != plan.layers || model.config.hidden_size != plan.hidden)
    fail("run_step_plan: the plan is for another model (", plan.architecture, ")");
  for (int32_t t : tokens)
    if (t < 0 || t >= model.config.vocab_size) fail("run_step_plan: token ", t, " outside the vocabulary");
  for (KvCache* c : caches) c->reserve(1);
  Step s(plan, model, caches, logits);
  for (const StepInstr& in : plan.instrs) s.run(in, tokens);
  for (KvCache* c : caches) c->commit(1);
}

}  // namespace kestrel::cpu
