// Choosing the next token from logits, as Hugging Face generate() does: repetition penalty, then
// temperature, top-k, top-p and min-p, then a draw from what is left (or the argmax when the
// temperature is 0). And the stop-string matcher that holds back text which may begin a stop.
#pragma once
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kestrel {

struct SamplerOptions {
  float temperature = 0.0f;         // 0: greedy
  int top_k = 0;                    // 0: off
  float top_p = 1.0f;               // 1: off
  float min_p = 0.0f;               // 0: off
  float repetition_penalty = 1.0f;  // 1: off
  float presence_penalty = 0.0f;    // 0: off; subtracted once from every token already generated
  float frequency_penalty = 0.0f;   // 0: off; subtracted per occurrence in the generated text
  uint64_t seed = 0;
};

// Fails (kestrel::Error) naming the option when a value is out of range.
void check_sampler_options(const SamplerOptions& o);

// Whether sampling with `o` looks at the sequence's tokens (a repetition, presence or frequency
// penalty): only the host sampler applies those, so a backend that samples itself declines them.
bool needs_history(const SamplerOptions& o);

// Logits of tokens in `history` divided by `penalty` when positive, multiplied when negative.
void apply_repetition_penalty(std::span<float> logits, std::span<const int32_t> history, float penalty);

// OpenAI-style penalties over the generated tokens only: logit -= presence * (count > 0) +
// frequency * count.
void apply_presence_frequency_penalty(std::span<float> logits, std::span<const int32_t> generated, float presence,
                                      float frequency);

// Sets the logits of the tokens `mask` does not allow to -infinity (a TokenConstraint's mask: bit
// t % 32 of word t / 32 for token t; tokens past the mask's end are not allowed). Sampling and
// greedy decoding then never choose them.
void apply_token_mask(std::span<float> logits, std::span<const uint32_t> mask);

// The distribution sampling draws from: softmax(logits / temperature) restricted by top-k, top-p
// and min-p, renormalized; removed tokens have probability 0. Needs temperature > 0.
std::vector<float> sampling_distribution(std::span<const float> logits, const SamplerOptions& o);

class Sampler {
 public:
  explicit Sampler(const SamplerOptions& o);
  // The next token for `logits` [vocab]. `history` is prompt and output so far (the repetition
  // penalty looks at all of it); history[prompt_len..] is the output, which the presence and
  // frequency penalties count.
  int32_t sample(std::span<const float> logits, std::span<const int32_t> history, size_t prompt_len = 0);

  // Speculative decoding's check of a drafted token against the target's logits at its position
  // (history as for sample(): everything before that position). Greedy: the draft is accepted
  // when it is the argmax, which is then the token. Sampling, for a draft that was proposed with
  // certainty (prompt lookup): accepted with probability p(draft); when rejected the token is
  // drawn from p with the draft's mass removed. Either way the token's distribution is exactly
  // what sample() draws from.
  struct Verdict {
    int32_t token;
    bool accepted;
  };
  Verdict verify(std::span<const float> logits, std::span<const int32_t> history, size_t prompt_len, int32_t draft);

 private:
  // The logits with the penalties applied, into work_.
  void penalize(std::span<const float> logits, std::span<const int32_t> history, size_t prompt_len);
  // A draw from p (zeros skipped), with `u` in [0, total).
  static int32_t draw(const std::vector<float>& p, double u);

  SamplerOptions o_;
  std::mt19937_64 rng_;
  std::vector<float> work_;
};

// Watches streamed text for stop strings. push() returns the text that can be shown now: text
// that might be the start of a stop string is held until the next chunk settles it. Once a stop
// string is seen, stopped() is true and nothing from it on is returned.
class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);
  std::string push(std::string_view chunk);
  std::string flush();  // what is held, when generation ends without a stop
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  std::string pending_;
  bool stopped_ = false;
};

}  // namespace kestrel
