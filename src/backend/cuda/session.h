// One sequence on the GPU: tokens go in after those already run, up to `chunk` consecutive tokens
// per step (one graph replay of a decoder whose batch rows share the sequence's KV cache: a prompt
// is prefilled a chunk at a time, a generated token is one step), and the logits of a token
// come back to the host on request, or the next token drawn on the GPU (sample.h). A split
// model runs the same steps on every rank of its
// RankGroup at once, each rank's graph holding its collectives.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "backend/cuda/decoder.h"

namespace kestrel::cuda {

class GpuModel;

class Session {
 public:
  // Positions per prefill step: each step reads the weights its tokens touch once, so larger
  // chunks prefill faster, at the price of activation and attention scratch growing with it.
  static constexpr int kDefaultChunk = 64;
  // kv: the type of the cached keys and values (KvSource::type).
  Session(const DeviceModel& model, int max_context, int chunk = kDefaultChunk, KvType kv = KvType::F32);
  // A model on the GPUs, split or not.
  Session(const GpuModel& model, int max_context, int chunk = kDefaultChunk, KvType kv = KvType::F32);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Runs `tokens` at the next positions. When `logits` is not null it receives the logits of
  // every token ([tokens, vocab]) if `all`, else those of the last token only ([vocab]).
  void run(std::span<const int32_t> tokens, float* logits, bool all = false);
  // Runs `tokens` like run() and returns the next token, drawn on the GPU with `params` from the
  // last token's logits: 4 bytes come back instead of the logits.
  int32_t run_sample(std::span<const int32_t> tokens, const SampleParams& params);
  int position() const { return pos_; }
  // Forgets the sequence: the next run starts at position 0 (its cache entries are overwritten).
  void reset() { pos_ = 0; }
  // Forgets the positions from `position` on (their cache entries are overwritten by later runs).
  void rewind(int position) {
    if (position < 0 || position > pos_) fail("session: rewind to ", position, " of ", pos_, " positions");
    pos_ = position;
  }

 private:
  // The steps of `tokens` on one rank's decoder; rank 0 copies the logits out, or with `sample`
  // draws the next token into *token.
  void run_rank(int rank, std::span<const int32_t> tokens, float* logits, bool all, const SampleParams* sample = nullptr,
                int32_t* token = nullptr);

  const GpuModel* gpus_ = nullptr;
  std::vector<std::unique_ptr<Decoder>> decs_;
  std::vector<cudaStream_t> streams_;
  cudaStream_t own_stream_ = nullptr;
  int chunk_, pos_ = 0;
  int64_t vocab_;
};

}  // namespace kestrel::cuda
