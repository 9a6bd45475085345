// How an instruction's weights reach it before its inputs do. Rows of a matrix are contiguous,
// so a tile's rows are one run of codes (or values) and one of scales (the tensor-core tiles: a
// run per row, into padded rows), known before the step for every product but the experts'. A
// block asks for them as soon as it reaches the instruction, before it waits on its inputs:
//  - staged (the tile's runs fit the stage and are 16-byte aligned): bulk copies into the
//    block's shared-memory stage, completing on an mbarrier the block waits on after its
//    counters; the products then read the stage;
//  - otherwise (the LM head's large tiles): bulk prefetches into the L2, also for the
//    instructions kPrefetchAhead ahead in the queue. Expert tiles learn their expert from the
//    route once their wait is over: gate/up then copies its rows into the stage (copy_packed_rows),
//    down asks the L2 for them.
#pragma once
#include <cstdint>

#include "backend/cuda/dlinear.h"
#include "backend/cuda/persistent/program.h"

namespace kestrel::cuda {

__host__ __device__ inline uint64_t row_bytes(const DLinear& W) {
  switch (W.format) {
    case DFormat::F32: return uint64_t(W.in) * 4;
    case DFormat::F16:
    case DFormat::BF16: return uint64_t(W.in) * 2;
    case DFormat::NVFP4: return uint64_t(W.in) / 2;
  }
  return 0;
}
__host__ __device__ inline uint32_t align16(uint64_t n) { return uint32_t((n + 15) & ~uint64_t(15)); }

// Whether a tile of W with a batch of Bt rows of x takes the tensor-core products from the stage
// (op_mma.cuh): NVFP4 rows of whole 256-weight units (a row's scales are then whole 16-byte bulk
// copies) whose Bt fragment rows fit kFragBytes.
__host__ __device__ inline uint32_t mma_frag_words(int K) { return uint32_t(K) + 16; }  // a fragment row, padded
__host__ __device__ inline bool mma_tile_fits(const DLinear& W, int Bt) {
  return W.format == DFormat::NVFP4 && W.in % 256 == 0 && uint64_t(Bt) * mma_frag_words(W.in) * 4 <= kFragBytes;
}

// The tensor-core tiles' rows in the stage: codes ≡ 64 and scales ≡ 16 bytes (mod 128) apart, so
// that the eight row groups of a warp's loads (lane (g, j): 16 bytes of codes at 64c + 16j, 2 of
// scales at 8c + 2j of rows g and g + 8) spread over the banks instead of meeting on 16 of them.
__host__ __device__ inline uint32_t pad_rows_to(uint32_t n, uint32_t rem) { return n + (rem + 128u - n % 128u) % 128u; }
__host__ __device__ inline uint32_t mma_code_stride(int K) { return pad_rows_to(uint32_t(K) / 2, 64); }
__host__ __device__ inline uint32_t mma_scale_stride(int K) { return pad_rows_to(uint32_t(K) / 16, 16); }

// Where rows [r0, r1) of W sit in a stage filled in order (the host lays it out, the ops find
// their matrices with the same calls): codes at *at, then scales; *at moves past both. Tiles of
// a batch of Bt that take tensor cores (mma_tile_fits) have padded rows, `codes_stride` and
// `scales_stride` apart; the others contiguous rows.
struct StagedRows {
  uint32_t codes, scales;
  uint32_t codes_stride, scales_stride;  // 0: contiguous rows
};
__host__ __device__ inline StagedRows stage_rows(const DLinear& W, int r0, int r1, uint32_t* at, int Bt) {
  const uint32_t n = uint32_t(r1 - r0);
  StagedRows s{*at, 0, 0, 0};
  if (mma_tile_fits(W, Bt)) {
    s.codes_stride = mma_code_stride(W.in), s.scales_stride = mma_scale_stride(W.in);
    *at += n * s.codes_stride;
    s.scales = *at;
    *at += n * s.scales_stride;
    return s;
  }
  *at += align16(uint64_t(n) * row_bytes(W));
  s.scales = *at;
  if (W.format == DFormat::NVFP4) *at += align16(uint64_t(n) * uint64_t(W.in / 16));
  return s;
}

// Rows [r0, r1) of an NVFP4 W of whole 256-weight units as two contiguous runs (codes, then
// scales) at *at, *at moving past both: one bulk copy each, for tiles whose rows are known only
// after their wait (the experts'), where a copy per padded row costs more to issue than the
// padding saves in bank conflicts (docs/PERF.md v33).
__host__ __device__ inline StagedRows stage_rows_packed(const DLinear& W, int r0, int r1, uint32_t* at) {
  const uint32_t n = uint32_t(r1 - r0), codes = *at;
  *at += n * uint32_t(W.in / 2);
  const uint32_t scales = *at;
  *at += n * uint32_t(W.in / 16);
  return {codes, scales, uint32_t(W.in / 2), uint32_t(W.in / 16)};
}
// Whether rows [r0, r1) of W copy as stage_rows_packed's runs (16-byte aligned whole units).
__host__ __device__ inline bool packed_rows_fit(const DLinear& W, int r0, int r1) {
  const uint64_t c = uint64_t(W.in) / 2, sc = uint64_t(W.in) / 16;
  return W.format == DFormat::NVFP4 && W.in % 32 == 0 && (uint64_t(r0) * c) % 16 == 0 && (uint64_t(r1 - r0) * c) % 16 == 0 &&
         (uint64_t(r0) * sc) % 16 == 0 && (uint64_t(r1 - r0) * sc) % 16 == 0;
}

// W as the stage holds rows [r0, r1) of it: the same row numbers, read from shared memory (the
// rows past r1 a warp's last group reads are clamped to r1 - 1, inside the stage).
__device__ __forceinline__ DLinear staged(const DLinear& W, int r0, int r1, const uint8_t* stage, StagedRows s) {
  DLinear v = W;
  v.out = r1;
  v.data = stage + s.codes - uint64_t(r0) * row_bytes(W);
  if (W.format == DFormat::NVFP4) v.scales = stage + s.scales - uint64_t(r0) * uint64_t(W.in / 16);
  return v;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// By one thread: `bytes` in all are coming to the barrier's current phase.
__device__ __forceinline__ void mbar_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

// [src, src + bytes) into shared memory at dst, completing on bar (16-byte aligned, whole units).
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

// Until the barrier's phase `parity` completes.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
}

// Asks the L2 for [p, p + bytes), from a 16-byte boundary, in whole 16-byte units (one thread).
__device__ __forceinline__ void bulk_prefetch_l2(const void* p, uint32_t bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p), b = (a + bytes) & ~uintptr_t(15);
  const uintptr_t s = a & ~uintptr_t(15);
  if (b <= s) return;
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(s), "r"(uint32_t(b - s)) : "memory");
}

// Rows [r0, r1) of W into the L2, by the calling thread.
__device__ __forceinline__ void bulk_prefetch_rows(const DLinear& W, int r0, int r1) {
  if (r1 <= r0) return;
  const uint64_t rb = row_bytes(W);
  bulk_prefetch_l2(W.data + uint64_t(r0) * rb, uint32_t(uint64_t(r1 - r0) * rb));
  if (W.format == DFormat::NVFP4)
    bulk_prefetch_l2(W.scales + uint64_t(r0) * (W.in / 16), uint32_t(r1 - r0) * uint32_t(W.in / 16));
}

// Instruction i's fixed ranges into the L2 (unstaged instructions; staged ones copy them).
__device__ __forceinline__ void prefetch_instr(const PProgram& P, int32_t i) {
  for (int r = P.range_begin[i]; r < P.range_begin[i + 1]; ++r) bulk_prefetch_l2(P.ranges[r].p, P.ranges[r].bytes);
}

// By the lanes of one warp: `rows` runs of `bytes` from src (one after another) to the stage at
// dst, `stride` apart, completing on bar. The caller's lane 0 has announced the bytes.
__device__ __forceinline__ void copy_runs(uint8_t* dst, const uint8_t* src, uint32_t bytes, uint32_t rows, uint32_t stride,
                                          uint64_t* bar, int lane) {
  for (uint32_t k = uint32_t(lane); k < rows; k += 32) bulk_copy(dst + k * stride, src + uint64_t(k) * bytes, bytes, bar);
}

// By lane 0, before a warp's copies: the stage's last reads are ordered before the copies'
// writes, and `total` bytes are coming to the barrier's phase.
__device__ __forceinline__ void stage_expect(uint64_t* bar, uint32_t total) {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  mbar_expect(bar, total);
}

// By warp 0: instruction i's ranges into the stage when it is staged; true (in every lane) if so.
__device__ __forceinline__ bool stage_instr(const PProgram& P, int32_t i, uint8_t* stage, uint64_t* bar, int lane) {
  const int r0 = P.range_begin[i], r1 = P.range_begin[i + 1];
  if (r0 == r1 || P.ranges[r0].stage == kNotStaged) return false;
  if (lane == 0) {
    uint32_t total = 0;
    for (int r = r0; r < r1; ++r) total += P.ranges[r].bytes * P.ranges[r].rows;
    stage_expect(bar, total);
  }
  __syncwarp();
  for (int r = r0; r < r1; ++r) {
    const PRange g = P.ranges[r];
    copy_runs(stage + g.stage, g.p, g.bytes, g.rows, g.stride, bar, lane);
  }
  return true;
}

// Rows [r0, r1) of W into the stage as stage_rows_packed laid them out (s): the codes' run by
// the calling thread, then the scales' (the caller has announced their bytes: stage_expect).
__device__ __forceinline__ void copy_packed_rows(const DLinear& W, int r0, int r1, const StagedRows& s, uint8_t* stage,
                                                 uint64_t* bar) {
  const uint32_t n = uint32_t(r1 - r0);
  bulk_copy(stage + s.codes, W.data + uint64_t(r0) * (W.in / 2), n * uint32_t(W.in / 2), bar);
  bulk_copy(stage + s.scales, W.scales + uint64_t(r0) * (W.in / 16), n * uint32_t(W.in / 16), bar);
}

}  // namespace kestrel::cuda
