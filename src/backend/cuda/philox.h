// The random numbers of GPU sampling (sample.h): Philox4x32-10 (Salmon, Moraes, Dror, Shaw,
// "Parallel random numbers: as easy as 1, 2, 3", SC'11), a counter-based generator: draw n of a
// stream is a pure function of (seed, n), so a row needs no generator state and a captured graph
// replays with whatever counter sits in device memory. Host and device code compute the same bits
// (the tests check Random123's known answers and re-draw GPU tokens on the host).
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define KESTREL_HOST_DEVICE __host__ __device__
#else
#define KESTREL_HOST_DEVICE
#endif

namespace kestrel::cuda {

// Ten Philox rounds of the 128-bit counter `ctr` under the 64-bit key `key`.
KESTREL_HOST_DEVICE inline void philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
  uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3], k0 = key[0], k1 = key[1];
  for (int r = 0; r < 10; ++r) {
    if (r > 0) k0 += 0x9E3779B9u, k1 += 0xBB67AE85u;
    const uint64_t p0 = uint64_t(0xD2511F53u) * c0, p1 = uint64_t(0xCD9E8D57u) * c2;
    const uint32_t n0 = uint32_t(p1 >> 32) ^ c1 ^ k0, n2 = uint32_t(p0 >> 32) ^ c3 ^ k1;
    c0 = n0, c1 = uint32_t(p1), c2 = n2, c3 = uint32_t(p0);
  }
  out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

// 64 random bits, draw `counter` of stream `seed`: key = seed, counter = (counter, 0), the first
// two output words (low word first).
KESTREL_HOST_DEVICE inline uint64_t sample_bits(uint64_t seed, uint64_t counter) {
  const uint32_t ctr[4] = {uint32_t(counter), uint32_t(counter >> 32), 0u, 0u};
  const uint32_t key[2] = {uint32_t(seed), uint32_t(seed >> 32)};
  uint32_t out[4];
  philox4x32_10(ctr, key, out);
  return uint64_t(out[0]) | uint64_t(out[1]) << 32;
}

// floor(bits * total / 2^64): a uniform draw of [0, total) from 64 random bits.
KESTREL_HOST_DEVICE inline uint64_t scale_bits(uint64_t bits, uint64_t total) {
#if defined(__CUDA_ARCH__)
  return __umul64hi(bits, total);
#else
  return uint64_t((unsigned __int128)bits * total >> 64);
#endif
}

}  // namespace kestrel::cuda
