// A constraint on the tokens a sequence may generate (grammar-constrained decoding: the server's
// structured outputs, server/grammar.h). The engine masks the logits with allowed() before the
// host samples, then reports the chosen token with accept(), which computes the next mask. A
// constrained sequence never lets the backend sample (the mask is applied on the host).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>

namespace kestrel {

class TokenConstraint {
 public:
  virtual ~TokenConstraint() = default;
  // The tokens that may come next: bit t % 32 of word t / 32 is set when token t may
  // (apply_token_mask in sampler.h). Covers the model's vocabulary.
  virtual std::span<const uint32_t> allowed() const = 0;
  // Takes the chosen token (an end-of-sequence token too) and computes the next mask; false when
  // the constraint refuses it.
  virtual bool accept(int32_t token) = 0;
  // Whether the text is complete and nothing but the end of the sequence may follow: the engine
  // then ends the sequence as if it had drawn its end-of-sequence token.
  virtual bool ended() const = 0;
};

// A request's constraint: each of its choices gets its own, made when the choice starts.
using ConstraintFactory = std::function<std::unique_ptr<TokenConstraint>()>;

}  // namespace kestrel
