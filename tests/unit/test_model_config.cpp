#include <gtest/gtest.h>

#include "common/error.h"
#include "formats/json_file.h"
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

namespace kestrel {
namespace {

nlohmann::json mla_base(const std::string& arch) {
  auto j = base(arch);
  j.update({{"kv_lora_rank", 32}, {"q_lora_rank", 24}, {"qk_nope_head_dim", 16}, {"qk_rope_head_dim", 8},
            {"v_head_dim", 16}, {"n_routed_experts", 8}, {"num_experts_per_tok", 2}, {"moe_intermediate_size", 32},
            {"first_k_dense_replace", 1}});
  return j;
}

TEST(ModelConfig, DeepseekV3Mla) {
  auto j = mla_base("DeepseekV3ForCausalLM");
  j["q_lora_rank"] = nullptr;  // DeepSeek-V2-Lite style
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 40.0}, {"original_max_position_embeddings", 64},
                       {"mscale", 1.0}, {"mscale_all_dim", 1.0}};
  ModelConfig m = parse_model_config(j, "c");
  EXPECT_TRUE(m.is_mla());
  EXPECT_EQ(m.mla.q_lora_rank, 0);
  EXPECT_EQ(m.mla.latent(), 40);
  EXPECT_EQ(m.head_dim, 24);
  EXPECT_EQ(m.rope.rotary_dim, 8);
  EXPECT_TRUE(m.rope.interleaved);  // rope_interleave defaults to true
  EXPECT_FALSE(m.indexer.enabled());
  EXPECT_EQ(m.moe_layer, (std::vector<bool>{false, true, true, true}));
  // DeepSeek-V3's softmax scale: (0.1 * ln 40 + 1)^2 / sqrt(24)
  const double mscale = 0.1 * std::log(40.0) + 1.0;
  EXPECT_NEAR(m.mla.softmax_scale, mscale * mscale / std::sqrt(24.0), 1e-6);
}

TEST(ModelConfig, GlmMoeDsaIndexerLayers) {
  auto j = mla_base("GlmMoeDsaForCausalLM");
  j.update({{"index_topk", 16}, {"index_n_heads", 2}, {"index_head_dim", 16}});
  ModelConfig m = parse_model_config(j, "c");
  EXPECT_TRUE(m.indexer.enabled());
  EXPECT_EQ(m.indexer.own, (std::vector<bool>{true, true, true, true}));
  j["indexer_types"] = {"full", "shared", "shared", "full"};
  EXPECT_EQ(parse_model_config(j, "c").indexer.own, (std::vector<bool>{true, false, false, true}));
  j.erase("indexer_types");
  j["index_topk_pattern"] = "FSFS";
  EXPECT_EQ(parse_model_config(j, "c").indexer.own, (std::vector<bool>{true, false, true, false}));
  j.erase("index_topk_pattern");
  j["index_topk_freq"] = 2;  // transformers' schedule: layer i selects when max(i - 1, 0) % 2 == 0
  EXPECT_EQ(parse_model_config(j, "c").indexer.own, (std::vector<bool>{true, true, false, true}));
  j.erase("index_topk_freq");
  j["mlp_layer_types"] = {"dense", "dense", "sparse", "sparse"};
  EXPECT_EQ(parse_model_config(j, "c").moe_layer, (std::vector<bool>{false, false, true, true}));
}

// The hub configs of GLM-5 and DeepSeek-V3 (as shipped with their NVFP4 checkpoints).
TEST(ModelConfig, HubMlaConfigs) {
  const std::string dir = std::string(KESTREL_FIXTURES) + "/../../configs/";
  ModelConfig g = parse_model_config_and_quant(read_json_file(dir + "glm-5-nvfp4.json"), dir + "glm-5-nvfp4.json");
  EXPECT_EQ(g.mla.q_lora_rank, 2048);
  EXPECT_EQ(g.mla.latent(), 576);
  EXPECT_EQ(g.mla.qk_head_dim(), 256);
  EXPECT_NEAR(g.mla.softmax_scale, 1.0 / 16.0, 1e-7);
  EXPECT_EQ(g.indexer.topk, 2048);
  EXPECT_EQ(g.indexer.own, std::vector<bool>(78, true));
  EXPECT_EQ(g.num_moe_layers(), 75);
  EXPECT_TRUE(g.quant.is_quantized());
  ModelConfig d = parse_model_config_and_quant(read_json_file(dir + "deepseek-v3-nvfp4.json"), dir + "deepseek-v3-nvfp4.json");
  EXPECT_EQ(d.mla.q_lora_rank, 1536);
  EXPECT_EQ(d.rope.type, "yarn");
  EXPECT_FALSE(d.indexer.enabled());
  EXPECT_EQ(d.n_group, 8);
  const double mscale = 0.1 * std::log(40.0) + 1.0;
  EXPECT_NEAR(d.mla.softmax_scale, mscale * mscale / std::sqrt(192.0), 1e-7);
}

TEST(ModelConfig, MlaBadInputNamesTheField) {
  auto j = mla_base("DeepseekV3ForCausalLM");
  j.erase("kv_lora_rank");
  EXPECT_NE(error_of(j).find("kv_lora_rank"), std::string::npos) << error_of(j);
  j = mla_base("DeepseekV3ForCausalLM");
  j["qk_rope_head_dim"] = 0;
  EXPECT_NE(error_of(j).find("qk_rope_head_dim"), std::string::npos) << error_of(j);
  j = mla_base("DeepseekV3ForCausalLM");
  j["scoring_func"] = "softmax";
  EXPECT_NE(error_of(j).find("scoring_func"), std::string::npos) << error_of(j);
  j = mla_base("GlmMoeDsaForCausalLM");
  j["indexer_types"] = {"full", "shared"};
  EXPECT_NE(error_of(j).find("'indexer_types' has 2 entries for 4 layers"), std::string::npos) << error_of(j);
  j["indexer_types"] = {"shared", "full", "full", "full"};
  EXPECT_NE(error_of(j).find("layer 0 cannot reuse"), std::string::npos) << error_of(j);
  j["indexer_types"] = {"full", "sometimes", "full", "full"};
  EXPECT_NE(error_of(j).find("indexer_types[1] is 'sometimes'"), std::string::npos) << error_of(j);
  j = mla_base("GlmMoeDsaForCausalLM");
  j["q_lora_rank"] = nullptr;
  EXPECT_NE(error_of(j).find("needs q_lora_rank"), std::string::npos) << error_of(j);
  j = mla_base("GlmMoeDsaForCausalLM");
  j["mlp_layer_types"] = {"dense", "sparse", "moe", "sparse"};
  EXPECT_NE(error_of(j).find("mlp_layer_types[2]"), std::string::npos) << error_of(j);
}

}  // namespace
}  // namespace kestrel
