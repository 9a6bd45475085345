#include "backend/cuda/check.h"
#include "backend/cuda/op_timer.h"

namespace kestrel::cuda {

OpTimer::~OpTimer() {
  for (cudaEvent_t e : pool_) cudaEventDestroy(e);
}

cudaEvent_t OpTimer::event() {
  if (used_ == pool_.size()) {
    cudaEvent_t e;
    KESTREL_CUDA_CHECK(cudaEventCreate(&e));
    pool_.push_back(e);
  }
  return pool_[used_++];
}

void OpTimer::begin(cudaStream_t s) {
  used_ = 0;
  ops_.clear();
  KESTREL_CUDA_CHECK(cudaEventRecord(event(), s));
}

void OpTimer::mark(const std::string& name, double bytes, cudaStream_t s) {
  KESTREL_CUDA_CHECK(cudaEventRecord(event(), s));
  ops_.push_back({name, bytes, 0.0f});
}

std::vector<OpTime> OpTimer::finish() {
  KESTREL_CUDA_CHECK(cudaEventSynchronize(pool_[used_ - 1]));
  for (size_t i = 0; i < ops_.size(); ++i) KESTREL_CUDA_CHECK(cudaEventElapsedTime(&ops_[i].ms, pool_[i], pool_[i + 1]));
  return ops_;
}

}  // namespace kestrel::cuda
