// The server's engine loop on a fixture model: a request gives the same tokens alone or among
// many (greedy and seeded sampling), prompts longer than a prefill chunk, cancellation frees the
// KV positions, admission waits for room and refuses what can never fit, shutdown ends streams.
#include <gtest/gtest.h>

#include <thread>

#include "fixture.h"
#include "model/weights.h"
#include "runtime/engine.h"

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
  o.kv_tokens = 16;  // one block of 16 positions
  o.threads = 1;
  Engine e(*model_, o);
  EXPECT_THROW(e.submit(request({}, 4)), Error);                              // empty prompt
  EXPECT_THROW(e.submit(request({1, int32_t(model_->config.vocab_size)}, 4)), Error);  // token id
  EXPECT_THROW(e.submit(request({1, 2, 3}, 30)), Error);                      // past the context
  EXPECT_THROW(e.submit(request({1, 2, 3}, 14)), Error);                      // more than the KV cache (2 blocks)
  EXPECT_THROW(e.submit(request({1, 2}, -1)), Error);
  const Result r = drain(*e.submit(request({1, 2}, 0)));
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

}  // namespace
}  // namespace kestrel
