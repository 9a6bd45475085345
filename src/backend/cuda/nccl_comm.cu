#include <nccl.h>

#include <cstdlib>
#include <mutex>
#include <set>
#include <shared_mutex>

#include "backend/cuda/check.h"
#include "backend/cuda/nccl_comm.h"

#define KESTREL_NCCL_CHECK(expr)                                                                              \
  do {                                                                                                        \
    ncclResult_t kestrel_nccl_ = (expr);                                                                      \
    if (kestrel_nccl_ != ncclSuccess) {                                                                       \
      const char* kestrel_last_ = ncclGetLastError(nullptr);                                                  \
      ::kestrel::fail("NCCL error at ", __FILE__, ":", __LINE__, ": ", #expr, ": ", ncclGetErrorString(kestrel_nccl_), \
                      kestrel_last_ && *kestrel_last_ ? " (" : "", kestrel_last_ ? kestrel_last_ : "",           \
                      kestrel_last_ && *kestrel_last_ ? ")" : "");                                           \
    }                                                                                                         \
  } while (0)

namespace kestrel::cuda {

// A collective enqueues under a shared lock and abort() takes it whole, so no call uses a
// communicator that another thread is tearing down.
struct NcclClique {
  std::vector<ncclComm_t> comms;
  std::shared_mutex mu;
  bool aborted = false;
  int aborted_by = -1;
  std::vector<bool> destroyed;
};

NcclCommunicator::NcclCommunicator(std::shared_ptr<NcclClique> clique, int rank, int device, cudaStream_t stream)
    : clique_(std::move(clique)), rank_(rank), device_(device), stream_(stream) {}

NcclCommunicator::~NcclCommunicator() {
  std::unique_lock lock(clique_->mu);
  if (clique_->aborted || clique_->destroyed[size_t(rank_)]) return;
  try {
    DeviceGuard g(device_);
    ncclCommDestroy(comm());
  } catch (const Error&) {  // a destructor must not throw; the process is in trouble anyway
  }
  clique_->destroyed[size_t(rank_)] = true;
}

int NcclCommunicator::size() const { return int(clique_->comms.size()); }

ncclComm* NcclCommunicator::comm() const { return clique_->comms[size_t(rank_)]; }

namespace {

void check_usable(const NcclClique& c, int rank) {
  if (c.aborted) fail("nccl: rank ", rank, ": the communicators were aborted by rank ", c.aborted_by,
                      "; no collective runs after abort()");
}

}  // namespace

void NcclCommunicator::all_reduce_sum(float* buf, int64_t n) {
  if (n < 0) fail("nccl: all_reduce_sum of ", n, " floats");
  std::shared_lock lock(clique_->mu);
  check_usable(*clique_, rank_);
  DeviceGuard g(device_);
  KESTREL_NCCL_CHECK(ncclAllReduce(buf, buf, size_t(n), ncclFloat32, ncclSum, comm(), stream_));
}

void NcclCommunicator::all_gather(const float* in, int64_t n, float* out) {
  if (n < 0) fail("nccl: all_gather of ", n, " floats");
  std::shared_lock lock(clique_->mu);
  check_usable(*clique_, rank_);
  DeviceGuard g(device_);
  KESTREL_NCCL_CHECK(ncclAllGather(in, out, size_t(n), ncclFloat32, comm(), stream_));
}

void NcclCommunicator::abort() {
  std::unique_lock lock(clique_->mu);
  if (clique_->aborted) return;
  clique_->aborted = true;
  clique_->aborted_by = rank_;
  // Every communicator, destroyed ones excepted; the first failure is reported after all were tried.
  ncclResult_t first = ncclSuccess;
  for (size_t r = 0; r < clique_->comms.size(); ++r) {
    if (clique_->destroyed[r]) continue;
    const ncclResult_t e = ncclCommAbort(clique_->comms[r]);
    if (first == ncclSuccess) first = e;
  }
  if (first != ncclSuccess) fail("nccl: rank ", rank_, ": ncclCommAbort: ", ncclGetErrorString(first));
}

std::vector<std::unique_ptr<NcclCommunicator>> make_nccl_communicators(const std::vector<int>& devices,
                                                                       const std::vector<cudaStream_t>& streams) {
  if (devices.empty()) fail("nccl: no devices given");
  if (streams.size() != devices.size())
    fail("nccl: ", devices.size(), " devices but ", streams.size(), " streams (one stream per device)");
  int count = 0;
  KESTREL_CUDA_CHECK(cudaGetDeviceCount(&count));
  std::set<int> seen;
  for (size_t i = 0; i < devices.size(); ++i) {
    if (devices[i] < 0 || devices[i] >= count) fail("nccl: no GPU ", devices[i], " (this machine has ", count, ")");
    if (!seen.insert(devices[i]).second) fail("nccl: GPU ", devices[i], " is listed twice");
    if (streams[i] != nullptr) {
      int d = -1;
      KESTREL_CUDA_CHECK(cudaStreamGetDevice(streams[i], &d));
      if (d != devices[i]) fail("nccl: the stream of rank ", i, " belongs to GPU ", d, ", not to its GPU ", devices[i]);
    }
  }
  // NVLink multicast (NVLS) stays off whatever the environment says: on a shared host a program
  // using it can put every GPU of the host out of service. Overwritten on purpose.
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  // Connect the ranks now rather than at their first collective, so that a collective only
  // enqueues and never blocks its thread waiting for a peer's thread (unless the environment
  // sets it otherwise).
  setenv("NCCL_RUNTIME_CONNECT", "0", 0);
  auto clique = std::make_shared<NcclClique>();
  clique->comms.resize(devices.size());
  clique->destroyed.assign(devices.size(), false);
  {
    DeviceGuard g(devices[0]);
    KESTREL_NCCL_CHECK(ncclCommInitAll(clique->comms.data(), int(devices.size()), devices.data()));
  }
  std::vector<std::unique_ptr<NcclCommunicator>> out;
  for (size_t i = 0; i < devices.size(); ++i)
    out.push_back(std::make_unique<NcclCommunicator>(clique, int(i), devices[i], streams[i]));
  return out;
}

void check_peer_access(const std::vector<int>& devices) {
  for (int a : devices)
    for (int b : devices) {
      if (a == b) continue;
      int ok = 0;
      KESTREL_CUDA_CHECK(cudaDeviceCanAccessPeer(&ok, a, b));
      if (!ok)
        fail("GPU ", a, " cannot access the memory of GPU ", b,
             " (cudaDeviceCanAccessPeer is false): peer-to-peer collectives need NVLink or PCIe peer access "
             "between every pair of GPUs");
      DeviceGuard g(a);
      const cudaError_t e = cudaDeviceEnablePeerAccess(b, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled)
        (void)cudaGetLastError();  // enabled before: fine
      else if (e != cudaSuccess)
        fail("enabling peer access from GPU ", a, " to GPU ", b, ": ", cudaGetErrorString(e));
    }
}

}  // namespace kestrel::cuda
