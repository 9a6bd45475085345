#include "plan/step_plan.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <unordered_map>

#include "common/error.h"
#include "plan/roofline.h"
#include "plan/step_accesses.h"
#include "plan/step_plan_check.h"

namespace kestrel {

const char* step_op_name(StepOp op) {
  switch (op) {
    case StepOp::Embed: return "embed";
    case StepOp::AttnNormQkv: return "norm_qkv";
    case StepOp::AttnSplit: return "attn_split";
    case StepOp::AttnCombine: return "attn_combine";
    case StepOp::OProj: return "o_proj";
    case StepOp::FfnNormRouter: return "norm_router";
    case StepOp::Route: return "route";
    case StepOp::ExpertGateUp: return "expert_gate_up";
    case StepOp::SharedGateUp: return "shared_gate_up";
    case StepOp::ExpertDown: return "expert_down";
    case StepOp::MlpGateUp: return "mlp_gate_up";
    case StepOp::MlpDown: return "mlp_down";
    case StepOp::HeadNormLogits: return "norm_lm_head";
    case StepOp::MlaNormProj: return "mla_norm_proj";
    case StepOp::MlaLatent: return "mla_latent";
    case StepOp::MlaQb: return "mla_q_b";
    case StepOp::MlaAbsorbQ: return "mla_absorb_q";
    case StepOp::MlaAttnSplit: return "mla_attn_split";
    case StepOp::MlaCombineAbsorb: return "mla_combine_absorb";
    case StepOp::IndexProj: return "index_proj";
    case StepOp::IndexPrep: return "index_prep";
    case StepOp::IndexScore: return "index_score";
    case StepOp::IndexTopK: return "index_topk";
  }
  return "?";
}

const char* step_buf_name(StepBuf b) {
  switch (b) {
    case StepBuf::Hidden: return "hidden";
    case StepBuf::Qkv: return "qkv";
    case StepBuf::KvCache: return "kv_cache";
    case StepBuf::AttnPart: return "attn_part";
    case StepBuf::AttnOut: return "attn_out";
    case StepBuf::RouterLogits: return "router_logits";
    case StepBuf::Routes: return "routes";
    case StepBuf::ExpertMid: return "expert_mid";
    case StepBuf::SharedMid: return "shared_mid";
    case StepBuf::Mid: return "mid";
    case StepBuf::Logits: return "logits";
    case StepBuf::MlaProj: return "mla_proj";
    case StepBuf::QLat: return "q_latent";
    case StepBuf::QAbs: return "q_absorbed";
    case StepBuf::IndexQ: return "index_q";
    case StepBuf::IndexCache: return "index_cache";
    case StepBuf::IndexScores: return "index_scores";
    case StepBuf::Selection: return "selection";
    case StepBuf::KvNew: return "kv_new";
  }
  return "?";
}

double StepPlan::weight_bytes() const {
  double b = 0;
  for (const StepInstr& i : instrs) b += i.weight_bytes;
  return b;
}

std::vector<int32_t> StepPlan::tail_of_counters() const {
  std::vector<int32_t> out(counters.size(), -1);
  for (int32_t t : tails) out.at(size_t(instrs.at(size_t(t)).waits.at(0))) = t;
  return out;
}

double StepPlan::cache_bytes() const {
  double b = 0;
  for (const StepInstr& i : instrs) b += i.cache_bytes;
  return b;
}

std::vector<std::pair<int64_t, int64_t>> tile_rows(int64_t rows, int64_t group, int64_t quantum, int64_t target) {
  if (rows <= 0) return {};
  group = std::clamp<int64_t>(group, 1, rows);
  quantum = std::clamp<int64_t>(quantum, 1, group);
  target = std::max<int64_t>(target, 1);
  std::vector<std::pair<int64_t, int64_t>> out;
  const int64_t groups = (rows + group - 1) / group;
  if (groups >= target) {
    // Whole groups per tile.
    const int64_t per = (groups + target - 1) / target;
    for (int64_t g = 0; g < groups; g += per) out.emplace_back(g * group, std::min(rows, (g + per) * group));
    return out;
  }
  const int64_t per_group = std::max<int64_t>(1, (target + groups / 2) / groups);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t begin = g * group, end = std::min(rows, begin + group);
    const int64_t quanta = (end - begin + quantum - 1) / quantum, k = std::min(per_group, quanta);
    for (int64_t t = 0; t < k; ++t)
      out.emplace_back(begin + quanta * t / k * quantum, std::min(end, begin + quanta * (t + 1) / k * quantum));
  }
  return out;
}

namespace {

// Union-find over a producer op's tiles.
struct Groups {
  std::vector<int32_t> parent;
  explicit Groups(size_t n) : parent(n) { std::iota(parent.begin(), parent.end(), 0); }
  int32_t find(int32_t x) {
    while (parent[size_t(x)] != x) x = parent[size_t(x)] = parent[size_t(parent[size_t(x)])];
    return x;
  }
  void join(int32_t a, int32_t b) { parent[size_t(find(a))] = find(b); }
};

class Builder {
 public:
  Builder(const ModelConfig& c, const StepPlanOptions& o, StepPlan& p) : c_(c), o_(o), p_(p) {
    const StepShapes s = step_shapes(c);
    for (const ModuleShape& m : s.modules) bpw_[m.name] = m.bytes_per_weight;
    if (s.experts > 0) expert_bpw_ = s.expert_bytes / (3.0 * double(c.moe_intermediate_size) * double(c.hidden_size));
  }

  double bpw(const std::string& name) const {
    auto it = bpw_.find(name);
    if (it == bpw_.end()) fail("internal: no module '", name, "' in the step's shapes");
    return it->second;
  }

  // Starts a new op (layer, op): its tiles follow.
  void op(StepOp op, int32_t layer, bool tail = false) {
    cur_op_ = op;
    cur_layer_ = layer;
    cur_tail_ = tail;
    op_begin_.push_back(int32_t(p_.instrs.size()));
  }

  StepInstr& tile(int64_t a, int64_t b, int64_t c = 0) {
    StepInstr& i = p_.instrs.emplace_back();
    i.op = cur_op_;
    i.layer = cur_layer_;
    i.a = a;
    i.b = b;
    i.c = c;
    i.tail = cur_tail_;
    op_of_.push_back(int32_t(op_begin_.size()) - 1);
    return i;
  }

  void build();

 private:
  // Tiles per op: one per SM (balance across ops is the assignment's).
  int64_t target() const { return std::max<int64_t>(1, o_.sms); }
  void layer(int32_t l);
  void gqa_attention(int32_t l);
  void mla_attention(int32_t l);
  void assign();
  void connect();

  const ModelConfig& c_;
  const StepPlanOptions& o_;
  StepPlan& p_;
  std::unordered_map<std::string, double> bpw_;
  double expert_bpw_ = 0;
  StepOp cur_op_ = StepOp::Embed;
  int32_t cur_layer_ = -1;
  bool cur_tail_ = false;
  // Per instruction: its queue for the clocks (a tail's own, after the SMs') and place in it.
  std::vector<int32_t> vsm_, vslot_;
  int32_t queues_ = 0;  // SMs + tails
  std::vector<int32_t> op_begin_;  // first instruction of each op, in program order
  std::vector<int32_t> op_of_;     // per instruction: its op
};

void Builder::build() {
  StepPlan& p = p_;
  const double B = double(o_.batch);
  op(StepOp::Embed, -1);
  StepInstr& e = tile(0, p.hidden);
  e.writes = {{StepBuf::Hidden, 0, p.hidden}};
  e.weight_bytes = B * double(p.hidden) * 2.0;
  for (int32_t l = 0; l < int32_t(p.layers); ++l) layer(l);
  op(StepOp::HeadNormLogits, -1);
  for (const auto& [r0, r1] : tile_rows(p.vocab, p.vocab, o_.row_quantum, target())) {
    StepInstr& i = tile(r0, r1);
    i.reads = {{StepBuf::Hidden, 0, p.hidden}};
    i.writes = {{StepBuf::Logits, r0, r1}};
    i.weight_bytes = double(r1 - r0) * double(p.hidden) * bpw("lm_head");
  }
  assign();
  connect();
}

void Builder::gqa_attention(int32_t l) {
  StepPlan& p = p_;
  const int64_t H = p.hidden, hd = p.head_dim, nq = p.heads, nkv = p.kv_heads, G = nq / nkv;
  const std::string at = "model.layers." + std::to_string(l) + ".";
  const double bq = bpw(at + "self_attn.q_proj"), bk = bpw(at + "self_attn.k_proj"), bv = bpw(at + "self_attn.v_proj");
  const int64_t qr = nq * hd, kr = nkv * hd;

  op(StepOp::AttnNormQkv, l);
  for (const auto& [r0, r1] : tile_rows(p.qkv_rows, hd, o_.row_quantum, target())) {
    StepInstr& i = tile(r0, r1);
    i.reads = {{StepBuf::Hidden, 0, H}};
    i.writes = {{StepBuf::Qkv, r0, r1}};
    const int64_t lo = r0, hi = r1;  // (clang 14 cannot capture structured bindings)
    auto rows_in = [lo, hi](int64_t b, int64_t e) { return double(std::max<int64_t>(0, std::min(hi, e) - std::max(lo, b))); };
    i.weight_bytes = double(H) * (rows_in(0, qr) * bq + rows_in(qr, qr + kr) * bk + rows_in(qr + kr, qr + 2 * kr) * bv);
  }
  // Every split normalizes and rotates its own copy of the group's queries (a few hundred floats:
  // cheaper than a stage of its own between q/k/v and the splits); the last split, whose
  // positions end at the step's, also rotates the key and stores it and the value in the cache.
  op(StepOp::AttnSplit, l);
  const double positions = double(std::max<int64_t>(o_.context, 1));
  for (int64_t g = 0; g < nkv; ++g)
    for (int64_t s = 0; s < p.splits; ++s) {
      StepInstr& i = tile(g, s);
      const StepSpan cache{StepBuf::KvCache, l * nkv + g, l * nkv + g + 1}, fresh{StepBuf::KvNew, l * nkv + g, l * nkv + g + 1};
      i.reads = {{StepBuf::Qkv, g * G * hd, (g + 1) * G * hd}, cache};
      if (s + 1 == p.splits) {
        i.reads.push_back({StepBuf::Qkv, qr + g * hd, qr + (g + 1) * hd});
        i.reads.push_back({StepBuf::Qkv, qr + kr + g * hd, qr + kr + (g + 1) * hd});
        i.writes.push_back(fresh);
      }
      i.writes.push_back({StepBuf::AttnPart, g * p.splits + s, g * p.splits + s + 1});
      i.cache_bytes = double(o_.batch) * positions / double(p.splits) * 2.0 * double(hd) * o_.kv_value_bytes;
    }
  op(StepOp::AttnCombine, l, true);
  for (int64_t g = 0; g < nkv; ++g) {
    StepInstr& i = tile(g, g + 1);
    i.reads = {{StepBuf::AttnPart, g * p.splits, (g + 1) * p.splits}};
    i.writes = {{StepBuf::AttnOut, g * G * hd, (g + 1) * G * hd}};
  }
}

// Absorbed MLA: the queries' non-rotary parts are carried into latent space through kv_b's key
// rows (W_UK), attention runs over the cached latent rows, and its output leaves latent space
// through kv_b's value rows (W_UV), so the latents are read once per step and never expanded.
void Builder::mla_attention(int32_t l) {
  StepPlan& p = p_;
  const int64_t H = p.hidden, nh = p.heads, qk = p.head_dim, r = p.kv_lora, lat = p.kv_lora + p.rope_dim;
  const int64_t first = p.proj_rows - lat;  // q_a's rows, or q's
  const std::string at = "model.layers." + std::to_string(l) + ".self_attn.";
  const double bfirst = bpw(at + (p.q_lora > 0 ? "q_a_proj" : "q_proj")), bkva = bpw(at + "kv_a_proj_with_mqa");
  const double bkvb = bpw(at + "kv_b_proj");
  op(StepOp::MlaNormProj, l);
  const int64_t t_first = std::max<int64_t>(1, target() * first / p.proj_rows), t_lat = std::max<int64_t>(1, target() - t_first);
  for (const auto& [r0, r1] : tile_rows(first, p.q_lora > 0 ? first : qk, o_.row_quantum, t_first)) {
    StepInstr& i = tile(r0, r1);
    i.reads = {{StepBuf::Hidden, 0, H}};
    i.writes = {{StepBuf::MlaProj, r0, r1}};
    i.weight_bytes = double(r1 - r0) * double(H) * bfirst;
  }
  for (const auto& [r0, r1] : tile_rows(lat, lat, o_.row_quantum, t_lat)) {
    StepInstr& i = tile(first + r0, first + r1);
    i.reads = {{StepBuf::Hidden, 0, H}};
    i.writes = {{StepBuf::MlaProj, first + r0, first + r1}};
    i.weight_bytes = double(r1 - r0) * double(H) * bkva;
  }
  op(StepOp::MlaLatent, l);
  StepInstr& li = tile(0, 1);
  li.reads = {{StepBuf::MlaProj, p.q_lora > 0 ? 0 : first, p.proj_rows}};
  li.writes = {{StepBuf::KvCache, l, l + 1}};
  if (p.q_lora > 0) li.writes.push_back({StepBuf::QLat, 0, p.q_lora});
  if (p.q_lora > 0) {
    op(StepOp::MlaQb, l);
    const double bqb = bpw(at + "q_b_proj");
    for (const auto& [r0, r1] : tile_rows(nh * qk, qk, o_.row_quantum, target())) {
      StepInstr& i = tile(r0, r1);
      i.reads = {{StepBuf::QLat, 0, p.q_lora}};
      i.writes = {{StepBuf::Qkv, r0, r1}};
      i.weight_bytes = double(r1 - r0) * double(p.q_lora) * bqb;
    }
  }
  op(StepOp::MlaAbsorbQ, l);
  for (int64_t h = 0; h < nh; ++h) {
    StepInstr& i = tile(h, h + 1);
    i.reads = {{p.q_lora > 0 ? StepBuf::Qkv : StepBuf::MlaProj, h * qk, (h + 1) * qk}};
    i.writes = {{StepBuf::QAbs, h, h + 1}};
    i.weight_bytes = double(p.nope) * double(r) * bkvb;
  }
  const double positions = double(std::max<int64_t>(o_.context, 1));
  const bool sparse = p.index_topk > 0;
  if (sparse && c_.indexer.own[size_t(l)]) {
    // The indexer: its projections, the key into the index cache, every position's score, the
    // best index_topk positions per token, which this layer and the ones reusing it attend to.
    const int64_t ih = p.index_heads, id = p.index_dim, qrows = ih * id;
    const double bwq = bpw(at + "indexer.wq_b"), bwk = bpw(at + "indexer.wk"), bww = bpw(at + "indexer.weights_proj");
    op(StepOp::IndexProj, l);
    for (const auto& [r0, r1] : tile_rows(qrows, id, o_.row_quantum, std::max<int64_t>(1, target() - 2))) {
      StepInstr& i = tile(r0, r1);
      i.reads = {{StepBuf::QLat, 0, p.q_lora}};
      i.writes = {{StepBuf::IndexQ, r0, r1}};
      i.weight_bytes = double(r1 - r0) * double(p.q_lora) * bwq;
    }
    StepInstr& k = tile(qrows, qrows + id);
    k.reads = {{StepBuf::Hidden, 0, H}};
    k.writes = {{StepBuf::IndexQ, qrows, qrows + id}};
    k.weight_bytes = double(id) * double(H) * bwk;
    StepInstr& w = tile(qrows + id, p.index_rows);
    w.reads = {{StepBuf::Hidden, 0, H}};
    w.writes = {{StepBuf::IndexQ, qrows + id, p.index_rows}};
    w.weight_bytes = double(ih) * double(H) * bww;
    op(StepOp::IndexPrep, l);
    StepInstr& prep = tile(0, 1);
    prep.reads = {{StepBuf::IndexQ, 0, qrows + id}};
    prep.writes = {{StepBuf::IndexQ, 0, qrows + id}, {StepBuf::IndexCache, l, l + 1}};
    op(StepOp::IndexScore, l);
    for (int64_t s = 0; s < p.splits; ++s) {
      StepInstr& i = tile(s, s + 1);
      i.reads = {{StepBuf::IndexQ, 0, p.index_rows}, {StepBuf::IndexCache, l, l + 1}};
      i.writes = {{StepBuf::IndexScores, s, s + 1}};
      i.cache_bytes = double(o_.batch) * positions / double(p.splits) * double(id) * o_.kv_value_bytes;
    }
    op(StepOp::IndexTopK, l);
    StepInstr& top = tile(0, 1);
    top.reads = {{StepBuf::IndexScores, 0, p.splits}};
    top.writes = {{StepBuf::Selection, 0, 1}};
  }
  op(StepOp::MlaAttnSplit, l);
  const double attended = sparse ? std::min(positions, double(p.index_topk)) : positions;
  for (int64_t s = 0; s < p.splits; ++s) {
    StepInstr& i = tile(s, s + 1);
    i.reads = {{StepBuf::QAbs, 0, nh}, {StepBuf::KvCache, l, l + 1}};
    if (sparse) i.reads.push_back({StepBuf::Selection, 0, 1});
    i.writes = {{StepBuf::AttnPart, s, s + 1}};
    i.cache_bytes = double(o_.batch) * attended / double(p.splits) * double(lat) * o_.kv_value_bytes;
  }
  op(StepOp::MlaCombineAbsorb, l);
  for (const auto& [h0, h1] : tile_rows(nh, 1, 1, target())) {
    StepInstr& i = tile(h0, h1);
    i.reads = {{StepBuf::AttnPart, 0, p.splits}};
    i.writes = {{StepBuf::AttnOut, h0 * p.v_dim, h1 * p.v_dim}};
    i.weight_bytes = double(h1 - h0) * double(p.v_dim) * double(r) * bkvb;
  }
}

void Builder::layer(int32_t l) {
  StepPlan& p = p_;
  const int64_t H = p.hidden;
  const std::string at = "model.layers." + std::to_string(l) + ".";
  if (p.mla) mla_attention(l);
  else gqa_attention(l);
  op(StepOp::OProj, l);
  const double bo = bpw(at + "self_attn.o_proj");
  for (const auto& [r0, r1] : tile_rows(H, H, o_.row_quantum, target())) {
    StepInstr& i = tile(r0, r1);
    i.reads = {{StepBuf::AttnOut, 0, p.att_rows}, {StepBuf::Hidden, r0, r1}};
    i.writes = {{StepBuf::Hidden, r0, r1}};
    i.weight_bytes = double(r1 - r0) * double(p.att_rows) * bo;
  }

  if (!c_.is_moe_layer(l)) {
    const int64_t I = p.mlp_rows;
    op(StepOp::MlpGateUp, l);
    const double bg = bpw(at + "mlp.gate_proj"), bu = bpw(at + "mlp.up_proj"), bd = bpw(at + "mlp.down_proj");
    for (const auto& [r0, r1] : tile_rows(I, I, o_.row_quantum, target())) {
      StepInstr& i = tile(r0, r1);
      i.reads = {{StepBuf::Hidden, 0, H}};
      i.writes = {{StepBuf::Mid, r0, r1}};
      i.weight_bytes = double(r1 - r0) * double(H) * (bg + bu);
    }
    op(StepOp::MlpDown, l);
    for (const auto& [r0, r1] : tile_rows(H, H, o_.row_quantum, target())) {
      StepInstr& i = tile(r0, r1);
      i.reads = {{StepBuf::Mid, 0, I}, {StepBuf::Hidden, r0, r1}};
      i.writes = {{StepBuf::Hidden, r0, r1}};
      i.weight_bytes = double(r1 - r0) * double(I) * bd;
    }
    return;
  }

  const int64_t E = c_.num_experts, I = p.expert_rows, S = p.shared_rows, P = p.expert_positions;
  op(StepOp::FfnNormRouter, l);
  for (const auto& [r0, r1] : tile_rows(E, E, 1, target())) {
    StepInstr& i = tile(r0, r1);
    i.reads = {{StepBuf::Hidden, 0, H}};
    i.writes = {{StepBuf::RouterLogits, r0, r1}};
    i.weight_bytes = double(r1 - r0) * double(H) * 2.0;
  }
  op(StepOp::Route, l, true);
  StepInstr& r = tile(0, 1);
  r.reads = {{StepBuf::RouterLogits, 0, E}};
  r.writes = {{StepBuf::Routes, 0, 1}};
  op(StepOp::ExpertGateUp, l);
  const int64_t per_expert = std::max<int64_t>(1, target() / P);
  for (int64_t e = 0; e < P; ++e)
    for (const auto& [r0, r1] : tile_rows(I, I, o_.row_quantum, per_expert)) {
      StepInstr& i = tile(r0, r1, e);
      i.reads = {{StepBuf::Hidden, 0, H}, {StepBuf::Routes, 0, 1}};
      i.writes = {{StepBuf::ExpertMid, e * I + r0, e * I + r1}};
      i.weight_bytes = double(r1 - r0) * double(H) * 2.0 * expert_bpw_;
    }
  double bsd = 0;
  if (S > 0) {
    op(StepOp::SharedGateUp, l);
    const std::string sp = at + "mlp.shared_experts.";
    const double bsg = bpw(sp + "gate_proj"), bsu = bpw(sp + "up_proj");
    bsd = bpw(sp + "down_proj");
    for (const auto& [r0, r1] : tile_rows(S, S, o_.row_quantum, target())) {
      StepInstr& i = tile(r0, r1);
      i.reads = {{StepBuf::Hidden, 0, H}};
      i.writes = {{StepBuf::SharedMid, r0, r1}};
      i.weight_bytes = double(r1 - r0) * double(H) * (bsg + bsu);
    }
  }
  op(StepOp::ExpertDown, l);
  for (const auto& [r0, r1] : tile_rows(H, H, o_.row_quantum, target())) {
    StepInstr& i = tile(r0, r1);
    i.reads = {{StepBuf::ExpertMid, 0, P * I}, {StepBuf::Routes, 0, 1}, {StepBuf::Hidden, r0, r1}};
    if (S > 0) i.reads.push_back({StepBuf::SharedMid, 0, S});
    i.writes = {{StepBuf::Hidden, r0, r1}};
    i.weight_bytes = double(r1 - r0) * (double(P * I) * expert_bpw_ + double(S) * bsd);
  }
}

// Op by op, each tile (largest first) to the SM with the least work so far; queues in program order.
void Builder::assign() {
  StepPlan& p = p_;
  const int n = o_.sms;
  std::vector<double> load(size_t(n), 0.0);
  for (size_t k = 0; k < op_begin_.size(); ++k) {
    const int32_t begin = op_begin_[k], end = k + 1 < op_begin_.size() ? op_begin_[k + 1] : int32_t(p.instrs.size());
    if (p.instrs[size_t(begin)].tail) continue;
    std::vector<int32_t> order(size_t(end - begin));
    std::iota(order.begin(), order.end(), begin);
    auto cost = [&](int32_t i) { return p.instrs[size_t(i)].weight_bytes + p.instrs[size_t(i)].cache_bytes + o_.instr_cost; };
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return cost(a) > cost(b); });
    for (int32_t i : order) {
      const int sm = int(std::min_element(load.begin(), load.end()) - load.begin());
      p.instrs[size_t(i)].sm = sm;
      load[size_t(sm)] += cost(i);
    }
  }
  p.queues.assign(size_t(n), {});
  vsm_.assign(p.instrs.size(), 0);
  vslot_.assign(p.instrs.size(), 0);
  for (int32_t i = 0; i < int32_t(p.instrs.size()); ++i) {
    StepInstr& in = p.instrs[size_t(i)];
    if (in.tail) {
      vsm_[size_t(i)] = n + int32_t(p.tails.size());
      p.tails.push_back(i);
      continue;
    }
    in.slot = int32_t(p.queues[size_t(in.sm)].size());
    p.queues[size_t(in.sm)].push_back(i);
    vsm_[size_t(i)] = in.sm;
    vslot_[size_t(i)] = in.slot;
  }
  queues_ = n + int32_t(p.tails.size());
}

void Builder::connect() {
  StepPlan& p = p_;
  const size_t N = p.instrs.size();
  // 3. What each instruction needs, by producer op (StepAccesses).
  StepAccesses accesses(p);
  std::vector<std::vector<std::pair<int32_t, int32_t>>> needs(N);  // (producer op, producer instr)
  for (int32_t i = 0; i < int32_t(N); ++i) {
    accesses.visit(i, [&](int32_t j, StepHazard, const StepSpan&, int64_t) {
      needs[size_t(i)].emplace_back(op_of_[size_t(j)], j);
    });
    auto& n = needs[size_t(i)];
    std::sort(n.begin(), n.end());
    n.erase(std::unique(n.begin(), n.end()), n.end());
    for (const auto& [op, j] : n)
      if (op == op_of_[size_t(i)]) fail("internal: tiles ", j, " and ", i, " of one op depend on each other");
  }
  // Needs that others imply are dropped before counters are formed, or they would join tiles
  // that no consumer needs together (o_proj's writes of the residual follow every q/k/v tile's
  // read of it, but through the attention that already waits on them). Vector clocks at the
  // level of single instructions, latest producer first: it implies the most. Where some of a
  // consumer's needs of one producer op remain, all of them stay (a counter is for the tiles one
  // consumer needs, even those its queue happens to have run already).
  {
    const size_t S = size_t(queues_);
    std::vector<std::vector<int32_t>> done(N), sm_clock(S, std::vector<int32_t>(S, 0));
    for (int32_t i = 0; i < int32_t(N); ++i) {
      std::vector<int32_t> vc = sm_clock[size_t(vsm_[size_t(i)])];
      auto& n = needs[size_t(i)];
      std::sort(n.begin(), n.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
      std::vector<int32_t> kept_ops;
      for (const auto& need : n) {
        if (vc[size_t(vsm_[size_t(need.second)])] > vslot_[size_t(need.second)]) continue;
        kept_ops.push_back(need.first);
        for (size_t s = 0; s < S; ++s) vc[s] = std::max(vc[s], done[size_t(need.second)][s]);
      }
      std::vector<std::pair<int32_t, int32_t>> kept;
      for (const auto& need : n)
        if (std::find(kept_ops.begin(), kept_ops.end(), need.first) != kept_ops.end()) kept.push_back(need);
      std::sort(kept.begin(), kept.end());
      n = std::move(kept);
      vc[size_t(vsm_[size_t(i)])] = vslot_[size_t(i)] + 1;
      done[size_t(i)] = vc;
      sm_clock[size_t(vsm_[size_t(i)])] = std::move(vc);
    }
  }
  // 4. Counters: a producer op's tiles that one consumer needs share a counter.
  Groups groups(N);
  for (size_t i = 0; i < N; ++i)
    for (size_t k = 1; k < needs[i].size(); ++k)
      if (needs[i][k].first == needs[i][k - 1].first) groups.join(needs[i][k].second, needs[i][k - 1].second);
  std::vector<int32_t> counter_of_root(N, -1);
  for (int32_t i = 0; i < int32_t(N); ++i) {
    const int32_t root = groups.find(i);
    if (counter_of_root[size_t(root)] < 0) {
      counter_of_root[size_t(root)] = int32_t(p.counters.size());
      p.counters.push_back({0, i});
    }
    StepInstr& in = p.instrs[size_t(i)];
    in.signal = counter_of_root[size_t(root)];
    ++p.counters[size_t(in.signal)].producers;
  }
  std::vector<std::vector<int32_t>> producers(p.counters.size());
  for (int32_t i = 0; i < int32_t(N); ++i) producers[size_t(p.instrs[size_t(i)].signal)].push_back(i);

  // 5. Waits, less those the rest imply: vector clocks over the SMs, in program order. vc[i][s]
  // is how many instructions of SM s are done before instruction i starts.
  const size_t S = size_t(queues_);
  std::vector<std::vector<int32_t>> done(N);  // per instruction: the clock once it is done
  std::vector<std::vector<int32_t>> counter_clock(p.counters.size());
  auto clock_of = [&](int32_t k) -> const std::vector<int32_t>& {
    auto& c = counter_clock[size_t(k)];
    if (c.empty()) {
      c.assign(S, 0);
      for (int32_t j : producers[size_t(k)])
        for (size_t s = 0; s < S; ++s) c[s] = std::max(c[s], done[size_t(j)][s]);
    }
    return c;
  };
  std::vector<std::vector<int32_t>> sm_clock(S, std::vector<int32_t>(S, 0));
  for (int32_t i = 0; i < int32_t(N); ++i) {
    StepInstr& in = p.instrs[size_t(i)];
    std::vector<int32_t> candidates;
    for (const auto& [op, j] : needs[size_t(i)]) candidates.push_back(p.instrs[size_t(j)].signal);
    std::sort(candidates.begin(), candidates.end());
    candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());
    // The widest first: it implies the most.
    std::stable_sort(candidates.begin(), candidates.end(), [&](int32_t a, int32_t b) {
      return p.counters[size_t(a)].producers > p.counters[size_t(b)].producers;
    });
    std::vector<int32_t> vc = sm_clock[size_t(vsm_[size_t(i)])];
    auto implied = [&](int32_t k) {
      for (int32_t j : producers[size_t(k)])
        if (vc[size_t(vsm_[size_t(j)])] <= vslot_[size_t(j)]) return false;
      return true;
    };
    for (int32_t k : candidates) {
      if (implied(k)) continue;
      in.waits.push_back(k);
      const auto& ck = clock_of(k);
      for (size_t s = 0; s < S; ++s) vc[s] = std::max(vc[s], ck[s]);
    }
    std::sort(in.waits.begin(), in.waits.end());
    vc[size_t(vsm_[size_t(i)])] = vslot_[size_t(i)] + 1;
    done[size_t(i)] = vc;
    sm_clock[size_t(vsm_[size_t(i)])] = std::move(vc);
  }
  // A tail runs where its one wait completes: it must have exactly one, and a counter one tail.
  std::vector<int32_t> tail_of(p.counters.size(), -1);
  for (int32_t t : p.tails) {
    const StepInstr& in = p.instrs[size_t(t)];
    if (in.waits.size() != 1) fail("internal: the tail ", describe_instr(p, t), " waits on ", in.waits.size(), " counters, not one");
    if (tail_of[size_t(in.waits[0])] >= 0)
      fail("internal: the tails ", describe_instr(p, tail_of[size_t(in.waits[0])]), " and ", describe_instr(p, t), " wait on one counter");
    tail_of[size_t(in.waits[0])] = t;
  }
}

}  // namespace

StepPlan make_step_plan(const ModelConfig& c, const StepPlanOptions& o) {
  if (o.batch < 1 || o.batch > 64) fail("plan: batch must be 1..64, got ", o.batch);
  if (o.sms < 1 || o.sms > 1024) fail("plan: SMs must be 1..1024, got ", o.sms);
  if (o.context < 1) fail("plan: context must be at least 1, got ", o.context);
  StepPlan p;
  p.options = o;
  p.architecture = c.architecture;
  p.layers = c.num_layers;
  p.hidden = c.hidden_size;
  p.heads = c.num_heads;
  p.kv_heads = c.num_kv_heads;
  p.head_dim = c.head_dim;
  p.qkv_rows = (p.heads + 2 * p.kv_heads) * p.head_dim;
  p.att_rows = p.heads * p.head_dim;
  if (c.is_mla()) {
    const MlaConfig& m = c.mla;
    p.mla = true;
    p.head_dim = m.qk_head_dim();
    p.kv_heads = p.heads;
    p.q_lora = m.q_lora_rank;
    p.kv_lora = m.kv_lora_rank;
    p.nope = m.qk_nope_head_dim;
    p.rope_dim = m.qk_rope_head_dim;
    p.v_dim = m.v_head_dim;
    p.qkv_rows = p.heads * p.head_dim;  // the queries
    p.att_rows = p.heads * p.v_dim;
    p.proj_rows = (p.q_lora > 0 ? p.q_lora : p.qkv_rows) + p.kv_lora + p.rope_dim;
    if (c.indexer.enabled()) {
      p.index_heads = c.indexer.heads;
      p.index_dim = c.indexer.head_dim;
      p.index_topk = c.indexer.topk;
      p.index_rows = p.index_heads * p.index_dim + p.index_dim + p.index_heads;
    }
  }
  p.vocab = c.vocab_size;
  p.mlp_rows = c.intermediate_size;
  bool moe = false;
  for (int64_t l = 0; l < c.num_layers; ++l) moe |= c.is_moe_layer(l);
  if (moe) {
    p.expert_rows = c.moe_intermediate_size;
    p.shared_rows = c.moe_intermediate_size * c.num_shared_experts;
    p.expert_positions = std::min<int64_t>(c.num_experts, int64_t(o.batch) * c.experts_per_token);
  }
  // One split per SM over the KV heads (MLA: one group of every head), at least 16 positions
  // each: the splits run in one wave (two waves of shorter splits measured slower, docs/PERF.md
  // v29: each split's fixed cost is most of it).
  const int64_t groups = p.mla ? 1 : p.kv_heads;
  const int64_t want = std::max<int64_t>(1, int64_t(o.sms) / groups);
  p.splits = std::clamp<int64_t>(want, 1, std::min<int64_t>(64, (o.context + 15) / 16));
  p.units.assign(kStepBufCount, 0);
  p.units[size_t(StepBuf::Hidden)] = p.hidden;
  p.units[size_t(StepBuf::Qkv)] = p.qkv_rows;
  p.units[size_t(StepBuf::KvCache)] = p.layers * groups;
  p.units[size_t(StepBuf::KvNew)] = p.mla ? 0 : p.layers * groups;
  p.units[size_t(StepBuf::AttnPart)] = groups * p.splits;
  p.units[size_t(StepBuf::AttnOut)] = p.att_rows;
  p.units[size_t(StepBuf::MlaProj)] = p.proj_rows;
  p.units[size_t(StepBuf::QLat)] = p.q_lora;
  p.units[size_t(StepBuf::QAbs)] = p.mla ? p.heads : 0;
  const bool sparse = p.index_topk > 0;
  p.units[size_t(StepBuf::IndexQ)] = p.index_rows;
  p.units[size_t(StepBuf::IndexCache)] = sparse ? p.layers : 0;
  p.units[size_t(StepBuf::IndexScores)] = sparse ? p.splits : 0;
  p.units[size_t(StepBuf::Selection)] = sparse ? 1 : 0;
  p.units[size_t(StepBuf::RouterLogits)] = moe ? c.num_experts : 0;
  p.units[size_t(StepBuf::Routes)] = moe ? 1 : 0;
  p.units[size_t(StepBuf::ExpertMid)] = p.expert_positions * p.expert_rows;
  p.units[size_t(StepBuf::SharedMid)] = p.shared_rows;
  p.units[size_t(StepBuf::Mid)] = p.mlp_rows;
  p.units[size_t(StepBuf::Logits)] = p.vocab;
  Builder(c, o, p).build();
  return p;
}

}  // namespace kestrel
