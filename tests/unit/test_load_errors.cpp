// A model folder with something wrong gives one error naming the file, the tensor and the fault.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>

#include "common/error.h"
#include "model/weights.h"
#include "st_writer.h"

namespace kestrel {
namespace {

using test::StTensor;

struct TinyLlama {
  int64_t hidden = 32, vocab = 16, inter = 32, heads = 2;
  bool nvfp4 = false;

  nlohmann::json config() const {
    nlohmann::json c = {{"architectures", {"LlamaForCausalLM"}}, {"vocab_size", vocab}, {"hidden_size", hidden},
                        {"num_hidden_layers", 1},  {"num_attention_heads", heads}, {"num_key_value_heads", heads},
                        {"intermediate_size", inter}, {"max_position_embeddings", 64}};
    if (nvfp4)
      c["quantization_config"] = {{"quant_method", "modelopt"}, {"quant_algo", "NVFP4"}, {"group_size", 16},
                                  {"exclude_modules", {"lm_head"}}};
    return c;
  }

  std::vector<StTensor> tensors() const {
    std::vector<StTensor> t;
    auto bf16 = [&](const std::string& n, std::vector<int64_t> shape) {
      int64_t numel = 1;
      for (auto d : shape) numel *= d;
      t.push_back({n, "BF16", shape, std::vector<uint8_t>(size_t(numel) * 2, 0)});
    };
    auto lin = [&](const std::string& n, int64_t out, int64_t in) {
      if (!nvfp4) return bf16(n + ".weight", {out, in});
      t.push_back({n + ".weight", "U8", {out, in / 2}, std::vector<uint8_t>(size_t(out * (in / 2)), 0)});
      t.push_back({n + ".weight_scale", "F8_E4M3", {out, in / 16}, std::vector<uint8_t>(size_t(out * (in / 16)), 0x38)});
      t.push_back({n + ".weight_scale_2", "F32", {}, test::f32_bytes({1.0f})});
    };
    bf16("model.embed_tokens.weight", {vocab, hidden});
    bf16("model.norm.weight", {hidden});
    bf16("lm_head.weight", {vocab, hidden});
    const std::string p = "model.layers.0.";
    bf16(p + "input_layernorm.weight", {hidden});
    bf16(p + "post_attention_layernorm.weight", {hidden});
    for (const char* n : {"q_proj", "k_proj", "v_proj", "o_proj"}) lin(p + "self_attn." + n, hidden, hidden);
    lin(p + "mlp.gate_proj", inter, hidden);
    lin(p + "mlp.up_proj", inter, hidden);
    lin(p + "mlp.down_proj", hidden, inter);
    return t;
  }
};

void write_model(const std::filesystem::path& dir, const nlohmann::json& cfg, const std::vector<StTensor>& ts) {
  std::ofstream(dir / "config.json") << cfg.dump();
  test::write_file(dir / "model.safetensors", test::safetensors_image(ts));
}

std::string load_error(const std::filesystem::path& dir) {
  try {
    load_model(dir.string());
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void expect_parts(const std::string& msg, std::initializer_list<std::string> parts) {
  ASSERT_FALSE(msg.empty()) << "expected an error";
  for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "message: " << msg << "\nmissing: " << p;
}

TEST(LoadErrors, ValidModelsLoad) {
  for (bool q : {false, true}) {
    test::TempDir d;
    TinyLlama m;
    m.nvfp4 = q;
    write_model(d.path(), m.config(), m.tensors());
    EXPECT_EQ(load_error(d.path()), "");
  }
}

TEST(LoadErrors, MissingTensor) {
  test::TempDir d;
  TinyLlama m;
  auto ts = m.tensors();
  std::erase_if(ts, [](const StTensor& t) { return t.name == "model.layers.0.mlp.up_proj.weight"; });
  write_model(d.path(), m.config(), ts);
  expect_parts(load_error(d.path()), {d.path().string(), "missing tensor 'model.layers.0.mlp.up_proj.weight'"});
}

TEST(LoadErrors, ShapeDisagreesWithConfig) {
  test::TempDir d;
  TinyLlama m;
  auto cfg = m.config();
  cfg["vocab_size"] = 17;
  write_model(d.path(), cfg, m.tensors());
  expect_parts(load_error(d.path()), {"model.safetensors", "'model.embed_tokens.weight'", "[16, 32]", "[17, 32]"});
}

TEST(LoadErrors, WrongDtype) {
  test::TempDir d;
  TinyLlama m;
  auto ts = m.tensors();
  for (auto& t : ts)
    if (t.name == "model.layers.0.self_attn.k_proj.weight") {
      t.dtype = "I16";
    }
  write_model(d.path(), m.config(), ts);
  expect_parts(load_error(d.path()), {"'model.layers.0.self_attn.k_proj.weight'", "I16"});
}

TEST(LoadErrors, Nvfp4KNotMultipleOf16) {
  test::TempDir d;
  TinyLlama m;
  m.nvfp4 = true;
  m.hidden = 24;
  m.heads = 2;
  m.inter = 32;
  auto ts = m.tensors();
  for (auto& t : ts)  // make the scales tensor shape consistent with K/16 rounded down, so K is what fails
    if (t.name.ends_with("weight_scale")) t.shape[1] = std::max<int64_t>(t.shape[1], 1), t.bytes.resize(size_t(t.shape[0] * t.shape[1]));
  write_model(d.path(), m.config(), ts);
  expect_parts(load_error(d.path()), {"'model.layers.0.self_attn.q_proj.weight'", "multiple of 16", "K = 24"});
}

TEST(LoadErrors, QuantizedByConfigButStoredDense) {
  test::TempDir d;
  TinyLlama dense;
  TinyLlama q;
  q.nvfp4 = true;
  write_model(d.path(), q.config(), dense.tensors());
  expect_parts(load_error(d.path()), {"'model.layers.0.self_attn.q_proj.weight'", "BF16", "NVFP4", "exclude"});
}

TEST(LoadErrors, StoredQuantizedButConfigSaysDense) {
  test::TempDir d;
  TinyLlama dense;
  TinyLlama q;
  q.nvfp4 = true;
  write_model(d.path(), dense.config(), q.tensors());
  expect_parts(load_error(d.path()), {"model.layers.0.self_attn.q_proj.weight_scale", "stored quantized"});
}

TEST(LoadErrors, BadScaleDtype) {
  test::TempDir d;
  TinyLlama m;
  m.nvfp4 = true;
  auto ts = m.tensors();
  for (auto& t : ts)
    if (t.name == "model.layers.0.mlp.down_proj.weight_scale") t.dtype = "U8";
  write_model(d.path(), m.config(), ts);
  expect_parts(load_error(d.path()), {"'model.layers.0.mlp.down_proj.weight_scale'", "F8_E4M3"});
}

TEST(LoadErrors, TruncatedShard) {
  test::TempDir d;
  TinyLlama m;
  std::ofstream(d.path() / "config.json") << m.config().dump();
  auto img = test::safetensors_image(m.tensors());
  img.resize(img.size() - 100);
  test::write_file(d.path() / "model.safetensors", img);
  expect_parts(load_error(d.path()), {"model.safetensors", "past the end"});
}

TEST(LoadErrors, ConfigNotJson) {
  test::TempDir d;
  TinyLlama m;
  write_model(d.path(), m.config(), m.tensors());
  std::ofstream(d.path() / "config.json") << "{\"architectures\": [";
  expect_parts(load_error(d.path()), {"config.json", "not valid JSON"});
}

TEST(LoadErrors, BadGenerationConfig) {
  test::TempDir d;
  TinyLlama m;
  write_model(d.path(), m.config(), m.tensors());
  std::ofstream(d.path() / "generation_config.json") << R"({"eos_token_id": "two"})";
  expect_parts(load_error(d.path()), {"generation_config.json", "eos_token_id"});
}

}  // namespace
}  // namespace kestrel
