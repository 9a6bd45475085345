// Scalar conversions for the storage formats: BF16, F16, FP8 E4M3 (FN) and FP4 E2M1.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kestrel {

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, NaN kept quiet.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  float f;
  if (exp == 0) {
    f = std::ldexp(float(man), -24);
  } else if (exp == 31) {
    f = man ? NAN : INFINITY;
  } else {
    f = std::ldexp(float(man | 0x400u), int(exp) - 25);
  }
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u |= sign;
  std::memcpy(&f, &u, 4);
  return f;
}

// FP8 E4M3 "FN" variant (as torch.float8_e4m3fn): bias 7, no infinities, S.1111.111 is NaN.
inline float e4m3_to_f32(uint8_t v) {
  const uint32_t exp = (v >> 3) & 0xfu;
  const uint32_t man = v & 0x7u;
  float mag;
  if (exp == 0) {
    mag = std::ldexp(float(man), -9);  // subnormal: man/8 * 2^-6
  } else if (exp == 15 && man == 7) {
    mag = NAN;
  } else {
    mag = std::ldexp(float(8 + man), int(exp) - 10);  // (1 + man/8) * 2^(exp-7)
  }
  return (v & 0x80u) ? -mag : mag;
}

// FP4 E2M1: bit 3 is the sign, bits 0-2 index the magnitudes below.
inline constexpr float kE2M1Values[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                          -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

inline float e2m1_to_f32(uint8_t code) { return kE2M1Values[code & 0xfu]; }

}  // namespace kestrel
