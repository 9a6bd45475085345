// The persistent decode step: one launch of one resident block per SM interprets a step plan
// (plan/step_plan.h): each block runs its queue, waiting on counters before an instruction and
// advancing one after it, so a tile of the next op starts as soon as its inputs exist. The ops
// (persistent/op_*.cuh) compute what cpu::run_step_plan computes. A tile's weights (a split's
// cached rows) come into the block's stage by bulk copies before its wait; docs/ARCHITECTURE.md
// walks a token through it, docs/PERF.md (v29-) says what it costs per op.
#pragma once
#include <cuda_runtime.h>

#include <array>
#include <memory>
#include <vector>

#include "backend/cuda/decoder.h"
#include "backend/cuda/device_model.h"
#include "backend/cuda/persistent/program.h"
#include "plan/step_plan.h"

namespace kestrel::cuda {

class PersistentStep {
 public:
  // A step of `plan` (1 to 8 sequences) over `model` on the current device, reading the tokens,
  // positions and KV cache of `kv` (a decoder of the same model for at least the plan's batch;
  // the step writes each sequence's key and value at its position there, as Decoder::step does).
  // The plan's SMs must not exceed the device's. Fails naming what does not fit.
  PersistentStep(const DeviceModel& model, Decoder& kv, StepPlan plan);
  ~PersistentStep();
  PersistentStep(const PersistentStep&) = delete;
  PersistentStep& operator=(const PersistentStep&) = delete;

  // Enqueues one step: a single cooperative launch (capturable in a graph).
  void run(cudaStream_t s);
  // Once the stream is done: fails naming the instruction whose wait timed out, if one did (the
  // counters are then out of step: reset() before running again).
  void check() const;
  void reset();
  // One step with every instruction timed on its SM's clock, summed per op (a step of its own:
  // it advances the counters as run() does).
  struct OpTime {
    StepOp op{};
    int tiles = 0;
    double wait_cycles = 0, run_cycles = 0;  // summed over the op's instructions
    // Cycles from a tile's start to each of the op's marks (trace_mark), summed over the tiles
    // that reached it, and how many did.
    std::array<double, kTraceMarks> mark_cycles{};
    std::array<int, kTraceMarks> marked{};
  };
  std::vector<OpTime> trace(cudaStream_t s);
  const float* logits() const { return logits_; }  // [batch, vocab], device memory
  const StepPlan& plan() const { return plan_; }
  int64_t staged_instructions() const { return staged_instrs_; }  // whose weights come through the stage
  // Tiles whose products run on tensor cores (op_mma.cuh): staged ones, and expert gate/up tiles
  // whose rows fit the stage (they take it only when their position has an expert).
  int64_t tensor_core_tiles() const { return mma_tiles_; }

  struct Device;

 private:
  StepPlan plan_;
  std::unique_ptr<Device> d_;
  const float* logits_ = nullptr;
  int64_t staged_instrs_ = 0, mma_tiles_ = 0;
};

}  // namespace kestrel::cuda
