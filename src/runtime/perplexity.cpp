#include "runtime/perplexity.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"

namespace kestrel {

std::vector<PerplexityWindow> perplexity_windows(int64_t n, int64_t context, int64_t stride) {
  if (n < 2) fail("perplexity needs at least 2 tokens, got ", n);
  if (context < 2) fail("the context must be at least 2 tokens, got ", context);
  if (stride < 1 || stride > context) fail("the stride must be between 1 and the context (", context, "), got ", stride);
  std::vector<PerplexityWindow> out;
  int64_t prev_end = 0;
  for (int64_t begin = 0;; begin += stride) {
    const int64_t end = std::min(begin + context, n);
    const int64_t first = std::max(prev_end, begin + 1);
    if (first < end) out.push_back({begin, end, first});
    prev_end = end;
    if (end == n) break;
  }
  return out;
}

namespace {

double log_sum_exp(const float* x, int64_t n) {
  double m = -INFINITY;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, double(x[i]));
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += std::exp(double(x[i]) - m);
  return m + std::log(s);
}

}  // namespace

double token_nll(const float* logits, int64_t vocab, int32_t target) {
  return log_sum_exp(logits, vocab) - double(logits[target]);
}

double kl_divergence(const float* p_logits, const float* q_logits, int64_t vocab) {
  const double lp = log_sum_exp(p_logits, vocab), lq = log_sum_exp(q_logits, vocab);
  double kl = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    const double a = double(p_logits[i]) - lp, b = double(q_logits[i]) - lq;
    kl += std::exp(a) * (a - b);
  }
  return std::max(kl, 0.0);  // rounding can leave -1e-17 for equal distributions
}

int64_t argmax(const float* v, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (v[i] > v[best]) best = i;
  return best;
}

void PerplexityStats::add(const float* logits, const float* ref_logits, int64_t vocab, int32_t target) {
  ++scored;
  nll += token_nll(logits, vocab, target);
  if (!ref_logits) return;
  ref_nll += token_nll(ref_logits, vocab, target);
  kl += kl_divergence(ref_logits, logits, vocab);
  top1_agree += argmax(logits, vocab) == argmax(ref_logits, vocab);
}

double PerplexityStats::perplexity() const { return std::exp(nll / double(scored)); }
double PerplexityStats::ref_perplexity() const { return std::exp(ref_nll / double(scored)); }
double PerplexityStats::mean_kl() const { return kl / double(scored); }
double PerplexityStats::top1() const { return double(top1_agree) / double(scored); }

}  // namespace kestrel
