#include "runtime/mtp_drafter.h"

#include <algorithm>

#include "common/error.h"

namespace kestrel {

void check_mtp_drafting(const Model& model, const Layout& layout) {
  const ModelConfig& c = model.config;
  if (model.weights.mtp.empty())
    fail("--speculative mtp: ", c.source, " has no MTP layer to draft with (num_nextn_predict_layers ",
         c.num_nextn_predict_layers, c.num_nextn_predict_layers > 0 ? ", none of its tensors in the checkpoint)" : ")");
  if (layout.split()) fail("--speculative mtp: not built yet for a split model (", layout.str(), "); run it without --tp/--ep");
}

MtpDrafter::MtpDrafter(cpu::Forward& fwd, const ModelConfig& c, int64_t capacity, int64_t chunk)
    : fwd_(fwd), hidden_size_(c.hidden_size), vocab_(c.vocab_size), chunk_(chunk), cache_(fwd.make_mtp_cache(capacity)) {
  if (chunk < 1) fail("internal: an MTP catch-up chunk of ", chunk, " positions");
}

void MtpDrafter::ran(std::span<const int32_t> tokens, const float* hidden) {
  tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
  hidden_.insert(hidden_.end(), hidden, hidden + tokens.size() * size_t(hidden_size_));
}

void MtpDrafter::rewind(int64_t position) {
  const int64_t held = cache_.length();
  if (position == 0) return reset();
  if (position <= held)
    fail("internal: the MTP cache holds ", held, " positions and cannot follow the target back to ", position);
  const size_t keep = std::min(tokens_.size(), size_t(position - held));
  tokens_.resize(keep);
  hidden_.resize(keep * size_t(hidden_size_));
}

void MtpDrafter::reset() {
  cache_.clear();
  tokens_.clear();
  hidden_.clear();
}

std::vector<int32_t> MtpDrafter::draft(int32_t next, int k) {
  const int64_t H = hidden_size_, T = int64_t(tokens_.size());
  if (T == 0) fail("internal: an MTP draft needs a position the target ran since the last draft");
  // The MTP layer catches up with the target: each position with the token after it, the last
  // with `next`.
  std::vector<int32_t> after(tokens_.begin() + 1, tokens_.end());
  after.push_back(next);
  out_.resize(size_t(std::min(T, chunk_) * H));
  int64_t last = 0;  // rows of the last chunk
  for (int64_t p = 0; p < T; p += chunk_) {
    last = std::min(chunk_, T - p);
    fwd_.run_mtp({after.data() + p, size_t(last)}, hidden_.data() + p * H, cache_, nullptr, 0, out_.data());
  }
  tokens_.clear();
  hidden_.clear();
  const int64_t held = cache_.length();

  std::vector<float> h(out_.begin() + (last - 1) * H, out_.begin() + last * H), chained(static_cast<size_t>(H));
  std::vector<int32_t> drafts;
  logits_.resize(size_t(vocab_));
  while (true) {
    fwd_.mtp_logits(h.data(), 1, logits_.data());
    drafts.push_back(int32_t(std::max_element(logits_.begin(), logits_.end()) - logits_.begin()));
    if (int(drafts.size()) == k) break;
    // The next draft: the layer's own output stands in for the target's hidden state, which the
    // check has not computed yet.
    fwd_.run_mtp({&drafts.back(), 1}, h.data(), cache_, nullptr, 0, chained.data());
    h.swap(chained);
  }
  cache_.truncate(held);  // the chained positions were guesses
  return drafts;
}

}  // namespace kestrel
