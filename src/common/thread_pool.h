// A fixed pool of worker threads with one primitive: parallel_for over [0, n) in chunks.
// The calling thread takes part, so a pool of one thread runs everything inline.
#pragma once
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kestrel {

class ThreadPool {
 public:
  explicit ThreadPool(int threads = 0);  // 0: hardware concurrency
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return int(workers_.size()) + 1; }

  // Calls fn(begin, end) on disjoint ranges covering [0, n); ranges hold at least `grain` items.
  void parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn);

  static ThreadPool& global();

 private:
  void worker_loop();

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  const std::function<void(size_t, size_t)>* fn_ = nullptr;
  size_t n_ = 0, chunk_ = 0, next_ = 0, pending_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

}  // namespace kestrel
