// Where the engine's sequences run. A slot holds one sequence's KV cache; a step runs a chunk of
// tokens for several slots at once. The CPU runs the slots one after another, each its own
// forward pass (a prompt in chunks); the GPU runs one token per slot, all slots in one batched
// decode step (backend/cuda/gpu_slots.h).
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/thread_pool.h"
#include "model/weights.h"
#include "parallel/layout.h"
#include "runtime/kv_blocks.h"
#include "runtime/sampler.h"

namespace kestrel {

class SequenceSlots {
 public:
  virtual ~SequenceSlots() = default;
  virtual int slots() const = 0;
  virtual int64_t max_chunk() const = 0;  // tokens per slot and step
  // A free slot for a sequence of up to `positions` tokens whose first tokens are `prompt`. With
  // the prefix cache (kv_blocks.h), the slot starts with the cached blocks of the prompt's first
  // full blocks, at most all but its last token (whose logits the first job makes): `cached`
  // positions, where its first job starts. Without, cached is 0.
  struct Opened {
    int slot = -1;
    int64_t cached = 0;
  };
  virtual Opened open(int64_t positions, std::span<const int32_t> prompt) = 0;
  virtual void close(int slot) = 0;
  // Whether open() looks prompts up in a prefix cache, and its counters (engine thread only).
  virtual bool prefix_cache() const { return false; }
  virtual PrefixCacheStats prefix_stats() const { return {}; }

  // An offer to draw the next token on the backend, from the last token's logits, instead of
  // handing the logits back. A backend that takes it writes *token and leaves Job::logits as it
  // was; one that does not (the CPU backend: it holds the logits in memory already; the GPU for
  // options with penalties, see needs_history()) leaves *token alone and writes the logits. The
  // GPU draws from the distribution the host's Sampler draws from, with a random stream of its
  // own (backend/cuda/sample.h): reproducible per seed on the GPU, other tokens than the host's.
  struct Sample {
    SamplerOptions options;
    uint64_t draw = 0;         // the draw's index in the seed's stream: tokens generated so far
    int32_t* token = nullptr;  // receives the token
  };
  struct Job {
    int slot = -1;
    std::span<const int32_t> tokens;  // 1 .. max_chunk() tokens at the slot's next positions
    float* logits = nullptr;          // receives the last token's logits [vocab] unless null
    const Sample* sample = nullptr;   // with logits: the backend may sample instead
    // A verification (speculative decoding; only where can_verify()): `logits` receives every
    // token's logits [tokens, vocab], `sample` is null, and the slot's next call is rewind(),
    // which keeps the positions of the accepted tokens. Until then the blocks the job filled are
    // not published to the prefix cache, so a rejected token never enters it.
    bool all_logits = false;
  };
  virtual void run(std::span<const Job> jobs) = 0;
  // Whether jobs may ask for all_logits and slots be rewound (the CPU and the GPU slots).
  virtual bool can_verify() const { return false; }
  // Drops the slot's positions from `position` on (at least the length it had before its last
  // job), giving back the blocks no longer needed, then publishes the full blocks a verification
  // left unpublished.
  virtual void rewind(int slot, int64_t position) {
    fail("internal: ", describe(), " cannot rewind slot ", slot, " to ", position);
  }
  // Whether draft_mtp() works: the CPU slots made with MTP drafters (mtp_drafter.h); not yet the GPU's.
  virtual bool can_draft_mtp() const { return false; }
  // k drafts from the model's MTP layer of the tokens after `next`, the token at the slot's next
  // position (chosen, not run yet).
  virtual std::vector<int32_t> draft_mtp(int slot, int32_t next, int k) {
    fail("internal: ", describe(), " cannot draft with the MTP layer");
  }
  // KV blocks held by the open slots (-1 where the backend does not count them): for tests.
  virtual int64_t kv_blocks_held() const { return -1; }
  virtual std::string describe() const = 0;  // "cpu, 2 threads" or "cuda, ..."
};

// The CPU reference backend: `slots` sequences whose KV caches share a pool of kv_positions
// positions in blocks (kv_cache.h; a split model's ranks give each sequence caches of its own,
// and have no prefix cache). With mtp_drafts each sequence also has an MTP drafter, whose cache
// of its own is not counted in kv_positions (one layer of the model's).
std::unique_ptr<SequenceSlots> make_cpu_slots(const Model& model, int slots, int threads, const Layout& layout,
                                              int64_t kv_positions, bool prefix_cache = true, bool mtp_drafts = false);

}  // namespace kestrel
