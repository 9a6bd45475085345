#include "client/stats.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>

namespace kestrel::client {

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::sort(v.begin(), v.end());
  const double h = double(v.size() - 1) * std::clamp(p, 0.0, 100.0) / 100.0;
  const size_t lo = size_t(std::floor(h));
  if (lo + 1 >= v.size()) return v.back();
  return v[lo] + (h - double(lo)) * (v[lo + 1] - v[lo]);
}

Summary summarize(std::vector<double> v) {
  Summary s;
  s.count = v.size();
  if (v.empty()) {
    s.mean = s.p50 = s.p90 = s.p99 = s.min = s.max = std::numeric_limits<double>::quiet_NaN();
    return s;
  }
  std::sort(v.begin(), v.end());
  s.mean = std::accumulate(v.begin(), v.end(), 0.0) / double(v.size());
  s.p50 = percentile(v, 50);
  s.p90 = percentile(v, 90);
  s.p99 = percentile(v, 99);
  s.min = v.front();
  s.max = v.back();
  return s;
}

std::vector<HistogramBin> histogram(const std::vector<double>& values, int bins) {
  if (values.empty() || bins < 1) return {};
  const double least = *std::min_element(values.begin(), values.end());
  const double top = *std::max_element(values.begin(), values.end());
  double lo = std::numeric_limits<double>::infinity();
  for (double v : values)
    if (v > 0) lo = std::min(lo, v);
  if (least == top || !(lo < top)) return {{least, top, values.size()}};
  std::vector<double> edges(static_cast<size_t>(bins) + 1);
  for (int i = 0; i <= bins; ++i) edges[size_t(i)] = lo * std::pow(top / lo, double(i) / bins);
  edges.front() = lo;
  edges.back() = top;
  std::vector<HistogramBin> out(static_cast<size_t>(bins));
  for (size_t i = 0; i < out.size(); ++i) out[i] = {edges[i], edges[i + 1], 0};
  if (least < lo) out.front().lo = least;
  for (double v : values) {
    // The bin whose [lo, hi) holds v: the last edge not above v (the largest value: the last bin).
    const size_t i = size_t(std::upper_bound(edges.begin(), edges.end(), v) - edges.begin());
    ++out[std::min(out.size(), std::max<size_t>(i, 1)) - 1].count;
  }
  return out;
}

RunStats run_stats(const std::vector<RequestRecord>& records, double wall_s) {
  RunStats s;
  s.requests = records.size();
  s.wall_s = wall_s;
  std::vector<double> ttft, itl, e2e, rate, prompt, completion;
  std::map<std::string, size_t> errors;
  for (const RequestRecord& r : records) {
    if (r.prompt_tokens >= 0) prompt.push_back(double(r.prompt_tokens));
    if (!r.ok) {
      ++s.errors;
      ++errors[r.error];
      continue;
    }
    ++s.ok;
    if (r.ttft_s >= 0) ttft.push_back(r.ttft_s);
    itl.insert(itl.end(), r.itl_s.begin(), r.itl_s.end());
    e2e.push_back(r.e2e_s);
    if (r.decode_tokens_per_s >= 0) rate.push_back(r.decode_tokens_per_s);
    completion.push_back(double(r.completion_tokens));
    s.output_tokens += r.completion_tokens;
  }
  s.ttft_s = summarize(ttft);
  s.itl_s = summarize(itl);
  s.e2e_s = summarize(e2e);
  s.decode_tokens_per_s = summarize(rate);
  s.prompt_tokens = summarize(prompt);
  s.completion_tokens = summarize(completion);
  s.output_tokens_per_s = wall_s > 0 ? double(s.output_tokens) / wall_s : 0;
  s.itl_histogram = histogram(itl);
  s.error_counts.assign(errors.begin(), errors.end());
  std::stable_sort(s.error_counts.begin(), s.error_counts.end(),
                   [](const auto& a, const auto& b) { return a.second > b.second; });
  return s;
}

}  // namespace kestrel::client
