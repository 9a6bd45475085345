// One sequence of a loaded model on the device the user chose: `--device auto|cpu|cuda` on the
// commands that run a model. auto takes the GPU when this build has CUDA, a GPU is present and
// the CUDA backend reads the model's weight formats, and the CPU otherwise (saying why).
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/error.h"

#include "model/weights.h"
#include "parallel/layout.h"
#include "runtime/sampler.h"

namespace kestrel::apps {

class Runner {
 public:
  // capacity: the most tokens the sequence will hold; threads: CPU threads (0: all cores);
  // layout: the split over GPUs (over threads on the CPU); kv_dtype: --kv-dtype (model_options.h);
  // mtp_drafts: keep the MTP layer's drafter beside the cache (--speculative mtp: the CPU, an
  // unsplit model with an MTP layer; auto then picks the CPU).
  static std::unique_ptr<Runner> make(const Model& model, const std::string& device, int64_t capacity, int threads,
                                      const Layout& layout = {}, const std::string& kv_dtype = "auto",
                                      bool mtp_drafts = false);
  virtual ~Runner() = default;
  // Runs `tokens` at the next positions: all at once on the CPU (prefill), one decode step per
  // token on the GPU. `logits` receives [tokens, vocab] if `all`, else the last token's [vocab].
  virtual void run(std::span<const int32_t> tokens, float* logits, bool all) = 0;
  // Runs `tokens` like run(). Where the device draws the next token itself (the GPU, for options
  // without penalties: see needs_history()), returns it, drawn as draw number `draw` of `o.seed`'s
  // stream: the same distribution as Sampler's, a random stream of its own. Otherwise writes the
  // last token's logits to `logits` and returns -1, for the host's Sampler.
  virtual int32_t run_sample(std::span<const int32_t> tokens, float* logits, const SamplerOptions& o, uint64_t draw) {
    run(tokens, logits, false);
    return -1;
  }
  // k drafts from the model's MTP layer of the tokens after `next`, the token at position()
  // (chosen, not run yet): a runner made with mtp_drafts (runtime/mtp_drafter.h).
  virtual std::vector<int32_t> draft_mtp(int32_t next, int k) {
    fail("internal: ", describe(), " was made without the MTP drafter");
  }
  // Forgets every position: the next run starts at position 0.
  virtual void reset() = 0;
  // Forgets the positions from `position` on (speculative decoding's rejected drafts).
  virtual void rewind(int64_t position) = 0;
  // Positions held; logits per token.
  virtual int64_t position() const = 0;
  virtual int64_t vocab() const = 0;
  // "cpu, 2 threads" or "cuda, NVIDIA H200".
  virtual std::string describe() const = 0;
};

// The --device option's check, shared by the commands.
void check_device_option(const std::string& device);
// Whether this build has CUDA and a CUDA GPU is visible.
bool gpu_present();

}  // namespace kestrel::apps
