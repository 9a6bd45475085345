// Percentiles, summaries, the histogram and a run's figures on hand-computed data.
#include <gtest/gtest.h>

#include <cmath>

#include "client/stats.h"

namespace kestrel::client {
namespace {

TEST(Stats, PercentileInterpolatesBetweenClosestRanks) {
  // 1..10 shuffled. Sorted v[0..9] = 1..10; rank h = 9 p / 100.
  const std::vector<double> v = {7, 3, 10, 1, 5, 2, 9, 4, 8, 6};
  EXPECT_DOUBLE_EQ(percentile(v, 50), 5.5);   // h = 4.5: v[4] + 0.5 (v[5] - v[4]) = 5 + 0.5
  EXPECT_DOUBLE_EQ(percentile(v, 90), 9.1);   // h = 8.1: 9 + 0.1 (10 - 9)
  EXPECT_NEAR(percentile(v, 99), 9.91, 1e-12);  // h = 8.91: 9 + 0.91
  EXPECT_DOUBLE_EQ(percentile(v, 0), 1);
  EXPECT_DOUBLE_EQ(percentile(v, 100), 10);
  EXPECT_DOUBLE_EQ(percentile({42}, 99), 42);
  EXPECT_TRUE(std::isnan(percentile({}, 50)));
  // Two values 0 and 1: h = p / 100, so the p-th percentile is p / 100.
  EXPECT_DOUBLE_EQ(percentile({1, 0}, 25), 0.25);
}

TEST(Stats, Summary) {
  // 1, 2, 3, 4: mean 10 / 4 = 2.5; h = 3 p / 100: p50 h = 1.5 -> 2.5, p90 h = 2.7 -> 3.7, p99 h = 2.97 -> 3.97.
  const Summary s = summarize({4, 1, 3, 2});
  EXPECT_EQ(s.count, 4u);
  EXPECT_DOUBLE_EQ(s.mean, 2.5);
  EXPECT_DOUBLE_EQ(s.p50, 2.5);
  EXPECT_NEAR(s.p90, 3.7, 1e-12);
  EXPECT_NEAR(s.p99, 3.97, 1e-12);
  EXPECT_EQ(s.min, 1);
  EXPECT_EQ(s.max, 4);
  const Summary e = summarize({});
  EXPECT_EQ(e.count, 0u);
  EXPECT_TRUE(std::isnan(e.mean) && std::isnan(e.p50));
}

TEST(Stats, HistogramBinsGrowGeometrically) {
  // From 1 to 1024 in 10 bins: edges 1 x 1024^(i / 10) = 2^i, so [1, 2), [2, 4), ..., [512, 1024].
  // 1.5 x 2^k lies inside bin k; 1 is the first edge (bin 0) and 1024 the last (bin 9).
  std::vector<double> v = {1, 1024};
  for (int k = 0; k < 10; ++k) v.push_back(1.5 * (1 << k));
  const auto h = histogram(v, 10);
  ASSERT_EQ(h.size(), 10u);
  for (int i = 0; i < 10; ++i) {
    EXPECT_NEAR(h[size_t(i)].lo, double(1 << i), 1e-9) << i;
    EXPECT_NEAR(h[size_t(i)].hi, double(2 << i), 1e-9) << i;
    EXPECT_EQ(h[size_t(i)].count, i == 0 || i == 9 ? 2u : 1u) << i;
  }

  // Zeros count in the first bin, which starts at 0; the range is from the smallest positive
  // value, 10, to 1000: edges 10 x 100^(i / 2) = 10, 100, 1000 with two bins.
  const auto z = histogram({0, 0, 10, 50, 150, 1000}, 2);
  ASSERT_EQ(z.size(), 2u);
  EXPECT_EQ(z[0].lo, 0);
  EXPECT_NEAR(z[0].hi, 100, 1e-9);
  EXPECT_EQ(z[0].count, 4u);  // 0, 0, 10, 50
  EXPECT_EQ(z[1].count, 2u);  // 150, 1000
  EXPECT_EQ(z[1].hi, 1000);

  // All equal: one bin. None: no bins.
  const auto one = histogram({3, 3, 3}, 10);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].count, 3u);
  EXPECT_TRUE(histogram({}, 10).empty());
}

TEST(Stats, RunFigures) {
  RequestRecord a, b, c;
  a.ok = b.ok = true;
  a.ttft_s = 0.1, a.itl_s = {0.02, 0.04}, a.e2e_s = 0.2, a.completion_tokens = 3, a.prompt_tokens = 10, a.decode_tokens_per_s = 40;
  b.ttft_s = 0.3, b.itl_s = {0.03}, b.e2e_s = 0.4, b.completion_tokens = 2, b.prompt_tokens = 12, b.decode_tokens_per_s = 60;
  c.ok = false, c.error = "HTTP 500: boom", c.prompt_tokens = -1;
  const RunStats s = run_stats({a, b, c}, 2.0);
  EXPECT_EQ(s.requests, 3u);
  EXPECT_EQ(s.ok, 2u);
  EXPECT_EQ(s.errors, 1u);
  EXPECT_DOUBLE_EQ(s.ttft_s.mean, 0.2);    // (0.1 + 0.3) / 2
  EXPECT_DOUBLE_EQ(s.ttft_s.p50, 0.2);     // h = 0.5 between 0.1 and 0.3
  EXPECT_EQ(s.itl_s.count, 3u);            // every gap of every ok request: 0.02, 0.03, 0.04
  EXPECT_NEAR(s.itl_s.mean, 0.03, 1e-12);  // 0.09 / 3
  EXPECT_NEAR(s.itl_s.p50, 0.03, 1e-12);
  EXPECT_DOUBLE_EQ(s.decode_tokens_per_s.mean, 50);  // (40 + 60) / 2
  EXPECT_EQ(s.output_tokens, 5);
  EXPECT_DOUBLE_EQ(s.output_tokens_per_s, 2.5);  // 5 tokens / 2 s
  EXPECT_DOUBLE_EQ(s.prompt_tokens.mean, 11);    // the two that reported usage
  ASSERT_EQ(s.error_counts.size(), 1u);
  EXPECT_EQ(s.error_counts[0].first, "HTTP 500: boom");
  EXPECT_EQ(s.error_counts[0].second, 1u);
}

}  // namespace
}  // namespace kestrel::client
