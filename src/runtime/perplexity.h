// Perplexity over a token sequence with a sliding window, exactly as the Hugging Face perplexity
// guide computes it, and the agreement of a model with a reference model position by position.
//
// Windows: begin = 0, stride, 2 x stride, ...; end = min(begin + context, n); each window runs
// tokens [begin, end) from an empty cache and scores positions j in [max(prev_end, begin + 1),
// end), prev_end being the previous window's end (0 at first); the last window is the first whose
// end is n. Position j scores -log p(t_j | t_begin .. t_{j-1}). With stride < context every
// position 1 .. n-1 is scored once; with stride == context the first token of each window is not
// scored (it has no context in its window), as in the guide. Perplexity = exp(mean score).
#pragma once
#include <cstdint>
#include <vector>

namespace kestrel {

struct PerplexityWindow {
  int64_t begin = 0, end = 0;  // tokens run
  int64_t first_scored = 0;    // positions [first_scored, end) are scored
};

// Needs n >= 2, context >= 2 and 1 <= stride <= context; windows that score nothing are left out.
std::vector<PerplexityWindow> perplexity_windows(int64_t n, int64_t context, int64_t stride);

// -log softmax(logits)[target], in double precision.
double token_nll(const float* logits, int64_t vocab, int32_t target);

// KL(P || Q) in nats for P = softmax(p_logits), Q = softmax(q_logits), in double precision.
double kl_divergence(const float* p_logits, const float* q_logits, int64_t vocab);

// Index of the largest value; the lowest index on ties.
int64_t argmax(const float* v, int64_t n);

// Sums over scored positions.
struct PerplexityStats {
  int64_t scored = 0;
  double nll = 0;          // sum of the model's scores
  double ref_nll = 0;      // the reference's (when there is one)
  double kl = 0;           // sum of KL(reference || model)
  int64_t top1_agree = 0;  // positions whose argmax agrees

  // One scored position: the model's logits, the reference's (or null) and the true next token.
  void add(const float* logits, const float* ref_logits, int64_t vocab, int32_t target);
  double perplexity() const;
  double ref_perplexity() const;
  double mean_kl() const;
  double top1() const;  // share of positions that agree
};

}  // namespace kestrel
