// Every family and storage format against transformers' float32 logits, per position, through
// both the prefill path and the token-by-token decode path.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>

#include "backend/cpu/forward.h"
#include "fixture.h"
#include "model/weights.h"

namespace kestrel {
namespace {

constexpr double kTolerance = 1e-3;  // relative L2 error per position

class FixtureTest : public ::testing::TestWithParam<std::string> {};

void expect_close(const std::vector<float>& got, const test::Reference& ref, const char* path) {
  double worst = 0;
  for (size_t t = 0; t < ref.tokens.size(); ++t) {
    const double e = test::rel_l2(got.data() + t * size_t(ref.vocab), ref.logits.data() + t * size_t(ref.vocab), ref.vocab);
    EXPECT_LE(e, kTolerance) << path << " path, position " << t;
    worst = std::max(worst, e);
  }
  std::printf("  %s path: worst relative L2 error %.2e\n", path, worst);
}

TEST_P(FixtureTest, PrefillAndDecodeMatchTransformers) {
  const std::string dir = test::fixture_dir(GetParam());
  auto model = load_model(dir);
  const test::Reference ref = test::load_reference(dir);
  ASSERT_EQ(ref.vocab, model->config.vocab_size);
  const int64_t T = int64_t(ref.tokens.size()), V = ref.vocab;
  ThreadPool pool(2);
  cpu::Forward fwd(*model, pool);

  std::vector<float> prefill(size_t(T * V), NAN);
  KvCache c1 = fwd.make_cache(T);
  fwd.run(ref.tokens, c1, prefill.data());
  expect_close(prefill, ref, "prefill");

  std::vector<float> decode(size_t(T * V), NAN);
  KvCache c2 = fwd.make_cache(T);
  for (int64_t t = 0; t < T; ++t) fwd.run({ref.tokens.data() + t, 1}, c2, decode.data() + t * V);
  expect_close(decode, ref, "decode");

  // A mixed split (prefill a prefix, then decode) lands on the same logits.
  std::vector<float> mixed(size_t(T * V), NAN);
  KvCache c3 = fwd.make_cache(T);
  const int64_t split = T / 2;
  fwd.run({ref.tokens.data(), size_t(split)}, c3, mixed.data());
  fwd.run({ref.tokens.data() + split, size_t(T - split)}, c3, mixed.data() + split * V);
  expect_close(mixed, ref, "split prefill");
}

INSTANTIATE_TEST_SUITE_P(Families, FixtureTest, ::testing::ValuesIn(test::fixture_names()),
                         test::fixture_test_name);
INSTANTIATE_TEST_SUITE_P(Fp8, FixtureTest, ::testing::ValuesIn(test::fp8_fixture_names()), test::fixture_test_name);

// The fixtures must exercise what they claim: a wrong routing, rotary or norm would be caught only
// if the logits depend on them, so check that the reference logits are far from trivial.
TEST(Fixtures, ReferenceLogitsAreInformative) {
  std::vector<std::string> names = test::fixture_names();
  names.insert(names.end(), test::fp8_fixture_names().begin(), test::fp8_fixture_names().end());
  for (const auto& name : names) {
    const test::Reference ref = test::load_reference(test::fixture_dir(name));
    double sum = 0, sq = 0;
    for (float v : ref.logits) {
      sum += v;
      sq += double(v) * v;
    }
    const double n = double(ref.logits.size()), sd = std::sqrt(sq / n - (sum / n) * (sum / n));
    EXPECT_GT(sd, 1.0) << name << ": logits barely vary";
  }
}

}  // namespace
}  // namespace kestrel

namespace kestrel {
namespace {

// The comparison is sharp enough to catch a wrong detail of a family: each mutation below must
// push the error far past the tolerance.
double worst_error_after(const std::string& fixture, const std::function<void(Model&)>& mutate) {
  const std::string dir = test::fixture_dir(fixture);
  auto model = load_model(dir);
  mutate(*model);
  const test::Reference ref = test::load_reference(dir);
  ThreadPool pool(1);
  cpu::Forward fwd(*model, pool);
  const int64_t T = int64_t(ref.tokens.size());
  std::vector<float> got(size_t(T * ref.vocab));
  KvCache cache = fwd.make_cache(T);
  fwd.run(ref.tokens, cache, got.data());
  double worst = 0;
  for (int64_t t = 0; t < T; ++t)
    worst = std::max(worst, test::rel_l2(got.data() + t * ref.vocab, ref.logits.data() + t * ref.vocab, ref.vocab));
  return worst;
}

TEST(Fixtures, MutationsAreCaught) {
  const double tol = 1e-3 * 10;
  EXPECT_GT(worst_error_after("glm4moe-bf16", [](Model& m) { m.config.rope.interleaved = true; }), tol);
  EXPECT_GT(worst_error_after("glm4moe-bf16", [](Model& m) { m.config.routed_scaling_factor = 1.0f; }), tol);
  EXPECT_GT(worst_error_after("glm4moe-bf16", [](Model& m) { m.config.n_group = 1; }), tol);
  EXPECT_GT(worst_error_after("glm4moe-bf16", [](Model& m) {
              for (auto& l : m.weights.layers) std::fill(l.moe.correction_bias.begin(), l.moe.correction_bias.end(), 0.0f);
            }), tol);
  EXPECT_GT(worst_error_after("qwen3moe-bf16", [](Model& m) { m.config.norm_topk_prob = !m.config.norm_topk_prob; }), tol);
  EXPECT_GT(worst_error_after("llama-bf16", [](Model& m) { m.config.rope.type = "default"; }), tol);
  EXPECT_GT(worst_error_after("qwen3-bf16", [](Model& m) {
              for (auto& l : m.weights.layers) std::fill(l.q_norm.begin(), l.q_norm.end(), 1.0f);
            }), tol);
  EXPECT_GT(worst_error_after("qwen2-nvfp4", [](Model& m) {
              m.weights.layers[0].q.scale2 *= 1.05f;
            }), tol);
}

TEST(Fixtures, MlaMutationsAreCaught) {
  const double tol = 1e-3 * 10;
  // rotate-half vs interleaved pairs on the rope part of q and the shared key
  EXPECT_GT(worst_error_after("deepseekv3-bf16", [](Model& m) { m.config.rope.interleaved = true; }), tol);
  EXPECT_GT(worst_error_after("deepseekv3-nvfp4", [](Model& m) { m.config.rope.interleaved = false; }), tol);
  // YaRN's mscale^2 on the softmax scale
  EXPECT_GT(worst_error_after("deepseekv3-nvfp4", [](Model& m) {
              m.config.mla.softmax_scale = 1.0f / std::sqrt(float(m.config.mla.qk_head_dim()));
            }), tol);
  // sparse attention really selects: dense attention over every position differs
  EXPECT_GT(worst_error_after("glm5-bf16", [](Model& m) { m.config.indexer.topk = 1000; }), tol);
  EXPECT_GT(worst_error_after("glm5-nvfp4", [](Model& m) { m.config.indexer.topk = 1000; }), tol);
  // the indexer's own rotary interleaving and its key LayerNorm bias
  EXPECT_GT(worst_error_after("glm5-bf16", [](Model& m) { m.config.indexer.rope_interleaved = false; }), tol);
  EXPECT_GT(worst_error_after("glm5-bf16", [](Model& m) {
              for (auto& l : m.weights.layers) std::fill(l.mla.indexer.k_norm_bias.begin(), l.mla.indexer.k_norm_bias.end(), 0.0f);
            }), tol);
}

}  // namespace
}  // namespace kestrel
