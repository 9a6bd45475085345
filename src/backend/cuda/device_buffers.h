// Device allocations owned by a host object: copies of host vectors and zeroed arrays, freed
// together with the owner's list.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "backend/cuda/check.h"

namespace kestrel::cuda {

template <class T>
T* device_copy(const std::vector<T>& v, std::vector<void*>& owned) {
  void* p = nullptr;
  KESTREL_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(1, v.size() * sizeof(T))));
  owned.push_back(p);
  if (!v.empty()) KESTREL_CUDA_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return static_cast<T*>(p);
}

template <class T>
T* device_zeros(size_t n, std::vector<void*>& owned) {
  void* p = nullptr;
  KESTREL_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(1, n * sizeof(T))));
  owned.push_back(p);
  KESTREL_CUDA_CHECK(cudaMemset(p, 0, std::max<size_t>(1, n * sizeof(T))));
  return static_cast<T*>(p);
}

}  // namespace kestrel::cuda
