// The persistent step's counters: a tile advances its counter once its writes are visible
// (release at GPU scope); a consumer's thread 0 spins until the counter reaches the step's
// target (relaxed polls, then an acquire fence), then the block passes a barrier before it reads. Counters only count up:
// the target of step e (from 0) is (e + 1) x producers. A wait that runs past the timeout
// records its instruction and gives up, so a wrong plan fails with a name instead of a hang.
#pragma once
#include <cstdint>

namespace kestrel::cuda {

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

__device__ __forceinline__ uint32_t load_relaxed(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// By thread 0: waits until *c >= target; false when the timeout passed first. The polls are
// relaxed and one acquire fence follows the poll that saw the target (the fence after a relaxed
// read of a release is an acquire pattern): ld.acquire empties the L1 (CCTL.IVALL) on every
// poll, hundreds of times per wait (docs/PERF.md v32).
__device__ __forceinline__ bool wait_counter(const uint32_t* c, uint32_t target, long long timeout_ns) {
  if (load_relaxed(c) < target) {
    const long long start = global_ns();
    while (load_relaxed(c) < target) {
      if (global_ns() - start > timeout_ns) return false;
      __nanosleep(64);
    }
  }
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
  return true;
}

}  // namespace kestrel::cuda
