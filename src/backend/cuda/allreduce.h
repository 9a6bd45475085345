// One-shot all-reduce among the GPUs of one process, for decode-sized messages (a few KB to a
// few hundred KB), where NCCL's latency dominates: each rank copies its partial into its own
// peer-visible buffer, tells the peers, and reads every rank's buffer over NVLink, summing in
// rank order so that all ranks get the same bits. One kernel per call, no host work: the calls
// are captured in CUDA graphs. The fused form adds the sum to the residual stream and applies
// the next RMSNorm in the same kernel. Larger messages go to a fallback communicator (NCCL).
//
// Flags and epochs (the group's protocol, see allreduce.cu for the argument):
//   - each rank has a device-side epoch: the number of one-shot calls it has completed. Every
//     block of a call reads it at its start and uses epoch + 1; the last block of the call to
//     finish stores epoch + 1. A graph replay thus gets a fresh epoch without the host.
//   - each rank's data buffer holds two halves; a call uses the half of its epoch's parity.
//   - block b of rank r, once its share is in r's buffer, stores the epoch into flag slot
//     [b][r] of every peer (a release store after a system-scope fence), then waits until its
//     own slots [b][p] of every peer p reach the epoch, and only then reads the peers' shares.
//   - a wait longer than the group's timeout (or an abort) marks the group failed: kernels
//     return instead of hanging, and check() names the rank and the peer it waited for.
// All ranks must make the same calls in the same order with the same sizes.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "parallel/communicator.h"

namespace kestrel::cuda {

struct OneShotStatus;  // host-mapped abort and error words

class OneShotGroup {
 public:
  static constexpr int kMaxRanks = 8;
  // 256 KB: a decode step's all-reduce carries batch x hidden floats (7168 x 8 = 229 KB at
  // DeepSeek-V3's width and batch 8). One-shot reads (ranks - 1) x size over NVLink per rank
  // in one step, NCCL's ring about 2 x size in 2 (ranks - 1) latency-bound steps; past a few
  // hundred KB the bandwidth term wins and NCCL is the better choice.
  static constexpr int64_t kDefaultMaxFloats = 64 * 1024;

  // Allocates each rank's buffers on its GPU (devices[r] is rank r) and enables peer access
  // between every pair (failing, with the pair named, where there is none).
  explicit OneShotGroup(const std::vector<int>& devices, int64_t max_floats = kDefaultMaxFloats,
                        int timeout_ms = 2000);
  ~OneShotGroup();
  OneShotGroup(const OneShotGroup&) = delete;
  OneShotGroup& operator=(const OneShotGroup&) = delete;

  int size() const { return int(devices_.size()); }
  int device(int rank) const { return devices_[size_t(rank)]; }
  int64_t max_floats() const { return max_floats_; }

  // Every rank's pending one-shot kernels return at once and later calls fail.
  void abort();
  bool aborted() const;
  // Fails naming the rank and what went wrong when a kernel timed out or saw an abort; the
  // group is then unusable (its epochs no longer agree). Reads host memory only: no sync.
  void check() const;

 private:
  friend class OneShotAllReduce;
  void release();
  std::vector<int> devices_;
  std::vector<float*> bufs_;   // per rank: 2 x max_floats floats, peer-visible
  std::vector<void*> ctls_;    // per rank: epoch, block count and flag slots
  OneShotStatus* status_ = nullptr;
  int64_t max_floats_;
  int timeout_ms_;
};

// One rank's view of a group. Implements Communicator on the rank's stream (all_gather goes to
// the fallback); the decoder calls the stream-taking forms.
class OneShotAllReduce : public Communicator {
 public:
  // `fallback` (NCCL) serves messages above the group's max_floats; it enqueues on
  // `fallback_stream` (null: the same as `stream`), joined to the caller's stream by events.
  // With one rank no fallback is needed: nothing is communicated.
  OneShotAllReduce(OneShotGroup& group, int rank, cudaStream_t stream, Communicator* fallback = nullptr,
                   cudaStream_t fallback_stream = nullptr);
  ~OneShotAllReduce() override;
  OneShotAllReduce(const OneShotAllReduce&) = delete;
  OneShotAllReduce& operator=(const OneShotAllReduce&) = delete;

  // out = sum over ranks of partial (out may be partial).
  void all_reduce_sum(const float* partial, float* out, int64_t n, cudaStream_t s);
  // x[r] += sum over ranks of partial[r]; then, unless norm_weight is null,
  // xn[r] = x[r] / sqrt(mean(x[r]^2) + eps) * norm_weight, for `rows` rows of `hidden` floats.
  void all_reduce_add_norm(const float* partial, float* x, const float* norm_weight, float eps, float* xn, int rows,
                           int hidden, cudaStream_t s);

  // Makes the fused call ready for messages of up to `floats` without allocating later (a call
  // above the one-shot size needs scratch, which cannot be allocated while a graph is captured).
  void reserve(int64_t floats);

  int rank() const override { return rank_; }
  int size() const override { return group_.size(); }
  std::string name() const override { return "one-shot"; }
  void all_reduce_sum(float* buf, int64_t n) override { all_reduce_sum(buf, buf, n, stream_); }
  void all_gather(const float* in, int64_t n, float* out) override;
  void abort() override;  // the group's and the fallback's

 private:
  template <typename F>
  void on_fallback(cudaStream_t s, F&& call);
  float* scratch(int64_t n, cudaStream_t s);

  OneShotGroup& group_;
  int rank_;
  cudaStream_t stream_;
  Communicator* fallback_;
  cudaStream_t fallback_stream_;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  float* scratch_ = nullptr;  // the fused call's fallback: the partial, reduced by NCCL in place
  int64_t scratch_floats_ = 0;
};

// x[r] += add[r]; then, unless w is null, xn[r] = rmsnorm(x[r]) * w: the one-rank form of the
// fused call (and the step after the fallback's all-reduce).
void launch_add_norm(const float* add, float* x, const float* w, float eps, float* xn, int rows, int hidden,
                     cudaStream_t s);

}  // namespace kestrel::cuda
