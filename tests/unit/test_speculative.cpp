// Speculative decoding by prompt lookup: the drafts, the draft length's policy, the check of a
// draft (the same greedy token; the same sampling distribution, tested statistically), and
// replies with and without speculation on every fixture family on the CPU: the same tokens over
// generations that cross KV block boundaries, and the cache holding exactly what was kept. With
// the MTP layer as the drafter (DeepSeek-V3 and GLM-5, BF16 and an NVFP4 layer): the same greedy
// tokens, its cache after checks that reject at every depth equal to one computed from scratch
// over the kept tokens, and its refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <tuple>
#include <nlohmann/json.hpp>

#include "apps/reply.h"
#include "apps/runner.h"
#include "backend/cpu/forward.h"
#include "fixture.h"
#include "model/weights.h"
#include "mtp_checkpoint.h"
#include "runtime/mtp_drafter.h"
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
  EXPECT_THROW(check_speculation_options({.method = "eagle"}), Error);
  EXPECT_NO_THROW(check_speculation_options({.method = "mtp", .draft_tokens = 3}));
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

// A reply of 70 tokens to `prompt` (greedy, past several blocks of 16 positions) with this
// speculation (the runner drafting with the MTP layer for "mtp"), checked to leave in the cache
// what it says it ran, the prompt then the kept tokens: (the reply's tokens, the reply).
std::pair<std::vector<int32_t>, apps::Reply> greedy_reply(const Model& model, const std::vector<int32_t>& prompt,
                                                          const std::string& method, int draft) {
  auto runner = apps::Runner::make(model, "cpu", 128, 2, {}, "auto", method == "mtp");
  apps::ReplyOptions o;
  o.max_tokens = 70;
  o.speculation.method = method;
  o.speculation.draft_tokens = draft;
  std::vector<int32_t> history = prompt;
  const apps::Reply r =
      apps::reply(*runner, byte_tokenizer(), {}, prompt, history, prompt.size(), o, [](const std::string&) {});
  EXPECT_EQ(runner->position(), int64_t(r.ran.size())) << method;
  EXPECT_TRUE(std::equal(r.ran.begin(), r.ran.end(), history.begin())) << method;
  return {std::vector<int32_t>(history.begin() + long(prompt.size()), history.end()), r};
}

class SpeculativeReply : public ::testing::TestWithParam<std::string> {};

TEST_P(SpeculativeReply, SameTokensAndCacheAsWithout) {
  auto model = load_model(test::fixture_dir(GetParam()));
  // A prompt that repeats itself, so that drafts are proposed from the start.
  std::vector<int32_t> prompt;
  for (int i = 0; i < 24; ++i) prompt.push_back(int32_t(40 + (i * 7) % 5));
  const auto [plain, r0] = greedy_reply(*model, prompt, "none", 8);
  ASSERT_EQ(plain.size(), 70u);
  for (int draft : {1, 3, 8}) {
    const auto [spec, r] = greedy_reply(*model, prompt, "ngram", draft);
    EXPECT_EQ(spec, plain) << "draft " << draft;
    EXPECT_GT(r.speculation.verifications, 0) << "draft " << draft;
    EXPECT_LE(r.speculation.accepted, r.speculation.drafted);
    std::printf("  draft %d: %lld checks, %lld of %lld drafted tokens accepted\n", draft,
                (long long)r.speculation.verifications, (long long)r.speculation.accepted, (long long)r.speculation.drafted);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, SpeculativeReply, ::testing::ValuesIn(test::fixture_names()), test::fixture_test_name);

// Speculation with the MTP layer.

// The fixtures with an MTP layer, and an NVFP4 one written from deepseekv3-nvfp4 (mtp_checkpoint.h)
// into a folder that lives as long as the model.
struct MtpModel {
  std::unique_ptr<test::TempDir> dir;
  std::unique_ptr<Model> model;
};
MtpModel load_mtp_model(const std::string& name) {
  if (name != "deepseekv3-nvfp4") return {nullptr, load_model(test::fixture_dir(name))};
  auto dir = std::make_unique<test::TempDir>();
  test::write_quantized_mtp_checkpoint(name, dir->path());
  auto model = load_model(dir->path().string());
  return {std::move(dir), std::move(model)};
}

const std::vector<std::string> kMtpFixtures = {"deepseekv3-bf16", "glm5-bf16", "deepseekv3-nvfp4"};

class MtpReply : public ::testing::TestWithParam<std::string> {};

// The same greedy tokens with MTP drafts as without, over 70 tokens (five KV blocks), for at
// most 1, 2 and 4 drafts per check; the target's cache holds what the reply ran.
TEST_P(MtpReply, SameGreedyTokensAsWithout) {
  const MtpModel m = load_mtp_model(GetParam());
  std::vector<int32_t> prompt;
  for (int i = 0; i < 20; ++i) prompt.push_back(int32_t(30 + (i * 11) % 17));
  const auto [plain, r0] = greedy_reply(*m.model, prompt, "none", 1);
  ASSERT_EQ(plain.size(), 70u);
  for (int draft : {1, 2, 4}) {
    const auto [spec, r] = greedy_reply(*m.model, prompt, "mtp", draft);
    EXPECT_EQ(spec, plain) << "draft " << draft;
    EXPECT_GT(r.speculation.verifications, 0) << "draft " << draft;
    EXPECT_LE(r.speculation.accepted, r.speculation.drafted);
    std::printf("  draft %d: %lld checks, %lld of %lld drafted tokens accepted, %.2f tokens per check\n", draft,
                (long long)r.speculation.verifications, (long long)r.speculation.accepted,
                (long long)r.speculation.drafted, r.speculation.mean_accepted_length());
  }
}

// A CPU runner with the MTP drafter whose drafts are replaced by the plain greedy reply's next
// tokens, right for a random number of them (0 .. k) and wrong after: the fixtures' random MTP
// layers draft nothing the target accepts, and this takes the reply loop through every outcome
// of a check (all accepted, rejected at each depth) while the real drafter runs beneath.
class OracleRunner final : public apps::Runner {
 public:
  OracleRunner(std::unique_ptr<apps::Runner> inner, std::vector<int32_t> reply, size_t prompt_len)
      : inner_(std::move(inner)), reply_(std::move(reply)), prompt_len_(prompt_len) {}
  void run(std::span<const int32_t> tokens, float* logits, bool all) override {
    inner_->run(tokens, logits, all);
    held_.insert(held_.end(), tokens.begin(), tokens.end());
  }
  std::vector<int32_t> draft_mtp(int32_t next, int k) override {
    EXPECT_EQ(inner_->draft_mtp(next, k).size(), size_t(k));
    const size_t g = held_.size() + 1 - prompt_len_;  // tokens generated up to `next`
    const int right = int(rng_() % uint32_t(k + 1));
    std::vector<int32_t> d;
    for (int i = 0; i < k; ++i) {
      const int32_t want = reply_.at(g + size_t(i));
      d.push_back(i < right ? want : int32_t((want + 1) % inner_->vocab()));
    }
    return d;
  }
  void reset() override {
    inner_->reset();
    held_.clear();
  }
  void rewind(int64_t position) override {
    inner_->rewind(position);
    held_.resize(size_t(position));
  }
  int64_t position() const override { return inner_->position(); }
  int64_t vocab() const override { return inner_->vocab(); }
  std::string describe() const override { return inner_->describe(); }

 private:
  std::unique_ptr<apps::Runner> inner_;
  std::vector<int32_t> reply_, held_;
  size_t prompt_len_;
  std::mt19937 rng_{3};
};

TEST_P(MtpReply, SameGreedyTokensWithPartlyRightDrafts) {
  const MtpModel m = load_mtp_model(GetParam());
  const text::Tokenizer tok = byte_tokenizer();
  std::vector<int32_t> prompt;
  for (int i = 0; i < 20; ++i) prompt.push_back(int32_t(30 + (i * 11) % 17));
  apps::ReplyOptions o;
  o.max_tokens = 70;
  std::vector<int32_t> plain = prompt;
  auto runner = apps::Runner::make(*m.model, "cpu", 128, 2);
  apps::reply(*runner, tok, {}, prompt, plain, prompt.size(), o, [](const std::string&) {});
  plain.erase(plain.begin(), plain.begin() + long(prompt.size()));
  ASSERT_EQ(plain.size(), 70u);
  o.speculation.method = "mtp";
  for (int draft : {1, 2, 4}) {
    OracleRunner oracle(apps::Runner::make(*m.model, "cpu", 128, 2, {}, "auto", true), plain, prompt.size());
    o.speculation.draft_tokens = draft;
    std::vector<int32_t> history = prompt;
    const apps::Reply r = apps::reply(oracle, tok, {}, prompt, history, prompt.size(), o, [](const std::string&) {});
    EXPECT_EQ(std::vector<int32_t>(history.begin() + long(prompt.size()), history.end()), plain) << "draft " << draft;
    EXPECT_EQ(oracle.position(), int64_t(r.ran.size()));
    EXPECT_GT(r.speculation.accepted, 0) << "draft " << draft;
  }
}

INSTANTIATE_TEST_SUITE_P(Families, MtpReply, ::testing::ValuesIn(kMtpFixtures), test::fixture_test_name);

// Every position of two MTP caches of one layer agrees (keys, values, indexer keys).
void expect_same_cache(const KvCache& got, const KvCache& want, int64_t positions) {
  const KvLayout& l = want.layout();
  const bool index = !l.index_layer.empty() && l.index_layer[0];
  for (int64_t p = 0; p < positions; ++p) {
    EXPECT_LE(test::rel_l2(got.k(0, p), want.k(0, p), l.k_row), 1e-5) << "keys, position " << p;
    if (l.v_row) {
      EXPECT_LE(test::rel_l2(got.v(0, p), want.v(0, p), l.v_row), 1e-5) << "values, position " << p;
    }
    if (index) {
      EXPECT_LE(test::rel_l2(got.index_key(0, p), want.index_key(0, p), l.index_row), 1e-5) << "index keys, position " << p;
    }
  }
}

// The speculative loop with checks that keep a random number of drafts (0 .. k, so rejections
// at every depth) and a random token in place of the first rejected one: after each draft the
// MTP cache holds the target's positions, and at the end it equals the MTP layer run from
// scratch over the kept tokens, as do its next drafts. A rewind that kept a rejected draft's
// position, or lost an accepted one's, shows here.
TEST_P(MtpReply, CacheAfterChecksEqualsOneFromScratch) {
  const MtpModel m = load_mtp_model(GetParam());
  const Model* model = m.model.get();
  const ModelConfig& c = model->config;
  const int64_t H = c.hidden_size, V = c.vocab_size, capacity = 96;
  ThreadPool pool(2);
  cpu::Forward fwd(*model, pool);
  KvCache target = fwd.make_cache(capacity);
  MtpDrafter drafter(fwd, c, capacity);
  std::mt19937 rng(11);
  std::vector<int32_t> kept;  // the tokens the target holds
  for (int i = 0; i < 21; ++i) kept.push_back(int32_t(rng() % V));
  std::vector<float> hidden(size_t(kept.size() * H));
  fwd.run(kept, target, nullptr, hidden.data());
  drafter.ran(kept, hidden.data());
  int32_t next = int32_t(rng() % V);  // chosen, not run
  int rejected_at[5] = {};
  while (target.length() < 80) {
    const int k = 1 + int(rng() % 4);
    const std::vector<int32_t> draft = drafter.draft(next, k);
    ASSERT_EQ(int(draft.size()), k);
    ASSERT_EQ(drafter.cache().length(), target.length());
    std::vector<int32_t> run = {next};
    run.insert(run.end(), draft.begin(), draft.end());
    hidden.resize(run.size() * size_t(H));
    const int64_t base = target.length();
    fwd.run(run, target, nullptr, hidden.data());
    drafter.ran(run, hidden.data());
    const int accepted = int(rng() % uint32_t(k + 1));
    ++rejected_at[accepted];
    target.truncate(base + 1 + accepted);
    drafter.rewind(base + 1 + accepted);
    kept.insert(kept.end(), run.begin(), run.begin() + 1 + accepted);
    next = accepted < k ? int32_t(rng() % V) : int32_t((draft.back() + 1) % V);
  }
  for (int a = 0; a < 4; ++a) EXPECT_GT(rejected_at[a], 0) << "no check kept " << a << " drafts";
  const std::vector<int32_t> drafts = drafter.draft(next, 3);
  const int64_t P = int64_t(kept.size());
  ASSERT_EQ(drafter.cache().length(), P);

  // From scratch: the target over the kept tokens, then the MTP layer over all their positions.
  KvCache target2 = fwd.make_cache(capacity), mtp2 = fwd.make_mtp_cache(capacity);
  std::vector<float> h2(size_t(P * H));
  fwd.run(kept, target2, nullptr, h2.data());
  std::vector<int32_t> after(kept.begin() + 1, kept.end());
  after.push_back(next);
  fwd.run_mtp(after, h2.data(), mtp2, nullptr);
  expect_same_cache(drafter.cache(), mtp2, P);
  MtpDrafter fresh(fwd, c, capacity);
  fresh.ran(kept, h2.data());
  EXPECT_EQ(fresh.draft(next, 3), drafts);
}

// A first draft after a prompt longer than the catch-up chunk runs the MTP layer chunk by chunk:
// the same cache and drafts as one pass over the whole prompt.
TEST_P(MtpReply, CatchUpInChunksEqualsOnePass) {
  const MtpModel m = load_mtp_model(GetParam());
  const Model* model = m.model.get();
  const ModelConfig& c = model->config;
  const int64_t H = c.hidden_size, V = c.vocab_size, P = 45, capacity = 64;
  ThreadPool pool(2);
  cpu::Forward fwd(*model, pool);
  std::mt19937 rng(5);
  std::vector<int32_t> prompt;
  for (int64_t i = 0; i < P; ++i) prompt.push_back(int32_t(rng() % V));
  KvCache target = fwd.make_cache(capacity);
  std::vector<float> hidden(size_t(P * H));
  fwd.run(prompt, target, nullptr, hidden.data());
  const int32_t next = int32_t(rng() % V);
  MtpDrafter chunked(fwd, c, capacity, 8), whole(fwd, c, capacity, P);
  chunked.ran(prompt, hidden.data());
  whole.ran(prompt, hidden.data());
  const std::vector<int32_t> got = chunked.draft(next, 3), want = whole.draft(next, 3);
  ASSERT_EQ(chunked.cache().length(), P);
  expect_same_cache(chunked.cache(), whole.cache(), P);
  EXPECT_EQ(got, want);
}

// Refusals, each naming the flag: a model without an MTP layer (its config), a split model, the
// GPU; ngram and none need no MTP layer.
TEST(MtpSpeculation, RefusalsNameTheProblem) {
  auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  auto plain = load_model(test::fixture_dir("qwen3-bf16"));
  const std::string no_layer = message([&] { apps::Runner::make(*plain, "cpu", 64, 1, {}, "auto", true); });
  EXPECT_NE(no_layer.find("--speculative mtp: " + plain->config.source + " has no MTP layer"), std::string::npos) << no_layer;
  // Announced in config.json, absent from the checkpoint.
  auto converted = load_model(test::fixture_dir("deepseekv3-nvfp4"));
  const std::string absent = message([&] { apps::Runner::make(*converted, "cpu", 64, 1, {}, "auto", true); });
  EXPECT_NE(absent.find("num_nextn_predict_layers 1, none of its tensors in the checkpoint"), std::string::npos) << absent;

  auto model = load_model(test::fixture_dir("deepseekv3-bf16"));
  Layout split;
  split.tp = 2;
  const std::string tp = message([&] { apps::Runner::make(*model, "cpu", 64, 2, split, "auto", true); });
  EXPECT_NE(tp.find("--speculative mtp: not built yet for a split model"), std::string::npos) << tp;
  const std::string gpu = message([&] { apps::Runner::make(*model, "cuda", 64, 1, {}, "auto", true); });
  EXPECT_NE(gpu.find("--speculative mtp: drafting with the MTP layer is not built yet on the GPU"), std::string::npos) << gpu;
  EXPECT_NO_THROW(apps::Runner::make(*plain, "cpu", 64, 1));
}

}  // namespace
}  // namespace kestrel
