// The NVFP4 quantizer on hand-made blocks whose right answers are worked out in the comments
// (docs/QUANTIZE.md states the rules), the FP8/FP4 encoders, fusion groups of `--quant nvfp4`,
// and the perplexity arithmetic.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "common/error.h"
#include "common/numeric.h"
#include "fixture.h"
#include "quant/nvfp4_quantize.h"
#include "quant/requantize.h"
#include "quant/targets.h"
#include "runtime/perplexity.h"

namespace kestrel {
namespace {

TEST(Quantize, E4M3RoundsToNearestEvenAndSaturates) {
  EXPECT_EQ(f32_to_e4m3(1.0f), 0x38);
  EXPECT_EQ(f32_to_e4m3(-1.0f), 0xb8);
  EXPECT_EQ(f32_to_e4m3(0.0f), 0x00);
  EXPECT_EQ(f32_to_e4m3(448.0f), 0x7e);
  EXPECT_EQ(f32_to_e4m3(447.0f), 0x7e);   // 447/32 = 13.97 units of 32 -> 14 -> 448
  EXPECT_EQ(f32_to_e4m3(464.0f), 0x7e);   // at or above 448: saturate (no NaN)
  EXPECT_EQ(f32_to_e4m3(1e6f), 0x7e);
  EXPECT_EQ(f32_to_e4m3(240.0f), 0x77);   // 1.875 x 2^7: exponent field 14, mantissa 7
  EXPECT_EQ(f32_to_e4m3(1.0625f), 0x38);  // halfway 1.0 / 1.125: even mantissa 0
  EXPECT_EQ(f32_to_e4m3(1.1875f), 0x3a);  // halfway 1.125 / 1.25: even mantissa 2
  EXPECT_EQ(f32_to_e4m3(1.9375f), 0x40);  // halfway 1.875 / 2.0: rounds into the next binade
  EXPECT_EQ(f32_to_e4m3(std::ldexp(1.0f, -9)), 0x01);        // smallest subnormal
  EXPECT_EQ(f32_to_e4m3(std::ldexp(1.0f, -10)), 0x00);       // halfway 0 / 2^-9: even 0
  EXPECT_EQ(f32_to_e4m3(std::ldexp(3.0f, -10)), 0x02);       // halfway 1 / 2 units: even 2
  EXPECT_EQ(f32_to_e4m3(std::ldexp(15.0f, -10)), 0x08);      // halfway 7 units / 2^-6: even (2^-6)
  EXPECT_EQ(f32_to_e4m3(NAN) & 0x7f, 0x7f);
  // Every finite code reads back to itself.
  for (int c = 0; c < 0x7f; ++c) {
    EXPECT_EQ(f32_to_e4m3(e4m3_to_f32(uint8_t(c))), c) << c;
    EXPECT_EQ(f32_to_e4m3(e4m3_to_f32(uint8_t(c | 0x80))), c | 0x80) << c;
  }
}

TEST(Quantize, E2M1RoundsToNearestEvenAndSaturates) {
  const std::pair<float, int> cases[] = {
      {0.0f, 0},  {0.25f, 0}, {0.26f, 1}, {0.5f, 1},  {0.74f, 1},  {0.75f, 2},   {1.25f, 2},  {1.26f, 3},
      {1.75f, 4}, {2.5f, 4},  {2.6f, 5},  {3.5f, 6},  {4.5f, 6},   {5.0f, 6},    {5.01f, 7},  {6.0f, 7},
      {7.0f, 7},  {1e9f, 7},  {-0.1f, 8}, {-1.0f, 10}, {-3.5f, 14}, {-6.0f, 15}, {-100.0f, 15},
  };
  for (const auto& [x, code] : cases) EXPECT_EQ(f32_to_e2m1(x), code) << x;
}

std::vector<uint8_t> quantize_block(const std::vector<float>& w, float scale2, uint8_t* scale) {
  std::vector<uint8_t> packed(w.size() / 2);
  nvfp4_quantize_row(w.data(), int64_t(w.size()), scale2, packed.data(), scale);
  return packed;
}

TEST(Quantize, HandMadeBlocks) {
  uint8_t s = 0;
  // scale_2 = 1. Block amax 12 -> block scale 12 / 6 = 2 (E4M3 0x40); w / 2 =
  // 6, -6, .5, -.5, .25 (tie: 0), .3, 1.25 (tie: 1), 1.5, 2.5 (tie: 2), 3.5 (tie: 4), 4.5, 5.5, -.2, 0, .75 (tie: 1), -1.45
  // codes 7, F, 1, 9, 0, 1, 2, 3, 4, 6, 6, 7, 8 (negative zero), 0, 2, B.
  EXPECT_EQ(quantize_block({12, -12, 1, -1, 0.5f, 0.6f, 2.5f, 3, 5, 7, 9, 11, -0.4f, 0, 1.5f, -2.9f}, 1.0f, &s),
            (std::vector<uint8_t>{0xF7, 0x91, 0x10, 0x32, 0x64, 0x76, 0x08, 0xB2}));
  EXPECT_EQ(s, 0x40);
  // Block amax 2688 -> 2688 / 6 = 448 (0x7e); w / 448 = 6, 1, .5, .25 (tie: 0), -3, 1.5, 2.23 (-> 2), zeros.
  EXPECT_EQ(quantize_block({2688, 448, 224, 112, -1344, 672, 1000, 0, 0, 0, 0, 0, 0, 0, 0, 0}, 1.0f, &s),
            (std::vector<uint8_t>{0x27, 0x01, 0x3D, 0x04, 0, 0, 0, 0}));
  EXPECT_EQ(s, 0x7e);
  // Block amax 6.36 -> 1.06, which E4M3 rounds down to 1.0: 6.36 and -6.2 saturate to +-6, 3 -> 3.
  EXPECT_EQ(quantize_block({6.36f, -6.2f, 3.0f, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, 1.0f, &s),
            (std::vector<uint8_t>{0xF7, 0x05, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(s, 0x38);
  // An all-zero block: scale 1.0 as ModelOpt writes it, zero codes.
  EXPECT_EQ(quantize_block(std::vector<float>(16, 0.0f), 1.0f, &s), std::vector<uint8_t>(8, 0));
  EXPECT_EQ(s, 0x38);
  // A block whose scale underflows E4M3 (1e-9 / 6 < 2^-10): scale 0 and zero codes.
  EXPECT_EQ(quantize_block({1e-9f, -1e-9f, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, 1.0f, &s),
            std::vector<uint8_t>(8, 0));
  EXPECT_EQ(s, 0x00);
  // scale_2 = 26.88 / 2688 = 0.01. Block amax 1.2 -> 1.2 / 0.06 = 20 (E4M3: exponent field 11,
  // mantissa 2: 0x5A); w / 0.2 = 6, 1.5, -2.2 (-> -2), .35 (-> .5).
  EXPECT_FLOAT_EQ(nvfp4_scale2(26.88f), 0.01f);
  EXPECT_EQ(quantize_block({1.2f, 0.3f, -0.44f, 0.07f, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, nvfp4_scale2(26.88f), &s),
            (std::vector<uint8_t>{0x37, 0x1C, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(s, 0x5A);
}

Linear f32_linear(const std::vector<float>& w, int64_t out, int64_t in, const char* name = "test.proj") {
  Linear l;
  l.name = name;
  l.out = out;
  l.in = in;
  l.format = WeightFormat::F32;
  l.data = reinterpret_cast<const uint8_t*>(w.data());
  return l;
}

TEST(Quantize, WholeLinearAndItsDequantization) {
  // Row 0: the first two hand-made blocks above; row 1: their negation. amax 2688 -> scale_2 = 1.
  std::vector<float> w = {12, -12, 1,    -1, 0.5f, 0.6f, 2.5f, 3, 5, 7, 9, 11, -0.4f, 0, 1.5f, -2.9f,
                          2688, 448, 224, 112, -1344, 672, 1000, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < 32; ++i) w.push_back(-w[size_t(i)]);
  ThreadPool pool(2);
  const Linear l = f32_linear(w, 2, 32);
  EXPECT_EQ(weight_amax(l, pool), 2688.0f);
  const Nvfp4Matrix q = quantize_linear(l, 2688.0f, pool);
  EXPECT_EQ(q.scale2, 1.0f);
  ASSERT_EQ(q.packed.size(), 32u);
  ASSERT_EQ(q.scales.size(), 4u);
  EXPECT_EQ(q.scales, (std::vector<uint8_t>{0x40, 0x7e, 0x40, 0x7e}));
  EXPECT_EQ(q.packed[0], 0xF7);
  EXPECT_EQ(q.packed[16], 0x7F);  // -12, 12
  Linear d = l;
  d.format = WeightFormat::NVFP4;
  d.data = q.packed.data();
  d.scales = q.scales.data();
  d.scale2 = q.scale2;
  std::vector<float> row(32);
  d.dequant_row(0, row.data());
  const std::vector<float> want = {12, -12, 1,   -1, 0, 1, 2, 3, 4, 8, 8, 12, -0.0f, 0, 2, -3,
                                   2688, 448, 224, 0, -1344, 672, 896, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  EXPECT_EQ(row, want);
}

TEST(Quantize, BadWeightsNameTheModule) {
  ThreadPool pool(1);
  std::vector<float> w(32, 1.0f);
  w[20] = NAN;
  try {
    weight_amax(f32_linear(w, 2, 16, "model.layers.3.mlp.up_proj"), pool);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.3.mlp.up_proj: weight row 1"), std::string::npos) << e.what();
  }
  std::vector<float> v(40, 1.0f);
  try {
    quantize_linear(f32_linear(v, 2, 20, "odd.proj"), 1.0f, pool);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("odd.proj: NVFP4 needs the input dimension to be a multiple of 16"),
              std::string::npos)
        << e.what();
  }
}

// --quant nvfp4: q/k/v share one scale_2 (the largest amax of the three), gate/up another; the
// exclusions apply; the LM head, embeddings and routers stay as stored.
TEST(Quantize, RequantizeSharesScalesInFusionGroups) {
  ThreadPool pool(2);
  auto orig = load_model(test::fixture_dir("qwen3moe-bf16"));
  auto m = load_model(test::fixture_dir("qwen3moe-bf16"));
  const QuantConfig settings = nvfp4_settings(m->config, {"model.layers.2.self_attn*"}, "test");
  const int n = requantize_nvfp4(*m, settings, pool);
  const auto& L0 = orig->weights.layers[0];
  const auto& Q0 = m->weights.layers[0];
  const float qkv = std::max({weight_amax(L0.q, pool), weight_amax(L0.k, pool), weight_amax(L0.v, pool)});
  for (const Linear* l : {&Q0.q, &Q0.k, &Q0.v}) {
    EXPECT_EQ(l->format, WeightFormat::NVFP4);
    EXPECT_EQ(l->scale2, nvfp4_scale2(qkv));
  }
  EXPECT_EQ(Q0.o.scale2, nvfp4_scale2(weight_amax(L0.o, pool)));
  ASSERT_TRUE(Q0.is_moe);
  const auto& e0 = L0.moe.experts[3];
  EXPECT_EQ(Q0.moe.experts[3].gate.scale2, Q0.moe.experts[3].up.scale2);
  EXPECT_EQ(Q0.moe.experts[3].gate.scale2, nvfp4_scale2(std::max(weight_amax(e0.gate, pool), weight_amax(e0.up, pool))));
  EXPECT_EQ(Q0.moe.router.format, WeightFormat::BF16);
  EXPECT_EQ(m->weights.embed.format, WeightFormat::BF16);
  EXPECT_EQ(m->weights.lm_head.format, WeightFormat::BF16);
  EXPECT_EQ(m->weights.layers[2].q.format, WeightFormat::BF16);  // excluded
  EXPECT_EQ(m->weights.layers[1].q.format, WeightFormat::NVFP4);
  const int64_t experts = m->config.num_experts * m->config.num_moe_layers();
  EXPECT_EQ(n, 4 * 3 - 4 + 3 * int(m->config.num_layers - m->config.num_moe_layers()) + 3 * int(experts));
}

TEST(Perplexity, WindowsFollowTheSlidingWindowDefinition) {
  auto w = perplexity_windows(10, 4, 2);
  ASSERT_EQ(w.size(), 4u);
  const int64_t want[4][3] = {{0, 4, 1}, {2, 6, 4}, {4, 8, 6}, {6, 10, 8}};
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(w[i].begin, want[i][0]);
    EXPECT_EQ(w[i].end, want[i][1]);
    EXPECT_EQ(w[i].first_scored, want[i][2]);
  }
  // stride == context: the first token of each later window is not scored.
  w = perplexity_windows(10, 4, 4);
  ASSERT_EQ(w.size(), 3u);
  EXPECT_EQ(w[1].begin, 4);
  EXPECT_EQ(w[1].first_scored, 5);
  EXPECT_EQ(w[2].first_scored, 9);
  // A last window of one token scores nothing and is left out.
  EXPECT_EQ(perplexity_windows(5, 4, 4).size(), 1u);
  // One window covering everything.
  w = perplexity_windows(3, 1024, 512);
  ASSERT_EQ(w.size(), 1u);
  EXPECT_EQ(w[0].end, 3);
  EXPECT_THROW(perplexity_windows(1, 4, 2), Error);
  EXPECT_THROW(perplexity_windows(10, 1, 1), Error);
  EXPECT_THROW(perplexity_windows(10, 4, 0), Error);
  EXPECT_THROW(perplexity_windows(10, 4, 5), Error);
}

TEST(Perplexity, ScoresByHand) {
  const float even[2] = {0, 0};
  EXPECT_NEAR(token_nll(even, 2, 0), std::log(2.0), 1e-12);
  const float p[2] = {float(std::log(1.0)), float(std::log(3.0))};  // softmax: 0.25, 0.75
  EXPECT_NEAR(token_nll(p, 2, 1), -std::log(0.75), 1e-7);
  // KL(0.25, 0.75 || 0.5, 0.5) = 0.25 ln 0.5 + 0.75 ln 1.5
  EXPECT_NEAR(kl_divergence(p, even, 2), 0.25 * std::log(0.5) + 0.75 * std::log(1.5), 1e-7);
  EXPECT_NEAR(kl_divergence(p, p, 2), 0.0, 1e-15);
  const float tie[3] = {1, 5, 5};
  EXPECT_EQ(argmax(tie, 3), 1);
  PerplexityStats s;
  s.add(p, even, 2, 1);  // model p, reference even: model top-1 is 1, reference's 0 (tie, lowest)
  s.add(even, even, 2, 0);
  EXPECT_EQ(s.scored, 2);
  EXPECT_NEAR(s.perplexity(), std::exp((-std::log(0.75) + std::log(2.0)) / 2), 1e-6);
  EXPECT_NEAR(s.ref_perplexity(), 2.0, 1e-9);
  EXPECT_NEAR(s.mean_kl(), (0.5 * std::log(0.5 / 0.25) + 0.5 * std::log(0.5 / 0.75)) / 2, 1e-7);
  EXPECT_EQ(s.top1_agree, 1);
}

}  // namespace
}  // namespace kestrel
