// Speculative decoding by prompt lookup: the drafts, the draft length's policy, the check of a
// draft (the same greedy token; the same sampling distribution, tested statistically), and
// replies with and without speculation on every fixture family on the CPU: the same tokens over
// generations that cross KV block boundaries, and the cache holding exactly what was kept.
#include <gtest/gtest.h>

#include <cmath>
#include <tuple>
#include <nlohmann/json.hpp>

#include "apps/reply.h"
#include "apps/runner.h"
#include "fixture.h"
#include "model/weights.h"
#include "runtime/sampler.h"
#include "runtime/speculative.h"
#include "text/pretokenize.h"
#include "text/tokenizer.h"

namespace kestrel {
namespace {

TEST(Speculative, DraftsContinueTheLatestEarlierMatch) {
  using V = std::vector<int32_t>;
  // The suffix 7 8 occurs at 1 and 5; the latest earlier occurrence (5) is continued.
  EXPECT_EQ(ngram_draft(V{1, 7, 8, 2, 3, 7, 8, 4, 5, 7, 8}, 3, 3, 1), (V{4, 5, 7}));
  // The longest suffix wins: 3 7 8 occurs once, before 9.
  EXPECT_EQ(ngram_draft(V{3, 7, 8, 9, 1, 7, 8, 2, 3, 7, 8}, 2, 3, 1), (V{9, 1}));
  // Past the end of the history the continuation copies on: a period of 3 drafts 8 tokens of it.
  EXPECT_EQ(ngram_draft(V{4, 5, 6, 4, 5}, 8, 3, 1), (V{6, 4, 5, 6, 4, 5, 6, 4}));
  EXPECT_EQ(ngram_draft(V{9, 9, 9}, 4, 3, 1), (V{9, 9, 9, 9}));
  // No recurring suffix of min_match tokens: nothing.
  EXPECT_TRUE(ngram_draft(V{1, 2, 3, 4}, 4, 3, 1).empty());
  EXPECT_TRUE(ngram_draft(V{1, 2, 9, 3, 4, 2}, 4, 3, 2).empty());  // only a one-token match
  EXPECT_EQ(ngram_draft(V{1, 2, 9, 3, 4, 2}, 4, 3, 1), (V{9, 3, 4, 2}));
  EXPECT_EQ(ngram_draft(V{1, 2, 9, 3, 4, 2}, 6, 3, 1), (V{9, 3, 4, 2, 9, 3}));
  EXPECT_TRUE(ngram_draft(V{}, 4).empty());
  EXPECT_TRUE(ngram_draft(V{5}, 4, 3, 1).empty());
}

TEST(Speculative, DraftLengthGrowsShrinksAndPauses) {
  DraftLength d(8);
  EXPECT_EQ(d.next(), 8);
  d.checked(8, 3);  // a rejection: one past the accepted
  EXPECT_EQ(d.next(), 4);
  d.checked(4, 4);  // all accepted: doubled, up to the most
  EXPECT_EQ(d.next(), 8);
  d.checked(8, 0);
  EXPECT_EQ(d.next(), 1);
  d.checked(1, 0);  // two checks that accept nothing: a pause of 4 tokens
  for (int i = 0; i < 4; ++i) EXPECT_EQ(d.next(), 0);
  EXPECT_EQ(d.next(), 8);
  d.checked(8, 0);
  d.checked(1, 0);  // again: 8 tokens
  for (int i = 0; i < 8; ++i) EXPECT_EQ(d.next(), 0);
  EXPECT_EQ(d.next(), 8);
  d.checked(8, 2);  // something accepted: the pauses start over
  d.checked(3, 0);
  d.checked(1, 0);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(d.next(), 0);
  EXPECT_EQ(d.next(), 8);
}

TEST(Speculative, OptionsAreChecked) {
  EXPECT_THROW(check_speculation_options({.method = "mtp"}), Error);
  EXPECT_THROW(check_speculation_options({.method = "ngram", .draft_tokens = 0}), Error);
  EXPECT_THROW(check_speculation_options({.method = "ngram", .draft_tokens = 17}), Error);
  EXPECT_NO_THROW(check_speculation_options({.method = "ngram"}));
}

TEST(Speculative, GreedyCheckIsTheArgmax) {
  const std::vector<float> logits = {1.0f, 3.0f, -2.0f, 2.5f};
  Sampler s({});
  EXPECT_EQ(s.verify(logits, {}, 0, 1).token, 1);
  EXPECT_TRUE(s.verify(logits, {}, 0, 1).accepted);
  const Sampler::Verdict v = s.verify(logits, {}, 0, 3);
  EXPECT_FALSE(v.accepted);
  EXPECT_EQ(v.token, 1);
  // Penalties apply as in sample(): a repeated token's logit is cut.
  Sampler p({.repetition_penalty = 10.0f});
  const std::vector<int32_t> seen = {1};
  EXPECT_EQ(p.verify(logits, seen, 0, 3).token, p.sample(logits, seen, 0));
}

// The acceptance check shared by replies and the engine (greedy here): drafts are taken while
// they are the argmax, the first that is not is replaced by it; a taker that ends the sequence
// stops the check, an accepted draft it takes counted, an end token it does not take not.
TEST(Speculative, CheckDraftsStopsAtTheFirstRejection) {
  // Rows of 4 logits: the argmax of row j is best[j].
  const std::vector<int32_t> best = {2, 0, 3, 1, 2};
  std::vector<float> rows;
  for (int32_t b : best)
    for (int32_t t = 0; t < 4; ++t) rows.push_back(t == b ? 1.0f : 0.0f);
  auto row = [&](size_t j) { return std::span<const float>(rows.data() + 4 * j, 4); };
  auto run = [&](std::vector<int32_t> draft, size_t end_at, Taken end) {
    Sampler s({});
    std::vector<int32_t> history = {9};
    std::vector<size_t> rows_seen;
    const DraftCheck c = check_drafts(s, draft, row, history, 1, [&](const Sampler::Verdict& v, size_t j) {
      rows_seen.push_back(j);
      if (j == end_at) return end;
      history.push_back(v.token);
      return Taken::More;
    });
    return std::make_tuple(c, std::vector<int32_t>(history.begin() + 1, history.end()), rows_seen);
  };
  {
    const auto [c, taken, seen] = run({2, 0, 1, 1}, 99, Taken::More);  // the third is rejected
    EXPECT_EQ(c.accepted, 2u);
    EXPECT_TRUE(c.rejected);
    EXPECT_FALSE(c.ended);
    EXPECT_EQ(taken, (std::vector<int32_t>{2, 0, 3}));
    EXPECT_EQ(seen, (std::vector<size_t>{0, 1, 2}));
  }
  {
    const auto [c, taken, seen] = run({2, 0, 3}, 99, Taken::More);  // all accepted: the rest is the caller's
    EXPECT_EQ(c.accepted, 3u);
    EXPECT_FALSE(c.rejected || c.ended);
    EXPECT_EQ(taken, (std::vector<int32_t>{2, 0, 3}));
  }
  {
    const auto [c, taken, seen] = run({2, 0, 3, 1}, 1, Taken::Last);  // a stop on the second
    EXPECT_EQ(c.accepted, 2u);
    EXPECT_TRUE(c.ended);
    EXPECT_EQ(seen, (std::vector<size_t>{0, 1}));
  }
  {
    const auto [c, taken, seen] = run({2, 0, 3, 1}, 1, Taken::Nothing);  // an end token second: not taken
    EXPECT_EQ(c.accepted, 1u);
    EXPECT_TRUE(c.ended);
  }
}

// Checking a fixed draft and taking the verdict's token, many times: the tokens' frequencies are
// the sampling distribution's, for a draft of high, low and zero probability.
TEST(Speculative, SampledCheckKeepsTheDistribution) {
  const std::vector<float> logits = {0.3f, 1.2f, -0.5f, 0.8f, 0.0f};
  const SamplerOptions o{.temperature = 0.9f, .top_k = 4, .seed = 7};
  const std::vector<float> p = sampling_distribution(logits, o);
  ASSERT_EQ(p[2], 0.0f);  // cut by top-k
  const int n = 200000;
  for (int32_t draft : {1, 4, 2}) {
    Sampler s(o);
    std::vector<int> count(logits.size(), 0);
    int accepted = 0;
    for (int i = 0; i < n; ++i) {
      const Sampler::Verdict v = s.verify(logits, {}, 0, draft);
      ++count[size_t(v.token)];
      accepted += v.accepted;
      if (v.accepted) {
        ASSERT_EQ(v.token, draft);
      }
    }
    for (size_t t = 0; t < p.size(); ++t) {
      const double sd = std::sqrt(n * p[t] * (1 - p[t]));
      EXPECT_NEAR(count[t], n * p[t], 5 * sd + 1) << "draft " << draft << ", token " << t;
    }
    EXPECT_NEAR(accepted, n * p[size_t(draft)], 5 * std::sqrt(n * p[size_t(draft)] * (1 - p[size_t(draft)])) + 1);
  }
}

// A byte-level tokenizer of the fixtures' 256 ids (their text does not matter here).
text::Tokenizer byte_tokenizer() {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[text::byte_to_unicode(static_cast<unsigned char>(b))] = b;
  const nlohmann::json j = {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}},
                            {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}},
                            {"decoder", {{"type", "ByteLevel"}}}};
  return text::Tokenizer::from_json_text(j.dump(), "bytes");
}

class SpeculativeReply : public ::testing::TestWithParam<std::string> {};

TEST_P(SpeculativeReply, SameTokensAndCacheAsWithout) {
  auto model = load_model(test::fixture_dir(GetParam()));
  const text::Tokenizer tok = byte_tokenizer();
  // A prompt that repeats itself, so that drafts are proposed from the start.
  std::vector<int32_t> prompt;
  for (int i = 0; i < 24; ++i) prompt.push_back(int32_t(40 + (i * 7) % 5));
  apps::ReplyOptions base;
  base.max_tokens = 70;  // past several blocks of 16 positions
  auto run = [&](const std::string& method, int draft) {
    auto runner = apps::Runner::make(*model, "cpu", 128, 2);
    apps::ReplyOptions o = base;
    o.speculation.method = method;
    o.speculation.draft_tokens = draft;
    std::vector<int32_t> history = prompt;
    const apps::Reply r = apps::reply(*runner, tok, {}, prompt, history, prompt.size(), o, [](const std::string&) {});
    // The cache holds what the reply says it ran: the prompt, then the kept tokens.
    EXPECT_EQ(runner->position(), int64_t(r.ran.size())) << method;
    EXPECT_TRUE(std::equal(r.ran.begin(), r.ran.end(), history.begin())) << method;
    return std::make_pair(std::vector<int32_t>(history.begin() + long(prompt.size()), history.end()), r);
  };
  const auto [plain, r0] = run("none", 8);
  ASSERT_EQ(plain.size(), 70u);
  for (int draft : {1, 3, 8}) {
    const auto [spec, r] = run("ngram", draft);
    EXPECT_EQ(spec, plain) << "draft " << draft;
    EXPECT_GT(r.speculation.verifications, 0) << "draft " << draft;
    EXPECT_LE(r.speculation.accepted, r.speculation.drafted);
    std::printf("  draft %d: %lld checks, %lld of %lld drafted tokens accepted\n", draft,
                (long long)r.speculation.verifications, (long long)r.speculation.accepted, (long long)r.speculation.drafted);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, SpeculativeReply, ::testing::ValuesIn(test::fixture_names()), test::fixture_test_name);

}  // namespace
}  // namespace kestrel
