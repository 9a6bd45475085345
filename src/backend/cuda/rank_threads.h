// One host thread per rank, each with its rank's GPU current: how the ranks of a split model are
// driven from one process. A rank that throws never leaves the others waiting: on_failure runs
// (it aborts the communicators, so kernels waiting for the failed rank end), sync() stops
// blocking, and run() rethrows the first failure once every thread has ended.
#pragma once
#include <cuda_runtime.h>

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "backend/cuda/check.h"

namespace kestrel::cuda {

class RankThreads {
 public:
  explicit RankThreads(std::vector<int> devices) : devices_(std::move(devices)) {}

  int size() const { return int(devices_.size()); }

  void run(const std::function<void(int rank)>& fn, const std::function<void()>& on_failure = {}) {
    {
      std::lock_guard l(mu_);
      failed_ = false;
      first_ = nullptr;
      count_ = 0;
    }
    std::vector<std::thread> threads;
    for (int r = 0; r < size(); ++r)
      threads.emplace_back([&, r] {
        try {
          KESTREL_CUDA_CHECK(cudaSetDevice(devices_[size_t(r)]));
          fn(r);
        } catch (...) {
          bool first = false;
          {
            std::lock_guard l(mu_);
            if (!failed_) {
              failed_ = true;
              first_ = std::current_exception();
              first = true;
            }
          }
          cv_.notify_all();
          if (first && on_failure) {
            try {
              on_failure();
            } catch (...) {  // the first failure is the one worth reporting
            }
          }
        }
      });
    for (auto& t : threads) t.join();
    if (first_) std::rethrow_exception(first_);
  }

  // A barrier for the threads inside run(). Throws, instead of waiting, once a rank has failed.
  void sync() {
    std::unique_lock l(mu_);
    if (failed_) fail("rank threads: another rank failed");
    const uint64_t gen = gen_;
    if (++count_ == size()) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
      return;
    }
    cv_.wait(l, [&] { return gen_ != gen || failed_; });
    if (gen_ == gen) fail("rank threads: another rank failed");
  }

 private:
  std::vector<int> devices_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool failed_ = false;
  std::exception_ptr first_;
  int count_ = 0;
  uint64_t gen_ = 0;
};

}  // namespace kestrel::cuda
