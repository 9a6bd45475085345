// Token sampling on the GPU, so that a step hands back a token (4 bytes) instead of the logits.
// Each row of logits [batch, vocab] gets the argmax (temperature 0; ties: lowest id) or a draw
// from the distribution runtime/sampler.h's sampling_distribution() gives: softmax(logits / T),
// then top-k, top-p and min-p in that order, renormalized, with the same rules for ties and for
// keeping at least one token. Repetition, presence and frequency penalties are not applied here
// (they need the sequence's history): the host samples those.
//
// One 1024-thread block per row and no sort: the logits' float bits, mapped to integers in the
// same order, are radix-selected 8 bits at a time (256-bin histograms in shared memory) to find
// the top-k cut-off (counts) and then the top-p cut-off (probability mass); ties at a cut-off
// are kept in vocabulary order, as the host's sort by (logit, id) keeps them; min-p keeps
// p >= min_p * p_max. Probabilities are held as 64-bit fixed point (exp(x - max) scaled so that
// the whole vocabulary sums below 2^62; a nonzero probability is at least 1 unit), so every sum
// is exact and the result does not depend on the order threads add in: the same logits and
// (seed, counter) give the same token on every run.
//
// The draw: 64 bits from Philox4x32-10 of (seed, counter) (philox.h) pick t uniform in
// [0, kept mass), and the token is the first id, in vocabulary order, at which the running sum
// of kept masses exceeds t. This is the host's inverse-CDF draw in the same order, but with its
// own random stream: a seeded request draws from the same distribution on the GPU as on the
// host, is reproducible on the same backend, and gives other tokens than the host's
// std::mt19937_64 would.
//
// Nothing synchronizes with the host and nothing is allocated (all scratch is the block's shared
// memory), so the launch can be captured in a CUDA graph with parameters read at replay time.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "runtime/sampler.h"

namespace kestrel::cuda {

// One row's parameters, in device memory (graph replays read them there).
struct SampleParams {
  float temperature = 0.0f;  // 0: argmax
  int32_t top_k = 0;         // 0 or >= vocab: off
  float top_p = 1.0f;        // >= 1: off
  float min_p = 0.0f;        // <= 0: off
  uint64_t seed = 0;
  uint64_t counter = 0;      // which draw of the seed's stream (the engine: tokens generated so far)
};

// The parameters of `o`'s draw number `draw`. Penalties are not carried: see needs_history().
SampleParams sample_params(const SamplerOptions& o, uint64_t draw);

// tokens[b] = the token drawn for row b of logits [batch, vocab] with params[b], b < batch.
// Logits must be finite or -inf (a row of only -inf draws uniformly). With `dist`, also writes
// the kept, renormalized distribution [batch, vocab] the draw used (one-hot at the argmax for
// temperature 0): the same kernel, for tests.
void launch_sample(const float* logits, int batch, int vocab, const SampleParams* params, int32_t* tokens,
                   cudaStream_t s, float* dist = nullptr);

}  // namespace kestrel::cuda
