#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "common/error.h"

namespace kestrel {

void check_sampler_options(const SamplerOptions& o) {
  if (!(o.temperature >= 0.0f) || !std::isfinite(o.temperature)) fail("--temperature: must be >= 0, got ", o.temperature);
  if (o.top_k < 0) fail("--top-k: must be >= 0, got ", o.top_k);
  if (!(o.top_p > 0.0f && o.top_p <= 1.0f)) fail("--top-p: must be in (0, 1], got ", o.top_p);
  if (!(o.min_p >= 0.0f && o.min_p <= 1.0f)) fail("--min-p: must be in [0, 1], got ", o.min_p);
  if (!(o.repetition_penalty > 0.0f) || !std::isfinite(o.repetition_penalty))
    fail("--repetition-penalty: must be > 0, got ", o.repetition_penalty);
  if (!(o.presence_penalty >= -2.0f && o.presence_penalty <= 2.0f))
    fail("--presence-penalty: must be in [-2, 2], got ", o.presence_penalty);
  if (!(o.frequency_penalty >= -2.0f && o.frequency_penalty <= 2.0f))
    fail("--frequency-penalty: must be in [-2, 2], got ", o.frequency_penalty);
}

bool needs_history(const SamplerOptions& o) {
  return o.repetition_penalty != 1.0f || o.presence_penalty != 0.0f || o.frequency_penalty != 0.0f;
}

void apply_presence_frequency_penalty(std::span<float> logits, std::span<const int32_t> generated, float presence,
                                      float frequency) {
  if (presence == 0.0f && frequency == 0.0f) return;
  std::vector<int32_t> ids(generated.begin(), generated.end());
  std::sort(ids.begin(), ids.end());
  for (size_t i = 0; i < ids.size();) {
    size_t j = i;
    while (j < ids.size() && ids[j] == ids[i]) ++j;
    const int32_t t = ids[i];
    if (t >= 0 && size_t(t) < logits.size()) logits[size_t(t)] -= presence + frequency * float(j - i);
    i = j;
  }
}

void apply_repetition_penalty(std::span<float> logits, std::span<const int32_t> history, float penalty) {
  if (penalty == 1.0f) return;
  std::vector<int32_t> seen(history.begin(), history.end());
  std::sort(seen.begin(), seen.end());
  seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
  for (int32_t id : seen) {
    if (id < 0 || size_t(id) >= logits.size()) continue;
    float& l = logits[size_t(id)];
    l = l > 0 ? l / penalty : l * penalty;
  }
}

void apply_token_mask(std::span<float> logits, std::span<const uint32_t> mask) {
  const float off = -std::numeric_limits<float>::infinity();
  const size_t n = logits.size();
  // Whole words first (none allowed is the common case outside strings, all allowed inside them),
  // which the compiler turns into vector stores; bit by bit only where a word is mixed.
  for (size_t w = 0; w * 32 < n; ++w) {
    const uint32_t bits = w < mask.size() ? mask[w] : 0u;
    if (bits == ~0u) continue;
    float* l = logits.data() + w * 32;
    const size_t len = std::min<size_t>(32, n - w * 32);
    if (bits == 0) {
      for (size_t i = 0; i < len; ++i) l[i] = off;
      continue;
    }
    for (size_t i = 0; i < len; ++i) l[i] = (bits >> i) & 1u ? l[i] : off;
  }
}

std::vector<float> sampling_distribution(std::span<const float> logits, const SamplerOptions& o) {
  const size_t n = logits.size();
  std::vector<float> p(n, 0.0f);
  if (n == 0) return p;
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  // Descending by logit, ties by id, so results do not depend on the sort's stability.
  auto better = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  size_t keep = n;
  if (o.top_k > 0 && size_t(o.top_k) < n) {
    keep = size_t(o.top_k);
    std::partial_sort(order.begin(), order.begin() + keep, order.end(), better);
  } else {
    std::sort(order.begin(), order.end(), better);
  }
  const float inv_t = 1.0f / o.temperature;
  const double top = double(logits[order[0]]) * inv_t;
  std::vector<double> e(keep);
  double sum = 0;
  for (size_t i = 0; i < keep; ++i) sum += e[i] = std::exp(double(logits[order[i]]) * inv_t - top);
  if (o.top_p < 1.0f) {
    double cum = 0;
    size_t i = 0;
    while (i < keep) {
      cum += e[i] / sum;
      ++i;
      if (cum >= double(o.top_p)) break;
    }
    keep = std::max<size_t>(i, 1);
    sum = 0;
    for (size_t k = 0; k < keep; ++k) sum += e[k];
  }
  if (o.min_p > 0.0f) {
    const double threshold = double(o.min_p) * (e[0] / sum);
    size_t k = 1;
    while (k < keep && e[k] / sum >= threshold) ++k;
    keep = k;
    sum = 0;
    for (size_t i = 0; i < keep; ++i) sum += e[i];
  }
  for (size_t i = 0; i < keep; ++i) p[size_t(order[i])] = float(e[i] / sum);
  return p;
}

Sampler::Sampler(const SamplerOptions& o) : o_(o), rng_(o.seed) { check_sampler_options(o); }

void Sampler::penalize(std::span<const float> logits, std::span<const int32_t> history, size_t prompt_len) {
  if (logits.empty()) fail("sampler: empty logits");
  work_.assign(logits.begin(), logits.end());
  apply_repetition_penalty(work_, history, o_.repetition_penalty);
  apply_presence_frequency_penalty(work_, history.subspan(std::min(prompt_len, history.size())), o_.presence_penalty,
                                   o_.frequency_penalty);
}

int32_t Sampler::draw(const std::vector<float>& p, double u) {
  double cum = 0;
  int32_t last = -1;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] <= 0.0f) continue;
    last = int32_t(i);
    cum += p[i];
    if (u < cum) return last;
  }
  return last;
}

int32_t Sampler::sample(std::span<const float> logits, std::span<const int32_t> history, size_t prompt_len) {
  penalize(logits, history, prompt_len);
  if (o_.temperature == 0.0f)
    return int32_t(std::max_element(work_.begin(), work_.end()) - work_.begin());
  const std::vector<float> p = sampling_distribution(work_, o_);
  return draw(p, std::uniform_real_distribution<double>(0.0, 1.0)(rng_));
}

Sampler::Verdict Sampler::verify(std::span<const float> logits, std::span<const int32_t> history, size_t prompt_len,
                                 int32_t draft) {
  penalize(logits, history, prompt_len);
  if (o_.temperature == 0.0f) {
    const int32_t best = int32_t(std::max_element(work_.begin(), work_.end()) - work_.begin());
    return {best, best == draft};
  }
  std::vector<float> p = sampling_distribution(work_, o_);
  const double pd = draft >= 0 && size_t(draft) < p.size() ? double(p[size_t(draft)]) : 0.0;
  if (std::uniform_real_distribution<double>(0.0, 1.0)(rng_) < pd) return {draft, true};
  // Rejected: the rest of the distribution, renormalized (the residual max(0, p - q) for a draft
  // distribution q that is all on the draft).
  double rest = 0;
  for (size_t i = 0; i < p.size(); ++i)
    if (int32_t(i) != draft) rest += p[i];
  if (draft >= 0 && size_t(draft) < p.size()) p[size_t(draft)] = 0.0f;
  if (rest <= 0) return {draft, true};  // every token's mass was the draft's
  return {draw(p, std::uniform_real_distribution<double>(0.0, rest)(rng_)), false};
}

StopMatcher::StopMatcher(std::vector<std::string> stops) {
  for (auto& s : stops)
    if (!s.empty()) stops_.push_back(std::move(s));
}

std::string StopMatcher::push(std::string_view chunk) {
  if (stopped_) return {};
  pending_ += chunk;
  size_t first = std::string::npos;
  for (const auto& s : stops_) first = std::min(first, pending_.find(s));
  if (first != std::string::npos) {
    stopped_ = true;
    std::string out = pending_.substr(0, first);
    pending_.clear();
    return out;
  }
  // Hold the longest tail of pending_ that a stop string starts with.
  size_t hold = 0;
  for (const auto& s : stops_)
    for (size_t len = std::min(s.size() - 1, pending_.size()); len > hold; --len)
      if (pending_.compare(pending_.size() - len, len, s, 0, len) == 0) {
        hold = len;
        break;
      }
  std::string out = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string StopMatcher::flush() {
  std::string out;
  if (!stopped_) out.swap(pending_);
  pending_.clear();
  return out;
}

}  // namespace kestrel
