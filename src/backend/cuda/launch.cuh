// Kernel launches with programmatic dependent launch (PDL, Hopper): a kernel's blocks start while
// the previous kernel in the stream is still running, prefetch the weights they will read, and
// wait in pdl_enter() until the previous kernel has finished and its writes are visible. Inside
// a captured decode step this hides each launch's ramp-up behind its predecessor.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "backend/cuda/check.h"
#include "common/env.h"

namespace kestrel::cuda {

// KESTREL_PDL=0 launches every kernel plainly (for A/B measurement).
inline bool pdl_enabled() {
  static const bool on = env_switch("KESTREL_PDL");
  return on;
}

// Streaming multiprocessors of the current device (the first call's device: the GPUs of one
// split model are alike). Grids are sized against it.
inline int sm_count() {
  static const int n = [] {
    int dev = 0, v = 0;
    KESTREL_CUDA_CHECK(cudaGetDevice(&dev));
    KESTREL_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
    return v;
  }();
  return n;
}

// Every kernel launched through launch() calls this before it touches memory that another
// kernel writes or reads (anything but weights): it waits for the previous kernel, then lets the
// next one start. Without PDL both instructions are no-ops. Waiting before triggering keeps at
// most one kernel waiting behind a running one, so a waiting kernel never holds SMs that the
// running kernel's unscheduled blocks need.
__device__ __forceinline__ void pdl_enter() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Prefetches [p, p + bytes) into L2, one 128-byte line per thread of the block at a time.
__device__ __forceinline__ void prefetch_bytes_l2(const void* p, size_t bytes) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(127);
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + bytes;
  for (uintptr_t a = begin + uintptr_t(threadIdx.x) * 128; a < end; a += uintptr_t(blockDim.x) * 128)
    prefetch_l2(reinterpret_cast<const void*>(a));
}

// f(std::integral_constant<int, B>) for a batch B of 1 to 8: kernels templated on their token count.
template <typename F>
void by_batch(int batch, F&& f) {
  switch (batch) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    default: fail("internal: batch ", batch, " outside 1..8");
  }
}

// cudaLaunchKernelEx of kernel<<<grid, block, smem, s>>>(args...) in clusters of *cluster blocks
// (null: none), with PDL when `pdl` and PDL is enabled and the stream is not the legacy default one.
template <typename... KArgs, typename... Args>
void launch_ex(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, bool pdl,
               const dim3* cluster, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (cluster) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster->x;
    attr[n].val.clusterDim.y = cluster->y;
    attr[n].val.clusterDim.z = cluster->z;
    ++n;
  }
  if (pdl && s != nullptr && pdl_enabled()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = n ? attr : nullptr;
  cfg.numAttrs = n;
  KESTREL_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

// One cooperative launch of kernel<<<blocks, threads, smem, s>>>(arg): every block resident at
// once, or the launch fails (the persistent steps' blocks wait for each other; one waiting for a
// block that is not scheduled would wait forever).
template <typename Arg>
void launch_cooperative(void (*kernel)(Arg), int blocks, int threads, size_t smem, cudaStream_t s, const Arg& arg) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(blocks));
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  KESTREL_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, arg));
}

// Launches kernel<<<grid, block, smem, s>>>(args...), with PDL when `pdl` (see launch_ex).
template <typename... KArgs, typename... Args>
void launch_pdl(bool pdl, void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                Args&&... args) {
  launch_ex(kernel, grid, block, smem, s, pdl, nullptr, std::forward<Args>(args)...);
}

// The largest thread block cluster launches may use: 16 (non-portable) unless lowered. The graph
// profiler captures its step with 8, since the driver refuses to re-enable a disabled graph node
// of a larger cluster (cudaGraphNodeSetEnabled: "cluster misconfiguration").
inline int& cluster_limit() {
  static int v = 16;
  return v;
}
// Set when a launch took a smaller cluster than it would have without the limit.
inline bool& cluster_lowered() {
  static bool v = false;
  return v;
}

// launch() in thread block clusters of `cluster` blocks (Hopper; more than 8 need the kernel's
// non-portable cluster size allowed, which this sets), with PDL as launch() does.
template <typename... KArgs, typename... Args>
void launch_cluster(void (*kernel)(KArgs...), dim3 grid, dim3 cluster, dim3 block, size_t smem, cudaStream_t s,
                    Args&&... args) {
  if (cluster.x * cluster.y * cluster.z > 8)
    KESTREL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  launch_ex(kernel, grid, block, smem, s, true, &cluster, std::forward<Args>(args)...);
}

// The largest cluster (16, 8, 4, 2 or 1 blocks) the device schedules for `kernel` launched with
// `block` threads and `smem` bytes of dynamic shared memory, within cluster_limit(); 0 below Hopper.
template <typename... KArgs>
int max_cluster_blocks(void (*kernel)(KArgs...), dim3 block, size_t smem) {
  int dev = 0, major = 0;
  KESTREL_CUDA_CHECK(cudaGetDevice(&dev));
  KESTREL_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  if (major < 9) return 0;
  KESTREL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(16);
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  int most = 0;
  if (cudaOccupancyMaxPotentialClusterSize(&most, kernel, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  int n = 1;
  while (n < 16 && 2 * n <= most) n *= 2;
  return n;
}

// Clusters of `size` blocks of `kernel` (launched with `block` threads and `smem` bytes of dynamic
// shared memory) the device holds at once; 0 where it cannot launch them (below Hopper).
template <typename... KArgs>
int active_clusters(void (*kernel)(KArgs...), dim3 block, size_t smem, int size) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(size));
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = unsigned(size), attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
  cfg.attrs = &attr, cfg.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

// The cluster barrier in two halves: arrive (no ordering) early, and wait before the first store
// into another block's shared memory, which is allowed only once every block has started.
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }
// A full cluster barrier: every block's shared-memory stores before it are seen by every block after it.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The usual launch: with PDL.
template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, Args&&... args) {
  launch_pdl(true, kernel, grid, block, smem, s, std::forward<Args>(args)...);
}

}  // namespace kestrel::cuda
