// The persistent step's counters: a tile advances its counter once its writes are visible
// (release at GPU scope); a consumer's thread 0 spins until the counter reaches the step's
// target (acquire), then the block passes a barrier before it reads. Counters only count up:
// the target of step e (from 0) is (e + 1) x producers. A wait that runs past the timeout
// records its instruction and gives up, so a wrong plan fails with a name instead of a hang.
#pragma once
#include <cstdint>

namespace kestrel::cuda {

__device__ __forceinline__ uint32_t load_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void add_release(uint32_t* p, uint32_t v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// The same, returning the count before: the producer that completes a counter acquires the
// others' writes with it (a tail runs on that block next).
__device__ __forceinline__ uint32_t add_acq_rel(uint32_t* p, uint32_t v) {
  uint32_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

__device__ __forceinline__ long long global_ns() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// By thread 0: waits until *c >= target; false when the timeout passed first.
__device__ __forceinline__ bool wait_counter(const uint32_t* c, uint32_t target, long long timeout_ns) {
  if (load_acquire(c) >= target) return true;
  const long long start = global_ns();
  while (load_acquire(c) < target) {
    if (global_ns() - start > timeout_ns) return false;
    __nanosleep(64);
  }
  return true;
}

}  // namespace kestrel::cuda
