// The grid barrier's memory operations (grid_barrier.cuh): a release add to the arrival counter,
// relaxed polls of it (an acquire load would empty the L1 on every poll, docs/PERF.md v32), and
// the GPU's global timer for the barrier's timeout.
#pragma once
#include <cstdint>

namespace kestrel::cuda {

__device__ __forceinline__ void add_release(uint32_t* p, uint32_t v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t load_relaxed(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ long long global_ns() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace kestrel::cuda
