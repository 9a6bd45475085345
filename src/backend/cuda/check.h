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
