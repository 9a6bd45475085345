// NCCL collectives among the GPUs of one process: one communicator, thread and stream per GPU.
// Buffers are device pointers of the rank's GPU; every call enqueues on the rank's stream (given
// at construction) and returns, so the calls are captured in the rank's CUDA graph.
#pragma once
#include <cuda_runtime.h>

#include <memory>
#include <vector>

#include "parallel/communicator.h"

struct ncclComm;  // nccl.h: typedef struct ncclComm* ncclComm_t

namespace kestrel::cuda {

struct NcclClique;  // the communicators made together

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<NcclClique> clique, int rank, int device, cudaStream_t stream);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override;
  std::string name() const override { return "nccl"; }
  void all_reduce_sum(float* buf, int64_t n) override;
  void all_gather(const float* in, int64_t n, float* out) override;
  // Aborts every communicator made with this one (ncclCommAbort), so that no rank waits for
  // this one: their pending collectives end, and every later call on any rank fails naming the
  // rank that aborted. Any rank's thread may call it; calling it again does nothing.
  void abort() override;

  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }

 private:
  ncclComm* comm() const;
  std::shared_ptr<NcclClique> clique_;
  int rank_, device_;
  cudaStream_t stream_;
};

// One communicator per device, made together (ncclCommInitAll); rank i is devices[i] and
// enqueues on streams[i], a stream of that device. NVLink multicast (NVLS) is forced off.
std::vector<std::unique_ptr<NcclCommunicator>> make_nccl_communicators(const std::vector<int>& devices,
                                                                       const std::vector<cudaStream_t>& streams);

// Start-up check for peer-to-peer collectives: fails naming the pair when a GPU cannot reach
// another's memory, else enables peer access in both directions for every pair.
void check_peer_access(const std::vector<int>& devices);

}  // namespace kestrel::cuda
