// The engine's sequences on the GPU (runtime/sequence_slots.h): slot i is row i of one batched
// decoder (its own KV cache region); a step runs one token for every slot that decodes as one
// CUDA graph replay (per GPU when split), and up to 8 prompt tokens for every slot that
// prefills (a one-sequence decoder working in the slot's KV cache). A job that offers to sample
// with options the GPU can apply (no penalties) gets its token drawn inside the graph (sample.h)
// and copied back (4 bytes); the others get their logits copied back for the host's samplers.
#pragma once
#include <cuda_runtime.h>

#include <memory>
#include <vector>

#include "backend/cuda/decoder.h"
#include "backend/cuda/gpu_model.h"
#include "runtime/sequence_slots.h"

namespace kestrel::cuda {

class GpuSlots final : public SequenceSlots {
 public:
  static constexpr int kMaxSlots = 8;  // the decode kernels' largest batch
  GpuSlots(const GpuModel& model, int slots, int context);
  ~GpuSlots() override;

  int slots() const override { return int(used_.size()); }
  static constexpr int kPrefillChunk = 8;  // positions per prefill step
  int64_t max_chunk() const override { return kPrefillChunk; }
  int open(int64_t positions) override;
  void close(int slot) override { used_.at(size_t(slot)) = false; }
  void run(std::span<const Job> jobs) override;
  std::string describe() const override { return "cuda, " + model_.describe(); }

 private:
  const GpuModel& model_;
  int context_;
  std::vector<std::unique_ptr<Decoder>> decs_;  // per rank
  std::vector<std::vector<std::unique_ptr<Decoder>>> prefill_;  // per rank and slot, made on first use
  std::vector<bool> used_;
  std::vector<int32_t> pos_;  // next position of each slot
  float* logits_ = nullptr;   // pinned [slots, vocab]
  int32_t* drawn_ = nullptr;  // pinned [2, slots]: tokens drawn by the batched step, by prefill steps
  int64_t vocab_;
};

}  // namespace kestrel::cuda
