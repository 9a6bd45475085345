#include "backend/cuda/rank_group.h"

#include <atomic>

#include "backend/cuda/allreduce.h"
#include "backend/cuda/check.h"
#include "backend/cuda/nccl_comm.h"
#include "common/error.h"

namespace kestrel::cuda {

RankGroup::RankGroup(int ranks) {
  int visible = 0;
  if (cudaGetDeviceCount(&visible) != cudaSuccess) visible = 0;
  if (ranks < 1 || ranks > visible) fail("--tp ", ranks, ": ", visible, " GPU", visible == 1 ? "" : "s", " visible");
  std::vector<int> devices;
  for (int r = 0; r < ranks; ++r) devices.push_back(r);
  if (ranks > 1) check_peer_access(devices);
  for (int r = 0; r < ranks; ++r) {
    KESTREL_CUDA_CHECK(cudaSetDevice(r));
    cudaStream_t s;
    KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    streams_.push_back(s);
  }
  nccl_ = make_nccl_communicators(devices, streams_);
  oneshot_ = std::make_unique<OneShotGroup>(devices);
  for (int r = 0; r < ranks; ++r) {
    KESTREL_CUDA_CHECK(cudaSetDevice(r));
    reduce_.push_back(std::make_unique<OneShotAllReduce>(*oneshot_, r, streams_[size_t(r)], nccl_[size_t(r)].get()));
    links_.push_back(RankLink{nccl_[size_t(r)].get(), reduce_.back().get()});
  }
  KESTREL_CUDA_CHECK(cudaSetDevice(0));
  threads_ = std::make_unique<RankThreads>(devices);
}

RankGroup::~RankGroup() {
  reduce_.clear();
  oneshot_.reset();
  nccl_.clear();
  for (size_t r = 0; r < streams_.size(); ++r) {
    cudaSetDevice(int(r));
    cudaStreamDestroy(streams_[r]);
  }
}

void RankGroup::run(const std::function<void(int)>& fn) {
  if (!failed_.empty()) fail("the GPUs of this split model stopped after an earlier failure: ", failed_);
  std::atomic<int> failed_rank{-1};  // the first rank to fail
  try {
    threads_->run(
        [&](int r) {
          try {
            fn(r);
            oneshot_->check();  // a one-shot kernel that timed out or saw an abort
          } catch (...) {
            int none = -1;
            failed_rank.compare_exchange_strong(none, r);
            throw;
          }
        },
        [&] {  // the first failure: the others' collectives end instead of waiting for it
          nccl_[0]->abort();
          oneshot_->abort();
        });
  } catch (const std::exception& e) {
    const int r = failed_rank.load();
    failed_ = "rank " + std::to_string(r) + " (GPU " + std::to_string(r) + "): " + e.what();
    fail(failed_);
  }
}

}  // namespace kestrel::cuda
