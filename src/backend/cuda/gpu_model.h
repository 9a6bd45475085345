// A loaded model on the GPUs: unsplit on GPU 0, or split by a layout over GPUs 0 .. N-1 (rank r's
// part, parallel/shard.h, uploaded on GPU r, the ranks driven by a RankGroup). Uploading shows
// its progress and ends with one line on stderr: bytes, seconds, GB/s (upload.h).
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/device_model.h"
#include "backend/cuda/rank_group.h"
#include "parallel/layout.h"

namespace kestrel::cuda {

class GpuModel {
 public:
  GpuModel(const Model& m, const Layout& layout);
  // Random weights of a configuration's shapes on GPU 0 (DeviceModel::random), unsplit: serving
  // measured at a real model's size without its weights (`serve --random-weights`).
  explicit GpuModel(const ModelConfig& c);
  ~GpuModel();
  GpuModel(const GpuModel&) = delete;
  GpuModel& operator=(const GpuModel&) = delete;

  int ranks() const { return int(parts_.size()); }
  const DeviceModel& part(int rank) const { return *parts_[size_t(rank)]; }
  RankGroup* group() const { return group_.get(); }  // null when unsplit
  const RankLink* link(int rank) const { return group_ ? group_->link(rank) : nullptr; }
  // The stream rank r's work goes on (the group's when split).
  cudaStream_t stream(int rank) const { return group_ ? group_->stream(rank) : stream_; }
  // Calls fn(rank) for every rank, each on its GPU (at once when split), and waits.
  void each_rank(const std::function<void(int)>& fn) const;
  std::string describe() const;  // "NVIDIA H200" or "2 x NVIDIA H200, TP2"

 private:
  Layout layout_;
  std::unique_ptr<RankGroup> group_;
  std::vector<std::unique_ptr<DeviceModel>> parts_;
  std::string gpu_ = "GPU 0";
  cudaStream_t stream_ = nullptr;  // unsplit
};

}  // namespace kestrel::cuda
