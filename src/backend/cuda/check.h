// CUDA error checks that turn a failed call into a kestrel::Error naming the call and place.
#pragma once
#include <cuda_runtime.h>

#include "common/error.h"

#define KESTREL_CUDA_CHECK(expr)                                                                          \
  do {                                                                                                    \
    cudaError_t kestrel_err_ = (expr);                                                                    \
    if (kestrel_err_ != cudaSuccess)                                                                      \
      ::kestrel::fail("CUDA error at ", __FILE__, ":", __LINE__, ": ", #expr, ": ", cudaGetErrorString(kestrel_err_)); \
  } while (0)

// After a kernel launch.
#define KESTREL_CUDA_LAUNCHED() KESTREL_CUDA_CHECK(cudaGetLastError())

namespace kestrel::cuda {

// Makes `device` current for a scope and restores the caller's device after: code that serves
// several GPUs from one thread touches each through one of these.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    KESTREL_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device) {
      KESTREL_CUDA_CHECK(cudaSetDevice(device));
      changed_ = true;
    }
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool changed_ = false;
};

}  // namespace kestrel::cuda
