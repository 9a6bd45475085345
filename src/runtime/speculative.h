// Speculative decoding by prompt lookup (n-gram drafting): the tokens that followed the latest
// earlier occurrence of the sequence's last n tokens are proposed as the next ones, then checked
// in one run of the target model over all of them (Sampler::verify), and the cache rewound past
// the first rejected one. On text that repeats its input (quotes, code edits, summaries) most
// drafts are accepted, and a run of k tokens costs about what one costs where reading the
// weights dominates. The other drafter, the model's own MTP layer, is runtime/mtp_drafter.h; the
// draft length's policy and the check here serve both.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "runtime/sampler.h"

namespace kestrel {

struct SpeculationOptions {
  // none | ngram (prompt lookup, below) | mtp (the model's MTP layer, runtime/mtp_drafter.h)
  std::string method = "none";
  // The most drafted per check, 1..16 (DraftLength adapts below it). Prompt lookup: up to 8 or
  // more on repetitive text. MTP: 1 to 4, since each draft after the first is the layer's guess
  // from its own guess and acceptance falls with depth.
  int draft_tokens = 8;
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

// What the taker of a checked token did with it: Nothing (not taken: an end-of-sequence token
// ends the sequence without it), More (taken, the sequence goes on), Last (taken, and the
// sequence ends with it: a stop string, max_tokens).
enum class Taken { Nothing, More, Last };

struct DraftCheck {
  size_t accepted = 0;    // drafts accepted and taken: their positions stay in the cache
  bool ended = false;     // take() ended the sequence
  bool rejected = false;  // a draft was rejected; the token drawn in its place was taken (not run yet)
};

// The acceptance check of speculative decoding, one for `generate`/`chat` (apps/reply.cpp) and
// the server's engine (runtime/engine.cpp): draft[j] is checked in order against before(j), the
// target's logits at its position (Sampler::verify: greedy keeps the argmax, sampling keeps the
// distribution), and each verdict goes to take(verdict, j), which appends its token to `history`
// and says how the sequence goes on. The check stops at the first rejected draft (the token
// drawn in its place is taken instead) or where take() ends the sequence; an accepted draft
// that is not taken (an end-of-sequence token) is not counted. With every draft accepted, the
// target's token after them is the caller's to draw, from the logits after the last draft.
template <class Before, class Take>
DraftCheck check_drafts(Sampler& sampler, std::span<const int32_t> draft, Before&& before,
                        const std::vector<int32_t>& history, size_t prompt_len, Take&& take) {
  DraftCheck c;
  for (size_t j = 0; j < draft.size(); ++j) {
    const Sampler::Verdict v = sampler.verify(before(j), history, prompt_len, draft[j]);
    const Taken t = take(v, j);
    if (t != Taken::More) {
      c.ended = true;
      if (v.accepted && t == Taken::Last) ++c.accepted;
      return c;
    }
    if (!v.accepted) {
      c.rejected = true;
      return c;
    }
    ++c.accepted;
  }
  return c;
}

}  // namespace kestrel
