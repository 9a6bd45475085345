#include "runtime/speculative.h"

#include <algorithm>

#include "common/error.h"

namespace kestrel {

void check_speculation_options(const SpeculationOptions& o) {
  if (o.method != "none" && o.method != "ngram" && o.method != "mtp")
    fail("--speculative: expected none, ngram or mtp, got '", o.method, "'");
  if (o.draft_tokens < 1 || o.draft_tokens > 16) fail("--draft-tokens: expected 1..16, got ", o.draft_tokens);
  if (o.min_match < 1 || o.max_match < o.min_match) fail("speculation: match lengths ", o.min_match, "..", o.max_match);
}

std::vector<int32_t> ngram_draft(std::span<const int32_t> history, int k, int max_match, int min_match) {
  const int64_t n = int64_t(history.size());
  for (int64_t m = std::min<int64_t>(max_match, n - 1); m >= min_match; --m) {
    const auto suffix = history.subspan(size_t(n - m));
    // The latest earlier occurrence, continued for k tokens; where the continuation reaches the
    // end of the history it goes on copying what it has drafted (a sequence that repeats with a
    // period shorter than k drafts k tokens of it).
    for (int64_t at = n - m - 1; at >= 0; --at) {
      if (!std::equal(suffix.begin(), suffix.end(), history.begin() + at)) continue;
      std::vector<int32_t> draft;
      for (int64_t i = at + m; int64_t(draft.size()) < k; ++i) draft.push_back(i < n ? history[size_t(i)] : draft[size_t(i - n)]);
      return draft;
    }
  }
  return {};
}

int DraftLength::next() {
  if (pause_ > 0) {
    --pause_;
    return 0;
  }
  return k_;
}

void DraftLength::checked(int drafted, int accepted) {
  if (accepted == drafted) {
    k_ = std::min(most_, std::max(1, 2 * k_));
    misses_ = 0;
    backoff_ = 4;
    return;
  }
  k_ = std::max(1, accepted + 1);
  if (accepted > 0) {
    misses_ = 0;
    backoff_ = 4;
    return;
  }
  if (++misses_ >= 2) {
    pause_ = backoff_;
    backoff_ = std::min(64, 2 * backoff_);
    misses_ = 0;
    k_ = most_;
  }
}

}  // namespace kestrel
