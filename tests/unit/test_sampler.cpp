// Sampling on hand-made logits: greedy, top-k, top-p, min-p, repetition penalty, seeds, stops.
#include <gtest/gtest.h>

#include <cmath>

#include "common/error.h"
#include "runtime/sampler.h"

namespace kestrel {
namespace {

const std::vector<float> kLogits = {1.0f, 3.0f, -2.0f, 2.5f, 0.0f, 2.9f};

TEST(Sampler, GreedyIsArgmax) {
  Sampler s({});
  EXPECT_EQ(s.sample(kLogits, {}), 1);
}

TEST(Sampler, TopKOneIsArgmaxAtAnyTemperature) {
  for (uint64_t seed = 0; seed < 20; ++seed) {
    Sampler s({.temperature = 5.0f, .top_k = 1, .seed = seed});
    EXPECT_EQ(s.sample(kLogits, {}), 1);
  }
}

TEST(Sampler, TopKKeepsTheKBest) {
  const auto p = sampling_distribution(kLogits, {.temperature = 1.0f, .top_k = 3});
  EXPECT_GT(p[1], 0);
  EXPECT_GT(p[5], 0);
  EXPECT_GT(p[3], 0);
  EXPECT_EQ(p[0] + p[2] + p[4], 0.0f);
  EXPECT_NEAR(p[1] + p[3] + p[5], 1.0, 1e-6);
  const double z = std::exp(3.0) + std::exp(2.9) + std::exp(2.5);
  EXPECT_NEAR(p[1], std::exp(3.0) / z, 1e-6);
}

TEST(Sampler, TopPKeepsTheSmallestSetReachingP) {
  // Probabilities 0.5, 0.3, 0.15, 0.05.
  const std::vector<float> l = {std::log(0.3f), std::log(0.05f), std::log(0.5f), std::log(0.15f)};
  auto kept = [&](float top_p) {
    const auto p = sampling_distribution(l, {.temperature = 1.0f, .top_p = top_p});
    int n = 0;
    for (float x : p) n += x > 0;
    return n;
  };
  EXPECT_EQ(kept(0.5f), 1);
  EXPECT_EQ(kept(0.6f), 2);
  EXPECT_EQ(kept(0.75f), 2);
  EXPECT_EQ(kept(0.81f), 3);
  EXPECT_EQ(kept(0.96f), 4);
  EXPECT_EQ(kept(0.01f), 1);
  const auto p = sampling_distribution(l, {.temperature = 1.0f, .top_p = 0.75f});
  EXPECT_NEAR(p[2], 0.5 / 0.8, 1e-5);
  EXPECT_NEAR(p[0], 0.3 / 0.8, 1e-5);
}

TEST(Sampler, MinPDropsTokensFarBelowTheBest) {
  const std::vector<float> l = {std::log(0.3f), std::log(0.05f), std::log(0.5f), std::log(0.15f)};
  const auto p = sampling_distribution(l, {.temperature = 1.0f, .min_p = 0.35f});  // threshold 0.175
  EXPECT_GT(p[2], 0);
  EXPECT_GT(p[0], 0);
  EXPECT_EQ(p[3], 0);
  EXPECT_EQ(p[1], 0);
}

TEST(Sampler, TemperatureSharpensAndFlattens) {
  const auto cold = sampling_distribution(kLogits, {.temperature = 0.1f});
  const auto hot = sampling_distribution(kLogits, {.temperature = 10.0f});
  EXPECT_GT(cold[1], 0.7f);
  EXPECT_LT(hot[1], 0.3f);
}

TEST(Sampler, RepetitionPenaltyDividesPositiveMultipliesNegative) {
  std::vector<float> l = {2.0f, -2.0f, 4.0f, 1.0f};
  const std::vector<int32_t> seen = {0, 1, 1, 7};  // repeats count once; out-of-range ids ignored
  apply_repetition_penalty(l, seen, 2.0f);
  EXPECT_EQ(l, (std::vector<float>{1.0f, -4.0f, 4.0f, 1.0f}));
  // Greedy follows the penalty: 3.0 / 2 < 2.9.
  Sampler s({.repetition_penalty = 2.0f});
  EXPECT_EQ(s.sample(kLogits, std::vector<int32_t>{1}), 5);
}

TEST(Sampler, FixedSeedRepeatsDifferentSeedsDiffer) {
  auto run = [](uint64_t seed) {
    Sampler s({.temperature = 1.5f, .top_p = 0.95f, .seed = seed});
    std::vector<int32_t> out;
    for (int i = 0; i < 64; ++i) out.push_back(s.sample(kLogits, {}));
    return out;
  };
  EXPECT_EQ(run(7), run(7));
  EXPECT_NE(run(7), run(8));
}

TEST(Sampler, DrawsFollowTheDistribution) {
  Sampler s({.temperature = 1.0f, .seed = 1});
  const auto p = sampling_distribution(kLogits, {.temperature = 1.0f});
  std::vector<int> count(kLogits.size());
  const int n = 20000;
  for (int i = 0; i < n; ++i) ++count[size_t(s.sample(kLogits, {}))];
  for (size_t i = 0; i < p.size(); ++i) EXPECT_NEAR(double(count[i]) / n, p[i], 0.02) << i;
}

TEST(Sampler, PresenceAndFrequencyPenaltiesCountGeneratedTokensOnly) {
  std::vector<float> l = {2.0f, 2.0f, 2.0f, 2.0f};
  const std::vector<int32_t> generated = {1, 2, 2, 2, 9};  // out-of-range ids ignored
  apply_presence_frequency_penalty(l, generated, 0.5f, 0.25f);
  EXPECT_EQ(l, (std::vector<float>{2.0f, 1.25f, 0.75f, 2.0f}));
  // Through the sampler: the prompt (first two tokens) is not counted.
  Sampler s({.presence_penalty = 1.0f});
  const std::vector<float> flat = {1.0f, 1.5f, 0.0f};
  EXPECT_EQ(s.sample(flat, std::vector<int32_t>{1, 1}, 2), 1);  // 1 only in the prompt: no penalty
  EXPECT_EQ(s.sample(flat, std::vector<int32_t>{0, 1}, 1), 0);  // 1 generated: 1.5 - 1 < 1.0
}

TEST(Sampler, BadOptionsAreRefused) {
  EXPECT_THROW(Sampler({.presence_penalty = 3.0f}), Error);
  EXPECT_THROW(Sampler({.frequency_penalty = -2.5f}), Error);
  EXPECT_THROW(Sampler({.temperature = -1.0f}), Error);
  EXPECT_THROW(Sampler({.top_p = 0.0f}), Error);
  EXPECT_THROW(Sampler({.top_p = 1.5f}), Error);
  EXPECT_THROW(Sampler({.min_p = 2.0f}), Error);
  EXPECT_THROW(Sampler({.repetition_penalty = 0.0f}), Error);
  EXPECT_THROW(Sampler({.top_k = -1}), Error);
}

TEST(StopMatcher, HoldsPossibleStartsAndCutsAtTheStop) {
  StopMatcher m({"</s>", "STOP"});
  EXPECT_EQ(m.push("hello <"), "hello ");
  EXPECT_EQ(m.push("/"), "");
  EXPECT_EQ(m.push("x"), "</x");
  EXPECT_EQ(m.push(" and ST"), " and ");
  EXPECT_EQ(m.push("OP after"), "");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.push("more"), "");
  EXPECT_EQ(m.flush(), "");
}

TEST(StopMatcher, FlushReturnsHeldTextWithoutAStop) {
  StopMatcher m({"\n\n"});
  EXPECT_EQ(m.push("a\n"), "a");
  EXPECT_EQ(m.flush(), "\n");
  EXPECT_FALSE(m.stopped());
  StopMatcher none({});
  EXPECT_EQ(none.push("abc"), "abc");
}

// A constraint's mask: disallowed logits become -inf, so greedy and sampled tokens are allowed ones,
// whatever the penalties; words of all ones are skipped and tokens past the mask are disallowed.
TEST(Sampler, TokenMaskLeavesOnlyAllowedTokens) {
  std::vector<float> l = kLogits;
  const uint32_t allow = (1u << 0) | (1u << 4);  // tokens 0 and 4 (the argmax, 1, is not)
  apply_token_mask(l, std::vector<uint32_t>{allow});
  EXPECT_EQ(l[0], kLogits[0]);
  EXPECT_EQ(l[4], kLogits[4]);
  for (int t : {1, 2, 3, 5}) EXPECT_TRUE(std::isinf(l[size_t(t)]) && l[size_t(t)] < 0) << t;
  Sampler greedy({});
  EXPECT_EQ(greedy.sample(l, {}), 0);
  for (uint64_t seed = 0; seed < 50; ++seed) {
    Sampler hot({.temperature = 2.0f, .top_p = 0.9f, .repetition_penalty = 1.3f, .presence_penalty = 1.0f, .seed = seed});
    const int32_t t = hot.sample(l, std::vector<int32_t>{0, 1, 4}, 1);
    EXPECT_TRUE(t == 0 || t == 4) << t;
  }
  std::vector<float> wide(70, 1.0f);
  apply_token_mask(wide, std::vector<uint32_t>{~0u, 1u << 3});  // word 2 absent: not allowed
  for (size_t t = 0; t < 32; ++t) EXPECT_EQ(wide[t], 1.0f);
  for (size_t t = 32; t < 70; ++t) EXPECT_EQ(wide[t] == 1.0f, t == 35) << t;
}

}  // namespace
}  // namespace kestrel
