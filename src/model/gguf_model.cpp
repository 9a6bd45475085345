#include "model/gguf_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <set>

#include "common/error.h"

namespace kestrel {
namespace {

struct Arch {
  const char* hf;         // Hugging Face class the file corresponds to
  bool permuted_qk;       // llama.cpp's converter interleaves the rotary halves of Q and K rows
  bool needs_qkv_bias;
  bool needs_qk_norm;
  const char* ffn_norm;   // the norm before the feed-forward block (Hugging Face post_attention_layernorm)
  bool sigmoid_router;    // GLM-4.5 style: sigmoid scores, correction bias, shared experts
};

const Arch* find_arch(const std::string& name) {
  static const std::map<std::string, Arch> table = {
      {"llama", {"LlamaForCausalLM", true, false, false, "ffn_norm", false}},
      {"qwen2", {"Qwen2ForCausalLM", false, true, false, "ffn_norm", false}},
      {"qwen3", {"Qwen3ForCausalLM", false, false, true, "ffn_norm", false}},
      {"qwen3moe", {"Qwen3MoeForCausalLM", false, false, true, "ffn_norm", false}},
      // llama.cpp names GLM-4.5's post_attention_layernorm attn_post_norm ("post_attention_norm").
      {"glm4moe", {"Glm4MoeForCausalLM", false, false, false, "post_attention_norm", true}},
  };
  auto it = table.find(name);
  return it == table.end() ? nullptr : &it->second;
}

// Blocks past block_count - nextn_predict_layers are multi-token-prediction (NextN) layers, which
// llama.cpp's converter appends to GLM-4.5 files; kestrel runs the main layers only.
int64_t main_layer_count(const GgufIndex& g, const std::string& a, int64_t blocks) {
  const int64_t nextn = g.get_int(a + "nextn_predict_layers", 0);
  if (nextn < 0 || nextn >= blocks)
    fail(g.where(a + "nextn_predict_layers"), ": ", nextn, " prediction layers for ", blocks, " blocks");
  return blocks - nextn;
}

std::string blk(int64_t i, const char* what) { return cat("blk.", i, ".", what); }

// A per-layer hyperparameter that may be written as a scalar or as one value per layer; kestrel
// needs it uniform.
int64_t uniform_int(const GgufIndex& g, const std::string& key, int64_t def, int64_t layers) {
  const std::vector<int64_t> v = g.get_int_array(key);
  if (v.empty()) {
    if (g.has(key)) fail(g.where(key), ": empty array");
    return def;
  }
  if (v.size() > 1) {
    if (int64_t(v.size()) != layers) fail(g.where(key), ": ", v.size(), " per-layer values for ", layers, " layers");
    if (std::any_of(v.begin(), v.end(), [&](int64_t x) { return x != v[0]; }))
      fail(g.where(key), ": differs between layers, which is not supported");
  }
  return v[0];
}

void positive(const GgufIndex& g, const std::string& key, int64_t v) {
  if (v <= 0) fail(g.where(key), ": must be positive, got ", v);
}

RopeConfig gguf_rope(const GgufIndex& g, const std::string& a, int64_t head_dim, int64_t max_pos) {
  RopeConfig r;
  r.theta = g.get_float(a + "rope.freq_base", 10000.0);
  if (!(r.theta > 0)) fail(g.where(a + "rope.freq_base"), ": must be positive");
  r.rotary_dim = g.get_int(a + "rope.dimension_count", head_dim);
  if (r.rotary_dim <= 0 || r.rotary_dim % 2 != 0 || r.rotary_dim > head_dim)
    fail(g.where(a + "rope.dimension_count"), ": ", r.rotary_dim, " must be a positive even number up to head_dim ",
         head_dim);
  if (g.find_tensor("rope_freqs.weight"))
    fail(g.where_tensor("rope_freqs.weight"),
         ": per-frequency rotary factors (llama3-style rope scaling) are not supported yet");

  std::string type = g.get_str(a + "rope.scaling.type", "none");
  double factor = g.get_float(a + "rope.scaling.factor", 0.0);
  if (g.has(a + "rope.scale_linear") && type == "none") {  // older files
    type = "linear";
    factor = g.get_float(a + "rope.scale_linear");
  }
  if (type == "none" || (type == "linear" && factor == 1.0)) return r;
  if (type != "linear" && type != "yarn")
    fail(g.where(a + "rope.scaling.type"), ": rope scaling '", type, "' is not supported (none, linear, yarn)");
  if (!(factor > 0)) fail(g.where(a + "rope.scaling.factor"), ": rope scaling '", type, "' needs a positive factor");
  r.factor = factor;
  if (type == "linear") {
    r.type = "linear";
  } else if (type == "yarn") {
    r.type = "yarn";
    r.original_max_position_embeddings = g.get_int(a + "rope.scaling.original_context_length", max_pos);
    if (r.original_max_position_embeddings <= 0)
      fail(g.where(a + "rope.scaling.original_context_length"), ": must be positive");
    r.beta_fast = g.get_float(a + "rope.scaling.yarn_beta_fast", 32.0);
    r.beta_slow = g.get_float(a + "rope.scaling.yarn_beta_slow", 1.0);
    // llama.cpp multiplies its YaRN magnitude correction (1 + 0.1 ln factor) by attn_factor.
    const double attn = g.get_float(a + "rope.scaling.attn_factor", 1.0);
    if (attn != 1.0) r.attention_factor = attn * (1.0 + 0.1 * std::log(factor));
    if (g.has(a + "rope.scaling.yarn_log_multiplier"))
      fail(g.where(a + "rope.scaling.yarn_log_multiplier"), ": YaRN log multiplier is not supported");
  }
  return r;
}

// GLM-4.5 routing, with the keys llama.cpp requires for glm4moe (expert_shared_count,
// expert_weights_scale) and its defaults for the rest.
void sigmoid_routing(const GgufIndex& g, const std::string& a, ModelConfig& m) {
  const int64_t gating = g.get_int(a + "expert_gating_func", 2);
  if (gating != 2) fail(g.where(a + "expert_gating_func"), ": ", gating, " is not sigmoid (2), which glm4moe needs");
  m.router = RouterKind::SigmoidBias;
  m.num_shared_experts = g.get_int(a + "expert_shared_count");
  if (m.num_shared_experts < 0 || m.num_shared_experts > 64)
    fail(g.where(a + "expert_shared_count"), ": ", m.num_shared_experts, " is out of range");
  const double scale = g.get_float(a + "expert_weights_scale");
  if (!(scale > 0 && scale < 1e6)) fail(g.where(a + "expert_weights_scale"), ": must be positive, got ", scale);
  m.routed_scaling_factor = float(scale);
  m.norm_topk_prob = g.get_bool(a + "expert_weights_norm", false);
  m.n_group = g.get_int(a + "expert_group_count", 1);
  m.topk_group = g.get_int(a + "expert_group_used_count", 1);
  const std::string gk = a + "expert_group_count", uk = a + "expert_group_used_count";
  positive(g, gk, m.n_group);
  positive(g, uk, m.topk_group);
  if (m.num_experts % m.n_group != 0)
    fail(g.where(gk), ": ", m.n_group, " groups do not divide the ", m.num_experts, " experts");
  if (m.topk_group > m.n_group) fail(g.where(uk), ": ", m.topk_group, " exceeds the ", m.n_group, " groups");
  if (m.n_group > 1 && m.num_experts / m.n_group < 2)
    fail(g.where(gk), ": group-limited routing needs at least 2 experts per group");
  if (m.topk_group * (m.num_experts / m.n_group) < m.experts_per_token)
    fail(g.where(uk), ": ", m.topk_group, " groups hold fewer experts than the ", m.experts_per_token, " chosen");
}

// The first leading_dense_block_count layers are dense, the rest sparse; the router tensors must
// agree. Without the key (llama.cpp does not require it), the router tensors decide.
void leading_dense_layers(const GgufIndex& g, const std::string& a, const ModelConfig& m) {
  const std::string key = a + "leading_dense_block_count";
  if (!g.has(key)) return;
  const int64_t lead = g.get_int(key);
  if (lead < 0 || lead > m.num_layers) fail(g.where(key), ": ", lead, " is not a layer count up to ", m.num_layers);
  for (int64_t i = 0; i < m.num_layers; ++i)
    if (m.is_moe_layer(i) != (i >= lead))
      fail(g.where(key), ": ", lead, " dense layers, but layer ", i, (m.is_moe_layer(i) ? " has" : " has no"),
           " router tensor '", blk(i, "ffn_gate_inp.weight"), "'");
}

}  // namespace

int64_t gguf_unpermuted_row(int64_t i, int64_t head_dim) {
  const int64_t half = head_dim / 2, h = i / head_dim, r = i % head_dim;
  return h * head_dim + 2 * (r % half) + r / half;
}

ModelConfig gguf_model_config(const GgufIndex& g) {
  ModelConfig m;
  m.source = g.label();
  const std::string arch = g.get_str("general.architecture", "");
  if (arch.empty()) fail(g.label(), ": missing metadata 'general.architecture'");
  const Arch* info = find_arch(arch);
  if (!info) fail(g.where("general.architecture"), ": '", arch, "' is not supported (llama, qwen2, qwen3, qwen3moe, glm4moe)");
  const std::string a = arch + ".";
  m.model_type = arch;

  const int64_t blocks = g.get_int(a + "block_count");
  positive(g, a + "block_count", blocks);
  if (blocks > 1024) fail(g.where(a + "block_count"), ": ", blocks, " layers is implausibly many");
  m.num_layers = main_layer_count(g, a, blocks);
  m.hidden_size = g.get_int(a + "embedding_length");
  positive(g, a + "embedding_length", m.hidden_size);
  m.num_heads = uniform_int(g, a + "attention.head_count", 0, blocks);
  positive(g, a + "attention.head_count", m.num_heads);
  m.num_kv_heads = uniform_int(g, a + "attention.head_count_kv", m.num_heads, blocks);
  positive(g, a + "attention.head_count_kv", m.num_kv_heads);
  if (m.num_heads % m.num_kv_heads != 0)
    fail(g.where(a + "attention.head_count_kv"), ": ", m.num_kv_heads, " does not divide the head count ", m.num_heads);
  if (!g.has(a + "attention.key_length") && m.hidden_size % m.num_heads != 0)
    fail(g.where(a + "embedding_length"), ": not a multiple of the head count and no attention.key_length is given");
  m.head_dim = g.get_int(a + "attention.key_length", m.hidden_size / m.num_heads);
  positive(g, a + "attention.key_length", m.head_dim);
  if (g.get_int(a + "attention.value_length", m.head_dim) != m.head_dim)
    fail(g.where(a + "attention.value_length"), ": differs from the key length ", m.head_dim,
         ", which is not supported");
  m.intermediate_size = uniform_int(g, a + "feed_forward_length", 0, blocks);
  m.rms_norm_eps = float(g.get_float(a + "attention.layer_norm_rms_epsilon"));
  if (!(m.rms_norm_eps > 0)) fail(g.where(a + "attention.layer_norm_rms_epsilon"), ": must be positive");
  m.max_position_embeddings = g.get_int(a + "context_length", 4096);
  positive(g, a + "context_length", m.max_position_embeddings);
  if (m.hidden_size > (1 << 17) || m.num_heads > 4096 || m.head_dim > 4096)
    fail(g.label(), ": model dimensions are implausibly large");

  const GgufTensor& embd = g.tensor("token_embd.weight");
  if (embd.dims.size() != 2 || embd.dims[0] != m.hidden_size)
    fail(g.where_tensor(embd.name), ": dims ", embd.dims_str(), " disagree with ", a, "embedding_length ",
         m.hidden_size);
  m.vocab_size = embd.dims[1];
  if (m.vocab_size <= 0 || m.vocab_size > (1 << 24))
    fail(g.where_tensor(embd.name), ": vocabulary of ", m.vocab_size, " rows is empty or implausibly large");
  if (g.has(a + "vocab_size") && g.get_int(a + "vocab_size") != m.vocab_size)
    fail(g.where(a + "vocab_size"), ": ", g.get_int(a + "vocab_size"), " disagrees with the ", m.vocab_size,
         " rows of token_embd.weight");
  m.tie_word_embeddings = g.find_tensor("output.weight") == nullptr;

  m.rope = gguf_rope(g, a, m.head_dim, m.max_position_embeddings);
  if (g.has(a + "rope.dimension_sections"))
    fail(g.where(a + "rope.dimension_sections"), ": multimodal rotary sections (M-RoPE) are not supported");
  if (info->permuted_qk && (m.head_dim % 2 != 0 || m.rope.rotary_dim != m.head_dim))
    fail(g.where(a + "rope.dimension_count"), ": llama files must rotate the whole head (", m.rope.rotary_dim,
         " of ", m.head_dim, ")");

  m.qkv_bias = g.find_tensor(blk(0, "attn_q.bias")) != nullptr;
  m.o_bias = g.find_tensor(blk(0, "attn_output.bias")) != nullptr;
  m.qk_norm = g.find_tensor(blk(0, "attn_q_norm.weight")) != nullptr;
  if (info->needs_qkv_bias && !m.qkv_bias)
    fail(g.label(), ": missing tensor '", blk(0, "attn_q.bias"), "' (", arch, " has QKV biases)");
  if (info->needs_qk_norm && !m.qk_norm)
    fail(g.label(), ": missing tensor '", blk(0, "attn_q_norm.weight"), "' (", arch, " has QK norm)");

  // Mixture of experts: which layers are sparse follows from the router tensors.
  m.num_experts = g.get_int(a + "expert_count", 0);
  m.moe_layer.assign(size_t(m.num_layers), false);
  for (int64_t i = 0; i < m.num_layers; ++i)
    m.moe_layer[size_t(i)] = g.find_tensor(blk(i, "ffn_gate_inp.weight")) != nullptr;
  m.architecture = info->hf;
  if (m.num_moe_layers() > 0) {
    positive(g, a + "expert_count", m.num_experts);
    if (m.num_experts > 4096) fail(g.where(a + "expert_count"), ": implausibly many experts");
    m.experts_per_token = g.get_int(a + "expert_used_count");
    positive(g, a + "expert_used_count", m.experts_per_token);
    if (m.experts_per_token > m.num_experts)
      fail(g.where(a + "expert_used_count"), ": ", m.experts_per_token, " exceeds the ", m.num_experts, " experts");
    // llama with experts is Mixtral; its experts are as wide as the dense FFN would be.
    m.moe_intermediate_size = g.get_int(a + "expert_feed_forward_length", arch == "llama" ? m.intermediate_size : 0);
    positive(g, a + "expert_feed_forward_length", m.moe_intermediate_size);
    if (info->sigmoid_router) {
      sigmoid_routing(g, a, m);
    } else {
      m.router = RouterKind::Softmax;
      m.norm_topk_prob = g.get_bool(a + "expert_weights_norm", true);  // llama.cpp renormalizes for these archs
      if (g.has(a + "expert_shared_count") && g.get_int(a + "expert_shared_count") > 0)
        fail(g.where(a + "expert_shared_count"), ": shared experts are not supported for ", arch);
    }
    if (arch == "llama") {
      m.architecture = "MixtralForCausalLM";
      m.model_type = "llama (experts)";
    }
  }
  if (info->sigmoid_router) leading_dense_layers(g, a, m);
  if (m.num_moe_layers() < m.num_layers) positive(g, a + "feed_forward_length", m.intermediate_size);
  m.architecture += " (GGUF)";

  auto token = [&](const char* key) -> int64_t {
    const std::string k = std::string("tokenizer.ggml.") + key;
    if (!g.has(k)) return -1;
    const int64_t v = g.get_int(k);
    if (v == 0xffffffffLL || v == -1) return -1;
    if (v < 0 || v >= m.vocab_size) fail(g.where(k), ": token id ", v, " is outside the vocabulary of ", m.vocab_size);
    return v;
  };
  m.bos_token_id = token("bos_token_id");
  for (const char* k : {"eos_token_id", "eot_token_id", "eom_token_id"}) {
    const int64_t v = token(k);
    if (v >= 0 && std::find(m.eos_token_ids.begin(), m.eos_token_ids.end(), v) == m.eos_token_ids.end())
      m.eos_token_ids.push_back(v);
  }
  return m;
}

namespace {

class GgufLoader {
 public:
  GgufLoader(const GgufIndex& g, const ModelConfig& c, std::vector<std::vector<uint8_t>>& owned)
      : g_(g), c_(c), owned_(owned) {}

  const GgufTensor& get(const std::string& name) {
    used_.insert(name);
    return g_.tensor(name);
  }
  bool has(const std::string& name) const { return g_.find_tensor(name) != nullptr; }

  void expect_dims(const GgufTensor& t, std::initializer_list<int64_t> dims, const char* why) {
    if (!std::equal(t.dims.begin(), t.dims.end(), dims.begin(), dims.end())) {
      std::string want = "[";
      size_t k = 0;
      for (int64_t d : dims) want += (k++ ? ", " : "") + std::to_string(d);
      fail(g_.where_tensor(t.name), ": dims ", t.dims_str(), " disagree with ", why, " (expected ", want,
           "], ggml order)");
    }
  }

  // A vector (norm weight or bias) as float.
  std::vector<float> vec(const std::string& name, int64_t n) {
    const GgufTensor& t = get(name);
    expect_dims(t, {n}, "the metadata");
    const GgmlTypeInfo* info = ggml_type_info(uint32_t(t.type));
    if (!info->dequant)
      fail(g_.where_tensor(name), ": ggml type ", info->name, " is not supported for vectors");
    std::vector<float> v(static_cast<size_t>(n));
    ggml_dequant_row(t.type, t.data, n, v.data());
    return v;
  }

  WeightFormat format(const GgufTensor& t) {
    auto f = weight_format_of(t.type);
    if (!f)
      fail(g_.where_tensor(t.name), ": ggml type ", ggml_type_name(uint32_t(t.type)),
           " is not supported (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4, "
           "NVFP4)");
    return *f;
  }

  // llama.cpp's per-tensor (or, for stacked experts, per-expert) weight scales of FP4 formats:
  // BASE.scale multiplies the weights, one value per entry of `count`; BASE.input_scale is the
  // activation scale of W4A4 checkpoints, which weight-only compute does not use.
  std::vector<float> fp4_scales(const std::string& base, WeightFormat f, int64_t count) {
    std::vector<float> out(size_t(count), 1.0f);
    for (const std::string suffix : {".scale", ".input_scale"}) {
      const std::string name = base + suffix;
      if (!has(name)) continue;
      const GgufTensor& t = get(name);
      if (f != WeightFormat::MXFP4 && f != WeightFormat::NVFP4_GGML)
        fail(g_.where_tensor(name), ": a weight scale is only supported on MXFP4 and NVFP4 weights, not ",
             format_name(f));
      if (t.type != GgmlType::F32) fail(g_.where_tensor(name), ": must be F32, found ", ggml_type_name(uint32_t(t.type)));
      const bool weights = suffix == ".scale";
      if (t.numel() != count && (weights || t.numel() != 1))
        fail(g_.where_tensor(name), ": dims ", t.dims_str(), " hold ", t.numel(), " values, expected ", count);
      if (!weights) continue;
      for (int64_t k = 0; k < count; ++k) {
        std::memcpy(&out[size_t(k)], t.data + 4 * k, 4);
        if (!std::isfinite(out[size_t(k)])) fail(g_.where_tensor(name), ": value ", k, " is not finite");
      }
    }
    return out;
  }

  // base.weight: ggml dims [in, out], i.e. out rows of in values.
  Linear linear(const std::string& base, int64_t out, int64_t in, bool bias) {
    const GgufTensor& t = get(base + ".weight");
    expect_dims(t, {in, out}, "the metadata");
    Linear l;
    l.name = base;
    l.out = out;
    l.in = in;
    l.format = format(t);
    l.data = t.data;
    l.scale2 = fp4_scales(base, l.format, 1)[0];
    if (bias) l.bias = vec(base + ".bias", out);
    return l;
  }

  GatedFfn ffn(int64_t i, int64_t width) {
    const int64_t h = c_.hidden_size;
    return {linear(blk(i, "ffn_gate"), width, h, false), linear(blk(i, "ffn_up"), width, h, false),
            linear(blk(i, "ffn_down"), h, width, false)};
  }

  // Experts stacked in one 3-D tensor per projection: ggml dims [in, out, experts].
  std::vector<GatedFfn> experts(int64_t i) {
    const int64_t e = c_.num_experts, w = c_.moe_intermediate_size, h = c_.hidden_size;
    std::vector<GatedFfn> out(static_cast<size_t>(e));
    if (!has(blk(i, "ffn_gate_exps.weight")) && has(cat("blk.", i, ".ffn_gate.0.weight"))) {
      // Older files: one tensor per expert, blk.N.ffn_gate.E.weight.
      for (int64_t x = 0; x < e; ++x)
        out[size_t(x)] = {linear(cat("blk.", i, ".ffn_gate.", x), w, h, false),
                          linear(cat("blk.", i, ".ffn_up.", x), w, h, false),
                          linear(cat("blk.", i, ".ffn_down.", x), h, w, false)};
      return out;
    }
    auto stacked = [&](const char* what, int64_t rows, int64_t cols, Linear GatedFfn::*member) {
      const GgufTensor& t = get(blk(i, what) + std::string(".weight"));
      expect_dims(t, {cols, rows, e}, "the metadata (in, out, experts)");
      const WeightFormat f = format(t);
      const std::vector<float> scale = fp4_scales(blk(i, what), f, e);
      for (int64_t x = 0; x < e; ++x) {
        Linear& l = out[size_t(x)].*member;
        l.name = cat(blk(i, what), ".", x);
        l.out = rows;
        l.in = cols;
        l.format = f;
        l.data = t.data + size_t(x) * size_t(rows) * l.row_bytes();
        l.scale2 = scale[size_t(x)];
      }
    };
    stacked("ffn_gate_exps", w, h, &GatedFfn::gate);
    stacked("ffn_up_exps", w, h, &GatedFfn::up);
    stacked("ffn_down_exps", h, w, &GatedFfn::down);
    return out;
  }

  // Copies a llama Q or K projection into Hugging Face row order.
  void unpermute(Linear& l) {
    const int64_t hd = c_.head_dim;
    const size_t rb = l.row_bytes();
    std::vector<uint8_t> buf(size_t(l.out) * rb);
    for (int64_t r = 0; r < l.out; ++r)
      std::memcpy(buf.data() + size_t(r) * rb, l.data + size_t(gguf_unpermuted_row(r, hd)) * rb, rb);
    if (!l.bias.empty()) {
      std::vector<float> b(l.bias.size());
      for (int64_t r = 0; r < l.out; ++r) b[size_t(r)] = l.bias[size_t(gguf_unpermuted_row(r, hd))];
      l.bias = std::move(b);
    }
    owned_.push_back(std::move(buf));
    l.data = owned_.back().data();
  }

  // Marks every tensor of blocks first..end-1 as used (NextN layers kestrel does not run).
  void skip_blocks(int64_t first, int64_t end) {
    for (const auto& t : g_.tensors()) {
      long long b = -1;
      if (std::sscanf(t.name.c_str(), "blk.%lld.", &b) == 1 && b >= first && b < end)
        used_.insert(t.name);
    }
  }

  // Every tensor of the file must have been consumed: one left over is a feature kestrel would
  // otherwise silently ignore.
  void check_all_used() const {
    for (const auto& t : g_.tensors())
      if (!used_.count(t.name))
        fail(g_.where_tensor(t.name), ": not used by the ", c_.model_type,
             " mapping (a feature kestrel does not support?)");
  }

 private:
  const GgufIndex& g_;
  const ModelConfig& c_;
  std::vector<std::vector<uint8_t>>& owned_;
  std::set<std::string> used_;
};

}  // namespace

ModelWeights gguf_model_weights(const GgufIndex& g, const ModelConfig& c, std::vector<std::vector<uint8_t>>& owned) {
  const Arch* arch = find_arch(g.get_str("general.architecture", ""));
  if (!arch) fail(g.label(), ": internal: configuration not made by gguf_model_config");
  const bool permuted = arch->permuted_qk;
  GgufLoader ld(g, c, owned);
  ModelWeights w;
  const int64_t h = c.hidden_size, hd = c.head_dim;

  w.embed = ld.linear("token_embd", c.vocab_size, h, false);
  w.final_norm = ld.vec("output_norm.weight", h);
  if (c.tie_word_embeddings) {
    w.lm_head = w.embed;
    w.lm_head.name = "output (tied to token_embd)";
  } else {
    w.lm_head = ld.linear("output", c.vocab_size, h, false);
  }

  w.layers.resize(size_t(c.num_layers));
  for (int64_t i = 0; i < c.num_layers; ++i) {
    LayerWeights& L = w.layers[size_t(i)];
    L.attn_norm = ld.vec(blk(i, "attn_norm.weight"), h);
    L.ffn_norm = ld.vec(blk(i, arch->ffn_norm) + std::string(".weight"), h);
    L.q = ld.linear(blk(i, "attn_q"), c.num_heads * hd, h, c.qkv_bias);
    L.k = ld.linear(blk(i, "attn_k"), c.num_kv_heads * hd, h, c.qkv_bias);
    L.v = ld.linear(blk(i, "attn_v"), c.num_kv_heads * hd, h, c.qkv_bias);
    L.o = ld.linear(blk(i, "attn_output"), h, c.num_heads * hd, c.o_bias);
    if (permuted) {
      ld.unpermute(L.q);
      ld.unpermute(L.k);
    }
    if (c.qk_norm) {
      L.q_norm = ld.vec(blk(i, "attn_q_norm.weight"), hd);
      L.k_norm = ld.vec(blk(i, "attn_k_norm.weight"), hd);
    }
    L.is_moe = c.is_moe_layer(i);
    if (!L.is_moe) {
      L.mlp = ld.ffn(i, c.intermediate_size);
    } else {
      L.moe.router = ld.linear(blk(i, "ffn_gate_inp"), c.num_experts, h, false);
      if (c.router == RouterKind::SigmoidBias) L.moe.correction_bias = ld.vec(blk(i, "exp_probs_b.bias"), c.num_experts);
      L.moe.experts = ld.experts(i);
      if (c.num_shared_experts > 0) {
        L.moe.has_shared = true;
        const int64_t sw = c.moe_intermediate_size * c.num_shared_experts;
        L.moe.shared = {ld.linear(blk(i, "ffn_gate_shexp"), sw, h, false), ld.linear(blk(i, "ffn_up_shexp"), sw, h, false),
                        ld.linear(blk(i, "ffn_down_shexp"), h, sw, false)};
      }
    }
  }
  ld.skip_blocks(c.num_layers, g.get_int(g.get_str("general.architecture", "") + ".block_count"));
  ld.check_all_used();
  return w;
}

std::unique_ptr<Model> load_gguf_model(const std::string& path) {
  auto m = std::make_unique<Model>();
  m->gguf = std::make_unique<GgufFile>(path);
  m->config = gguf_model_config(m->gguf->index());
  m->weights = gguf_model_weights(m->gguf->index(), m->config, m->owned);
  return m;
}

}  // namespace kestrel
