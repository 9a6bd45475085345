// The stage step: a decode step as one cooperative launch of one block per SM that runs the
// step's ops as stages, every block taking an even share of each, with a grid barrier between
// stages where the edge is all-to-all (q/k/v, attention, its combine, o, the router, the experts'
// gate/up, their down, per layer; then the LM head). Each stage is written for all 16 warps of a
// block (no phase runs on one warp while the others wait), and each block normalizes the residual
// itself instead of waiting for another stage. lab/grid_stages measures what the structure
// costs when its stages only read their bytes; docs/PERF.md (v36-) what the real one costs.
#pragma once
#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/decoder.h"
#include "backend/cuda/device_model.h"
#include "backend/cuda/stages/stage_args.h"

namespace kestrel::cuda {

class StageStep {
 public:
  // A step of `batch` (1 to 8) sequences over `model` on the current device, reading the tokens,
  // positions and KV cache of `kv` (a decoder of the same model for at least `batch` sequences;
  // the step writes each sequence's key and value at its position there, as Decoder::step
  // does). Fails naming what the stage step does not take (MLA, a split model, ...).
  StageStep(const DeviceModel& model, Decoder& kv, int batch);
  ~StageStep();
  StageStep(const StageStep&) = delete;
  StageStep& operator=(const StageStep&) = delete;

  // Enqueues one step: a single cooperative launch (capturable in a graph).
  void run(cudaStream_t s);
  // Once the stream is done: fails naming the barrier whose wait timed out, if one did (then
  // reset() before running again).
  void check() const;
  void reset();
  // One step with every stage timed on each block's clock, summed per kind of stage: cycles
  // running (from its barrier to its end) and the whole stage (to the next stage's start), each
  // averaged over the blocks.
  struct StageTime {
    Stage stage{};
    int count = 0;                       // per step
    double run_cycles = 0, wall_cycles = 0;
  };
  std::vector<StageTime> trace(cudaStream_t s);
  const float* logits() const { return logits_; }  // [batch, vocab], device memory
  int blocks() const;
  int barriers() const;

  struct Device;

 private:
  std::unique_ptr<Device> d_;
  const float* logits_ = nullptr;
  std::vector<Stage> stages_;  // of a step, in order
};

const char* stage_name(Stage s);

}  // namespace kestrel::cuda
