#include "model/weights.h"

#include <cstring>
#include <filesystem>
#include <iterator>

#include "common/error.h"
#include "common/numeric.h"
#include "formats/nvfp4.h"
#include "model/gguf_model.h"

namespace kestrel {
namespace fs = std::filesystem;

const char* format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::F32: return "F32";
    case WeightFormat::F16: return "F16";
    case WeightFormat::BF16: return "BF16";
    case WeightFormat::NVFP4: return "NVFP4";
    case WeightFormat::FP8: return "FP8";
    case WeightFormat::Q8_0: return "Q8_0";
    case WeightFormat::Q4_0: return "Q4_0";
    case WeightFormat::Q4_1: return "Q4_1";
    case WeightFormat::Q5_0: return "Q5_0";
    case WeightFormat::Q5_1: return "Q5_1";
    case WeightFormat::Q2_K: return "Q2_K";
    case WeightFormat::Q3_K: return "Q3_K";
    case WeightFormat::Q4_K: return "Q4_K";
    case WeightFormat::Q5_K: return "Q5_K";
    case WeightFormat::Q6_K: return "Q6_K";
    case WeightFormat::MXFP4: return "MXFP4";
    case WeightFormat::NVFP4_GGML: return "NVFP4_GGML";
  }
  return "?";
}

namespace {

// GGUF block formats in WeightFormat order, starting at Q8_0.
constexpr GgmlType kGgmlBlockTypes[] = {GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0,
                                        GgmlType::Q5_1, GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K,
                                        GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::MXFP4, GgmlType::NVFP4};
constexpr int kFirstGgml = int(WeightFormat::Q8_0);
static_assert(kFirstGgml + int(std::size(kGgmlBlockTypes)) == kWeightFormatCount);

GgmlType ggml_type_of(WeightFormat f) { return kGgmlBlockTypes[int(f) - kFirstGgml]; }

}  // namespace

std::optional<WeightFormat> weight_format_of(GgmlType t) {
  switch (t) {
    case GgmlType::F32: return WeightFormat::F32;
    case GgmlType::F16: return WeightFormat::F16;
    case GgmlType::BF16: return WeightFormat::BF16;
    default: break;
  }
  for (int k = 0; k < int(std::size(kGgmlBlockTypes)); ++k)
    if (kGgmlBlockTypes[k] == t) return WeightFormat(kFirstGgml + k);
  return std::nullopt;
}

size_t Linear::row_bytes() const {
  switch (format) {
    case WeightFormat::F32: return size_t(in) * 4;
    case WeightFormat::F16:
    case WeightFormat::BF16: return size_t(in) * 2;
    case WeightFormat::NVFP4: return size_t(in) / 2 + size_t(in) / kNvfp4Block;
    case WeightFormat::FP8: return size_t(in);
    default: {
      const GgmlTypeInfo* t = ggml_type_info(uint32_t(ggml_type_of(format)));
      return size_t(in) / t->block * t->bytes;
    }
  }
}

int64_t Linear::block() const {
  switch (format) {
    case WeightFormat::F32:
    case WeightFormat::F16:
    case WeightFormat::BF16: return 1;
    case WeightFormat::NVFP4: return kNvfp4Block;
    case WeightFormat::FP8: return fp8.cols;
    default: return ggml_type_info(uint32_t(ggml_type_of(format)))->block;
  }
}

size_t Linear::scale_bytes() const {
  if (format != WeightFormat::FP8) return 0;
  return size_t(fp8.scale_rows(out)) * size_t(fp8.scale_cols(in)) * (fp8_bf16_scales ? 2 : 4);
}

size_t Linear::bytes() const { return row_bytes() * size_t(out) + scale_bytes(); }

void Linear::dequant_row(int64_t row, float* o) const {
  switch (format) {
    case WeightFormat::F32:
      std::memcpy(o, data + size_t(row) * size_t(in) * 4, size_t(in) * 4);
      return;
    case WeightFormat::BF16: {
      const uint8_t* p = data + size_t(row) * size_t(in) * 2;
      for (int64_t i = 0; i < in; ++i) {
        uint16_t v;
        std::memcpy(&v, p + 2 * i, 2);
        o[i] = bf16_to_f32(v);
      }
      return;
    }
    case WeightFormat::F16: {
      const uint8_t* p = data + size_t(row) * size_t(in) * 2;
      for (int64_t i = 0; i < in; ++i) {
        uint16_t v;
        std::memcpy(&v, p + 2 * i, 2);
        o[i] = f16_to_f32(v);
      }
      return;
    }
    case WeightFormat::NVFP4:
      nvfp4_dequant_row(data + size_t(row) * size_t(in / 2), scales + size_t(row) * size_t(in / kNvfp4Block), scale2,
                        in, o);
      return;
    case WeightFormat::FP8: {
      const size_t scale_row = size_t(row / fp8.rows) * size_t(fp8.scale_cols(in)) * (fp8_bf16_scales ? 2 : 4);
      fp8_dequant_row(data + size_t(row) * size_t(in), scales + scale_row, fp8_bf16_scales, fp8.cols, in, o);
      return;
    }
    default:
      ggml_dequant_row(ggml_type_of(format), data + size_t(row) * row_bytes(), in, o);
      if (scale2 != 1.0f)
        for (int64_t i = 0; i < in; ++i) o[i] *= scale2;
      return;
  }
}

std::vector<const Linear*> LayerWeights::attention_linears() const {
  std::vector<const Linear*> out;
  for (const Linear* l : {&q, &k, &v, &mla.q_a, &mla.q_b, &mla.q, &mla.kv_a, &mla.kv_b, &mla.indexer.wq_b,
                          &mla.indexer.wk, &mla.indexer.weights_proj, &o})
    if (l->data) out.push_back(l);
  return out;
}

namespace {

std::string shape_str(std::initializer_list<int64_t> s) {
  std::string r = "[";
  size_t i = 0;
  for (int64_t d : s) r += (i++ ? ", " : "") + std::to_string(d);
  return r + "]";
}

void expect_shape(const TensorView& t, std::initializer_list<int64_t> shape, const std::string& why) {
  if (t.shape.size() != shape.size() || !std::equal(shape.begin(), shape.end(), t.shape.begin()))
    fail(t.where(), ": shape ", t.shape_str(), " disagrees with ", why, " (expected ", shape_str(shape), ")");
}

float read_scalar_f32(const TensorView& t) {
  if (t.dtype != DType::F32) fail(t.where(), ": expected an F32 scalar, found ", dtype_name(t.dtype));
  if (t.numel() != 1) fail(t.where(), ": expected a scalar, found shape ", t.shape_str());
  float v;
  std::memcpy(&v, t.data, 4);
  if (!std::isfinite(v)) fail(t.where(), ": scale is not finite");
  return v;
}

std::vector<float> to_floats(const TensorView& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < v.size(); ++i) {
    const uint8_t* p = t.data + i * dtype_size(t.dtype);
    uint16_t h;
    switch (t.dtype) {
      case DType::F32: std::memcpy(&v[i], p, 4); break;
      case DType::BF16: std::memcpy(&h, p, 2); v[i] = bf16_to_f32(h); break;
      case DType::F16: std::memcpy(&h, p, 2); v[i] = f16_to_f32(h); break;
      default: fail(t.where(), ": expected a float tensor (F32, F16, BF16), found ", dtype_name(t.dtype));
    }
  }
  return v;
}

std::optional<WeightFormat> dense_format(DType d) {
  switch (d) {
    case DType::F32: return WeightFormat::F32;
    case DType::F16: return WeightFormat::F16;
    case DType::BF16: return WeightFormat::BF16;
    default: return std::nullopt;
  }
}

class Loader {
 public:
  Loader(const Checkpoint& ck, const ModelConfig& cfg) : ck_(ck), cfg_(cfg) {}

  std::vector<float> vec(const std::string& name, int64_t n) {
    const TensorView& t = ck_.get(name);
    expect_shape(t, {n}, cat("config.json (", n, " entries)"));
    return to_floats(t);
  }

  // A dense matrix: embeddings, LM head, router.
  Linear dense(const std::string& module, const std::string& tensor, int64_t out, int64_t in) {
    const TensorView& t = ck_.get(tensor);
    Linear l;
    l.name = module;
    l.out = out;
    l.in = in;
    auto f = dense_format(t.dtype);
    if (!f) fail(t.where(), ": expected F32, F16 or BF16 for this module, found ", dtype_name(t.dtype));
    expect_shape(t, {out, in}, "config.json");
    l.format = *f;
    l.data = t.data;
    return l;
  }

  Linear linear(const std::string& module, int64_t out, int64_t in, bool bias) {
    Linear l;
    const QuantConfig& q = cfg_.quant;
    if (q.quantizes(module)) {
      l = q.is_fp8() ? fp8(module, out, in) : nvfp4(module, out, in);
    } else {
      for (const char* aux : {".weight_scale", ".weight_packed", ".weight_scale_inv"})
        if (const TensorView* t = ck_.find(module + aux))
          fail(t->where(), ": module is stored quantized but ", q.is_quantized() ? q.source : cfg_.source,
               " does not quantize it (excluded or no quantization settings)");
      l = dense(module, module + ".weight", out, in);
    }
    if (bias) l.bias = vec(module + ".bias", out);
    return l;
  }

  GatedFfn ffn(const std::string& prefix, const std::string& g, const std::string& u, const std::string& d,
               int64_t width) {
    const int64_t h = cfg_.hidden_size;
    return {linear(prefix + "." + g, width, h, false), linear(prefix + "." + u, width, h, false),
            linear(prefix + "." + d, h, width, false)};
  }

  // Experts stored as 3D tensors: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].
  std::vector<GatedFfn> fused_experts(const std::string& prefix) {
    const int64_t e = cfg_.num_experts, i = cfg_.moe_intermediate_size, h = cfg_.hidden_size;
    const TensorView& gu = ck_.get(prefix + ".gate_up_proj");
    const TensorView& dn = ck_.get(prefix + ".down_proj");
    expect_shape(gu, {e, 2 * i, h}, "config.json (experts, 2 x moe_intermediate_size, hidden_size)");
    expect_shape(dn, {e, h, i}, "config.json (experts, hidden_size, moe_intermediate_size)");
    if (cfg_.quant.is_quantized() && cfg_.quant.quantizes(prefix))
      fail(gu.where(), ": fused expert tensors are only supported unquantized");
    auto f1 = dense_format(gu.dtype), f2 = dense_format(dn.dtype);
    if (!f1) fail(gu.where(), ": expected F32, F16 or BF16, found ", dtype_name(gu.dtype));
    if (!f2) fail(dn.where(), ": expected F32, F16 or BF16, found ", dtype_name(dn.dtype));
    std::vector<GatedFfn> out(static_cast<size_t>(e));
    const size_t es = dtype_size(gu.dtype), ds = dtype_size(dn.dtype);
    for (int64_t x = 0; x < e; ++x) {
      auto view = [&](Linear& l, const TensorView& t, WeightFormat f, size_t elem, int64_t rows, int64_t cols,
                      size_t offset_elems, const char* what) {
        l.name = cat(prefix, ".", x, ".", what);
        l.out = rows;
        l.in = cols;
        l.format = f;
        l.data = t.data + offset_elems * elem;
      };
      GatedFfn& g = out[size_t(x)];
      view(g.gate, gu, *f1, es, i, h, size_t(x * 2 * i * h), "gate");
      view(g.up, gu, *f1, es, i, h, size_t(x * 2 * i * h + i * h), "up");
      view(g.down, dn, *f2, ds, h, i, size_t(x * h * i), "down");
    }
    return out;
  }

 private:
  // The stored weight's dtype is dense where the settings say quantized.
  [[noreturn]] void dense_but_quantized(const TensorView& w, const char* format) {
    const QuantConfig& q = cfg_.quant;
    fail(w.where(), ": stored as ", dtype_name(w.dtype), " but ", q.source, " says this module is ", format,
         " (is it missing from ", q.exclude_key(), "?)");
  }

  // FP8 E4M3 codes in `weight`, their scales in `weight_scale_inv` (block-scaled quant_method fp8)
  // or `weight_scale` (per tensor, compressed-tensors); input scales of static activation schemes
  // are not read.
  Linear fp8(const std::string& module, int64_t out, int64_t in) {
    const QuantConfig& q = cfg_.quant;
    const std::string wname = module + ".weight";
    const std::string sname = module + "." + q.fp8_scale_name();
    const TensorView* w = ck_.find(wname);
    if (!w) fail(ck_.dir(), ": missing tensor '", wname, "' (FP8 module per ", q.source, ")");
    if (dense_format(w->dtype)) dense_but_quantized(*w, "FP8");
    const TensorView* s = ck_.find(sname);
    if (!s) fail(w->where(), ": FP8 weight without its scales (missing tensor '", sname, "')");
    const Fp8Blocks blocks = q.fp8_blocks(out, in);
    const Fp8Matrix m = read_fp8_matrix(*w, *s, out, in, blocks);
    Linear l;
    l.name = module;
    l.out = out;
    l.in = in;
    l.format = WeightFormat::FP8;
    l.data = m.codes;
    l.scales = m.scales;
    l.fp8 = blocks;
    l.fp8_bf16_scales = m.bf16_scales;
    return l;
  }

  Linear nvfp4(const std::string& module, int64_t out, int64_t in) {
    const QuantConfig& q = cfg_.quant;
    const bool ct = q.method == QuantMethod::CompressedTensors;
    const std::string wname = module + (ct ? ".weight_packed" : ".weight");
    const TensorView* w = ck_.find(wname);
    if (!w) {
      if (const TensorView* plain = ck_.find(module + ".weight")) dense_but_quantized(*plain, "NVFP4");
      fail(ck_.dir(), ": missing tensor '", wname, "' (NVFP4 module per ", q.source, ")");
    }
    if (in % kNvfp4Block != 0)
      fail(w->where(), ": NVFP4 needs the input dimension to be a multiple of 16, but K = ", in);
    if (w->dtype != DType::U8) {
      if (dense_format(w->dtype)) dense_but_quantized(*w, "NVFP4");
      fail(w->where(), ": NVFP4 codes must be U8, found ", dtype_name(w->dtype));
    }
    expect_shape(*w, {out, in / 2}, "config.json for packed NVFP4 (out, in/2)");
    const TensorView& s = ck_.get(module + ".weight_scale");
    if (s.dtype != DType::F8_E4M3) fail(s.where(), ": NVFP4 block scales must be F8_E4M3, found ", dtype_name(s.dtype));
    expect_shape(s, {out, in / kNvfp4Block}, "config.json for NVFP4 block scales (out, in/16)");
    Linear l;
    l.name = module;
    l.out = out;
    l.in = in;
    l.format = WeightFormat::NVFP4;
    l.data = w->data;
    l.scales = s.data;
    if (ct) {
      const TensorView& g = ck_.get(module + ".weight_global_scale");
      const float global = read_scalar_f32(g);
      if (!(global > 0)) fail(g.where(), ": global scale must be positive (it divides the weights)");
      l.scale2 = 1.0f / global;
      if (const TensorView* is = ck_.find(module + ".input_global_scale")) {
        const float v = read_scalar_f32(*is);
        l.input_scale = v > 0 ? 1.0f / v : 0.0f;
      }
    } else {
      l.scale2 = read_scalar_f32(ck_.get(module + ".weight_scale_2"));
      if (const TensorView* is = ck_.find(module + ".input_scale")) l.input_scale = read_scalar_f32(*is);
    }
    return l;
  }

  const Checkpoint& ck_;
  const ModelConfig& cfg_;
};

// Hub names: q_a_proj, q_a_layernorm, q_b_proj (or q_proj), kv_a_proj_with_mqa, kv_a_layernorm,
// kv_b_proj, o_proj; GLM-5's indexer.{wq_b, wk, k_norm, weights_proj}. attention_bias covers
// q_a_proj, kv_a_proj_with_mqa and o_proj.
void load_mla(Loader& ld, const ModelConfig& c, bool own_indexer, const std::string& a, LayerWeights& L) {
  const MlaConfig& m = c.mla;
  const int64_t h = c.hidden_size, heads = c.num_heads;
  MlaWeights& w = L.mla;
  if (m.q_lora_rank > 0) {
    w.q_a = ld.linear(a + "q_a_proj", m.q_lora_rank, h, c.qkv_bias);
    w.q_a_norm = ld.vec(a + "q_a_layernorm.weight", m.q_lora_rank);
    w.q_b = ld.linear(a + "q_b_proj", heads * m.qk_head_dim(), m.q_lora_rank, false);
  } else {
    w.q = ld.linear(a + "q_proj", heads * m.qk_head_dim(), h, false);
  }
  w.kv_a = ld.linear(a + "kv_a_proj_with_mqa", m.latent(), h, c.qkv_bias);
  w.kv_a_norm = ld.vec(a + "kv_a_layernorm.weight", m.kv_lora_rank);
  w.kv_b = ld.linear(a + "kv_b_proj", heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, false);
  L.o = ld.linear(a + "o_proj", h, heads * m.v_head_dim, c.o_bias);
  const IndexerConfig& ix = c.indexer;
  if (ix.enabled() && own_indexer) {
    w.has_indexer = true;
    IndexerWeights& x = w.indexer;
    x.wq_b = ld.linear(a + "indexer.wq_b", ix.heads * ix.head_dim, m.q_lora_rank, false);
    x.wk = ld.linear(a + "indexer.wk", ix.head_dim, h, false);
    x.k_norm = ld.vec(a + "indexer.k_norm.weight", ix.head_dim);
    x.k_norm_bias = ld.vec(a + "indexer.k_norm.bias", ix.head_dim);
    x.weights_proj = ld.linear(a + "indexer.weights_proj", ix.heads, h, false);
  }
}

// The weights of one decoder layer under prefix p ("model.layers.N.").
void load_layer(Loader& ld, const Checkpoint& ck, const ModelConfig& c, const std::string& p, bool moe_layer,
                bool own_indexer, LayerWeights& L) {
  const int64_t h = c.hidden_size, hd = c.head_dim;
  L.attn_norm = ld.vec(p + "input_layernorm.weight", h);
  L.ffn_norm = ld.vec(p + "post_attention_layernorm.weight", h);
  if (c.is_mla()) {
    load_mla(ld, c, own_indexer, p + "self_attn.", L);
  } else {
    L.q = ld.linear(p + "self_attn.q_proj", c.num_heads * hd, h, c.qkv_bias);
    L.k = ld.linear(p + "self_attn.k_proj", c.num_kv_heads * hd, h, c.qkv_bias);
    L.v = ld.linear(p + "self_attn.v_proj", c.num_kv_heads * hd, h, c.qkv_bias);
    L.o = ld.linear(p + "self_attn.o_proj", h, c.num_heads * hd, c.o_bias);
  }
  if (c.qk_norm) {
    L.q_norm = ld.vec(p + "self_attn.q_norm.weight", hd);
    L.k_norm = ld.vec(p + "self_attn.k_norm.weight", hd);
  }
  L.is_moe = moe_layer;
  if (!L.is_moe) {
    L.mlp = ld.ffn(p + "mlp", "gate_proj", "up_proj", "down_proj", c.intermediate_size);
    return;
  }
  const std::string mp = p + c.moe_prefix;
  MoeWeights& moe = L.moe;
  moe.router = ld.dense(mp + ".gate", mp + ".gate.weight", c.num_experts, h);
  if (c.router == RouterKind::SigmoidBias) moe.correction_bias = ld.vec(mp + ".gate.e_score_correction_bias", c.num_experts);
  if (ck.has(mp + ".experts.gate_up_proj")) {
    moe.experts = ld.fused_experts(mp + ".experts");
  } else {
    for (int64_t e = 0; e < c.num_experts; ++e)
      moe.experts.push_back(ld.ffn(cat(mp, ".experts.", e), c.expert_gate, c.expert_up, c.expert_down,
                                   c.moe_intermediate_size));
  }
  if (c.num_shared_experts > 0) {
    moe.has_shared = true;
    moe.shared = ld.ffn(mp + ".shared_experts", "gate_proj", "up_proj", "down_proj",
                        c.moe_intermediate_size * c.num_shared_experts);
  }
}

// Whether the checkpoint holds any tensor under `prefix`.
bool has_prefix(const Checkpoint& ck, const std::string& prefix) {
  auto it = ck.tensors().lower_bound(prefix);
  return it != ck.tensors().end() && it->first.compare(0, prefix.size(), prefix) == 0;
}

// The MTP layers num_layers .. num_layers + num_nextn_predict_layers - 1. Checkpoints converted
// without them are common (the config still announces them), so all absent means none; a layer
// partly present fails on its first missing tensor, and some layers present but not all on the
// first absent layer's eh_proj.
void load_mtp(Loader& ld, const Checkpoint& ck, const ModelConfig& c, ModelWeights& w) {
  const int64_t n = c.num_nextn_predict_layers, h = c.hidden_size;
  int64_t present = 0;
  for (int64_t k = 0; k < n; ++k) present += has_prefix(ck, cat("model.layers.", c.num_layers + k, "."));
  if (present == 0) return;
  // The MTP layer's feed-forward is like the main model's last layer (DeepSeek-V3 and GLM-5: MoE).
  const bool moe = c.is_moe_layer(c.num_layers - 1);
  for (int64_t k = 0; k < n; ++k) {
    MtpLayer m;
    m.index = c.num_layers + k;
    const std::string p = cat("model.layers.", m.index, ".");
    if (!has_prefix(ck, p))
      fail(ck.dir(), ": missing tensor '", p, "eh_proj.weight' (", present, " of ", n,
           " MTP layers present; num_nextn_predict_layers in ", c.source, ")");
    m.enorm = ld.vec(p + "enorm.weight", h);
    m.hnorm = ld.vec(p + "hnorm.weight", h);
    m.eh_proj = ld.linear(p + "eh_proj", h, 2 * h, false);
    load_layer(ld, ck, c, p, moe, true, m.layer);
    m.head_norm = ld.vec(p + "shared_head.norm.weight", h);
    if (ck.has(p + "shared_head.head.weight")) {
      m.head = ld.dense(p + "shared_head.head", p + "shared_head.head.weight", c.vocab_size, h);
    } else {
      m.head = w.lm_head;
      m.head.name = p + "shared_head.head (the main lm_head)";
    }
    if (ck.has(p + "embed_tokens.weight")) {
      m.embed = ld.dense(p + "embed_tokens", p + "embed_tokens.weight", c.vocab_size, h);
    } else {
      m.embed = w.embed;
      m.embed.name = p + "embed_tokens (the main embedding)";
    }
    w.mtp.push_back(std::move(m));
  }
}

std::unique_ptr<Model> load_folder(const std::string& dir) {
  auto m = std::make_unique<Model>();
  m->config = load_model_config(dir);
  m->checkpoint = std::make_unique<Checkpoint>(dir);
  const ModelConfig& c = m->config;
  Loader ld(*m->checkpoint, c);
  ModelWeights& w = m->weights;
  const int64_t h = c.hidden_size;

  w.embed = ld.dense("model.embed_tokens", "model.embed_tokens.weight", c.vocab_size, h);
  w.final_norm = ld.vec("model.norm.weight", h);
  if (c.tie_word_embeddings && !m->checkpoint->has("lm_head.weight")) {
    w.lm_head = w.embed;
    w.lm_head.name = "lm_head (tied to model.embed_tokens)";
  } else {
    w.lm_head = ld.dense("lm_head", "lm_head.weight", c.vocab_size, h);
  }

  w.layers.resize(size_t(c.num_layers));
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const bool own_indexer = c.indexer.enabled() && c.indexer.own[size_t(i)];
    load_layer(ld, *m->checkpoint, c, cat("model.layers.", i, "."), c.is_moe_layer(i), own_indexer,
               w.layers[size_t(i)]);
  }
  load_mtp(ld, *m->checkpoint, c, w);
  return m;
}

}  // namespace

std::unique_ptr<Model> load_model(const std::string& path, Progress progress) {
  std::unique_ptr<Model> m;
  if (fs::is_regular_file(path)) {
    if (!is_gguf_file(path)) fail(path, ": not a GGUF file (give a .gguf file or a Hugging Face model folder)");
    m = load_gguf_model(path);
  } else if (fs::is_directory(path) && !fs::exists(fs::path(path) / "config.json")) {
    std::vector<std::string> ggufs;
    for (const auto& e : fs::directory_iterator(path))
      if (e.is_regular_file() && e.path().extension() == ".gguf") ggufs.push_back(e.path().string());
    if (ggufs.size() > 1) fail(path, ": no config.json and ", ggufs.size(), " .gguf files in this folder: name one");
    m = ggufs.size() == 1 ? load_gguf_model(ggufs[0]) : load_folder(path);
  } else {
    m = load_folder(path);
  }
  if (progress_shown(progress)) read_weights_with_progress(*m, path);
  return m;
}

StorageStats storage_stats(const Model& m) {
  StorageStats s;
  const ModelConfig& c = m.config;
  auto add = [&](const Linear& l, bool touched) {
    s.bytes[size_t(l.format)] += l.bytes();
    s.linears[size_t(l.format)] += 1;
    s.params += l.out * l.in;
    if (touched) s.params_per_token += l.out * l.in;
  };
  auto add_ffn = [&](const GatedFfn& f, bool touched) {
    add(f.gate, touched);
    add(f.up, touched);
    add(f.down, touched);
  };
  const ModelWeights& w = m.weights;
  add(w.embed, false);
  s.params_per_token += c.hidden_size;  // one embedding row
  if (w.lm_head.data != w.embed.data) add(w.lm_head, true);
  else s.params_per_token += c.vocab_size * c.hidden_size;
  // MTP layers count as stored, not as touched: a plain decode step does not run them.
  auto add_layer = [&](const LayerWeights& L, bool touched) {
    for (const Linear* l : L.attention_linears()) add(*l, touched);
    if (!L.is_moe) {
      add_ffn(L.mlp, touched);
      return;
    }
    add(L.moe.router, touched);
    int64_t per_expert = 0;
    for (const auto& e : L.moe.experts) {
      add_ffn(e, false);
      per_expert = e.gate.out * e.gate.in * 3;
    }
    if (touched) s.params_per_token += per_expert * c.experts_per_token;
    if (L.moe.has_shared) add_ffn(L.moe.shared, touched);
  };
  for (const auto& L : w.layers) add_layer(L, true);
  for (const auto& M : w.mtp) {
    add(M.eh_proj, false);
    add_layer(M.layer, false);
    if (M.head.data != w.lm_head.data) add(M.head, false);
    if (M.embed.data != w.embed.data) add(M.embed, false);
  }
  size_t total = 0, linear = 0;
  if (m.checkpoint)
    for (const auto& [name, t] : m.checkpoint->tensors()) total += t->nbytes;
  if (m.gguf)
    for (const auto& t : m.gguf->index().tensors()) total += t.nbytes;
  for (size_t b : s.bytes) linear += b;
  s.other_bytes = total > linear ? total - linear : 0;
  return s;
}

}  // namespace kestrel
