// What a decode step built as one cooperative kernel of barrier-separated stages costs when every
// stage does nothing but read its bytes: the structural floor of a "stage" persistent step (calm's
// shape: every block takes an even share of each op, a grid barrier where an edge is all-to-all),
// to set beside the launched step's read chains (docs/PERF.md v27: 340 kernels, 0.905 ms) before
// any real op is written into it.
//
// The stages of one Qwen3-30B-A3B NVFP4 layer at one token (bytes from src/plan/decode_cost.cpp's
// shapes): norm + q/k/v 5.90 MB, attention over 1024 BF16 positions 2.10 MB, the splits' combine
// (nothing), o + residual 4.72 MB, norm + router 0.52 MB, route + the 8 experts' gate/up 14.16 MB,
// down + residual 7.08 MB; 48 layers, then the LM head's 622 MB. The experts' addresses come from
// a route read after the router's barrier (8 of 16 experts per layer, changing every step), so
// nothing can fetch them earlier; down's are known from then on.
//
// Variants (every block's share of a stage contiguous, 16-byte loads, 8 in flight per thread):
//   barriers   the barriers alone (no bytes)
//   stream     the bytes alone, no barriers (the read loop's rate at this occupancy)
//   read       each stage reads after its barrier
//   l2         + each stage's share asked of the L2 (cp.async.bulk.prefetch.L2) as soon as its
//              addresses are known: the fixed weights one stage ahead, down with the route
//   smem       + instead copied into shared memory (cp.async.bulk, two slots), read from there
//   regs       each thread's first eight loads of a stage issued before the stage's barrier
//              (all but gate/up, whose addresses come from the route), the rest after it
//   ring       weights never wait for activations: one producer thread (warp 15) walks the
//              block's shares of every stage in order and bulk-copies them in pages of 16 KB into
//              a ring of 12 (full/empty mbarriers), running ahead across barriers and layers as far
//              as the ring allows; gate/up's (and down's) only once the consumers have passed the
//              barrier before gate/up (the route is known there). The other 15 warps pass the
//              grid barriers (a named barrier of 480 threads inside the block) and read the pages.
//   ringstream the ring without the grid barriers (what the bulk copies alone stream at)
//   ringbig    the ring in 6 pages of 32 KB
//   tworings   two rings, one for the fixed weights (5 pages) and one for the routed experts' (8):
//              the producer never waits on one while the other has room, so the next layers'
//              fixed weights stream while a route is pending, and the experts' the moment it is
//              known (the ring's in-order copying is what held `ring` back, v37).
//   math1/8    tworings whose consumers do a product stage's arithmetic on the pages: every
//              16-byte unit as 32 NVFP4 weights dotted with 1 or 8 activation rows in shared
//              memory (can the consumers keep up with the stream at batch 1 and 8?)
//   mma1/8     the same on tensor cores, as slot_mma.cuh computes one token's or eight tokens'
//              products: each page as 16 rows of 1 KB (K = 2048), a warp per 128-weight chunk of
//              the 16 rows (two 16-byte loads per lane), 16 MMAs per chunk on hi + lo FP16 parts of
//              the activations (fragment rows in shared memory: one token's, or lane g token g's)
// Usage: grid_stages_lab [threads] [steps]     (512 threads per block, one block per SM; 20 steps)
//
// Measured (H100 80 GB HBM3, copy bandwidth 3.01 TB/s, floor 0.756 ms, 2026-12-07; docs/PERF.md
// v36): barriers alone 0.497 ms (1.48 us each); the bytes alone, no barriers, 0.878 ms (2.59
// TB/s, 1.16x the floor); read after each barrier 1.558 ms (2.06x); l2 1.655 ms; smem 2.220 ms.
// A first version whose small shares went one load at a time per thread: 1.131 / 1.804 / 1.826 /
// 2.495 ms. On an H200 (4.28 TB/s, floor 0.532 ms, v37): barriers 0.398 ms (1.18 us each), stream
// 0.646, read 1.274 (2.39x), l2 1.400, smem 1.804, regs 1.247, ring 1.215 (2.28x). On an H100
// (3.04 TB/s, floor 0.748 ms): barriers 0.507, stream 0.813, read 1.498, regs 1.480, ring 1.577,
// ringstream 0.786 (1.05x), ringbig 1.508. The same H100 later (docs/PERF.md v39, floor 0.752):
// tworings 1.618 (2.15x: its pages issued ~20 us ahead, yet 1.5 us to read after each barrier),
// math1 5.551, math8 37.07, mma1 2.224, mma8 2.266.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "backend/cuda/dequant.cuh"
#include "backend/cuda/slot_mma.cuh"

#define CHECK(x)                                                    \
  do {                                                              \
    cudaError_t e_ = (x);                                           \
    if (e_ != cudaSuccess) {                                        \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                 \
    }                                                               \
  } while (0)

constexpr int kLayers = 48, kStages = 7, kPool = 16, kTopK = 8;
constexpr uint32_t kSlotBytes = 110 * 1024;  // two slots of shared memory
enum Kind { kFixed, kGateUp, kDown, kNone };
enum Mode { kBarriers, kStream, kRead, kL2, kSmem, kRegs, kRing, kRingStream, kRingBig, kTwoRings, kMath1, kMath8, kMma1, kMma8 };

struct Stage {
  const uint8_t* base;  // layer l's bytes at base + l * layer_stride
  size_t bytes;         // read per layer (for routed stages: per expert x kTopK)
  size_t layer_stride;
  int kind;
};
struct Lab {
  Stage st[kStages];
  const uint8_t* head;
  size_t head_bytes;
  const int* route;     // [steps][layers][kTopK] expert of the pool
  unsigned* counter;    // the barrier's, counts up across launches
  unsigned long long* sink;
  int mode, step;
  uint32_t page_bytes;  // ring modes
  int pages;
  // When set (the two-ring modes): per block and stage, the global timer before the consumers'
  // barrier, after it, when warp 0 has read the stage's pages, when the producer issued the
  // stage's first and last page, and (tworings) how long thread 0 waited for its pages to land
  // and when it had the stage's pieces (their addresses) after the barrier.
  unsigned long long* trace;
};

constexpr int kTraceWords = 7;  // per block and stage (Lab::trace)

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// A grid barrier that counts up forever: target = (barriers passed so far + 1) x blocks.
__device__ __forceinline__ void grid_barrier(unsigned* c, unsigned target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(c) : "memory");
    unsigned v;
    do asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(c) : "memory");
    while (int(v - target) < 0);
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
  }
  __syncthreads();
}

// Block b's share [lo, hi) of n bytes, 16-byte aligned.
__device__ __forceinline__ void share(size_t n, size_t& lo, size_t& hi) {
  const size_t units = n / 16, per = (units + gridDim.x - 1) / gridDim.x;
  lo = min(units, per * blockIdx.x) * 16, hi = min(units, per * (blockIdx.x + 1)) * 16;
}

// The pieces of a stage's share: one for fixed weights, up to two experts' for routed ones.
struct Piece {
  const uint8_t* p;
  uint32_t n;
};
__device__ int pieces(const Lab& L, int s, int layer, const int* route, Piece out[2]) {
  const Stage& S = L.st[s];
  if (S.kind == kNone) return 0;
  size_t lo, hi;
  share(S.kind == kFixed ? S.bytes : S.bytes * kTopK, lo, hi);
  if (lo >= hi) return 0;
  if (S.kind == kFixed) {
    out[0] = {S.base + size_t(layer) * S.layer_stride + lo, uint32_t(hi - lo)};
    return 1;
  }
  int k = 0;
  for (size_t at = lo; at < hi && k < 2;) {
    const size_t e = at / S.bytes, end = min(hi, (e + 1) * S.bytes);
    const int x = route[layer * kTopK + int(e)];
    out[k++] = {S.base + size_t(layer) * S.layer_stride + size_t(x) * S.bytes + (at - e * S.bytes), uint32_t(end - at)};
    at = end;
  }
  return k;
}

// skip: units of the first piece already read (kRegs: before the barrier).
__device__ __forceinline__ uint4 read_global(const Piece* ps, int n, int skip = 0) {
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (int k = 0; k < n; ++k) {
    const uint4* p = reinterpret_cast<const uint4*>(ps[k].p);
    const int units = int(ps[k].n / 16);
    // Eight loads in flight per thread, predicated: a small share (a few loads per thread) must
    // not take one memory latency per load.
    for (int i0 = threadIdx.x + (k == 0 ? skip : 0); i0 < units; i0 += 8 * blockDim.x) {
      uint4 v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int i = i0 + u * int(blockDim.x);
        v[u] = i < units ? __ldcs(p + i) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) acc.x ^= v[u].x, acc.y ^= v[u].y, acc.z ^= v[u].z, acc.w ^= v[u].w;
    }
  }
  return acc;
}

// The first eight loads per thread of a piece (what read_global's first round reads) into v.
__device__ __forceinline__ void load_first(const Piece& pc, uint4 (&v)[8]) {
  const uint4* p = reinterpret_cast<const uint4*>(pc.p);
  const int units = int(pc.n / 16);
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    const int i = threadIdx.x + u * int(blockDim.x);
    v[u] = i < units ? __ldcs(p + i) : make_uint4(0, 0, 0, 0);
  }
}

// Bulk copies of a stage's pieces into a slot, completing on its mbarrier (thread 0).
__device__ bool copy_to_slot(const Piece* ps, int n, uint8_t* slot, uint64_t* bar) {
  uint32_t total = 0;
  for (int k = 0; k < n; ++k) total += ps[k].n;
  if (total == 0 || total > kSlotBytes) return false;
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the slot was last read by plain loads
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(total) : "memory");
  uint32_t off = 0;
  for (int k = 0; k < n; ++k) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_addr(slot + off)),
                 "l"(ps[k].p), "r"(ps[k].n), "r"(smem_addr(bar))
                 : "memory");
    off += ps[k].n;
  }
  return true;
}

__device__ __forceinline__ void wait_slot(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}" ::"r"(
          smem_addr(bar)),
      "r"(parity)
      : "memory");
}

extern __shared__ __align__(128) uint8_t smem[];

__global__ void stages_kernel(const Lab L) {
  __shared__ uint64_t bars[2];
  __shared__ int in_slot[2];
  __shared__ uint32_t parity[2];
  const int* route = L.route + size_t(L.step) * kLayers * kTopK;
  const unsigned blocks = gridDim.x;
  unsigned passed = unsigned(L.step) * (kLayers * kStages);  // barriers of earlier steps
  if (threadIdx.x == 0) {
    for (int i = 0; i < 2; ++i) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bars[i])) : "memory");
      in_slot[i] = -1, parity[i] = 0;
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  uint4 acc = make_uint4(0, 0, 0, 0);
  const bool early = L.mode == kL2 || L.mode == kSmem;
  // Asks for global stage g's bytes (layer g / kStages) by the chosen means, when known.
  auto ask = [&](int g) {
    if (threadIdx.x != 0 || g >= kLayers * kStages) return;
    const int layer = g / kStages, s = g % kStages;
    Piece ps[2];
    const int n = pieces(L, s, layer, route, ps);
    if (L.mode == kL2) {
      for (int k = 0; k < n; ++k)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(ps[k].p), "r"(ps[k].n) : "memory");
    } else if (copy_to_slot(ps, n, smem + (g & 1) * kSlotBytes, &bars[g & 1])) {
      in_slot[g & 1] = g;
    }
  };
  if (early) ask(0);
  for (int g = 0; g < kLayers * kStages; ++g) {
    const int layer = g / kStages, s = g % kStages;
    // The next stage's fixed weights before this one's wait; down's once the route is known (the
    // gate/up stage has passed its wait).
    if (early && g + 1 < kLayers * kStages && L.st[(g + 1) % kStages].kind == kFixed) ask(g + 1);
    // kRegs: the stage's first loads into registers before its barrier, where its addresses are
    // known (all but gate/up's), so the barrier's wait and the loads' latency overlap.
    uint4 pre[8];
    const bool have = L.mode == kRegs && L.st[s].kind != kGateUp && L.st[s].kind != kNone;
    if (have) {
      Piece ps[2];
      if (pieces(L, s, layer, route, ps) > 0) load_first(ps[0], pre);
      else for (int u = 0; u < 8; ++u) pre[u] = make_uint4(0, 0, 0, 0);
    }
    if (L.mode != kStream && g > 0) grid_barrier(L.counter, (passed += 1) * blocks);
    if (early && L.st[s].kind == kGateUp) ask(g), ask(g + 1);
    if (L.mode == kBarriers) continue;
    if (L.mode == kSmem && in_slot[g & 1] == g) {
      wait_slot(&bars[g & 1], parity[g & 1]);
      const uint4* p = reinterpret_cast<const uint4*>(smem + (g & 1) * kSlotBytes);
      Piece ps[2];
      const int n = pieces(L, s, layer, route, ps);
      uint32_t units = 0;
      for (int k = 0; k < n; ++k) units += ps[k].n / 16;
      for (uint32_t i = threadIdx.x; i < units; i += blockDim.x) {
        const uint4 v = p[i];
        acc.x ^= v.x, acc.y ^= v.y, acc.z ^= v.z, acc.w ^= v.w;
      }
      __syncthreads();
      if (threadIdx.x == 0) in_slot[g & 1] = -1, parity[g & 1] ^= 1;
      __syncthreads();
    } else {
      Piece ps[2];
      const int n = pieces(L, s, layer, route, ps);
      const uint4 a = read_global(ps, n, have ? 8 * int(blockDim.x) : 0);
      acc.x ^= a.x, acc.y ^= a.y, acc.z ^= a.z, acc.w ^= a.w;
      if (have)
        for (int u = 0; u < 8; ++u) acc.x ^= pre[u].x, acc.y ^= pre[u].y, acc.z ^= pre[u].z, acc.w ^= pre[u].w;
    }
  }
  if (L.mode != kBarriers) {
    if (L.mode != kStream) grid_barrier(L.counter, (passed += 1) * blocks);
    size_t lo, hi;
    share(L.head_bytes, lo, hi);
    const Piece hp{L.head + lo, uint32_t(hi - lo)};
    const uint4 a = read_global(&hp, 1);
    acc.x ^= a.x, acc.y ^= a.y, acc.z ^= a.z, acc.w ^= a.w;
  } else {
    grid_barrier(L.counter, (passed += 1) * blocks);
  }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9e3779b9u) atomicAdd(L.sink, 1ull);  // the loads live
}

// ---- ring: a producer thread ahead of the consumers (see the header) ----
constexpr int kPages = 12;
constexpr uint32_t kPageBytes = 16 * 1024;
constexpr int kConsumerWarps = 15;

// The consumers' grid barrier: bar.sync 1 over their 480 threads instead of __syncthreads (the
// producer warp never joins it).
__device__ __forceinline__ void consumer_barrier(unsigned* c, unsigned target) {
  asm volatile("bar.sync 1, %0;" ::"n"(kConsumerWarps * 32) : "memory");
  if (threadIdx.x == 0) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(c) : "memory");
    unsigned v;
    do asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(c) : "memory");
    while (int(v - target) < 0);
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
  }
  asm volatile("bar.sync 1, %0;" ::"n"(kConsumerWarps * 32) : "memory");
}

// The block's pieces of stage g (g == kLayers * kStages: its share of the LM head).
__device__ int stage_pieces(const Lab& L, const int* route, int g, Piece out[2]) {
  if (g < kLayers * kStages) return pieces(L, g % kStages, g / kStages, route, out);
  size_t lo, hi;
  share(L.head_bytes, lo, hi);
  if (lo >= hi) return 0;
  out[0] = {L.head + lo, uint32_t(hi - lo)};
  return 1;
}

// Calls f(p, n) for the block's chunks of stage g (g == kLayers * kStages: the LM head), in the
// order the producer copies them and the consumers read them.
// The pieces' loop is unrolled so that ps stays in registers (a dynamically indexed array goes
// to the stack: local memory, an L2 round trip when L1 does not hold it).
template <class F>
__device__ __forceinline__ void for_pieces(const Piece (&ps)[2], int n, uint32_t page_bytes, F&& f) {
#pragma unroll
  for (int k = 0; k < 2; ++k)
    if (k < n)
      for (uint32_t at = 0; at < ps[k].n; at += page_bytes) f(ps[k].p + at, min(page_bytes, ps[k].n - at));
}
template <class F>
__device__ __forceinline__ void for_chunks(const Lab& L, const int* route, int g, F&& f) {
  Piece ps[2];
  const int n = stage_pieces(L, route, g, ps);
  for_pieces(ps, n, L.page_bytes, f);
}

// A ring's pages: full (the producer's copy landed, count 1 + bytes) and empty (each consumer
// warp is done with it); thread 0 initializes them.
__device__ void init_pages(uint64_t* full, uint64_t* empty, int n) {
  for (int i = 0; i < n; ++i) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&full[i])) : "memory");
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(&empty[i])), "r"(kConsumerWarps) : "memory");
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// The producer: n bytes from src into a page, landing on its full barrier.
__device__ __forceinline__ void copy_page(uint8_t* page, const uint8_t* src, uint32_t n, uint64_t* full) {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the page was last read by plain loads
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(full)), "r"(n) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(page)),
               "l"(src), "r"(n), "r"(smem_addr(full))
               : "memory");
}

// A consumer: waits for the page's copy, reads its n bytes into acc, and gives the page back.
__device__ __forceinline__ void read_page(const uint8_t* page, uint32_t n, uint64_t* full, uint32_t parity,
                                          uint64_t* empty, uint4& acc) {
  wait_slot(full, parity);
  const uint4* q = reinterpret_cast<const uint4*>(page);
  for (uint32_t u = threadIdx.x; u < n / 16; u += kConsumerWarps * 32) {
    const uint4 v = q[u];
    acc.x ^= v.x, acc.y ^= v.y, acc.z ^= v.z, acc.w ^= v.w;
  }
  __syncwarp();
  if ((threadIdx.x & 31) == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(empty)) : "memory");
}

__global__ void ring_kernel(const Lab L) {
  __shared__ uint64_t full[kPages], empty[kPages];
  __shared__ volatile int routed;  // the last gate/up stage whose barrier the consumers passed
  const int* route = L.route + size_t(L.step) * kLayers * kTopK;
  const unsigned blocks = gridDim.x;
  unsigned passed = unsigned(L.step) * (kLayers * kStages);
  if (threadIdx.x == 0) init_pages(full, empty, kPages), routed = -1;
  __syncthreads();
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  const int G = kLayers * kStages;
  if (warp == kConsumerWarps) {  // the producer
    if (lane != 0) return;
    int i = 0;
    for (int g = 0; g <= G; ++g) {
      if (g < G && L.st[g % kStages].kind == kGateUp)
        while (routed < g) __nanosleep(64);  // the route comes after gate/up's barrier
      for_chunks(L, route, g, [&](const uint8_t* p, uint32_t n) {
        const int page = i % L.pages, round = i / L.pages;
        if (round > 0) wait_slot(&empty[page], uint32_t(round - 1) & 1);
        copy_page(smem + size_t(page) * L.page_bytes, p, n, &full[page]);
        ++i;
      });
    }
    return;
  }
  uint4 acc = make_uint4(0, 0, 0, 0);
  int i = 0;
  for (int g = 0; g <= G; ++g) {
    if (g > 0 && L.mode != kRingStream) consumer_barrier(L.counter, (passed += 1) * blocks);
    if (g < G && L.st[g % kStages].kind == kGateUp && threadIdx.x == 0) routed = g;
    for_chunks(L, route, g, [&](const uint8_t*, uint32_t n) {
      const int page = i % L.pages;
      read_page(smem + size_t(page) * L.page_bytes, n, &full[page], uint32_t(i / L.pages) & 1, &empty[page], acc);
      ++i;
    });
  }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9e3779b9u) atomicAdd(L.sink, 1ull);
}

// ---- two rings: fixed weights and routed experts' apart (see the header) ----
constexpr int kFixedPages = 5, kRoutedPages = 8;

__device__ __forceinline__ bool routed_kind(int kind) { return kind == kGateUp || kind == kDown; }

// The next stage after g whose chunks go to this ring (the fixed ring ends with the LM head, G);
// -1 when none is left.
__device__ int next_stage(const Lab& L, int g, bool routed) {
  const int G = kLayers * kStages;
  for (int h = g + 1; h < G; ++h) {
    const int kind = L.st[h % kStages].kind;
    if (kind != kNone && routed_kind(kind) == routed) return h;
  }
  return !routed && g < G ? G : -1;
}

// Where the producer is in one ring's sequence of chunks.
struct Cursor {
  int g = -1, n = 0, k = 0;  // stage, its pieces, the piece
  uint32_t at = 0;           // offset in the piece
  bool loaded = false;
  Piece ps[2];
};

__device__ void load_stage(const Lab& L, const int* route, Cursor& c) {
  c.n = stage_pieces(L, route, c.g, c.ps);
  c.k = 0, c.at = 0, c.loaded = true;
}

// Moves past stages without chunks; false when the ring's sequence is done or (routed) its next
// stage's route is not known yet.
__device__ bool ready_chunk(const Lab& L, const int* route, Cursor& c, bool routed, int known) {
  while (c.g >= 0) {
    if (!c.loaded) {
      if (routed && known < (L.st[c.g % kStages].kind == kDown ? c.g - 1 : c.g)) return false;
      load_stage(L, route, c);
    }
    while (c.k < c.n && c.at >= c.ps[c.k].n) ++c.k, c.at = 0;
    if (c.k < c.n) return true;
    c.g = next_stage(L, c.g, routed), c.loaded = false;
  }
  return false;
}

__device__ __forceinline__ bool mbar_test(uint64_t* bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
      : "=r"(ok)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return ok != 0;
}

// The consumers of the two rings. B = 0: they read the pages (xor); B = 1 or 8: they do what a
// product stage does with them, each 16-byte unit taken as 32 NVFP4 weights (one scale word per
// unit, constant) dotted with B activation rows of kMathX floats in shared memory, so the
// dequantization and FMAs at batch 1 and 8 are timed against the stream.
constexpr int kMathX = 512;
// The two-ring kernel's dynamic shared memory: both rings' pages, then 8 activation rows.
constexpr int kTwoRingsSmem = (kFixedPages + kRoutedPages) * kPageBytes + 8 * kMathX * 4;
template <int B, bool kMma = false>
__device__ void two_rings_consume(const Lab& L, const int* route, uint64_t* full, uint64_t* empty,
                                  volatile int& routed, unsigned passed) {
  constexpr int kAll = kFixedPages + kRoutedPages;
  const unsigned blocks = gridDim.x;
  const int G = kLayers * kStages;
  float* x = reinterpret_cast<float*>(smem + size_t(kAll) * kPageBytes);
  if (B > 0) {
    for (int i = threadIdx.x; i < B * kMathX; i += kConsumerWarps * 32) x[i] = 1e-3f * float(i % 97);
    asm volatile("bar.sync 1, %0;" ::"n"(kConsumerWarps * 32) : "memory");
  }
  uint4 acc = make_uint4(0, 0, 0, 0);
  float facc[B > 0 ? B : 1];
  for (int b = 0; b < (B > 0 ? B : 1); ++b) facc[b] = 0.0f;
  const kestrel::cuda::NvRows mat[1] = {{nullptr, nullptr, 1.0f, 0}};
  int taken_fixed = 0, taken_routed = 0;  // scalars, not an array indexed by the ring (the stack)
  unsigned long long landed_wait = 0;
  for (int g = 0; g <= G; ++g) {
    unsigned long long* tr = L.trace && threadIdx.x == 0 ? L.trace + (size_t(blockIdx.x) * (G + 1) + g) * kTraceWords : nullptr;
    if (tr) tr[0] = global_ns();
    if (g > 0) consumer_barrier(L.counter, (passed += 1) * blocks);
    if (tr) tr[1] = global_ns();
    const int kind = g < G ? L.st[g % kStages].kind : kFixed;
    if (kind == kGateUp && threadIdx.x == 0) routed = g;
    const int r = routed_kind(kind) ? 1 : 0;
    const int pages = r ? kRoutedPages : kFixedPages, base = r ? kFixedPages : 0;
    Piece ps[2];
    const int np = stage_pieces(L, route, g, ps);
    if (tr) tr[6] = global_ns();
    for_pieces(ps, np, L.page_bytes, [&](const uint8_t*, uint32_t n) {
      const int taken = r ? taken_routed : taken_fixed;
      const int page = base + taken % pages;
      uint8_t* pg = smem + size_t(page) * kPageBytes;
      if constexpr (B == 0) {
        if (tr) {  // thread 0's time waiting for the page to land, apart from reading it
          const unsigned long long t = global_ns();
          wait_slot(&full[page], uint32_t(taken / pages) & 1);
          landed_wait += global_ns() - t;
        }
        read_page(pg, n, &full[page], uint32_t(taken / pages) & 1, &empty[page], acc);
      } else if constexpr (kMma) {
        wait_slot(&full[page], uint32_t(taken / pages) & 1);
        const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31, g = lane >> 2, j = lane & 3;
        const uint4* q = reinterpret_cast<const uint4*>(pg);
        const uint32_t* xf = reinterpret_cast<const uint32_t*>(x) + (B == 8 ? g : 0) * kMathX;
        // A full page: 16 rows of 1 KB, chunk c of rows g and g + 8 at words 64 row + 4 c + j; a
        // stage's last, partial page: its whole KBs as chunks of 16 rows x 64 bytes.
        const bool whole = n == kPageBytes;
        for (int c = warp; c < int(n / 1024); c += kConsumerWarps) {
          kestrel::cuda::SlotChunk ch;
          ch.qa = whole ? q[g * 64 + 4 * c + j] : q[c * 64 + g * 4 + j];
          ch.qb = whole ? q[(g + 8) * 64 + 4 * c + j] : q[c * 64 + (g + 8) * 4 + j];
          ch.sa = ch.sb = 0x3838u;
          float a4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          kestrel::cuda::slot_chunk_mma(ch, xf, c % (kMathX / 128), j, a4);
          facc[0] += a4[0] + a4[2];
        }
        __syncwarp();
        if ((threadIdx.x & 31) == 0)
          asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(&empty[page])) : "memory");
      } else {
        wait_slot(&full[page], uint32_t(taken / pages) & 1);
        const uint4* q = reinterpret_cast<const uint4*>(pg);
        for (uint32_t u = threadIdx.x; u < n / 16; u += kConsumerWarps * 32) {
          const uint4 c[1] = {q[u]};
          const uint32_t sc[1] = {0x38383838u};
          float part[1][B];
          for (int b = 0; b < B; ++b) part[0][b] = 0.0f;
          kestrel::cuda::nvfp4_group_fma<1, 1, B>(mat, c, sc, x + (u % (kMathX / 32)) * 32, kMathX, part);
          for (int b = 0; b < B; ++b) facc[b] += part[0][b];
        }
        __syncwarp();
        if ((threadIdx.x & 31) == 0)
          asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(&empty[page])) : "memory");
      }
      if (r) ++taken_routed;
      else ++taken_fixed;
    });
    if (tr) tr[2] = global_ns(), tr[5] = landed_wait, landed_wait = 0;
  }
  float f = 0.0f;
  for (int b = 0; b < (B > 0 ? B : 1); ++b) f += facc[b];
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9e3779b9u || f == 1234.5f) atomicAdd(L.sink, 1ull);
}

__global__ void two_rings_kernel(const Lab L) {
  constexpr int kAll = kFixedPages + kRoutedPages;
  __shared__ uint64_t full[kAll], empty[kAll];  // fixed ring's pages first
  __shared__ volatile int routed;
  const int* route = L.route + size_t(L.step) * kLayers * kTopK;
  const unsigned passed = unsigned(L.step) * (kLayers * kStages);
  if (threadIdx.x == 0) init_pages(full, empty, kAll), routed = -1;
  __syncthreads();
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  if (warp == kConsumerWarps) {  // the producer: whichever ring has room and a chunk, routed first
    if (lane != 0) return;
    Cursor c[2];
    int issued[2] = {0, 0};
    c[0].g = next_stage(L, -1, false), c[1].g = next_stage(L, -1, true);
    while (c[0].g >= 0 || c[1].g >= 0) {
      bool any = false;
      for (int r = 1; r >= 0; --r) {
        const int pages = r ? kRoutedPages : kFixedPages, base = r ? kFixedPages : 0;
        if (!ready_chunk(L, route, c[r], r == 1, routed)) continue;
        const int page = issued[r] % pages, round = issued[r] / pages;
        if (round > 0 && !mbar_test(&empty[base + page], uint32_t(round - 1) & 1)) continue;
        const uint32_t n = min(kPageBytes, c[r].ps[c[r].k].n - c[r].at);
        copy_page(smem + size_t(base + page) * kPageBytes, c[r].ps[c[r].k].p + c[r].at, n, &full[base + page]);
        if (L.trace) {
          unsigned long long* t = L.trace + (size_t(blockIdx.x) * (kLayers * kStages + 1) + c[r].g) * kTraceWords;
          const unsigned long long now = global_ns();
          if (c[r].at == 0 && c[r].k == 0) t[3] = now;
          t[4] = now;
        }
        c[r].at += n, ++issued[r], any = true;
      }
      if (!any) __nanosleep(32);
    }
    return;
  }
  if (L.mode == kMath1) two_rings_consume<1>(L, route, full, empty, routed, passed);
  else if (L.mode == kMath8) two_rings_consume<8>(L, route, full, empty, routed, passed);
  else if (L.mode == kMma1) two_rings_consume<1, true>(L, route, full, empty, routed, passed);
  else if (L.mode == kMma8) two_rings_consume<8, true>(L, route, full, empty, routed, passed);
  else two_rings_consume<0>(L, route, full, empty, routed, passed);
}

// One more step of a two-ring mode with the trace on: per stage of a layer, the consumers' mean
// wait at the barrier before it and their time reading its pages (warp 0's), over blocks and
// layers, in microseconds.
void print_trace(Lab L, int sms, int mode, int step) {
  const int G = kLayers * kStages;
  const size_t n = size_t(sms) * (G + 1) * kTraceWords;
  unsigned long long* d = nullptr;
  CHECK(cudaMalloc(&d, n * 8));
  CHECK(cudaMemset(d, 0, n * 8));
  L.mode = mode, L.step = step, L.trace = d;
  void* args[] = {&L};
  CHECK(cudaLaunchCooperativeKernel(two_rings_kernel, dim3(sms), dim3((kConsumerWarps + 1) * 32), args, kTwoRingsSmem, 0));
  CHECK(cudaDeviceSynchronize());
  std::vector<unsigned long long> t(n);
  CHECK(cudaMemcpy(t.data(), d, n * 8, cudaMemcpyDeviceToHost));
  CHECK(cudaFree(d));
  const char* names[kStages + 1] = {"q/k/v", "attention", "combine", "o", "router", "gate/up", "down", "head"};
  double wait[kStages + 1] = {}, read[kStages + 1] = {}, ahead[kStages + 1] = {}, last[kStages + 1] = {},
         landed[kStages + 1] = {}, plan[kStages + 1] = {};
  for (int b = 0; b < sms; ++b)
    for (int g = 1; g <= G; ++g) {
      const unsigned long long* x = t.data() + (size_t(b) * (G + 1) + g) * kTraceWords;
      const int s = g < G ? g % kStages : kStages;
      wait[s] += double(x[1] - x[0]) / 1e3, read[s] += double(x[2] - x[1]) / 1e3;
      if (x[3]) ahead[s] += (double(x[1]) - double(x[3])) / 1e3, last[s] += (double(x[1]) - double(x[4])) / 1e3;
      landed[s] += double(x[5]) / 1e3;
      if (x[6]) plan[s] += double(x[6] - x[1]) / 1e3;
    }
  std::printf("    per stage, us (barrier wait / reading pages):");
  for (int s = 0; s <= kStages; ++s) {
    const double per = s < kStages ? double(sms) * kLayers : double(sms);
    std::printf(" %s %.2f/%.2f", names[s], wait[s] / per, read[s] / per);
  }
  if (mode == kTwoRings) {
    std::printf("\n    of the reading, the pieces' addresses / waiting for the pages to land (thread 0), us:");
    for (int s = 0; s <= kStages; ++s) {
      const double per = s < kStages ? double(sms) * kLayers : double(sms);
      std::printf(" %s %.2f/%.2f", names[s], plan[s] / per, landed[s] / per);
    }
  }
  std::printf("\n    first / last page issued this long before the stage's barrier passed, us:");
  for (int s = 0; s <= kStages; ++s) {
    const double per = s < kStages ? double(sms) * kLayers : double(sms);
    std::printf(" %s %.2f/%.2f", names[s], ahead[s] / per, last[s] / per);
  }
  std::printf("\n");
}

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each line as it comes, also into a pipe
  const int threads = argc > 1 ? std::atoi(argv[1]) : 512;
  const int steps = argc > 2 ? std::atoi(argv[2]) : 20;
  int sms = 0, coop = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, 0));
  if (!coop) return std::fprintf(stderr, "no cooperative launch\n"), 1;
  const double MB = 1e6;
  const size_t qkv = size_t(5120) * 2048 * 9 / 16, o = size_t(2048) * 4096 * 9 / 16, router = size_t(128) * 2048 * 2;
  const size_t kv = size_t(1024) * 4 * 128 * 2 * 2, gate_up = size_t(2) * 768 * 2048 * 9 / 16,
               down = size_t(2048) * 768 * 9 / 16, head = size_t(151936) * 2048 * 2;
  const size_t sizes[kStages] = {qkv, kv, 0, o, router, gate_up * kPool, down * kPool};
  const int kinds[kStages] = {kFixed, kFixed, kNone, kFixed, kFixed, kGateUp, kDown};
  Lab L{};
  size_t total = 0;
  for (int s = 0; s < kStages; ++s) {
    uint8_t* p = nullptr;
    const size_t n = std::max<size_t>(sizes[s], 16) * kLayers;
    CHECK(cudaMalloc(&p, n));
    CHECK(cudaMemset(p, s + 1, n));
    const size_t per = kinds[s] == kGateUp ? gate_up : kinds[s] == kDown ? down : sizes[s];
    L.st[s] = {p, per, std::max<size_t>(sizes[s], 16), kinds[s]};
    total += (kinds[s] == kFixed ? per : kinds[s] == kNone ? 0 : per * kTopK) * kLayers;
  }
  uint8_t* hp = nullptr;
  CHECK(cudaMalloc(&hp, head));
  CHECK(cudaMemset(hp, 9, head));
  L.head = hp, L.head_bytes = head;
  total += head;
  // Routes: kTopK distinct experts of the pool per layer, fresh every step.
  std::vector<int> routes(size_t(steps + 4) * kLayers * kTopK);  // + the traced step
  std::mt19937 rng(5);
  for (size_t i = 0; i < routes.size() / kTopK; ++i) {
    std::vector<int> e(kPool);
    for (int k = 0; k < kPool; ++k) e[k] = k;
    std::shuffle(e.begin(), e.end(), rng);
    std::copy(e.begin(), e.begin() + kTopK, routes.begin() + i * kTopK);
  }
  int* d_route;
  CHECK(cudaMalloc(&d_route, routes.size() * 4));
  CHECK(cudaMemcpy(d_route, routes.data(), routes.size() * 4, cudaMemcpyHostToDevice));
  L.route = d_route;
  CHECK(cudaMalloc(&L.counter, 4));
  CHECK(cudaMalloc(&L.sink, 8));
  // The copy bandwidth the floor is taken at (read + write of 4 GiB).
  const size_t cb = size_t(2) << 30;
  void *ca, *cbuf;
  CHECK(cudaMalloc(&ca, cb));
  CHECK(cudaMalloc(&cbuf, cb));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  CHECK(cudaMemcpy(cbuf, ca, cb, cudaMemcpyDeviceToDevice));
  float ms = 0;
  CHECK(cudaEventRecord(e0));
  for (int i = 0; i < 5; ++i) CHECK(cudaMemcpyAsync(cbuf, ca, cb, cudaMemcpyDeviceToDevice));
  CHECK(cudaEventRecord(e1));
  CHECK(cudaEventSynchronize(e1));
  CHECK(cudaEventElapsedTime(&ms, e0, e1));
  const double bw = 2.0 * cb * 5 / (ms * 1e-3);
  CHECK(cudaFree(ca));
  CHECK(cudaFree(cbuf));
  const double floor_ms = total / bw * 1e3;
  std::printf("%d SMs, %d threads per block; copy bandwidth %.2f TB/s; a step reads %.1f MB: floor %.3f ms\n", sms,
              threads, bw / 1e12, total / MB, floor_ms);
  std::printf("per layer: q/k/v %.2f, attention %.2f, o %.2f, router %.2f, gate/up %.2f, down %.2f MB; %d barriers\n",
              qkv / MB, kv / MB, o / MB, router / MB, gate_up * kTopK / MB, down * kTopK / MB, kLayers * kStages);
  CHECK(cudaFuncSetAttribute(stages_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(2 * kSlotBytes)));
  CHECK(cudaFuncSetAttribute(ring_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kPages * kPageBytes)));
  CHECK(cudaFuncSetAttribute(two_rings_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kTwoRingsSmem));
  const char* names[] = {"barriers", "stream", "read", "l2", "smem", "regs", "ring", "ringstream", "ringbig", "tworings",
                         "math1", "math8", "mma1", "mma8"};
  for (int mode : {kBarriers, kStream, kRead, kRingStream, kTwoRings, kMath1, kMath8, kMma1, kMma8}) {
    CHECK(cudaMemset(L.counter, 0, 4));
    std::vector<float> t;
    for (int step = 0; step < steps + 3; ++step) {
      L.mode = mode, L.step = step;
      void* args[] = {&L};
      CHECK(cudaEventRecord(e0));
      L.pages = mode == kRingBig ? 6 : kPages, L.page_bytes = mode == kRingBig ? 2 * kPageBytes : kPageBytes;
      if (mode >= kTwoRings)
        CHECK(cudaLaunchCooperativeKernel(two_rings_kernel, dim3(sms), dim3((kConsumerWarps + 1) * 32), args,
                                          kTwoRingsSmem, 0));
      else if (mode >= kRing)  // 16 warps: 15 consumers and the producer
        CHECK(cudaLaunchCooperativeKernel(ring_kernel, dim3(sms), dim3((kConsumerWarps + 1) * 32), args, kPages * kPageBytes, 0));
      else
        CHECK(cudaLaunchCooperativeKernel(stages_kernel, dim3(sms), dim3(threads), args, 2 * kSlotBytes, 0));
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      CHECK(cudaGetLastError());
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (step >= 3) t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    const double med = t[t.size() / 2];
    const int barriers = mode == kStream || mode == kRingStream ? 0 : kLayers * kStages;
    std::printf("  %-9s %7.3f ms (x%.2f floor)%s", names[mode], med, med / floor_ms, "");
    if (mode == kBarriers) std::printf("  %.2f us per barrier", med * 1e3 / barriers);
    else std::printf("  %.2f TB/s", total / (med * 1e-3) / 1e12);
    std::printf("\n");
    if (mode >= kTwoRings) print_trace(L, sms, mode, steps + 3);
  }
  return 0;
}
