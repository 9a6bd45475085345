#include "quant/write_checkpoint.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>

#include "common/error.h"
#include "common/mapped_file.h"
#include "common/numeric.h"
#include "formats/nvfp4.h"
#include "formats/safetensors_writer.h"
#include "quant/fp8_quantize.h"
#include "quant/nvfp4_quantize.h"
#include "quant/targets.h"

namespace kestrel {
namespace fs = std::filesystem;
namespace {

// What one step of the writer produces: a quantized module's tensors, or one tensor.
struct Unit {
  enum class Kind { Raw, Nvfp4, Fp8, Bf16, F32 } kind = Kind::Raw;
  std::vector<TensorSpec> specs;
  const uint8_t* raw = nullptr;             // Raw: the bytes as stored
  const QuantTarget* target = nullptr;      // Nvfp4, Fp8
  const Linear* linear = nullptr;           // Bf16: dequantized row by row
  const std::vector<float>* vec = nullptr;  // F32
  uint64_t bytes() const {
    uint64_t n = 0;
    for (const auto& s : specs) n += s.nbytes();
    return n;
  }
};

class Plan {
 public:
  Plan(Model& m, const WriteOptions& o, const std::string& config_path)
      : m_(m),
        o_(o),
        settings_(o.format == WriteFormat::Fp8 ? fp8_settings(o.exclude, config_path)
                                               : nvfp4_settings(m.config, o.exclude, config_path)),
        targets_(quant_targets(m)) {
    if (m.config.quant.is_quantized())
      fail(m.config.quant.source, ": the model is already quantized (", m.config.quant.describe(),
           "); kestrel quantize reads BF16, F16 or F32 checkpoints and GGUF files");
    for (const QuantTarget& t : targets_) {
      const bool q = o.format != WriteFormat::Bf16 && settings_.quantizes(t.module);
      quantized_[&t] = q;
      if (!q || o.format == WriteFormat::Fp8) continue;
      if (t.linear->in % kNvfp4Block != 0)
        fail(t.module, ": input dimension ", t.linear->in, " is not a multiple of 16, so it cannot be NVFP4; leave it ",
             "dense with --exclude ", t.module);
      groups_[t.group].push_back(&t);
    }
    if (m.checkpoint) plan_from_checkpoint();
    else plan_from_model();
    // The exclusions added for dense tensors must not cover a module that is quantized.
    for (const QuantTarget& t : targets_)
      if (quantized(t) && !settings_.quantizes(t.module))
        fail(t.module, ": quantized, but the exclusions written for the dense tensors cover it (",
             settings_.describe(), ")");
  }

  const std::vector<Unit>& units() const { return units_; }
  const QuantConfig& settings() const { return settings_; }
  int quantized_count() const {
    int n = 0;
    for (const auto& u : units_) n += u.kind == Unit::Kind::Nvfp4 || u.kind == Unit::Kind::Fp8;
    return n;
  }
  // The quantized members of a fusion group.
  const std::vector<const QuantTarget*>& group(int g) const { return groups_.at(g); }

 private:
  bool quantized(const QuantTarget& t) const { return quantized_.at(&t); }

  // A module written densely must not look quantized to a reader of the settings.
  void dense_written(const std::string& tensor, size_t rank) {
    if (o_.format == WriteFormat::Bf16 || rank < 2) return;
    // "a.b.weight" is module "a.b"; a fused "a.experts.gate_up_proj" stands for "a.experts".
    const std::string module = tensor.substr(0, tensor.rfind('.'));
    if (settings_.quantizes(module)) settings_.exclude.push_back(module);
  }

  void add_quantized(const QuantTarget& t) {
    if (o_.format == WriteFormat::Fp8) return fp8(t);
    Unit u;
    u.kind = Unit::Kind::Nvfp4;
    u.target = &t;
    const int64_t n = t.linear->out, k = t.linear->in;
    u.specs = {{t.module + ".weight", DType::U8, {n, k / 2}},
               {t.module + ".weight_scale", DType::F8_E4M3, {n, k / kNvfp4Block}},
               {t.module + ".weight_scale_2", DType::F32, {}},
               {t.module + ".input_scale", DType::F32, {}}};
    units_.push_back(std::move(u));
  }

  // DeepSeek-V3's layout: the codes and one F32 scale per 128 x 128 block.
  void fp8(const QuantTarget& t) {
    Unit u;
    u.kind = Unit::Kind::Fp8;
    u.target = &t;
    const int64_t n = t.linear->out, k = t.linear->in;
    const Fp8Blocks b;
    u.specs = {{t.module + ".weight", DType::F8_E4M3, {n, k}},
               {t.module + ".weight_scale_inv", DType::F32, {b.scale_rows(n), b.scale_cols(k)}}};
    units_.push_back(std::move(u));
  }

  void raw(const std::string& name, DType dtype, std::vector<int64_t> shape, const uint8_t* data) {
    Unit u;
    u.kind = Unit::Kind::Raw;
    u.raw = data;
    u.specs = {{name, dtype, std::move(shape)}};
    dense_written(name, u.specs[0].shape.size());
    units_.push_back(std::move(u));
  }

  void bf16(const std::string& name, const Linear& l) {
    Unit u;
    u.kind = Unit::Kind::Bf16;
    u.linear = &l;
    u.specs = {{name, DType::BF16, {l.out, l.in}}};
    dense_written(name, 2);
    units_.push_back(std::move(u));
  }

  void f32(const std::string& name, const std::vector<float>& v) {
    Unit u;
    u.kind = Unit::Kind::F32;
    u.vec = &v;
    u.specs = {{name, DType::F32, {int64_t(v.size())}}};
    units_.push_back(std::move(u));
  }

  // A Hugging Face source: every tensor as stored, except the quantized linears' weights (and
  // fused expert tensors any of whose experts are quantized, which are split per expert).
  void plan_from_checkpoint() {
    std::map<std::string, std::vector<const QuantTarget*>> by_fused;
    std::map<std::string, const QuantTarget*> by_weight;
    for (const QuantTarget& t : targets_) {
      if (!t.fused.empty()) by_fused[t.fused].push_back(&t);
      else by_weight[t.module + ".weight"] = &t;
    }
    for (const auto& [name, view] : m_.checkpoint->tensors()) {
      if (auto f = by_fused.find(name); f != by_fused.end()) {
        const auto& ts = f->second;
        if (std::any_of(ts.begin(), ts.end(), [&](const QuantTarget* t) { return quantized(*t); })) {
          for (const QuantTarget* t : ts) {
            if (quantized(*t)) add_quantized(*t);
            else raw(t->module + ".weight", view->dtype, {t->linear->out, t->linear->in}, t->linear->data);
          }
          continue;
        }
      }
      if (auto w = by_weight.find(name); w != by_weight.end() && quantized(*w->second)) {
        add_quantized(*w->second);
        continue;
      }
      raw(name, view->dtype, view->shape, view->data);
    }
  }

  // A GGUF source: Hugging Face names, matrices dequantized to BF16 (or quantized), vectors F32.
  void plan_from_model() {
    const ModelConfig& c = m_.config;
    ModelWeights& w = m_.weights;
    bf16("model.embed_tokens.weight", w.embed);
    size_t next = 0;
    for (int64_t i = 0; i < c.num_layers; ++i) {
      const LayerWeights& L = w.layers[size_t(i)];
      const std::string p = cat("model.layers.", i, ".");
      f32(p + "input_layernorm.weight", L.attn_norm);
      f32(p + "post_attention_layernorm.weight", L.ffn_norm);
      if (c.qk_norm) {
        f32(p + "self_attn.q_norm.weight", L.q_norm);
        f32(p + "self_attn.k_norm.weight", L.k_norm);
      }
      if (L.is_moe) bf16(p + c.moe_prefix + ".gate.weight", L.moe.router);
      for (; next < targets_.size() && targets_[next].module.starts_with(p); ++next) {
        const QuantTarget& t = targets_[next];
        if (quantized(t)) add_quantized(t);
        else bf16(t.module + ".weight", *t.linear);
        if (!t.linear->bias.empty()) f32(t.module + ".bias", t.linear->bias);
      }
    }
    f32("model.norm.weight", w.final_norm);
    if (!c.tie_word_embeddings) bf16("lm_head.weight", w.lm_head);
  }

  Model& m_;
  const WriteOptions& o_;
  QuantConfig settings_;
  std::vector<QuantTarget> targets_;
  std::map<const QuantTarget*, bool> quantized_;
  std::map<int, std::vector<const QuantTarget*>> groups_;
  std::vector<Unit> units_;
};

class Writer {
 public:
  Writer(const Plan& plan, const WriteOptions& o, ThreadPool& pool) : plan_(plan), o_(o), pool_(pool) {}

  void write(SafetensorsWriter& out, const Unit& u) {
    switch (u.kind) {
      case Unit::Kind::Raw:
        out.write(u.specs[0].name, u.raw, u.specs[0].nbytes());
        return;
      case Unit::Kind::F32:
        out.write(u.specs[0].name, u.vec->data(), u.vec->size() * 4);
        return;
      case Unit::Kind::Bf16:
        write_bf16(out, u.specs[0].name, *u.linear);
        return;
      case Unit::Kind::Nvfp4: {
        const QuantTarget& t = *u.target;
        const Nvfp4Matrix q = quantize_linear(*t.linear, group_amax(t.group), pool_);
        const float input_scale = nvfp4_scale2(input_amax(t));
        out.write(u.specs[0].name, q.packed.data(), q.packed.size());
        out.write(u.specs[1].name, q.scales.data(), q.scales.size());
        out.write(u.specs[2].name, &q.scale2, 4);
        out.write(u.specs[3].name, &input_scale, 4);
        return;
      }
      case Unit::Kind::Fp8: {
        const Fp8Quantized q = fp8_quantize_linear(*u.target->linear, pool_);
        out.write(u.specs[0].name, q.codes.data(), q.codes.size());
        out.write(u.specs[1].name, q.scales.data(), q.scales.size() * 4);
        return;
      }
    }
  }

 private:
  // One per-tensor scale per fusion group: the largest |weight| of its quantized members.
  float group_amax(int group) {
    auto it = amax_.find(group);
    if (it != amax_.end()) return it->second;
    float a = 0.0f;
    for (const QuantTarget* t : plan_.group(group)) a = std::max(a, weight_amax(*t->linear, pool_));
    return amax_[group] = a;
  }

  float input_amax(const QuantTarget& t) {
    if (o_.input_amax) {
      auto it = o_.input_amax->find(t.linear);
      if (it != o_.input_amax->end()) return it->second;
    }
    std::fprintf(stderr, "\nkestrel: %s: no calibrated input (all its inputs were zero); input_scale assumes |x| <= 1\n",
                 t.module.c_str());
    return 1.0f;
  }

  void write_bf16(SafetensorsWriter& out, const std::string& name, const Linear& l) {
    const int64_t rows_per_chunk = std::max<int64_t>(1, (1 << 20) / std::max<int64_t>(l.in, 1));
    std::vector<uint16_t> buf;
    for (int64_t r0 = 0; r0 < l.out; r0 += rows_per_chunk) {
      const int64_t n = std::min(rows_per_chunk, l.out - r0);
      buf.resize(size_t(n * l.in));
      pool_.parallel_for(size_t(n), 1, [&](size_t b, size_t e) {
        thread_local std::vector<float> row;
        row.resize(size_t(l.in));
        for (size_t i = b; i < e; ++i) {
          l.dequant_row(r0 + int64_t(i), row.data());
          for (int64_t j = 0; j < l.in; ++j) buf[i * size_t(l.in) + size_t(j)] = f32_to_bf16(row[size_t(j)]);
        }
      });
      out.write(name, buf.data(), buf.size() * 2);
    }
  }

  const Plan& plan_;
  const WriteOptions& o_;
  ThreadPool& pool_;
  std::map<int, float> amax_;
};

// Returns whether the folder was created (else it existed, empty).
bool prepare_folder(const std::string& out) {
  std::error_code ec;
  if (fs::exists(out, ec)) {
    if (!fs::is_directory(out, ec)) fail(out, ": exists and is not a folder");
    if (!fs::is_empty(out, ec)) fail(out, ": folder is not empty (the checkpoint is written into a new or empty folder)");
    return false;
  }
  if (!fs::create_directories(out, ec)) fail(out, ": cannot create the folder: ", ec.message());
  return true;
}

// The shards, the index and the settings files.
WriteSummary write_files(const Plan& plan, nlohmann::ordered_json config, const std::string& out,
                         const WriteOptions& o, const std::vector<std::vector<size_t>>& shards, uint64_t total,
                         ThreadPool& pool) {
  const std::string config_path = (fs::path(out) / "config.json").string();
  Writer writer(plan, o, pool);
  nlohmann::json weight_map = nlohmann::json::object();
  WriteSummary sum;
  uint64_t done = 0;
  auto last = std::chrono::steady_clock::now() - std::chrono::seconds(1);
  for (size_t s = 0; s < shards.size(); ++s) {
    char fname[64];
    std::snprintf(fname, sizeof fname, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    std::vector<TensorSpec> specs;
    for (size_t i : shards[s])
      for (const TensorSpec& t : plan.units()[i].specs) {
        specs.push_back(t);
        weight_map[t.name] = fname;
      }
    SafetensorsWriter file((fs::path(out) / fname).string(), specs);
    for (size_t k = 0; k < shards[s].size(); ++k) {
      const Unit& u = plan.units()[shards[s][k]];
      writer.write(file, u);
      done += u.bytes();
      sum.tensors += int(u.specs.size());
      const auto now = std::chrono::steady_clock::now();
      if (o.progress && (now - last > std::chrono::milliseconds(200) || done == total)) {
        last = now;
        std::fprintf(stderr, "\rwriting %s: %zu/%zu modules and tensors of this shard, %.1f/%.1f MB in all", fname, k + 1,
                     shards[s].size(), double(done) / 1e6, double(total) / 1e6);
      }
    }
    file.finish();
  }
  if (o.progress) std::fprintf(stderr, "\n");

  const nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  write_text_file((fs::path(out) / "model.safetensors.index.json").string(), index.dump(2) + "\n");

  sum.shards = int(shards.size());
  sum.quantized = plan.quantized_count();
  sum.bytes = total;
  sum.exclude = plan.settings().exclude;
  if (o.format == WriteFormat::Fp8) {
    nlohmann::ordered_json q;
    q["quant_method"] = "fp8";
    q["activation_scheme"] = "dynamic";
    q["fmt"] = "e4m3";
    q["weight_block_size"] = {kFp8Block, kFp8Block};
    q["modules_to_not_convert"] = sum.exclude;
    config["quantization_config"] = q;
  }
  if (o.format == WriteFormat::Nvfp4) {
    nlohmann::ordered_json q;
    q["quant_method"] = "modelopt";
    q["quant_algo"] = "NVFP4";
    q["kv_cache_quant_algo"] = nullptr;
    q["group_size"] = kNvfp4Block;
    q["exclude_modules"] = sum.exclude;
    config["quantization_config"] = q;
    nlohmann::ordered_json h;
    h["producer"] = {{"name", "kestrel"}, {"version", "0.1.0"}};
    nlohmann::ordered_json hq;
    hq["quant_algo"] = "NVFP4";
    hq["kv_cache_quant_algo"] = nullptr;
    hq["group_size"] = kNvfp4Block;
    hq["exclude_modules"] = sum.exclude;
    h["quantization"] = hq;
    write_text_file((fs::path(out) / "hf_quant_config.json").string(), h.dump(2) + "\n");
  }
  write_text_file(config_path, config.dump(2) + "\n");
  return sum;
}


}  // namespace

WriteSummary write_checkpoint(Model& m, nlohmann::ordered_json config, const std::string& out, const WriteOptions& o,
                              ThreadPool& pool) {
  if (o.shard_bytes == 0) fail("shard size must be positive");
  const std::string config_path = (fs::path(out) / "config.json").string();
  const Plan plan(m, o, config_path);
  const bool created = prepare_folder(out);

  // Shards: consecutive units, a new shard when the next unit would overflow a non-empty one.
  std::vector<std::vector<size_t>> shards(1);
  uint64_t in_shard = 0, total = 0;
  for (size_t i = 0; i < plan.units().size(); ++i) {
    const uint64_t b = plan.units()[i].bytes();
    if (!shards.back().empty() && in_shard + b > o.shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(i);
    in_shard += b;
    total += b;
  }

  try {
    return write_files(plan, std::move(config), out, o, shards, total, pool);
  } catch (...) {
    // Leave things as they were found (no folder, or an empty one), not half written.
    std::error_code ec;
    if (created) fs::remove_all(out, ec);
    else
      for (const auto& e : fs::directory_iterator(out, ec)) fs::remove_all(e.path(), ec);
    throw;
  }
}

}  // namespace kestrel
