// The GPUs of a split model in one process: rank r on GPU r with its own stream and thread, the
// NCCL communicators and the one-shot all-reduce made once at start-up (after checking that
// every GPU reaches every other), and the RankLink each rank's decoder uses.
#pragma once
#include <cuda_runtime.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/decoder.h"
#include "backend/cuda/rank_threads.h"

namespace kestrel::cuda {

class NcclCommunicator;
class OneShotGroup;

class RankGroup {
 public:
  explicit RankGroup(int ranks);  // GPUs 0 .. ranks - 1
  ~RankGroup();
  RankGroup(const RankGroup&) = delete;
  RankGroup& operator=(const RankGroup&) = delete;

  int size() const { return int(streams_.size()); }
  cudaStream_t stream(int rank) const { return streams_[size_t(rank)]; }
  const RankLink* link(int rank) const { return &links_[size_t(rank)]; }

  // Calls fn(rank) for every rank at once, each on its rank's thread with its GPU current, and
  // waits for all. When a rank fails, the collectives are aborted so that the others return
  // instead of waiting for it, the group stays failed (later calls say why), and the failure
  // is rethrown naming the rank.
  void run(const std::function<void(int)>& fn);

 private:
  std::vector<cudaStream_t> streams_;
  std::vector<std::unique_ptr<NcclCommunicator>> nccl_;
  std::unique_ptr<OneShotGroup> oneshot_;
  std::vector<std::unique_ptr<OneShotAllReduce>> reduce_;
  std::vector<RankLink> links_;
  std::unique_ptr<RankThreads> threads_;
  std::string failed_;  // why the group can no longer run
};

}  // namespace kestrel::cuda
