#include <gtest/gtest.h>

#include <fstream>

#include "common/error.h"
#include "formats/quant_config.h"
#include "st_writer.h"

namespace kestrel {
namespace {

TEST(Glob, Wildcards) {
  EXPECT_TRUE(glob_match("lm_head", "lm_head"));
  EXPECT_FALSE(glob_match("lm_head", "lm_head2"));
  EXPECT_TRUE(glob_match("model.layers.*.mlp.gate", "model.layers.12.mlp.gate"));
  EXPECT_FALSE(glob_match("model.layers.*.mlp.gate", "model.layers.12.mlp.gate_proj"));
  EXPECT_TRUE(glob_match("*self_attn*", "model.layers.0.self_attn.q_proj"));
  EXPECT_TRUE(glob_match("model.layers.?.mlp", "model.layers.3.mlp"));
  EXPECT_FALSE(glob_match("model.layers.?.mlp", "model.layers.13.mlp"));
  EXPECT_TRUE(glob_match("model.layers.[0-2].mlp", "model.layers.1.mlp"));
  EXPECT_FALSE(glob_match("model.layers.[0-2].mlp", "model.layers.5.mlp"));
  EXPECT_TRUE(glob_match("model.layers.[!0-2].mlp", "model.layers.5.mlp"));
  EXPECT_TRUE(glob_match("*", ""));
  EXPECT_TRUE(glob_match("a*b*c", "a__b__c"));
  EXPECT_FALSE(glob_match("a*b*c", "a__b__"));
}

TEST(QuantConfig, ModelOptFromConfig) {
  test::TempDir dir;
  nlohmann::json cfg = {{"quantization_config",
                         {{"quant_method", "modelopt"},
                          {"quant_algo", "NVFP4"},
                          {"group_size", 16},
                          {"exclude_modules", {"lm_head", "model.layers.*.mlp.gate", "model.layers.1.self_attn"}}}}};
  QuantConfig q = load_quant_config(dir.path().string(), cfg, "config.json");
  EXPECT_EQ(q.method, QuantMethod::ModelOpt);
  EXPECT_TRUE(q.quantizes("model.layers.0.mlp.experts.3.gate_proj"));
  EXPECT_FALSE(q.quantizes("model.layers.0.mlp.gate"));
  EXPECT_FALSE(q.quantizes("lm_head"));
  EXPECT_TRUE(q.quantizes("model.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(q.quantizes("model.layers.1.self_attn.q_proj"));  // a module prefix excludes its children
}

TEST(QuantConfig, HfQuantConfigFileWins) {
  test::TempDir dir;
  std::ofstream(dir.path() / "hf_quant_config.json")
      << R"({"producer":{"name":"modelopt"},"quantization":{"quant_algo":"NVFP4","group_size":16,"exclude_modules":["lm_head"]}})";
  QuantConfig q = load_quant_config(dir.path().string(), nlohmann::json::object(), "config.json");
  EXPECT_EQ(q.method, QuantMethod::ModelOpt);
  EXPECT_NE(q.source.find("hf_quant_config.json"), std::string::npos);
  EXPECT_FALSE(q.quantizes("lm_head"));
}

TEST(QuantConfig, CompressedTensorsIgnoreRegex) {
  nlohmann::json cfg = nlohmann::json::parse(R"({"quantization_config":{"quant_method":"compressed-tensors",
    "format":"nvfp4-pack-quantized","config_groups":{"group_0":{"targets":["Linear"],
    "weights":{"num_bits":4,"type":"float","strategy":"tensor_group","group_size":16}}},
    "ignore":["lm_head","re:.*mlp.gate$"]}})");
  QuantConfig q = load_quant_config("/nonexistent", cfg, "config.json");
  EXPECT_EQ(q.method, QuantMethod::CompressedTensors);
  EXPECT_FALSE(q.quantizes("lm_head"));
  EXPECT_FALSE(q.quantizes("model.layers.3.mlp.gate"));
  EXPECT_TRUE(q.quantizes("model.layers.3.mlp.gate_proj"));
}

TEST(QuantConfig, UnsupportedSettingsNameTheFile) {
  auto expect = [](const nlohmann::json& q, const std::string& part) {
    try {
      load_quant_config("/nonexistent", {{"quantization_config", q}}, "cfg.json");
      FAIL() << "expected an error for " << q.dump();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("cfg.json"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  expect({{"quant_method", "modelopt"}, {"quant_algo", "FP8"}}, "FP8");
  expect({{"quant_method", "modelopt"}, {"quant_algo", "NVFP4"}, {"group_size", 32}}, "group_size");
  expect({{"quant_method", "gptq"}}, "gptq");
  expect({{"quant_method", "compressed-tensors"}, {"format", "int-quantized"}}, "int-quantized");
}

TEST(QuantConfig, NoneWhenAbsent) {
  QuantConfig q = load_quant_config("/nonexistent", nlohmann::json::object(), "config.json");
  EXPECT_FALSE(q.is_quantized());
  EXPECT_FALSE(q.quantizes("model.layers.0.mlp.down_proj"));
}

}  // namespace
}  // namespace kestrel
