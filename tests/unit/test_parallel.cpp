// Split models on the CPU: the thread communicator against a reference sum, the shards'
// weights against the full model's, and every fixture family at TP 2 and 4, EP 2 and 4 against
// the unsplit model's logits.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <thread>

#include "backend/cpu/forward.h"
#include "common/error.h"
#include "fixture.h"
#include "parallel/shard.h"
#include "parallel/thread_comm.h"

namespace kestrel {
namespace {

// Runs fn(rank, comm) on one thread per rank; returns the first exception's message or "".
template <typename Fn>
std::vector<std::string> on_ranks(std::vector<std::unique_ptr<Communicator>>& comms, Fn fn) {
  std::vector<std::string> errors(comms.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < comms.size(); ++r)
    threads.emplace_back([&, r] {
      try {
        fn(int(r), *comms[r]);
      } catch (const std::exception& e) {
        errors[r] = e.what();
        comms[r]->abort();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

TEST(ThreadComm, AllReduceMatchesTheReferenceSumWithTheSameBitsOnEveryRank) {
  for (int ranks : {1, 2, 3, 4}) {
    for (int64_t n : {int64_t(1), int64_t(7), int64_t(1024), int64_t(4099), int64_t(65536)}) {
      std::mt19937 rng(uint32_t(ranks * 1000 + n));
      std::normal_distribution<float> d;
      std::vector<std::vector<float>> data(static_cast<size_t>(ranks), std::vector<float>(static_cast<size_t>(n)));
      std::vector<double> want(size_t(n), 0.0);
      for (auto& v : data)
        for (int64_t i = 0; i < n; ++i) {
          v[size_t(i)] = d(rng);
          want[size_t(i)] += v[size_t(i)];
        }
      auto comms = make_thread_communicators(ranks);
      auto errors = on_ranks(comms, [&](int r, Communicator& c) { c.all_reduce_sum(data[size_t(r)].data(), n); });
      for (const auto& e : errors) ASSERT_EQ(e, "");
      for (int r = 0; r < ranks; ++r) {
        ASSERT_EQ(0, std::memcmp(data[size_t(r)].data(), data[0].data(), size_t(n) * 4)) << "rank " << r << " n " << n;
      }
      for (int64_t i = 0; i < n; ++i)
        ASSERT_NEAR(data[0][size_t(i)], want[size_t(i)], 1e-5 * (1 + std::abs(want[size_t(i)]))) << "n " << n << " i " << i;
    }
  }
}

TEST(ThreadComm, AllGatherPutsEachRankInItsPlace) {
  const int ranks = 3;
  const int64_t n = 5;
  auto comms = make_thread_communicators(ranks);
  std::vector<std::vector<float>> out(ranks, std::vector<float>(size_t(ranks * n), -1.0f));
  auto errors = on_ranks(comms, [&](int r, Communicator& c) {
    std::vector<float> in(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) in[size_t(i)] = float(r * 100 + i);
    c.all_gather(in.data(), n, out[size_t(r)].data());
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  for (int r = 0; r < ranks; ++r)
    for (int s = 0; s < ranks; ++s)
      for (int64_t i = 0; i < n; ++i) EXPECT_EQ(out[size_t(r)][size_t(s * n + i)], float(s * 100 + i));
}

TEST(ThreadComm, ARankThatFailsStopsTheOthersInsteadOfHangingThem) {
  auto comms = make_thread_communicators(4);
  auto errors = on_ranks(comms, [&](int r, Communicator& c) {
    std::vector<float> v(16, 1.0f);
    c.all_reduce_sum(v.data(), 16);
    if (r == 2) fail("rank 2: out of memory");
    c.all_reduce_sum(v.data(), 16);  // ranks 0, 1, 3 wait here for rank 2
  });
  EXPECT_EQ(errors[2], "rank 2: out of memory");
  for (int r : {0, 1, 3}) EXPECT_NE(errors[size_t(r)].find("aborted"), std::string::npos) << errors[size_t(r)];
}

TEST(Shard, SlicesHoldTheFullModelsRowsAndColumns) {
  // NVFP4 experts of width 32 split 4 ways cut through the 16-value blocks (stored as F32);
  // split 2 ways they stay NVFP4. Both must hold exactly the full matrix's values.
  auto full = load_model(test::fixture_dir("qwen3moe-nvfp4"));
  ASSERT_TRUE(full->weights.layers[1].is_moe);
  ASSERT_GT(full->weights.layers[1].moe.experts.size(), 3u);
  const Linear& down = full->weights.layers[1].moe.experts[3].down;
  ASSERT_EQ(down.format, WeightFormat::NVFP4);
  for (int tp : {2, 4}) {
    for (int r = 0; r < tp; ++r) {
      auto part = shard_model(*full, Layout{tp, 1}, r);
      const Linear& d = part->weights.layers[1].moe.experts[3].down;
      EXPECT_EQ(d.format, tp == 2 ? WeightFormat::NVFP4 : WeightFormat::F32);
      ASSERT_EQ(d.in, down.in / tp);
      std::vector<float> a(static_cast<size_t>(full->config.hidden_size + down.in)), b(a.size());
      for (int64_t row = 0; row < down.out; ++row) {
        down.dequant_row(row, a.data());
        d.dequant_row(row, b.data());
        for (int64_t i = 0; i < d.in; ++i) ASSERT_EQ(b[size_t(i)], a[size_t(r * d.in + i)]) << "tp " << tp << " rank " << r;
      }
      const Linear& gate = part->weights.layers[1].moe.experts[3].gate;
      const Linear& fg = full->weights.layers[1].moe.experts[3].gate;
      for (int64_t row = 0; row < gate.out; ++row) {
        fg.dequant_row(r * gate.out + row, a.data());
        gate.dequant_row(row, b.data());
        for (int64_t i = 0; i < gate.in; ++i) ASSERT_EQ(b[size_t(i)], a[size_t(i)]);
      }
    }
  }
}

TEST(Shard, LayoutsThatDoNotDivideTheModelNameWhatDoesNot) {
  auto full = load_model(test::fixture_dir("qwen3moe-bf16"));
  auto message = [&](Layout l) {
    try {
      shard_model(*full, l, 0);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(message({3, 1}), "--tp 3: 4 attention heads do not divide evenly");
  EXPECT_EQ(message({8, 1}), "--tp 8: 4 attention heads do not divide evenly");
  EXPECT_NE(message({4, 2}).find("--ep: must be 1"), std::string::npos);
  EXPECT_NE(message({0, 1}).find("--tp: must be at least 1"), std::string::npos);
}

TEST(Shard, VocabularySharesCoverTheVocabularyOnce) {
  for (int64_t v : {256, 257, 151936, 3}) {
    for (int n : {1, 2, 3, 4, 8}) {
      int64_t next = 0;
      for (int r = 0; r < n; ++r) {
        const VocabShare s = vocab_share(v, n, r);
        EXPECT_EQ(s.begin, next);
        EXPECT_LE(s.end - s.begin, s.share);
        next = s.end;
      }
      EXPECT_EQ(next, v);
    }
  }
}

// Prefill of the reference prompt, then two decode steps, split and unsplit.
std::vector<float> run_model(const Model& m, const Layout& layout, const std::vector<int32_t>& prompt) {
  ThreadPool pool(2);
  cpu::Forward fwd(m, pool, layout);
  KvCache cache = fwd.make_cache(int64_t(prompt.size()) + 2);
  const int64_t V = m.config.vocab_size;
  std::vector<float> logits(prompt.size() * size_t(V)), step(static_cast<size_t>(V));
  fwd.run(prompt, cache, logits.data());
  for (int32_t t : {int32_t(3), int32_t(200 % V)}) {  // the FP8 fixtures' vocabulary is 128
    fwd.run({&t, 1}, cache, step.data());
    logits.insert(logits.end(), step.begin(), step.end());
  }
  EXPECT_EQ(cache.length(), int64_t(prompt.size()) + 2);
  return logits;
}

class SplitFamily : public ::testing::TestWithParam<std::string> {};

TEST_P(SplitFamily, GivesTheUnsplitLogitsAtTp2And4AndEp2And4) {
  auto m = load_model(test::fixture_dir(GetParam()));
  const test::Reference ref = test::load_reference(test::fixture_dir(GetParam()));
  const std::vector<float> want = run_model(*m, {}, ref.tokens);
  const int64_t V = m->config.vocab_size, rows = int64_t(want.size()) / V;
  std::vector<Layout> layouts = {{2, 1}, {4, 1}};
  if (m->config.num_experts > 0) layouts.insert(layouts.end(), {{2, 2}, {4, 4}});
  for (const Layout& l : layouts) {
    const std::vector<float> got = run_model(*m, l, ref.tokens);
    ASSERT_EQ(got.size(), want.size());
    double worst = 0;
    for (int64_t r = 0; r < rows; ++r) worst = std::max(worst, test::rel_l2(&got[size_t(r * V)], &want[size_t(r * V)], V));
    EXPECT_LT(worst, 1e-5) << GetParam() << " " << l.str();
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, SplitFamily, ::testing::ValuesIn(test::fixture_names()),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& ch : n)
                             if (ch == '-') ch = '_';
                           return n;
                         });
INSTANTIATE_TEST_SUITE_P(Fp8Fixtures, SplitFamily, ::testing::ValuesIn(test::fp8_fixture_names()),
                         test::fixture_test_name);

TEST(SplitForward, ABadTokenFailsEveryRankCleanlyAndTheNextStepStillRuns) {
  auto m = load_model(test::fixture_dir("qwen3moe-bf16"));
  ThreadPool pool(2);
  cpu::Forward fwd(*m, pool, Layout{2, 2});
  KvCache cache = fwd.make_cache(8);
  const int32_t bad = 100000, good = 5;
  EXPECT_THROW(fwd.run({&bad, 1}, cache, nullptr), Error);
  EXPECT_EQ(cache.length(), 0);
  std::vector<float> logits(static_cast<size_t>(m->config.vocab_size));
  fwd.run({&good, 1}, cache, logits.data());
  EXPECT_EQ(cache.length(), 1);
  EXPECT_TRUE(std::isfinite(logits[0]));
}

}  // namespace
}  // namespace kestrel
