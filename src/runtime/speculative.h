// Speculative decoding by prompt lookup (n-gram drafting): the tokens that followed the latest
// earlier occurrence of the sequence's last n tokens are proposed as the next ones, then checked
// in one run of the target model over all of them (Sampler::verify), and the cache rewound past
// the first rejected one. On text that repeats its input (quotes, code edits, summaries) most
// drafts are accepted, and a run of k tokens costs about what one costs where reading the
// weights dominates.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace kestrel {

struct SpeculationOptions {
  std::string method = "none";  // none | ngram
  int draft_tokens = 8;         // the most drafted per check, 1..16
  int max_match = 3;            // the longest suffix looked up, in tokens
  int min_match = 2;            // the shortest (one token recurs too often to be worth checking)
};

// Fails naming the flag when a value is out of range (--speculative, --draft-tokens).
void check_speculation_options(const SpeculationOptions& o);

// k tokens: the continuation of the latest earlier occurrence of the longest suffix of `history`
// of max_match down to min_match tokens (copying on past the end, as a repeating sequence goes
// on); empty when no suffix recurs.
std::vector<int32_t> ngram_draft(std::span<const int32_t> history, int k, int max_match = 3, int min_match = 1);

// How many tokens to draft next, from how the last checks went: all accepted doubles it (up to
// the most), a rejection shrinks it to one past what was accepted, and checks that accept nothing
// pause drafting for a while, twice as long each time it happens again (text that does not repeat
// its context then costs almost nothing), back to the start once a check accepts.
class DraftLength {
 public:
  explicit DraftLength(int most) : most_(most), k_(most) {}
  int next();                              // 0 while paused
  void checked(int drafted, int accepted);

 private:
  int most_, k_, misses_ = 0, pause_ = 0, backoff_ = 4;
};

struct SpeculationStats {
  int64_t verifications = 0;  // runs of the target over drafted tokens
  int64_t drafted = 0, accepted = 0;
  // Tokens a verification yields on average: accepted drafts plus the target's own token.
  double mean_accepted_length() const { return verifications ? double(accepted + verifications) / double(verifications) : 0; }
  double acceptance() const { return drafted ? double(accepted) / double(drafted) : 0; }
};

}  // namespace kestrel
