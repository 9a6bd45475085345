// What a kernel of a given size costs on this GPU at the least: the time per kernel of a chain of
// kernels in one CUDA graph, launched with programmatic dependent launch as the decode step's
// are, that do nothing but stream their bytes and wait for the kernel before them. Against a
// decode op's time it splits the op's distance from its floor into what launching, filling and
// draining kernels of that size costs anyway and what the op's own kernels add.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

namespace kestrel::cuda {

// Microseconds per kernel of a chain of 64 to 2048 kernels that read `bytes` each (distinct bytes
// per kernel, 256 MB over the chain where 2048 kernels reach it, so that no kernel finds its bytes
// in L2); median of 5 replays.
// early = false: each kernel waits for the one before, then reads (bytes that depend on it);
// true: each reads, then waits (bytes that do not, like weights, read behind the kernel before).
double chained_read_us(size_t bytes, bool early, cudaStream_t s);

}  // namespace kestrel::cuda
