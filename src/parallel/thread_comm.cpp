#include "parallel/thread_comm.h"

#include <condition_variable>
#include <cstring>
#include <mutex>

#include "common/error.h"

namespace kestrel {
namespace {

// What the ranks share: a barrier that an abort opens for good, and each rank's published buffer.
struct Group {
  explicit Group(int n) : size(n), in(size_t(n)) {}
  const int size;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  bool aborted = false;
  std::vector<const float*> in;

  void barrier() {
    std::unique_lock lock(mu);
    if (aborted) fail("collective aborted: another rank failed");
    const uint64_t gen = generation;
    if (++arrived == size) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    cv.wait(lock, [&] { return generation != gen || aborted; });
    if (generation == gen) fail("collective aborted: another rank failed");
  }
  void abort() {
    std::lock_guard lock(mu);
    aborted = true;
    cv.notify_all();
  }
};

class ThreadCommunicator final : public Communicator {
 public:
  ThreadCommunicator(std::shared_ptr<Group> g, int rank) : g_(std::move(g)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return g_->size; }
  std::string name() const override { return "threads"; }

  void all_reduce_sum(float* buf, int64_t n) override {
    if (n <= 0 || g_->size == 1) return;
    g_->in[size_t(rank_)] = buf;
    g_->barrier();  // every rank's buffer is published
    sum_.assign(g_->in[0], g_->in[0] + n);
    for (int r = 1; r < g_->size; ++r) {
      const float* p = g_->in[size_t(r)];
      for (int64_t i = 0; i < n; ++i) sum_[size_t(i)] += p[i];
    }
    g_->barrier();  // every rank has read every buffer: each may now overwrite its own
    std::memcpy(buf, sum_.data(), size_t(n) * sizeof(float));
  }

  void all_gather(const float* in, int64_t n, float* out) override {
    if (n <= 0) return;
    g_->in[size_t(rank_)] = in;
    g_->barrier();
    for (int r = 0; r < g_->size; ++r) std::memcpy(out + r * n, g_->in[size_t(r)], size_t(n) * sizeof(float));
    g_->barrier();  // no rank changes its input while another still copies it
  }

  void abort() override { g_->abort(); }

 private:
  std::shared_ptr<Group> g_;
  int rank_;
  std::vector<float> sum_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_thread_communicators(int ranks) {
  if (ranks < 1) fail("a communicator group needs at least one rank, got ", ranks);
  auto g = std::make_shared<Group>(ranks);
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < ranks; ++r) out.push_back(std::make_unique<ThreadCommunicator>(g, r));
  return out;
}

}  // namespace kestrel
