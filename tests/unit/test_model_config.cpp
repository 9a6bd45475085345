#include <gtest/gtest.h>

#include "common/error.h"
#include "model/model_config.h"

namespace kestrel {
namespace {

nlohmann::json base(const std::string& arch) {
  return {{"architectures", {arch}}, {"vocab_size", 100},          {"hidden_size", 64},
          {"num_hidden_layers", 4},  {"num_attention_heads", 4},   {"num_key_value_heads", 2},
          {"intermediate_size", 96}, {"rms_norm_eps", 1e-5},       {"max_position_embeddings", 128},
          {"hidden_act", "silu"}};
}

std::string error_of(const nlohmann::json& j) {
  try {
    parse_model_config(j, "config.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(ModelConfig, Llama) {
  auto j = base("LlamaForCausalLM");
  j["tie_word_embeddings"] = true;
  ModelConfig m = parse_model_config(j, "config.json");
  EXPECT_EQ(m.head_dim, 16);
  EXPECT_TRUE(m.tie_word_embeddings);
  EXPECT_EQ(m.num_moe_layers(), 0);
  EXPECT_FALSE(m.qkv_bias);
  EXPECT_EQ(m.rope.rotary_dim, 16);
}

TEST(ModelConfig, Qwen2HasQkvBiasQwen3HasQkNorm) {
  ModelConfig q2 = parse_model_config(base("Qwen2ForCausalLM"), "c");
  EXPECT_TRUE(q2.qkv_bias);
  EXPECT_FALSE(q2.o_bias);
  auto j = base("Qwen3ForCausalLM");
  j["head_dim"] = 32;
  ModelConfig q3 = parse_model_config(j, "c");
  EXPECT_TRUE(q3.qk_norm);
  EXPECT_EQ(q3.head_dim, 32);
}

TEST(ModelConfig, Qwen3MoeLayerLayout) {
  auto j = base("Qwen3MoeForCausalLM");
  j["num_experts"] = 8;
  j["num_experts_per_tok"] = 2;
  j["moe_intermediate_size"] = 32;
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {3};
  ModelConfig m = parse_model_config(j, "c");
  EXPECT_EQ(m.moe_layer, (std::vector<bool>{false, true, false, false}));
  EXPECT_FALSE(m.norm_topk_prob);  // transformers' default for this family
}

TEST(ModelConfig, MixtralNames) {
  auto j = base("MixtralForCausalLM");
  j["num_local_experts"] = 8;
  j["num_experts_per_tok"] = 2;
  ModelConfig m = parse_model_config(j, "c");
  EXPECT_EQ(m.moe_prefix, "block_sparse_moe");
  EXPECT_EQ(m.expert_gate, "w1");
  EXPECT_EQ(m.moe_intermediate_size, 96);
  EXPECT_EQ(m.num_moe_layers(), 4);
}

TEST(ModelConfig, Glm4Moe) {
  auto j = base("Glm4MoeForCausalLM");
  j["n_routed_experts"] = 8;
  j["num_experts_per_tok"] = 2;
  j["moe_intermediate_size"] = 32;
  j["first_k_dense_replace"] = 1;
  j["n_group"] = 2;
  j["topk_group"] = 1;
  j["routed_scaling_factor"] = 2.5;
  j["partial_rotary_factor"] = 0.5;
  j["use_qk_norm"] = true;
  j["attention_bias"] = true;
  ModelConfig m = parse_model_config(j, "c");
  EXPECT_EQ(m.moe_layer, (std::vector<bool>{false, true, true, true}));
  EXPECT_EQ(m.router, RouterKind::SigmoidBias);
  EXPECT_EQ(m.rope.rotary_dim, 8);
  EXPECT_TRUE(m.qkv_bias);
  EXPECT_FALSE(m.o_bias);
  EXPECT_FLOAT_EQ(m.routed_scaling_factor, 2.5f);
  j["topk_group"] = 3;
  EXPECT_NE(error_of(j).find("topk_group"), std::string::npos);
}

TEST(ModelConfig, RopeParametersAndRopeScalingAgree) {
  auto a = base("LlamaForCausalLM");
  a["rope_theta"] = 500000.0;
  a["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 64}};
  auto b = base("LlamaForCausalLM");
  b["rope_parameters"] = {{"rope_type", "llama3"}, {"rope_theta", 500000.0}, {"factor", 8.0},
                          {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 64}};
  EXPECT_EQ(parse_model_config(a, "c").rope.inv_freq(), parse_model_config(b, "c").rope.inv_freq());
}

// Reference values from transformers' rope initialisation for the same parameters (head_dim 64).
TEST(Rope, Llama3MatchesReference) {
  RopeConfig r;
  r.type = "llama3";
  r.theta = 500000.0;
  r.factor = 8.0;
  r.original_max_position_embeddings = 8192;
  r.rotary_dim = 64;
  const auto f = r.inv_freq();
  const double expect[8] = {1.0, 0.193922758102417, 0.03760603070259094, 0.00729266507551074,
                            0.0005248460220173001, 3.428102354519069e-05, 6.647869668086059e-06, 1.289173155782919e-06};
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(f[size_t(4 * i)], expect[i], expect[i] * 1e-6) << i;
}

TEST(Rope, YarnMatchesReference) {
  RopeConfig r;
  r.type = "yarn";
  r.theta = 10000.0;
  r.factor = 4.0;
  r.original_max_position_embeddings = 4096;
  r.mscale = 1.0;
  r.mscale_all_dim = 0.707;
  r.rotary_dim = 64;
  const auto f = r.inv_freq();
  const double expect[8] = {1.0, 0.3162277638912201, 0.10000000149011612, 0.027973996475338936,
                            0.006538461893796921, 0.0013378867879509926, 0.0002500000118743628, 7.905694656074047e-05};
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(f[size_t(4 * i)], expect[i], expect[i] * 1e-6) << i;
  EXPECT_NEAR(r.attention_scaling(), 1.036992729910394, 1e-6);
}

TEST(ModelConfig, BadInputNamesTheField) {
  EXPECT_NE(error_of(base("GPT2LMHeadModel")).find("architecture 'GPT2LMHeadModel' is not supported"), std::string::npos);
  auto j = base("LlamaForCausalLM");
  j.erase("hidden_size");
  EXPECT_NE(error_of(j).find("missing field 'hidden_size'"), std::string::npos);
  j = base("LlamaForCausalLM");
  j["num_key_value_heads"] = 3;
  EXPECT_NE(error_of(j).find("num_key_value_heads"), std::string::npos);
  j = base("LlamaForCausalLM");
  j["vocab_size"] = "many";
  EXPECT_NE(error_of(j).find("'vocab_size' must be an integer"), std::string::npos);
  j = base("LlamaForCausalLM");
  j["rope_scaling"] = {{"rope_type", "longrope"}, {"factor", 2.0}};
  EXPECT_NE(error_of(j).find("longrope"), std::string::npos);
  j = base("LlamaForCausalLM");
  j["hidden_act"] = "gelu";
  EXPECT_NE(error_of(j).find("gelu"), std::string::npos);
  j = base("LlamaForCausalLM");
  j.erase("architectures");
  EXPECT_NE(error_of(j).find("architectures"), std::string::npos);
  EXPECT_NE(error_of(nlohmann::json::array()).find("not a JSON object"), std::string::npos);
  j = base("Qwen3MoeForCausalLM");
  j["num_experts"] = 4;
  j["num_experts_per_tok"] = 8;
  j["moe_intermediate_size"] = 8;
  EXPECT_NE(error_of(j).find("exceeds"), std::string::npos);
}

}  // namespace
}  // namespace kestrel
