// The server's engine loop on a fixture model: a request gives the same tokens alone or among
// many (greedy and seeded sampling), prompts longer than a prefill chunk, cancellation frees the
// KV positions, admission waits for room and refuses what can never fit, shutdown ends streams;
// requests of n choices (seeds per choice, admitted together, cancelled together); a backend that
// samples itself; constrained requests; the per-step budget of prompt tokens; speculation (the
// plain greedy tokens and the checks they call for, end tokens, log-probabilities, the prompt
// budget, rewinds and the prefix cache).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <future>
#include <map>
#include <random>
#include <tuple>
#include <thread>

#include "fixture.h"
#include "model/weights.h"
#include "runtime/engine.h"
#include "runtime/scripted_slots.h"
#include "runtime/speculative.h"

namespace kestrel {
namespace {

struct Result {
  std::vector<int32_t> tokens;
  Finish finish = Finish::None;
  std::string error;
};

Result drain(RequestStream& s) {
  Result r;
  TokenEvent e;
  while (s.next(e)) {
    if (e.finish == Finish::None) r.tokens.push_back(e.token);
    else r.finish = e.finish, r.error = e.error;
  }
  return r;
}

// The results of a request's choices by index.
std::vector<Result> drain_choices(RequestStream& s) {
  std::vector<Result> r(size_t(s.choices()));
  TokenEvent e;
  while (s.next(e)) {
    Result& c = r.at(size_t(e.index));
    EXPECT_EQ(c.finish, Finish::None) << "an event of choice " << e.index << " after its end";
    if (e.finish == Finish::None) c.tokens.push_back(e.token);
    else c.finish = e.finish, c.error = e.error;
  }
  return r;
}

// The field a refused request is blamed on.
std::string refused(Engine& e, GenerationRequest r) {
  try {
    e.submit(std::move(r));
  } catch (const RequestError& err) {
    return err.field;
  }
  return "<accepted>";
}

GenerationRequest request(std::vector<int32_t> prompt, int max_tokens, float temperature = 0.0f, uint64_t seed = 0) {
  GenerationRequest r;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  r.sampling.temperature = temperature;
  r.sampling.seed = seed;
  r.ignore_eos = true;
  return r;
}

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override { model_ = load_model(test::fixture_dir("qwen3moe-bf16")); }
  std::unique_ptr<Model> model_;
};

TEST_F(EngineTest, SameTokensAloneAndInABatch) {
  EngineOptions o;
  o.max_batch = 8;
  o.context = 64;
  o.prefill_chunk = 3;  // prompts span several chunks
  o.threads = 1;
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 12; ++i)
    reqs.push_back(request({int32_t(1 + i), int32_t(7 + 2 * i), 5, 9, int32_t(3 + i % 4), 11, 2}, 6 + i % 3,
                           i % 2 ? 0.8f : 0.0f, uint64_t(i)));
  std::vector<Result> alone;
  {
    Engine e(*model_, o);
    for (const auto& r : reqs) alone.push_back(drain(*e.submit(r)));
  }
  Engine e(*model_, o);
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const auto& r : reqs) streams.push_back(e.submit(r));
  for (size_t i = 0; i < reqs.size(); ++i) {
    const Result got = drain(*streams[i]);
    EXPECT_EQ(got.tokens, alone[i].tokens) << "request " << i;
    EXPECT_EQ(got.finish, Finish::Length);
    EXPECT_EQ(int(got.tokens.size()), reqs[i].max_tokens);
  }
  EngineStats st = e.stats();
  EXPECT_EQ(st.kv_used, 0);
  for (int i = 0; i < 100 && st.running + st.waiting > 0; ++i) {  // finished sequences leave after their step
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    st = e.stats();
  }
  EXPECT_EQ(st.running + st.waiting, 0);
  int total = 0;
  for (const auto& r : reqs) total += r.max_tokens;
  EXPECT_EQ(st.generated_tokens, total);
}

// A request of n choices with the prefix cache runs its prompt once: the other choices start
// after choice 0 has run it, on the blocks it published, and give the tokens they give alone.
TEST_F(EngineTest, ChoicesRunTheirPromptOnceWithThePrefixCache) {
  EngineOptions o;
  o.max_batch = 4;
  o.context = 96;
  o.prefill_chunk = 16;
  o.threads = 1;
  std::vector<int32_t> prompt(40);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = int32_t((5 * i + 1) % 97);
  for (bool cache : {false, true}) {
    SCOPED_TRACE(cache ? "prefix cache" : "none");
    o.prefix_cache = cache;
    Engine e(*model_, o);
    GenerationRequest r = request(prompt, 6, 0.9f, 7);
    r.n = 3;
    const std::vector<Result> got = drain_choices(*e.submit(r));
    ASSERT_EQ(got.size(), 3u);
    const EngineStats st = e.stats();
    EXPECT_EQ(st.cached_tokens, cache ? 2 * 32 : 0);  // choices 1 and 2: the prompt's 2 full blocks
    EXPECT_EQ(st.prompt_tokens, 3 * 40);
    Engine alone(*model_, o);
    for (int i = 0; i < 3; ++i)
      EXPECT_EQ(got[size_t(i)].tokens, drain(*alone.submit(request(prompt, 6, 0.9f, choice_seed(7, i)))).tokens)
          << "choice " << i;
  }
}

// The prefix cache: requests that share a beginning with earlier ones take its full blocks from
// the cache (at most all but the prompt's last token, whose logits the first step makes) and
// give the tokens they give without it, greedy and sampled: a hit that ends inside a block
// (the rest of it computed again), a prompt made of an earlier prompt and its reply (the reply's
// blocks are cached too), a prompt that is a whole number of blocks, and a different start. For
// GQA, MLA (blocks of latents) and GLM-5 (latents and the indexer's keys).
class PrefixCacheTest : public ::testing::TestWithParam<std::string> {};

TEST_P(PrefixCacheTest, GivesTheTokensOfAFullPrefill) {
  auto model = load_model(test::fixture_dir(GetParam()));
  const int32_t V = int32_t(model->config.vocab_size);
  std::vector<int32_t> a(45);
  for (size_t i = 0; i < a.size(); ++i) a[i] = int32_t((7 * i + 3) % size_t(V));
  auto run = [&](bool cache) {
    EngineOptions o;
    o.max_batch = 2;
    o.context = 128;
    o.prefill_chunk = 20;
    o.threads = 1;
    o.prefix_cache = cache;
    Engine e(*model, o);
    std::vector<std::vector<int32_t>> out;
    std::vector<int64_t> cached;
    auto go = [&](std::vector<int32_t> prompt, float temperature) {
      auto s = e.submit(request(std::move(prompt), 8, temperature, 5));
      out.push_back(drain(*s).tokens);
      cached.push_back(s->cached_tokens());
    };
    go(a, 0.0f);                                                   // computes everything
    std::vector<int32_t> b(a.begin(), a.begin() + 40);             // a's first 40, then others
    for (int i = 0; i < 8; ++i) b.push_back(int32_t((11 * i + 1) % V));
    go(b, 0.0f);                                                   // a's 2 full blocks; 40 ends in the third
    std::vector<int32_t> turn = a;                                 // a and its reply, then more
    turn.insert(turn.end(), out[0].begin(), out[0].end());
    turn.push_back(3);
    go(turn, 0.7f);
    go(std::vector<int32_t>(a.begin(), a.begin() + 32), 0.0f);     // 2 whole blocks: the first only
    std::vector<int32_t> c = a;
    c[0] = (c[0] + 1) % V;
    go(c, 0.0f);                                                   // differs in its first token
    const EngineStats st = e.stats();
    EXPECT_EQ(st.cached_tokens, cache ? 32 + 48 + 16 : 0);
    EXPECT_EQ(st.prefix.hit_tokens, st.cached_tokens);
    return std::make_pair(out, cached);
  };
  const auto [without, none] = run(false);
  const auto [with, cached] = run(true);
  EXPECT_EQ(with, without);
  EXPECT_EQ(none, (std::vector<int64_t>{0, 0, 0, 0, 0}));
  EXPECT_EQ(cached, (std::vector<int64_t>{0, 32, 48, 16, 0}));
}

INSTANTIATE_TEST_SUITE_P(Families, PrefixCacheTest, ::testing::Values("qwen3moe-bf16", "deepseekv3-bf16", "glm5-bf16"),
                         [](const auto& info) {
                           std::string n = info.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

// The engine over a model split across threads (the CPU twin of --tp 2 --ep 2 on two GPUs)
// gives the unsplit engine's greedy tokens.
TEST_F(EngineTest, SplitModelGivesTheUnsplitTokens) {
  EngineOptions o;
  o.max_batch = 3;
  o.context = 32;
  o.threads = 2;
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 4; ++i) reqs.push_back(request({int32_t(3 + i), 9, int32_t(40 + 7 * i), 2}, 5));
  auto run = [&](const Layout& l) {
    o.layout = l;
    Engine e(*model_, o);
    std::vector<std::shared_ptr<RequestStream>> streams;
    for (const auto& r : reqs) streams.push_back(e.submit(r));
    std::vector<std::vector<int32_t>> out;
    for (auto& s : streams) out.push_back(drain(*s).tokens);
    return out;
  };
  const auto want = run({1, 1});
  EXPECT_EQ(run({2, 2}), want);
  EXPECT_EQ(run({2, 1}), want);
}

TEST_F(EngineTest, RefusesWhatCanNeverRun) {
  EngineOptions o;
  o.context = 32;
  o.kv_tokens = 32;  // two blocks of 16 positions
  o.max_batch = 4;
  o.threads = 1;
  Engine e(*model_, o);
  EXPECT_EQ(refused(e, request({}, 4)), "prompt");
  EXPECT_EQ(refused(e, request({1, int32_t(model_->config.vocab_size)}, 4)), "prompt");  // token id
  EXPECT_EQ(refused(e, request({1, 2, 3}, 30)), "max_tokens");  // past the context
  EXPECT_EQ(refused(e, request({1, 2}, -1)), "max_tokens");
  GenerationRequest many = request({1, 2, 3}, 4);
  many.n = 5;  // more choices than run at once
  EXPECT_EQ(refused(e, many), "n");
  many.n = 3;  // three sequences of one block each, two blocks in all
  EXPECT_EQ(refused(e, many), "n");
  many.n = 0;
  EXPECT_EQ(refused(e, many), "n");
  many.n = 2;
  for (const Result& r : drain_choices(*e.submit(many))) EXPECT_EQ(r.tokens.size(), 4u);
  o.kv_tokens = 16;
  Engine one_block(*model_, o);
  EXPECT_EQ(refused(one_block, request({1, 2, 3}, 14)), "max_tokens");  // more than the KV cache (2 blocks)
  const Result r = drain(*one_block.submit(request({1, 2}, 0)));
  EXPECT_TRUE(r.tokens.empty());
  EXPECT_EQ(r.finish, Finish::Length);
}

TEST_F(EngineTest, WaitsForRoomThenRuns) {
  EngineOptions o;
  o.context = 32;
  o.kv_tokens = 20;  // one block of 16 positions: one request of 3 + 12 at a time
  o.threads = 1;
  Engine e(*model_, o);
  auto a = e.submit(request({1, 2, 3}, 12));
  auto b = e.submit(request({4, 5, 6}, 12));
  const Result ra = drain(*a), rb = drain(*b);
  EXPECT_EQ(ra.tokens.size(), 12u);
  EXPECT_EQ(rb.tokens.size(), 12u);
  EXPECT_EQ(e.stats().kv_used, 0);
}

TEST_F(EngineTest, CancelFreesTheSequence) {
  EngineOptions o;
  o.context = 256;
  o.kv_tokens = 256;
  o.threads = 1;
  Engine e(*model_, o);
  // The engine may finish a request before a cancel reaches it (a descheduled test thread on a
  // busy machine); it must lose that race every time of several for the test to fail.
  bool cancelled = false;
  for (int attempt = 0; attempt < 5 && !cancelled; ++attempt) {
    auto s = e.submit(request({1, 2, 3}, 200));
    TokenEvent ev;
    ASSERT_TRUE(s->next(ev));
    s->cancel();
    const Result rest = drain(*s);
    if (rest.finish == Finish::Cancelled) {
      cancelled = true;
      EXPECT_LT(rest.tokens.size(), 199u);
    } else {
      EXPECT_EQ(rest.finish, Finish::Length);
    }
  }
  EXPECT_TRUE(cancelled) << "200 tokens finished before the cancel in all 5 attempts";
  // The positions are free again: a request needing all of them runs.
  const Result big = drain(*e.submit(request({1, 2, 3, 4}, 252)));
  EXPECT_EQ(big.tokens.size(), 252u);
}

TEST_F(EngineTest, ShutdownEndsEveryStream) {
  EngineOptions o;
  o.context = 256;
  o.max_batch = 2;
  o.threads = 1;
  auto e = std::make_unique<Engine>(*model_, o);
  std::vector<std::shared_ptr<RequestStream>> s;
  for (int i = 0; i < 4; ++i) s.push_back(e->submit(request({1, 2, int32_t(3 + i)}, 200)));
  e->shutdown(0.0);
  for (auto& x : s) EXPECT_EQ(drain(*x).finish, Finish::Cancelled);
  EXPECT_THROW(e->submit(request({1}, 1)), EngineStopped);
}

TEST(ChoiceSeed, ChoiceZeroKeepsTheSeedOthersDiffer) {
  EXPECT_EQ(choice_seed(7, 0), 7u);
  std::vector<uint64_t> seen;
  for (uint64_t seed : {0ull, 1ull, 2ull})
    for (int i = 0; i < 16; ++i) seen.push_back(choice_seed(seed, i));
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(std::unique(seen.begin(), seen.end()), seen.end()) << "two (seed, choice) pairs share a seed";
  EXPECT_EQ(choice_seed(5, 3), choice_seed(5, 3));
}

// Choice i of a request is the request with n = 1 and choice i's seed: greedy choices are all
// the n = 1 result, sampled ones differ from each other and are reproducible.
TEST_F(EngineTest, ChoicesAreSequencesOfTheirOwn) {
  EngineOptions o;
  o.max_batch = 8;
  o.context = 64;
  o.prefill_chunk = 4;
  o.threads = 1;
  Engine e(*model_, o);
  const std::vector<int32_t> prompt = {3, 17, 5, 9, 11, 2};
  GenerationRequest greedy = request(prompt, 7);
  const Result one = drain(*e.submit(greedy));
  greedy.n = 3;
  const std::vector<Result> three = drain_choices(*e.submit(greedy));
  ASSERT_EQ(three.size(), 3u);
  for (const Result& r : three) {
    EXPECT_EQ(r.tokens, one.tokens);
    EXPECT_EQ(r.finish, Finish::Length);
  }

  GenerationRequest sampled = request(prompt, 8, 4.0f, 42);  // hot: the fixture's logits are sharp
  sampled.n = 4;
  const std::vector<Result> a = drain_choices(*e.submit(sampled));
  const std::vector<Result> b = drain_choices(*e.submit(sampled));
  ASSERT_EQ(a.size(), 4u);
  bool differ = false;
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(a[size_t(i)].tokens, b[size_t(i)].tokens) << "choice " << i << " is not reproducible";
    EXPECT_EQ(a[size_t(i)].tokens.size(), 8u);
    const Result alone = drain(*e.submit(request(prompt, 8, 4.0f, choice_seed(42, i))));
    EXPECT_EQ(a[size_t(i)].tokens, alone.tokens) << "choice " << i;
    differ = differ || a[size_t(i)].tokens != a[0].tokens;
  }
  EXPECT_TRUE(differ) << "four sampled choices are all the same";
  const EngineStats st = e.stats();
  EXPECT_EQ(st.kv_used, 0);
  EXPECT_EQ(st.generated_tokens, 7 + 3 * 7 + 2 * 4 * 8 + 4 * 8);
}

// A request's choices are admitted together: while one sequence runs and there is room for one
// more, a request of n = 2 waits whole (never half admitted), then every choice runs to its end.
TEST_F(EngineTest, ChoicesAreAdmittedTogether) {
  EngineOptions o;
  o.max_batch = 2;
  o.context = 256;
  o.threads = 1;
  Engine e(*model_, o);
  auto sa = e.submit(request({1, 2, 3}, 240));
  TokenEvent ev;
  ASSERT_TRUE(sa->next(ev));  // running
  GenerationRequest b = request({4, 5, 6}, 12);
  b.n = 2;
  auto sb = e.submit(b);
  for (int i = 0; i < 20; ++i) {
    const EngineStats st = e.stats();
    EXPECT_TRUE(st.waiting == 0 || st.waiting == 2) << st.waiting << " of the request's 2 sequences wait";
    EXPECT_LE(st.running, 2);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  sa->cancel();
  drain(*sa);
  const std::vector<Result> rb = drain_choices(*sb);
  for (const Result& r : rb) {
    EXPECT_EQ(r.tokens.size(), 12u);
    EXPECT_EQ(r.finish, Finish::Length);
  }
  EXPECT_EQ(rb[0].tokens, rb[1].tokens);  // greedy
}

// Cancelling a request ends all of its choices and frees their positions; cancelling one choice
// (a stop string) ends only that one.
TEST_F(EngineTest, CancelEndsEveryChoice) {
  EngineOptions o;
  o.context = 256;
  o.kv_tokens = 768;  // three sequences of 203 positions (208 in blocks)
  o.threads = 1;
  Engine e(*model_, o);
  GenerationRequest r = request({1, 2, 3}, 200);
  r.n = 3;
  // As in CancelFreesTheSequence, the engine may finish before a cancel reaches it; it must lose
  // that race every time of several for the test to fail.
  auto cancel_after_one_token = [&](int choice) {
    for (int attempt = 0; attempt < 5; ++attempt) {
      auto s = e.submit(r);
      TokenEvent ev;
      EXPECT_TRUE(s->next(ev));
      if (choice < 0) s->cancel();
      else s->cancel(choice);
      const std::vector<Result> rest = drain_choices(*s);
      bool as_asked = true;
      for (int i = 0; i < 3; ++i) {
        const Finish want = choice < 0 || choice == i ? Finish::Cancelled : Finish::Length;
        if (i != choice && choice >= 0) {
          EXPECT_EQ(rest[size_t(i)].finish, Finish::Length) << "choice " << i;
        }
        as_asked = as_asked && rest[size_t(i)].finish == want;
      }
      if (as_asked) return true;
    }
    return false;
  };
  EXPECT_TRUE(cancel_after_one_token(-1)) << "200 tokens finished before the cancel in all 5 attempts";
  EXPECT_EQ(e.stats().kv_used, 0);
  EXPECT_TRUE(cancel_after_one_token(1)) << "200 tokens finished before the cancel in all 5 attempts";
  EXPECT_EQ(e.stats().kv_used, 0);
}

// The CPU slots behind a test's own run(): everything else passes through.
class CpuSlotsWrapper : public SequenceSlots {
 public:
  CpuSlotsWrapper(const Model& m, int slots, bool mtp_drafts = false)
      : inner_(make_cpu_slots(m, slots, 1, {}, 4096, true, mtp_drafts)) {}
  int slots() const override { return inner_->slots(); }
  int64_t max_chunk() const override { return inner_->max_chunk(); }
  Opened open(int64_t positions, std::span<const int32_t> prompt) override { return inner_->open(positions, prompt); }
  bool prefix_cache() const override { return inner_->prefix_cache(); }
  PrefixCacheStats prefix_stats() const override { return inner_->prefix_stats(); }
  void close(int slot) override { inner_->close(slot); }
  void run(std::span<const Job> jobs) override { inner_->run(jobs); }
  bool can_verify() const override { return inner_->can_verify(); }
  void rewind(int slot, int64_t position) override { inner_->rewind(slot, position); }
  bool can_draft_mtp() const override { return inner_->can_draft_mtp(); }
  std::vector<int32_t> draft_mtp(int slot, int32_t next, int k) override { return inner_->draft_mtp(slot, next, k); }
  int64_t kv_blocks_held() const override { return inner_->kv_blocks_held(); }
  std::string describe() const override { return "wrapped " + inner_->describe(); }

 protected:
  std::unique_ptr<SequenceSlots> inner_;
};

// The CPU slots, noting the prompt or generated tokens of each job of every step (jobs in the
// engine's order), and holding the first step until the test opens the gate.
class RecordingSlots final : public CpuSlotsWrapper {
 public:
  using CpuSlotsWrapper::CpuSlotsWrapper;
  void run(std::span<const Job> jobs) override {
    if (steps.empty()) gate.get_future().wait();
    std::vector<size_t> sizes;
    for (const Job& j : jobs) sizes.push_back(j.tokens.size());
    steps.push_back(sizes);
    inner_->run(jobs);
  }
  std::promise<void> gate;
  std::vector<std::vector<size_t>> steps;
};

// A step runs at most step_tokens prompt tokens over all sequences, the earliest admitted first
// (a chunk cut short where the budget ends), while every decoding sequence advances; the tokens
// are those of an engine without a budget.
TEST_F(EngineTest, StepTokensBoundEachStepsPromptTokens) {
  EngineOptions o;
  o.max_batch = 3;
  o.context = 64;
  o.prefill_chunk = 4;
  o.step_tokens = 6;
  o.threads = 1;
  auto slots = std::make_unique<RecordingSlots>(*model_, o.max_batch);
  RecordingSlots* rec = slots.get();
  std::vector<GenerationRequest> reqs = {request({3, 17, 5, 9, 11, 2, 8, 30, 4, 6}, 3),
                                         request({7, 1, 22, 13, 5, 5, 19, 2, 40}, 3), request({9, 9, 14, 3, 28, 1, 6}, 3)};
  for (GenerationRequest& r : reqs) r.ignore_eos = true;
  Engine e(*model_, o, std::move(slots));
  std::vector<std::shared_ptr<RequestStream>> streams;
  streams.push_back(e.submit(reqs[0]));
  while (e.stats().running == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));  // its first step holds
  streams.push_back(e.submit(reqs[1]));
  streams.push_back(e.submit(reqs[2]));
  rec->gate.set_value();
  std::vector<Result> got;
  for (auto& s : streams) got.push_back(drain(*s));
  // Prompts of 10, 9 and 7 tokens, chunks of 4, 6 prompt tokens a step.
  const std::vector<std::vector<size_t>> want = {{4}, {4, 2}, {2, 4}, {1, 3, 3}, {1, 1, 4}, {1, 1}, {1}};
  EXPECT_EQ(rec->steps, want);
  EngineOptions plain = o;
  plain.step_tokens = 1 << 20;
  Engine unbounded(*model_, plain);
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(got[i].finish, Finish::Length);
    EXPECT_EQ(got[i].tokens, drain(*unbounded.submit(reqs[i])).tokens) << "request " << i;
  }
  o.step_tokens = 0;
  EXPECT_THROW(Engine(*model_, o), Error);
}

// A backend that samples itself (as the GPU does): the CPU slots, taking every offer to draw
// the next token (except those needing the history, as the GPU) and answering with a token
// derived from the draw's index, and noting what it was offered.
class SamplingSlots final : public CpuSlotsWrapper {
 public:
  SamplingSlots(const Model& m, int slots) : CpuSlotsWrapper(m, slots), vocab_(size_t(m.config.vocab_size)) {}
  void run(std::span<const Job> jobs) override {
    std::vector<Job> js(jobs.begin(), jobs.end());
    std::vector<float> scratch(js.size() * vocab_);
    for (size_t i = 0; i < js.size(); ++i)
      if (js[i].sample && !needs_history(js[i].sample->options)) {
        offers.push_back(*js[i].sample);
        *js[i].sample->token = drawn(js[i].sample->draw);
        js[i].logits = scratch.data() + i * vocab_;  // a sampling backend leaves the caller's logits alone
      }
    inner_->run(js);
  }
  static int32_t drawn(uint64_t draw) { return int32_t(40 + 3 * draw); }
  std::vector<Sample> offers;  // taken, in order

 private:
  size_t vocab_;
};

// The engine offers the backend each draw of a request that asks for no log-probabilities (its
// options and the draw's index, counting the sequence's tokens) and streams the token the
// backend drew; a request with log-probabilities, or one the backend declines (penalties),
// samples on the host as before.
TEST_F(EngineTest, BackendSamplingWhereTheBackendTakesIt) {
  EngineOptions o;
  o.max_batch = 2;
  o.context = 64;
  o.prefill_chunk = 4;
  o.threads = 1;
  auto slots = std::make_unique<SamplingSlots>(*model_, o.max_batch);
  SamplingSlots* backend = slots.get();
  Engine e(*model_, o, std::move(slots));
  GenerationRequest offered = request({3, 17, 5, 9, 11, 2}, 5, 0.7f, 9);  // a prompt of two chunks
  offered.sampling.top_k = 20;
  offered.sampling.top_p = 0.9f;
  offered.sampling.min_p = 0.05f;
  const Result got = drain(*e.submit(offered));
  EXPECT_EQ(got.tokens, (std::vector<int32_t>{40, 43, 46, 49, 52}));
  ASSERT_EQ(backend->offers.size(), 5u);
  for (size_t i = 0; i < backend->offers.size(); ++i) {
    const SequenceSlots::Sample& s = backend->offers[i];
    EXPECT_EQ(s.draw, i);
    EXPECT_EQ(s.options.temperature, 0.7f);
    EXPECT_EQ(s.options.top_k, 20);
    EXPECT_EQ(s.options.top_p, 0.9f);
    EXPECT_EQ(s.options.min_p, 0.05f);
    EXPECT_EQ(s.options.seed, 9u);
  }

  // Declined or never offered: the tokens of the CPU engine, which samples on the host.
  GenerationRequest logprobs = request({3, 17, 5, 9}, 4, 0.9f, 5);
  logprobs.top_logprobs = 1;
  GenerationRequest penalized = request({3, 17, 5, 9}, 4, 0.9f, 6);
  penalized.sampling.repetition_penalty = 1.2f;
  backend->offers.clear();
  const Result a = drain(*e.submit(logprobs)), b = drain(*e.submit(penalized));
  EXPECT_TRUE(backend->offers.empty());
  Engine cpu(*model_, o);
  EXPECT_EQ(a.tokens, drain(*cpu.submit(logprobs)).tokens);
  EXPECT_EQ(b.tokens, drain(*cpu.submit(penalized)).tokens);
  EXPECT_EQ(a.tokens.size(), 4u);
}

// A constraint that allows exactly the tokens of `script`, one after another, then ends.
class ScriptConstraint final : public TokenConstraint {
 public:
  ScriptConstraint(std::vector<int32_t> script, int64_t vocab) : script_(std::move(script)), mask_(size_t((vocab + 31) / 32)) {
    set();
  }
  std::span<const uint32_t> allowed() const override { return mask_; }
  bool accept(int32_t token) override {
    if (at_ >= script_.size() || token != script_[at_]) return false;
    ++at_;
    set();
    return true;
  }
  bool ended() const override { return at_ == script_.size(); }

 private:
  void set() {
    std::fill(mask_.begin(), mask_.end(), 0u);
    if (at_ < script_.size()) mask_[size_t(script_[at_]) / 32] |= 1u << (uint32_t(script_[at_]) % 32);
  }
  std::vector<int32_t> script_;
  std::vector<uint32_t> mask_;
  size_t at_ = 0;
};

// A constrained request is never offered to the backend's sampler: its logits are masked on the
// host, greedy and sampled alike, each choice with a constraint of its own, and it ends (Eos, as
// a grammar that is complete) when the constraint does, before max_tokens.
TEST_F(EngineTest, ConstrainedRequestsSampleMaskedLogitsOnTheHost) {
  EngineOptions o;
  o.max_batch = 2;
  o.context = 64;
  o.threads = 1;
  auto slots = std::make_unique<SamplingSlots>(*model_, o.max_batch);
  SamplingSlots* backend = slots.get();
  Engine e(*model_, o, std::move(slots));
  const std::vector<int32_t> script = {7, 200, 3, 7};
  const int64_t V = model_->config.vocab_size;
  int made = 0;
  for (float temperature : {0.0f, 1.5f}) {
    GenerationRequest r = request({3, 17, 5, 9}, 20, temperature, 4);
    r.n = 2;
    r.constraint = [&]() -> std::unique_ptr<TokenConstraint> {
      ++made;
      return std::make_unique<ScriptConstraint>(script, V);
    };
    for (const Result& c : drain_choices(*e.submit(r))) {
      EXPECT_EQ(c.tokens, script);
      EXPECT_EQ(c.finish, Finish::Eos) << c.error;
    }
  }
  EXPECT_EQ(made, 4);
  EXPECT_TRUE(backend->offers.empty());
}

// Speculation (prompt lookup) in the engine.

// A prompt that repeats itself, so that drafts are proposed from the first decoding step.
std::vector<int32_t> repeating_prompt(int n, int offset) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back(int32_t(offset + (i * 7) % 5));
  return p;
}

EngineOptions speculative(EngineOptions o, int draft_tokens = 8) {
  o.speculation.method = "ngram";
  o.speculation.draft_tokens = draft_tokens;
  return o;
}

// What speculation must do to a greedy sequence whose plain tokens are `out` (max_tokens of
// them, no end-of-sequence token): the drafts of each step (at most what max_tokens leaves), the
// accepted ones those that match `out`, worked out here from the plain tokens alone.
SpeculationStats expected_checks(const std::vector<int32_t>& prompt, const std::vector<int32_t>& out,
                                 const SpeculationOptions& so) {
  SpeculationStats st;
  DraftLength length(so.draft_tokens);
  const int max_tokens = int(out.size());
  std::vector<int32_t> history = prompt;
  size_t g = 1;  // the prefill's token
  history.push_back(out[0]);
  while (int(g) < max_tokens) {
    const int k = std::min(length.next(), max_tokens - int(g) - 1);
    const std::vector<int32_t> draft = k > 0 ? ngram_draft(history, k, so.max_match, so.min_match) : std::vector<int32_t>{};
    size_t accepted = 0;
    while (accepted < draft.size() && draft[accepted] == out[g + accepted]) ++accepted;
    if (!draft.empty()) {
      ++st.verifications;
      st.drafted += int64_t(draft.size());
      st.accepted += int64_t(accepted);
      length.checked(int(draft.size()), int(accepted));
    }
    for (size_t i = 0; i <= accepted && g < out.size(); ++i) history.push_back(out[g++]);
  }
  return st;
}

// Greedy requests give the tokens they give without speculation, alone and several at once
// (sequences that verify beside sequences that prefill or decode plainly), over outputs of several
// KV blocks, for every most draft length; the checks are those the plain tokens call for.
TEST_F(EngineTest, SpeculationGivesThePlainGreedyTokens) {
  EngineOptions o;
  o.max_batch = 4;
  o.context = 160;
  o.prefill_chunk = 16;
  o.threads = 1;
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 6; ++i) reqs.push_back(request(repeating_prompt(18 + 5 * i, 40 + i), 40 + 13 * i));
  reqs.push_back(request({3, 17, 5, 9, 11, 2}, 50));  // drafts only once its output repeats
  std::vector<Result> plain;
  {
    Engine e(*model_, o);
    for (const auto& r : reqs) plain.push_back(drain(*e.submit(r)));
  }
  for (int draft : {1, 3, 8}) {
    SCOPED_TRACE("draft tokens " + std::to_string(draft));
    const EngineOptions so = speculative(o, draft);
    SpeculationStats want;
    for (size_t i = 0; i < reqs.size(); ++i) {
      const SpeculationStats w = expected_checks(reqs[i].prompt, plain[i].tokens, so.speculation);
      want.verifications += w.verifications, want.drafted += w.drafted, want.accepted += w.accepted;
    }
    ASSERT_GT(want.accepted, 0) << "the fixture's outputs never repeat: nothing here checks speculation";
    for (bool together : {false, true}) {
      SCOPED_TRACE(together ? "together" : "alone");
      auto slots = std::make_unique<CpuSlotsWrapper>(*model_, o.max_batch);
      CpuSlotsWrapper* backend = slots.get();
      Engine e(*model_, so, std::move(slots));
      std::vector<Result> got;
      if (together) {
        std::vector<std::shared_ptr<RequestStream>> streams;
        for (const auto& r : reqs) streams.push_back(e.submit(r));
        for (auto& s : streams) got.push_back(drain(*s));
      } else {
        for (const auto& r : reqs) got.push_back(drain(*e.submit(r)));
      }
      for (size_t i = 0; i < reqs.size(); ++i) {
        EXPECT_EQ(got[i].tokens, plain[i].tokens) << "request " << i;
        EXPECT_EQ(got[i].finish, Finish::Length);
      }
      const EngineStats st = e.stats();
      EXPECT_TRUE(st.speculating);
      EXPECT_EQ(st.speculation.verifications, want.verifications);
      EXPECT_EQ(st.speculation.drafted, want.drafted);
      EXPECT_EQ(st.speculation.accepted, want.accepted);
      EXPECT_EQ(st.kv_used, 0);
      for (int i = 0; i < 100 && e.stats().running > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      EXPECT_EQ(backend->kv_blocks_held(), 0) << "a finished sequence kept KV blocks";
    }
  }
}

// An end-of-sequence token inside a run of accepted drafts ends the sequence there, unstreamed,
// as without speculation: the fixture's end tokens are set to tokens its plain output makes.
TEST_F(EngineTest, SpeculationEndsAtTheEndOfSequenceToken) {
  EngineOptions o;
  o.context = 128;
  o.threads = 1;
  const std::vector<int32_t> prompt = repeating_prompt(24, 40);
  const Result plain = drain(*Engine(*model_, o).submit(request(prompt, 60)));
  ASSERT_EQ(plain.tokens.size(), 60u);
  int ended_early = 0;
  for (size_t at : {5u, 17u, 30u, 44u}) {
    const int32_t eos = plain.tokens[at];
    model_->config.eos_token_ids = {eos};
    GenerationRequest r = request(prompt, 60);
    r.ignore_eos = false;
    const Result want = drain(*Engine(*model_, o).submit(r));
    Engine e(*model_, speculative(o));
    const Result got = drain(*e.submit(r));
    EXPECT_EQ(got.tokens, want.tokens) << "end token " << eos;
    EXPECT_EQ(got.finish, want.finish) << "end token " << eos;
    EXPECT_EQ(std::find(got.tokens.begin(), got.tokens.end(), eos), got.tokens.end());
    ended_early += want.finish == Finish::Eos;
    EXPECT_EQ(e.stats().generated_tokens, int64_t(got.tokens.size()));
  }
  EXPECT_GT(ended_early, 0);
}

// Log-probabilities come from each verified row (those of plain decoding, to rounding); sampled
// requests are reproducible per seed and give max_tokens tokens; constrained requests do not
// speculate; a backend that cannot verify refuses speculation.
TEST_F(EngineTest, SpeculationLogprobsSamplingAndConstraints) {
  EngineOptions o;
  o.max_batch = 2;
  o.context = 128;
  o.threads = 1;
  GenerationRequest lp = request(repeating_prompt(20, 41), 40);
  lp.top_logprobs = 3;
  auto events = [&](Engine& e, const GenerationRequest& r) {
    std::vector<TokenEvent> out;
    auto s = e.submit(r);
    TokenEvent ev;
    while (s->next(ev))
      if (ev.finish == Finish::None) out.push_back(ev);
    return out;
  };
  Engine plain(*model_, o), spec(*model_, speculative(o));
  const std::vector<TokenEvent> a = events(plain, lp), b = events(spec, lp);
  ASSERT_EQ(a.size(), b.size());
  int from_drafts = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].token, b[i].token) << i;
    EXPECT_NEAR(a[i].logprob, b[i].logprob, 1e-4) << i;
    ASSERT_EQ(b[i].top.size(), 3u);
    for (size_t t = 0; t < 3; ++t) {
      EXPECT_EQ(a[i].top[t].token, b[i].top[t].token) << i;
      EXPECT_NEAR(a[i].top[t].logprob, b[i].top[t].logprob, 1e-4) << i;
    }
    EXPECT_FALSE(a[i].accepted_draft);
    EXPECT_EQ(a[i].drafted, 0);
    from_drafts += b[i].accepted_draft;
  }
  EXPECT_GT(from_drafts, 0);
  EXPECT_EQ(spec.stats().speculation.accepted, from_drafts);

  GenerationRequest hot = request(repeating_prompt(20, 41), 30, 0.8f, 11);
  const Result h1 = drain(*spec.submit(hot)), h2 = drain(*spec.submit(hot));
  EXPECT_EQ(h1.tokens, h2.tokens);
  EXPECT_EQ(h1.tokens.size(), 30u);

  const SpeculationStats before = spec.stats().speculation;
  const std::vector<int32_t> script = {40, 42, 44, 41, 43, 40, 42, 44, 41, 43, 40, 42};
  GenerationRequest c = request(repeating_prompt(20, 40), 20);
  const int64_t V = model_->config.vocab_size;
  c.constraint = [&]() -> std::unique_ptr<TokenConstraint> { return std::make_unique<ScriptConstraint>(script, V); };
  const Result rc = drain(*spec.submit(c));
  EXPECT_EQ(rc.tokens, script);
  EXPECT_EQ(spec.stats().speculation.verifications, before.verifications) << "a constrained request speculated";

  auto scripted = std::make_unique<ScriptedSlots>(make_cpu_slots(*model_, 2, 1, {}, 4096), V, 0, std::vector<int32_t>{});
  EXPECT_THROW(Engine(*model_, speculative(o), std::move(scripted)), Error);
  EXPECT_THROW(Engine(*model_, speculative(o, 0)), Error);
  EngineOptions bad = o;
  bad.speculation.method = "mtp";
  EXPECT_THROW(Engine(*model_, bad), Error);
}

// The CPU slots, noting for every step the sizes of its prompt jobs (a slot's positions short of
// its prompt) and the verification jobs, and holding the first step until the test opens the gate.
class PromptRecordingSlots final : public CpuSlotsWrapper {
 public:
  using CpuSlotsWrapper::CpuSlotsWrapper;
  Opened open(int64_t positions, std::span<const int32_t> prompt) override {
    const Opened o = inner_->open(positions, prompt);
    prompt_[o.slot] = int64_t(prompt.size());
    written_[o.slot] = o.cached;
    return o;
  }
  void run(std::span<const Job> jobs) override {
    if (prompt_steps.empty()) gate.get_future().wait();
    std::vector<size_t> prompts;
    int checks = 0;
    for (const Job& j : jobs) {
      if (written_[j.slot] < prompt_[j.slot]) prompts.push_back(j.tokens.size());
      checks += j.all_logits;
      written_[j.slot] += int64_t(j.tokens.size());
    }
    prompt_steps.push_back(prompts);
    verifications.push_back(checks);
    inner_->run(jobs);
  }
  void rewind(int slot, int64_t position) override {
    written_[slot] = position;
    inner_->rewind(slot, position);
  }
  std::promise<void> gate;
  std::vector<std::vector<size_t>> prompt_steps;
  std::vector<int> verifications;

 private:
  std::map<int, int64_t> prompt_, written_;
};

// Drafted tokens do not take the step's prompt budget: prompts are prefilled in the chunks and
// steps they are without speculation while a sequence beside them verifies drafts.
TEST_F(EngineTest, SpeculationLeavesThePromptBudgetToPrompts) {
  EngineOptions o;
  o.max_batch = 3;
  o.context = 256;
  o.prefill_chunk = 8;
  o.step_tokens = 10;
  o.threads = 1;
  // The first decodes (and drafts once its output repeats) while the others' prompts take 25 steps.
  const std::vector<GenerationRequest> reqs = {request(repeating_prompt(12, 40), 60), request(repeating_prompt(151, 60), 4),
                                               request(repeating_prompt(99, 80), 4)};
  auto run = [&](const EngineOptions& eo) {
    auto slots = std::make_unique<PromptRecordingSlots>(*model_, eo.max_batch);
    PromptRecordingSlots* rec = slots.get();
    Engine e(*model_, eo, std::move(slots));
    std::vector<std::shared_ptr<RequestStream>> streams;
    streams.push_back(e.submit(reqs[0]));
    while (e.stats().running == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    streams.push_back(e.submit(reqs[1]));
    streams.push_back(e.submit(reqs[2]));
    rec->gate.set_value();
    std::vector<std::vector<int32_t>> out;
    for (auto& s : streams) out.push_back(drain(*s).tokens);
    std::vector<std::vector<size_t>> prompts;
    int checks_beside_prompts = 0;
    for (size_t i = 0; i < rec->prompt_steps.size(); ++i) {
      if (!rec->prompt_steps[i].empty()) prompts.push_back(rec->prompt_steps[i]);
      checks_beside_prompts += rec->prompt_steps[i].empty() ? 0 : rec->verifications[i];
    }
    return std::make_tuple(out, prompts, checks_beside_prompts);
  };
  const auto [plain_out, plain_prompts, none] = run(o);
  const auto [out, prompts, checks] = run(speculative(o));
  EXPECT_EQ(out, plain_out);
  EXPECT_EQ(prompts, plain_prompts);
  EXPECT_EQ(none, 0);
  EXPECT_GT(checks, 0) << "no verification ran beside a prefill: nothing here checks the budget";
}

// A rewind gives back the blocks past the kept positions, and a verification's blocks reach the
// prefix cache only after it: a prompt that begins with rejected tokens finds nothing, one that
// begins with what was kept finds its full blocks.
TEST(SpeculationSlots, RewindFreesBlocksAndKeepsRejectedTokensOutOfThePrefixCache) {
  auto model = load_model(test::fixture_dir("qwen3moe-bf16"));
  const size_t V = size_t(model->config.vocab_size);
  auto slots = make_cpu_slots(*model, 2, 1, {}, 16 * 16);
  ASSERT_TRUE(slots->can_verify());
  const std::vector<int32_t> prompt = repeating_prompt(12, 40);
  const SequenceSlots::Opened a = slots->open(64, prompt);
  ASSERT_EQ(a.cached, 0);
  std::vector<float> logits(V);
  SequenceSlots::Job j;
  j.slot = a.slot;
  j.tokens = prompt;
  j.logits = logits.data();
  slots->run({&j, 1});
  EXPECT_EQ(slots->kv_blocks_held(), 1);
  // A verification of 10 tokens over positions 12..21: into a second block.
  const std::vector<int32_t> check = {50, 51, 52, 53, 54, 55, 56, 57, 58, 59};
  std::vector<float> rows(check.size() * V);
  SequenceSlots::Job v;
  v.slot = a.slot;
  v.tokens = check;
  v.logits = rows.data();
  v.all_logits = true;
  slots->run({&v, 1});
  EXPECT_EQ(slots->kv_blocks_held(), 2);
  EXPECT_EQ(slots->prefix_stats().cached_blocks, 0) << "a verification's block was published before its rewind";
  slots->rewind(a.slot, 14);  // 50 and 51 kept
  EXPECT_EQ(slots->kv_blocks_held(), 1);
  EXPECT_EQ(slots->prefix_stats().cached_blocks, 0);
  const std::vector<int32_t> more = {60, 61, 62};
  j.tokens = more;
  slots->run({&j, 1});  // positions 14..16: the first block is full with the kept tokens
  EXPECT_EQ(slots->prefix_stats().cached_blocks, 1);

  std::vector<int32_t> rejected = prompt;  // the prompt, then the rewound drafts
  rejected.insert(rejected.end(), check.begin(), check.end());
  rejected.push_back(7);
  const SequenceSlots::Opened b = slots->open(64, rejected);
  EXPECT_EQ(b.cached, 0) << "the prefix cache holds rejected tokens";
  slots->close(b.slot);
  std::vector<int32_t> kept = prompt;
  kept.insert(kept.end(), {50, 51, 60, 61, 62});
  const SequenceSlots::Opened c = slots->open(64, kept);
  EXPECT_EQ(c.cached, 16);
  slots->close(c.slot);
  slots->close(a.slot);
  EXPECT_EQ(slots->kv_blocks_held(), 0);
}

// After speculation the prefix cache holds what it holds without: a prompt made of an earlier
// prompt and its reply finds the same blocks, and gives the same tokens.
TEST_F(EngineTest, SpeculationPublishesTheRepliesBlocks) {
  EngineOptions o;
  o.context = 160;
  o.threads = 1;
  auto run = [&](const EngineOptions& eo) {
    Engine e(*model_, eo);
    const std::vector<int32_t> prompt = repeating_prompt(21, 40);
    const Result first = drain(*e.submit(request(prompt, 50)));
    std::vector<int32_t> turn = prompt;
    turn.insert(turn.end(), first.tokens.begin(), first.tokens.end());
    turn.push_back(3);
    auto s = e.submit(request(turn, 20));
    const Result second = drain(*s);
    return std::make_tuple(first.tokens, second.tokens, s->cached_tokens());
  };
  const auto [a1, a2, a_cached] = run(o);
  const auto [b1, b2, b_cached] = run(speculative(o));
  EXPECT_EQ(b1, a1);
  EXPECT_EQ(b2, a2);
  EXPECT_EQ(a_cached, 64);  // 21 + 50 + 1 = 72 positions: 4 full blocks of the first request's
  EXPECT_EQ(b_cached, a_cached);
}

// Speculation with the MTP layer in the engine (DeepSeek-V3 and GLM-5): greedy requests give the
// plain engine's tokens, several at once (prompts in chunks beside verifications, a request of
// two choices), over outputs of several KV blocks, for at most 1, 2 and 4 drafts, with the
// layer's drafts and with drafts that are partly right (OracleSlots); the counters count the
// checks, and every block goes back.
class MtpEngine : public ::testing::TestWithParam<std::string> {};

// The CPU slots with MTP drafters, whose drafts are replaced by the plain greedy reply's next
// tokens (by prompt), right for a random number of them (0 .. k) and wrong after: the fixtures'
// random MTP layers draft nothing the target accepts, and this takes the engine through every
// outcome of a check while the real drafters run beneath (their own drafts unused).
class OracleSlots final : public CpuSlotsWrapper {
 public:
  OracleSlots(const Model& m, int slots, std::map<std::vector<int32_t>, std::vector<int32_t>> plain)
      : CpuSlotsWrapper(m, slots, true), plain_(std::move(plain)), prompts_(size_t(slots)), held_(size_t(slots)),
        vocab_(m.config.vocab_size) {}
  Opened open(int64_t positions, std::span<const int32_t> prompt) override {
    const Opened o = inner_->open(positions, prompt);
    prompts_[size_t(o.slot)].assign(prompt.begin(), prompt.end());
    held_[size_t(o.slot)].assign(prompt.begin(), prompt.begin() + o.cached);
    return o;
  }
  void run(std::span<const Job> jobs) override {
    inner_->run(jobs);
    for (const Job& j : jobs) held_[size_t(j.slot)].insert(held_[size_t(j.slot)].end(), j.tokens.begin(), j.tokens.end());
  }
  void rewind(int slot, int64_t position) override {
    inner_->rewind(slot, position);
    held_[size_t(slot)].resize(size_t(position));
  }
  std::vector<int32_t> draft_mtp(int slot, int32_t next, int k) override {
    EXPECT_EQ(inner_->draft_mtp(slot, next, k).size(), size_t(k));
    const std::vector<int32_t>& out = plain_.at(prompts_[size_t(slot)]);
    const size_t g = held_[size_t(slot)].size() + 1 - prompts_[size_t(slot)].size();  // tokens up to `next`
    const int right = int(rng_() % uint32_t(k + 1));
    std::vector<int32_t> d;
    for (int i = 0; i < k; ++i) {
      const int32_t want = out.at(g + size_t(i));
      d.push_back(i < right ? want : int32_t((want + 1) % vocab_));
    }
    return d;
  }

 private:
  std::map<std::vector<int32_t>, std::vector<int32_t>> plain_;  // prompt -> greedy reply
  std::vector<std::vector<int32_t>> prompts_, held_;              // per slot: its prompt, its positions' tokens
  int64_t vocab_;
  std::mt19937 rng_{5};
};

TEST_P(MtpEngine, GivesThePlainGreedyTokens) {
  auto model = load_model(test::fixture_dir(GetParam()));
  EngineOptions o;
  o.max_batch = 4;
  o.context = 128;
  o.prefill_chunk = 16;
  o.threads = 1;
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 4; ++i) reqs.push_back(request(repeating_prompt(14 + 9 * i, 30 + i), 30 + 11 * i));
  reqs[1].n = 2;
  std::vector<std::vector<Result>> plain;
  {
    Engine e(*model, o);
    for (const auto& r : reqs) plain.push_back(drain_choices(*e.submit(r)));
  }
  std::map<std::vector<int32_t>, std::vector<int32_t>> replies;
  for (size_t i = 0; i < reqs.size(); ++i) replies[reqs[i].prompt] = plain[i][0].tokens;
  for (auto [draft, oracle] : {std::pair{1, false}, {2, false}, {4, false}, {2, true}, {4, true}}) {
    SCOPED_TRACE("draft tokens " + std::to_string(draft) + (oracle ? ", the plain reply's drafts" : ""));
    EngineOptions so = o;
    so.speculation.method = "mtp";
    so.speculation.draft_tokens = draft;
    std::unique_ptr<CpuSlotsWrapper> slots = oracle ? std::make_unique<OracleSlots>(*model, o.max_batch, replies)
                                                    : std::make_unique<CpuSlotsWrapper>(*model, o.max_batch, true);
    CpuSlotsWrapper* backend = slots.get();
    Engine e(*model, so, std::move(slots));
    std::vector<std::shared_ptr<RequestStream>> streams;
    for (const auto& r : reqs) streams.push_back(e.submit(r));
    for (size_t i = 0; i < reqs.size(); ++i) {
      const std::vector<Result> got = drain_choices(*streams[i]);
      ASSERT_EQ(got.size(), plain[i].size());
      for (size_t c = 0; c < got.size(); ++c) {
        EXPECT_EQ(got[c].tokens, plain[i][c].tokens) << "request " << i << ", choice " << c;
        EXPECT_EQ(got[c].finish, Finish::Length) << got[c].error;
      }
    }
    const EngineStats st = e.stats();
    EXPECT_TRUE(st.speculating);
    EXPECT_GT(st.speculation.verifications, 0);
    EXPECT_LE(st.speculation.accepted, st.speculation.drafted);
    if (oracle) EXPECT_GT(st.speculation.accepted, 0);
    EXPECT_EQ(st.cached_tokens, 0) << "a prefix cache block has no hidden states for the MTP layer";
    std::printf("  draft %d: %lld checks, %lld of %lld drafted tokens accepted\n", draft,
                (long long)st.speculation.verifications, (long long)st.speculation.accepted,
                (long long)st.speculation.drafted);
    for (int i = 0; i < 100 && e.stats().running > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    EXPECT_EQ(backend->kv_blocks_held(), 0) << "a finished sequence kept KV blocks";
  }
  // Sampling with log-probabilities goes through the same checks (the distribution is
  // Sampler::verify's, tested in test_speculative.cpp).
  EngineOptions so = o;
  so.speculation.method = "mtp";
  so.speculation.draft_tokens = 3;
  Engine e(*model, so);
  GenerationRequest r = request(repeating_prompt(20, 30), 40, 0.9f, 7);
  r.top_logprobs = 2;
  const Result sampled = drain(*e.submit(r));
  EXPECT_EQ(sampled.tokens.size(), 40u);
  EXPECT_EQ(sampled.finish, Finish::Length) << sampled.error;
  EXPECT_GT(e.stats().speculation.verifications, 0);
}

INSTANTIATE_TEST_SUITE_P(Families, MtpEngine, ::testing::Values("deepseekv3-bf16", "glm5-bf16"), test::fixture_test_name);

// The engine refuses MTP speculation on a model without an MTP layer and on slots that cannot
// draft with one, naming the flag.
TEST_F(EngineTest, MtpSpeculationRefusals) {
  EngineOptions o;
  o.max_batch = 1;
  o.context = 64;
  o.threads = 1;
  o.speculation.method = "mtp";
  auto message = [&](const std::function<void()>& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const std::string none = message([&] { Engine e(*model_, o); });
  EXPECT_NE(none.find("--speculative mtp: " + model_->config.source + " has no MTP layer"), std::string::npos) << none;
  auto model = load_model(test::fixture_dir("deepseekv3-bf16"));
  const std::string slots = message([&] { Engine e(*model, o, std::make_unique<CpuSlotsWrapper>(*model, 1)); });
  EXPECT_NE(slots.find("--speculative mtp: wrapped cpu, 1 threads does not draft with the MTP layer"), std::string::npos)
      << slots;
}

}  // namespace
}  // namespace kestrel
