// Collectives among the ranks of a split model, behind one interface: threads in one process for
// the CPU backend (thread_comm.h), NCCL or peer-to-peer buffers for GPUs (backend/cuda). A rank
// calls every collective in the same order as the others. For the GPU implementations the
// buffers are device pointers and a call enqueues work on the rank's stream (given when the
// communicator was made), so collectives are captured inside the rank's decode graph.
#pragma once
#include <cstdint>
#include <string>

namespace kestrel {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;  // for reports: "threads", "nccl", ...

  // buf[0, n) becomes the sum over ranks of every rank's buf[0, n), with the same bits on every
  // rank (the order of the sum does not depend on the rank).
  virtual void all_reduce_sum(float* buf, int64_t n) = 0;
  // out[r * n, (r + 1) * n) becomes rank r's in[0, n), on every rank.
  virtual void all_gather(const float* in, int64_t n, float* out) = 0;
  // Makes every rank's pending and future collectives fail instead of waiting for this rank
  // (called when this rank cannot go on), so that one failed rank never hangs the others.
  virtual void abort() = 0;
};

}  // namespace kestrel
