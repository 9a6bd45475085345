// The stage step's grid barrier: every block adds one to a counter once its writes are done
// (release at GPU scope) and waits until all blocks have (relaxed polls, then one acquire fence:
// an acquire load empties the L1 on every poll, docs/PERF.md v32). The counter only counts up, so
// barrier j of step e waits for (e x barriers + j + 1) x blocks arrivals, compared modulo 2^32.
// A wait past the timeout records the barrier and makes every block leave, so a broken step
// fails by name instead of hanging.
#pragma once
#include <cstdint>

#include "backend/cuda/stages/counters.cuh"
#include "backend/cuda/stages/stage_args.h"

namespace kestrel::cuda {

// Barrier j of this step; false when a block must leave the kernel (a wait timed out here or
// elsewhere). Every thread of the block calls it.
__device__ __forceinline__ bool grid_barrier(const SArgs& a, uint32_t epoch, int j) {
  __shared__ int leave;
  __syncthreads();
  if (threadIdx.x == 0) {
    add_release(a.arrived, 1);
    const uint32_t target = (epoch * uint32_t(a.barriers) + uint32_t(j) + 1) * gridDim.x;
    leave = 0;
    if (int32_t(load_relaxed(a.arrived) - target) < 0) {
      const long long start = global_ns();
      while (int32_t(load_relaxed(a.arrived) - target) < 0) {
        if (*reinterpret_cast<volatile int32_t*>(a.error) != 0 || global_ns() - start > a.timeout_ns) {
          atomicCAS(a.error, 0, j + 1);
          leave = 1;
          break;
        }
      }
    }
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
  }
  __syncthreads();
  return !leave;
}

}  // namespace kestrel::cuda
