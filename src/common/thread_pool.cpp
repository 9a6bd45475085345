#include "common/thread_pool.h"

#include <algorithm>
#include <cstdlib>

namespace kestrel {

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) {
    if (const char* env = std::getenv("KESTREL_THREADS")) threads = std::atoi(env);
    if (threads <= 0) threads = int(std::max(1u, std::thread::hardware_concurrency()));
  }
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  for (auto& t : workers_) t.join();
}

ThreadPool& ThreadPool::global() {
  static ThreadPool pool;
  return pool;
}

void ThreadPool::parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn) {
  if (n == 0) return;
  grain = std::max<size_t>(grain, 1);
  const size_t parts = std::min<size_t>(size_t(size()) * 4, (n + grain - 1) / grain);
  if (parts <= 1 || workers_.empty()) {
    fn(0, n);
    return;
  }
  std::unique_lock<std::mutex> lock(mu_);
  fn_ = &fn;
  n_ = n;
  chunk_ = (n + parts - 1) / parts;
  next_ = 0;
  pending_ = (n + chunk_ - 1) / chunk_;
  ++generation_;
  cv_work_.notify_all();
  // The caller works too.
  while (next_ < n_) {
    size_t b = next_;
    next_ = std::min(n_, b + chunk_);
    size_t e = next_;
    lock.unlock();
    fn(b, e);
    lock.lock();
    --pending_;
  }
  cv_done_.wait(lock, [this] { return pending_ == 0; });
  fn_ = nullptr;
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_work_.wait(lock, [&] { return stop_ || (generation_ != seen && fn_ && next_ < n_); });
    if (stop_) return;
    seen = generation_;
    while (fn_ && next_ < n_) {
      size_t b = next_;
      next_ = std::min(n_, b + chunk_);
      size_t e = next_;
      const auto* fn = fn_;
      lock.unlock();
      (*fn)(b, e);
      lock.lock();
      if (--pending_ == 0) cv_done_.notify_all();
    }
  }
}

}  // namespace kestrel
