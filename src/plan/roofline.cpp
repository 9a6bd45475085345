#include "plan/roofline.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "common/error.h"
#include "formats/quant_config.h"
#include "model/model_config.h"

namespace kestrel {
namespace {

constexpr double kNvfp4 = 0.5 + 1.0 / 16.0;  // 4-bit code + an FP8 scale per 16 weights

// An FP8 code per weight + a float32 scale per block (partial edge blocks not counted).
double fp8_bpw(const QuantConfig& q) {
  const Fp8Blocks b = q.fp8_block;
  return q.fp8_scaling == Fp8Scaling::Block ? 1.0 + 4.0 / double(b.rows * b.cols) : 1.0;
}

double bpw(const QuantConfig& q, QuantWhatIf w, const std::string& module) {
  switch (w) {
    case QuantWhatIf::Nvfp4: return kNvfp4;
    case QuantWhatIf::Bf16: return 2.0;
    default: return !q.quantizes(module) ? 2.0 : q.is_fp8() ? fp8_bpw(q) : kNvfp4;
  }
}

struct Builder {
  StepShapes& s;
  const QuantConfig& q;
  QuantWhatIf w;
  void add(const std::string& name, Part part, Split split, double out, double in, bool dense_only = false) {
    const double b = dense_only ? 2.0 : bpw(q, w, name);
    s.modules.push_back({name, part, split, out, in, 1.0, b});
  }
  double expert(const std::string& prefix, const std::string& g, const std::string& u, const std::string& d, double I,
                double H) {
    return I * H * (bpw(q, w, prefix + g) + bpw(q, w, prefix + u) + bpw(q, w, prefix + d));
  }
};

StepShapes mla_shapes(const ModelConfig& c, QuantWhatIf w) {
  StepShapes s;
  Builder b{s, c.quant, w};
  s.mla = true;
  s.architecture = c.architecture;
  const double H = double(s.hidden = c.hidden_size);
  s.layers = c.num_layers;
  s.vocab = c.vocab_size;
  const MlaConfig& m = c.mla;
  const IndexerConfig& ix = c.indexer;
  const double nh = double(c.num_heads), qlr = double(m.q_lora_rank), kvlr = double(m.kv_lora_rank);
  const double nope = double(m.qk_nope_head_dim), rope = double(m.qk_rope_head_dim), vd = double(m.v_head_dim);
  const double ihn = double(ix.heads), ihd = double(ix.head_dim);
  s.attended_positions_cap = ix.enabled() ? ix.topk : 0;
  s.kv_values_per_position = kvlr + rope;
  int64_t index_layers = 0;
  for (bool own : ix.own) index_layers += own;
  s.index_values_per_position = ix.enabled() ? ihd * double(index_layers) / double(c.num_layers) : 0;
  const double I = double(c.intermediate_size), MI = double(c.moe_intermediate_size);
  const double shared = double(c.num_shared_experts);
  s.experts = c.num_experts;
  s.experts_per_token = c.experts_per_token;
  for (int64_t i = 0; i < s.layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    const std::string a = p + "self_attn.";
    if (qlr > 0) {
      b.add(a + "q_a_proj", Part::Attention, Split::Replicated, qlr, H);
      b.add(a + "q_b_proj", Part::Attention, Split::Column, nh * (nope + rope), qlr);
    } else {
      b.add(a + "q_proj", Part::Attention, Split::Column, nh * (nope + rope), H);
    }
    b.add(a + "kv_a_proj_with_mqa", Part::Attention, Split::Replicated, kvlr + rope, H);
    b.add(a + "kv_b_proj", Part::Attention, Split::Column, nh * (nope + vd), kvlr);
    b.add(a + "o_proj", Part::Attention, Split::Row, H, nh * vd);
    if (ix.enabled() && ix.own[size_t(i)]) {
      b.add(a + "indexer.wq_b", Part::Attention, Split::Replicated, ihn * ihd, qlr);
      b.add(a + "indexer.wk", Part::Attention, Split::Replicated, ihd, H);
      b.add(a + "indexer.weights_proj", Part::Attention, Split::Replicated, ihn, H, true);
    }
    if (!c.is_moe_layer(i)) {
      b.add(p + "mlp.gate_proj", Part::DenseFfn, Split::Column, I, H);
      b.add(p + "mlp.up_proj", Part::DenseFfn, Split::Column, I, H);
      b.add(p + "mlp.down_proj", Part::DenseFfn, Split::Row, H, I);
      continue;
    }
    ++s.moe_layers;
    b.add(p + "mlp.gate", Part::Router, Split::Replicated, double(c.num_experts), H, true);
    if (shared > 0) {
      const std::string sp = p + "mlp.shared_experts.";
      b.add(sp + "gate_proj", Part::SharedExperts, Split::Column, MI * shared, H);
      b.add(sp + "up_proj", Part::SharedExperts, Split::Column, MI * shared, H);
      b.add(sp + "down_proj", Part::SharedExperts, Split::Row, H, MI * shared);
    }
    if (s.expert_bytes == 0) s.expert_bytes = b.expert(p + "mlp.experts.0.", "gate_proj", "up_proj", "down_proj", MI, H);
  }
  b.add("lm_head", Part::LmHead, Split::Vocab, double(s.vocab), H, true);
  return s;
}

StepShapes gqa_shapes(const ModelConfig& c, QuantWhatIf w) {
  StepShapes s;
  Builder b{s, c.quant, w};
  s.architecture = c.architecture;
  s.layers = c.num_layers;
  s.hidden = c.hidden_size;
  s.vocab = c.vocab_size;
  s.kv_heads = c.num_kv_heads;
  s.kv_values_per_position = 2.0 * double(c.num_kv_heads * c.head_dim);
  s.experts = c.num_experts;
  s.experts_per_token = c.experts_per_token;
  const double H = double(c.hidden_size), hd = double(c.head_dim), nq = double(c.num_heads), nkv = double(c.num_kv_heads);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    b.add(p + "self_attn.q_proj", Part::Attention, Split::Column, nq * hd, H);
    b.add(p + "self_attn.k_proj", Part::Attention, Split::KvHeads, nkv * hd, H);
    b.add(p + "self_attn.v_proj", Part::Attention, Split::KvHeads, nkv * hd, H);
    b.add(p + "self_attn.o_proj", Part::Attention, Split::Row, H, nq * hd);
    if (!c.is_moe_layer(i)) {
      const double I = double(c.intermediate_size);
      b.add(p + "mlp.gate_proj", Part::DenseFfn, Split::Column, I, H);
      b.add(p + "mlp.up_proj", Part::DenseFfn, Split::Column, I, H);
      b.add(p + "mlp.down_proj", Part::DenseFfn, Split::Row, H, I);
      continue;
    }
    ++s.moe_layers;
    const double E = double(c.num_experts), I = double(c.moe_intermediate_size);
    b.add(p + c.moe_prefix + ".gate", Part::Router, Split::Replicated, E, H, true);
    if (c.num_shared_experts > 0) {
      const double S = I * double(c.num_shared_experts);
      const std::string sp = p + "mlp.shared_experts.";
      b.add(sp + "gate_proj", Part::SharedExperts, Split::Column, S, H);
      b.add(sp + "up_proj", Part::SharedExperts, Split::Column, S, H);
      b.add(sp + "down_proj", Part::SharedExperts, Split::Row, H, S);
    }
    if (s.expert_bytes == 0)
      s.expert_bytes = b.expert(p + c.moe_prefix + ".experts.0.", c.expert_gate, c.expert_up, c.expert_down, I, H);
  }
  b.add("lm_head", Part::LmHead, Split::Vocab, double(c.vocab_size), H, true);
  return s;
}

// "model.layers.3.self_attn.indexer.wk" -> "indexer.wk"
std::string short_name(const std::string& name) {
  std::string n = name;
  if (n.rfind("model.layers.", 0) == 0) n = n.substr(n.find('.', 13) + 1);
  for (const char* prefix : {"self_attn.", "mlp."})
    if (n.rfind(prefix, 0) == 0) return n.substr(std::string(prefix).size());
  return n;
}

}  // namespace

double expected_distinct_experts(double pool, double experts, double top_k, int batch) {
  return pool * (1.0 - std::pow(1.0 - top_k / experts, double(batch)));
}

const char* part_name(Part p) {
  switch (p) {
    case Part::Attention: return "attention weights";
    case Part::DenseFfn: return "dense FFN";
    case Part::RoutedExperts: return "routed experts";
    case Part::SharedExperts: return "shared experts";
    case Part::Router: return "router";
    case Part::Embedding: return "embedding rows";
    case Part::LmHead: return "LM head";
  }
  return "?";
}

StepShapes step_shapes(const nlohmann::json& config, const std::string& config_path, QuantWhatIf quant) {
  if (!config.is_object()) fail(config_path, ": not a JSON object");
  return step_shapes(parse_model_config_and_quant(config, config_path), quant);
}

StepShapes step_shapes(const ModelConfig& c, QuantWhatIf quant) {
  return c.is_mla() ? mla_shapes(c, quant) : gqa_shapes(c, quant);
}

Roofline roofline(const StepShapes& s, const Layout& layout, int batch, int64_t context, double kv_bytes,
                  double bandwidth_gbs, const GpuSpec& link) {
  const int tp = layout.tp, ep = layout.ep;
  check_layout(layout, long(s.experts));
  if (batch < 1) fail("--batch: must be at least 1, got ", batch);
  if (context < 1) fail("--context: must be at least 1, got ", context);
  if (bandwidth_gbs <= 0) fail("--bandwidth: must be positive");
  const double B = double(batch), H = double(s.hidden);
  Roofline r;
  auto part = [&](Part p) -> RooflinePart& {
    for (RooflinePart& x : r.parts)
      if (x.part == p) return x;
    r.parts.push_back({p, 0.0, ""});
    return r.parts.back();
  };
  auto shards = [&](Split sp) {
    switch (sp) {
      case Split::Column:
      case Split::Row:
      case Split::Vocab: return double(tp);
      case Split::KvHeads: return double(std::min<int64_t>(tp, std::max<int64_t>(s.kv_heads, 1)));
      default: return 1.0;
    }
  };
  std::map<Part, std::set<std::string>> replicated;
  for (const ModuleShape& m : s.modules) {
    const double full = m.out * m.in * m.bytes_per_weight * m.count;
    part(m.part).bytes += full / shards(m.split);
    r.resident_bytes += full / shards(m.split);
    if (tp > 1 && (m.split == Split::Replicated || (m.split == Split::KvHeads && s.kv_heads < tp))) {
      replicated[m.part].insert(short_name(m.name));
    }
  }
  // Embedding rows: the table is replicated (a row per token is little to read; splitting it by
  // vocabulary would cost one more all-reduce per step).
  part(Part::Embedding).bytes = B * H * 2.0;
  r.resident_bytes += double(s.vocab) * H * 2.0;
  if (s.experts > 0) {
    const double E = double(s.experts);
    const double per_rank = ep > 1 ? E / ep : E;
    r.expected_experts = expected_distinct_experts(per_rank, E, double(s.experts_per_token), batch);
    RooflinePart& re = part(Part::RoutedExperts);
    re.bytes = double(s.moe_layers) * r.expected_experts * s.expert_bytes / (ep > 1 ? 1.0 : double(tp));
    r.resident_bytes += double(s.moe_layers) * per_rank * s.expert_bytes / (ep > 1 ? 1.0 : double(tp));
    char buf[160];
    std::snprintf(buf, sizeof buf, "%.1f of %.0f experts per layer%s (expected under uniform routing)", r.expected_experts,
                  per_rank, ep > 1 ? " on each GPU" : "");
    re.how = buf;
  }
  for (RooflinePart& p : r.parts) {
    if (!p.how.empty()) continue;
    if (tp == 1) p.how = "whole";
    else if (p.part == Part::Router) p.how = "replicated";
    else if (p.part == Part::Embedding) p.how = "replicated (one row per token)";
    else p.how = "split " + std::to_string(tp) + " ways";
    if (tp > 1 && p.part != Part::Router && !replicated[p.part].empty()) {
      std::string names;
      for (const std::string& n : replicated[p.part]) names += (names.empty() ? "" : ", ") + n;
      p.how += " except " + names + " (replicated)";
    }
  }
  std::stable_sort(r.parts.begin(), r.parts.end(), [](const RooflinePart& a, const RooflinePart& b) { return a.part < b.part; });
  for (const RooflinePart& p : r.parts) r.weight_bytes += p.bytes;

  // KV cache: GQA heads split across ranks (replicated below one head per rank); the MLA latent
  // is replicated on every rank; DSA attends to at most index_topk positions but its indexer
  // reads a key at every position.
  const double L = double(context), layers = double(s.layers);
  if (s.mla) {
    const double attended = s.attended_positions_cap > 0 ? std::min(L, double(s.attended_positions_cap)) : L;
    r.kv_bytes = B * layers * (attended * s.kv_values_per_position + L * s.index_values_per_position) * kv_bytes;
  } else {
    const double heads = double(std::max<int64_t>(s.kv_heads, 1));
    const double per_gpu_heads = std::ceil(heads / double(std::min<int64_t>(tp, s.kv_heads)));
    r.kv_bytes = B * L * layers * s.kv_values_per_position / heads * per_gpu_heads * kv_bytes;
  }
  r.memory_ms = r.total_bytes() / (bandwidth_gbs * 1e6);
  const int ranks = std::max(tp, ep);
  if (ranks > 1) {
    r.allreduces = int(2 * s.layers + 1);  // after attention and after the FFN of each layer; the sampled token
    r.allreduce_bytes = B * H * 2.0;          // BF16 activations
    const double per = link.allreduce_latency_us + r.allreduce_bytes * 2.0 * (ranks - 1) / ranks / (link.link_gbs * 1e3);
    r.comm_ms = r.allreduces * per / 1e3;
  }
  r.floor_ms = r.memory_ms + r.comm_ms;
  return r;
}

}  // namespace kestrel
