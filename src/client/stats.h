// Statistics of a load generator run: percentiles, summaries, a histogram, and the run's figures
// from its request records. Pure.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "client/stream.h"

namespace kestrel::client {

// The p-th percentile (0 <= p <= 100) by linear interpolation between closest ranks (numpy's
// default): with the n values sorted, rank h = (n - 1) p / 100 and the result
// v[floor h] + (h - floor h) (v[floor h + 1] - v[floor h]). NaN for no values.
double percentile(std::vector<double> values, double p);

struct Summary {
  size_t count = 0;
  double mean = 0, p50 = 0, p90 = 0, p99 = 0, min = 0, max = 0;  // all NaN when count is 0
};
Summary summarize(std::vector<double> values);

struct HistogramBin {
  double lo = 0, hi = 0;  // [lo, hi); the last bin holds hi too
  size_t count = 0;
};
// `bins` bins from the smallest value to the largest with edges in geometric progression
// (lo x (hi / lo)^(i / bins)), so that the bulk of a latency distribution and its tail (a
// stream waiting behind another request's prompt) show in one small table; where the range is
// narrow they are close to equal-width bins. The range starts at the smallest positive value;
// zeros (two chunks in one read) count in the first bin, which then starts at 0. One bin when
// all values are equal; none for no values.
std::vector<HistogramBin> histogram(const std::vector<double>& values, int bins = 10);

// The figures of a run.
struct RunStats {
  size_t requests = 0, ok = 0, errors = 0;
  double wall_s = 0;
  Summary ttft_s, itl_s, e2e_s;     // ok requests (TTFT: those with a text chunk)
  Summary decode_tokens_per_s;      // per request (ok, two text chunks or more): the rate of its stream
  int64_t output_tokens = 0;        // completion tokens of the ok requests
  double output_tokens_per_s = 0;   // output_tokens / wall_s
  Summary prompt_tokens;            // usage.prompt_tokens of the requests that reported it
  Summary completion_tokens;        // per ok request
  std::vector<HistogramBin> itl_histogram;
  std::vector<std::pair<std::string, size_t>> error_counts;  // distinct messages, most frequent first
};
RunStats run_stats(const std::vector<RequestRecord>& records, double wall_s);

}  // namespace kestrel::client
