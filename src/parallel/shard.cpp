#include "parallel/shard.h"

#include <algorithm>
#include <cstring>

#include "common/error.h"
#include "formats/nvfp4.h"

namespace kestrel {
namespace {

// Builds the linears of one rank; column slices that need copies keep them in `owned`.
class Slicer {
 public:
  explicit Slicer(std::vector<std::vector<uint8_t>>& owned) : owned_(owned) {}

  // Output rows [r0, r1): a view. FP8 rows that start inside a block of rows (of several) are
  // stored as F32 (exact), since their scale rows would not line up.
  Linear rows(const Linear& w, int64_t r0, int64_t r1) {
    if (!w.data) return w;
    Linear s = w;
    s.out = r1 - r0;
    if (w.format == WeightFormat::FP8 && r0 % w.fp8.rows != 0 && w.out > w.fp8.rows) {
      s.format = WeightFormat::F32;
      s.scales = nullptr;
      auto* buf = reinterpret_cast<float*>(own(size_t(s.out * w.in) * 4));
      for (int64_t r = r0; r < r1; ++r) w.dequant_row(r, buf + (r - r0) * w.in);
      s.data = reinterpret_cast<const uint8_t*>(buf);
    } else if (w.format == WeightFormat::FP8) {
      s.data = w.data + size_t(r0) * size_t(w.in);
      const size_t scale_row = size_t(w.fp8.scale_cols(w.in)) * (w.fp8_bf16_scales ? 2 : 4);
      s.scales = w.scales + size_t(r0 / w.fp8.rows) * scale_row;
    } else if (w.format == WeightFormat::NVFP4) {
      s.data = w.data + size_t(r0) * size_t(w.in / 2);
      s.scales = w.scales + size_t(r0) * size_t(w.in / kNvfp4Block);
    } else {
      s.data = w.data + size_t(r0) * w.row_bytes();
    }
    if (!w.bias.empty()) s.bias.assign(w.bias.begin() + r0, w.bias.begin() + r1);
    return s;
  }

  // Input columns [c0, c1): a copy. The bias stays with one rank (`keep_bias`) since the ranks'
  // outputs are summed. A slice that cuts through the format's blocks is stored as F32 (exact).
  Linear cols(const Linear& w, int64_t c0, int64_t c1, bool keep_bias) {
    if (!w.data) return w;
    Linear s = w;
    s.in = c1 - c0;
    if (!keep_bias) s.bias.clear();
    const int64_t b = w.block();
    if (c0 % b != 0 || c1 % b != 0) {
      s.format = WeightFormat::F32;
      s.scales = nullptr;
      s.scale2 = 1.0f;
      uint8_t* buf = own(size_t(w.out * s.in) * 4);
      std::vector<float> row(static_cast<size_t>(w.in));
      for (int64_t r = 0; r < w.out; ++r) {
        w.dequant_row(r, row.data());
        std::memcpy(buf + size_t(r * s.in) * 4, row.data() + c0, size_t(s.in) * 4);
      }
      s.data = buf;
      return s;
    }
    if (w.format == WeightFormat::FP8) {
      const size_t es = w.fp8_bf16_scales ? 2 : 4, ins = size_t(w.fp8.scale_cols(w.in)) * es;
      const size_t outs = size_t(w.fp8.scale_cols(s.in)) * es, sr = size_t(w.fp8.scale_rows(w.out));
      uint8_t* d = own(size_t(w.out * s.in));
      uint8_t* sc = own(sr * outs);
      for (int64_t r = 0; r < w.out; ++r) std::memcpy(d + size_t(r * s.in), w.data + size_t(r * w.in + c0), size_t(s.in));
      for (size_t r = 0; r < sr; ++r) std::memcpy(sc + r * outs, w.scales + r * ins + size_t(c0 / b) * es, outs);
      s.data = d;
      s.scales = sc;
      return s;
    }
    if (w.format == WeightFormat::NVFP4) {
      const size_t in2 = size_t(w.in / 2), out2 = size_t(s.in / 2);
      const size_t ins = size_t(w.in / kNvfp4Block), outs = size_t(s.in / kNvfp4Block);
      uint8_t* d = own(size_t(w.out) * out2);
      uint8_t* sc = own(size_t(w.out) * outs);
      for (int64_t r = 0; r < w.out; ++r) {
        std::memcpy(d + size_t(r) * out2, w.data + size_t(r) * in2 + size_t(c0 / 2), out2);
        std::memcpy(sc + size_t(r) * outs, w.scales + size_t(r) * ins + size_t(c0 / kNvfp4Block), outs);
      }
      s.data = d;
      s.scales = sc;
      return s;
    }
    // Plain types and ggml blocks: a row is in / block blocks of equal size.
    const size_t per_block = w.row_bytes() / size_t(w.in / b);
    const size_t from = size_t(c0 / b) * per_block, n = s.row_bytes();
    uint8_t* d = own(size_t(w.out) * n);
    for (int64_t r = 0; r < w.out; ++r) std::memcpy(d + size_t(r) * n, w.data + size_t(r) * w.row_bytes() + from, n);
    s.data = d;
    return s;
  }

  // A gated FFN whose hidden width is split: gate/up rows and down columns [i0, i1).
  GatedFfn ffn(const GatedFfn& f, int64_t i0, int64_t i1, bool keep_bias) {
    return {rows(f.gate, i0, i1), rows(f.up, i0, i1), cols(f.down, i0, i1, keep_bias)};
  }

 private:
  // The storage stays put while `owned_` grows (a moved vector keeps its buffer).
  uint8_t* own(size_t n) { return owned_.emplace_back(n).data(); }
  std::vector<std::vector<uint8_t>>& owned_;
};

int64_t divide(int64_t n, int parts, const char* what, const char* flag) {
  if (n % parts != 0) fail(flag, " ", parts, ": ", n, " ", what, " do not divide evenly");
  return n / parts;
}

}  // namespace

VocabShare vocab_share(int64_t vocab, int ranks, int rank) {
  VocabShare v;
  v.share = (vocab + ranks - 1) / ranks;
  v.begin = std::min(vocab, v.share * rank);
  v.end = std::min(vocab, v.begin + v.share);
  return v;
}

ShardDims shard_dims(const ModelConfig& c, const Layout& layout, int rank) {
  check_layout(layout, long(c.num_experts));
  const int n = layout.tp;
  if (rank < 0 || rank >= n) fail("internal: rank ", rank, " outside 0..", n - 1);
  ShardDims d;
  d.config = c;
  ModelConfig& sc = d.config;
  // Attention: heads split; KV heads split, or each rank keeps the one its heads read.
  const int64_t heads = divide(c.num_heads, n, "attention heads", "--tp");
  d.head0 = heads * rank;
  sc.num_heads = heads;
  if (c.is_mla()) {
    sc.num_kv_heads = heads;
  } else if (c.num_kv_heads >= n) {
    sc.num_kv_heads = divide(c.num_kv_heads, n, "KV heads", "--tp");
    d.kv_head0 = sc.num_kv_heads * rank;
  } else {
    if (n % c.num_kv_heads != 0) fail("--tp ", n, ": ", c.num_kv_heads, " KV heads cannot be replicated evenly");
    sc.num_kv_heads = 1;
    d.kv_head0 = d.head0 / (c.num_heads / c.num_kv_heads);
  }
  if (c.num_moe_layers() < c.num_layers) {
    sc.intermediate_size = divide(c.intermediate_size, n, "intermediate_size values", "--tp");
    d.ffn0 = sc.intermediate_size * rank;
  }
  d.experts = c.num_experts;
  if (c.num_moe_layers() > 0) {
    if (layout.ep > 1) {
      d.experts = c.num_experts / n;
      d.first_expert = d.experts * rank;
    } else {
      sc.moe_intermediate_size = divide(c.moe_intermediate_size, n, "moe_intermediate_size values", "--tp");
      d.expert_col0 = sc.moe_intermediate_size * rank;
    }
    d.shared_width = divide(c.moe_intermediate_size * c.num_shared_experts, n, "shared expert values", "--tp");
    d.shared0 = d.shared_width * rank;
  }
  d.vocab = vocab_share(c.vocab_size, n, rank);
  return d;
}

std::unique_ptr<Model> shard_model(const Model& full, const Layout& layout, int rank) {
  const ModelConfig& c = full.config;
  const ShardDims d = shard_dims(c, layout, rank);
  auto m = std::make_unique<Model>();
  m->config = d.config;
  Slicer slice(m->owned);
  const ModelWeights& w = full.weights;
  ModelWeights& o = m->weights;
  const int64_t heads = d.config.num_heads, h0 = d.head0, kv = d.config.num_kv_heads, kv0 = d.kv_head0;
  const int64_t inter = d.config.intermediate_size, width = d.config.moe_intermediate_size;
  const bool ep = layout.ep > 1, first_rank = rank == 0;

  o.embed = w.embed;  // replicated: a token's row is read whole on every rank
  o.final_norm = w.final_norm;
  o.lm_head = slice.rows(w.lm_head, d.vocab.begin, d.vocab.end);

  const int64_t hd = c.head_dim;
  for (const LayerWeights& L : w.layers) {
    LayerWeights R;
    R.attn_norm = L.attn_norm;
    R.ffn_norm = L.ffn_norm;
    R.q_norm = L.q_norm;
    R.k_norm = L.k_norm;
    if (c.is_mla()) {
      const MlaConfig& a = c.mla;
      const int64_t qh = a.qk_head_dim(), kvh = a.qk_nope_head_dim + a.v_head_dim;
      R.mla = L.mla;  // low-rank down-projections, their norms and the indexer: replicated
      if (a.q_lora_rank > 0) R.mla.q_b = slice.rows(L.mla.q_b, h0 * qh, (h0 + heads) * qh);
      else R.mla.q = slice.rows(L.mla.q, h0 * qh, (h0 + heads) * qh);
      R.mla.kv_b = slice.rows(L.mla.kv_b, h0 * kvh, (h0 + heads) * kvh);
      R.o = slice.cols(L.o, h0 * a.v_head_dim, (h0 + heads) * a.v_head_dim, first_rank);
    } else {
      R.q = slice.rows(L.q, h0 * hd, (h0 + heads) * hd);
      R.k = slice.rows(L.k, kv0 * hd, (kv0 + kv) * hd);
      R.v = slice.rows(L.v, kv0 * hd, (kv0 + kv) * hd);
      R.o = slice.cols(L.o, h0 * hd, (h0 + heads) * hd, first_rank);
    }
    R.is_moe = L.is_moe;
    if (!L.is_moe) {
      R.mlp = slice.ffn(L.mlp, d.ffn0, d.ffn0 + inter, first_rank);
    } else {
      const MoeWeights& M = L.moe;
      MoeWeights& E = R.moe;
      E.router = M.router;
      E.correction_bias = M.correction_bias;
      E.first_expert = d.first_expert;
      for (int64_t e = d.first_expert; e < d.first_expert + d.experts; ++e) {
        const GatedFfn& f = M.experts[size_t(e)];
        E.experts.push_back(ep ? f : slice.ffn(f, d.expert_col0, d.expert_col0 + width, first_rank));
      }
      E.has_shared = M.has_shared;
      if (M.has_shared) {
        E.shared = slice.ffn(M.shared, d.shared0, d.shared0 + d.shared_width, first_rank);
      }
    }
    o.layers.push_back(std::move(R));
  }
  return m;
}

}  // namespace kestrel
