// Scalar conversions for the storage formats: BF16, F16, FP8 E4M3 (FN) and FP4 E2M1.
#pragma once
#include <algorithm>
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

// The FP8 E4M3 (FN) value nearest to f, ties to the even mantissa. Magnitudes of 448 and above
// saturate to 448 (the largest finite value); NaN becomes the NaN code.
inline uint8_t f32_to_e4m3(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  if (std::isnan(f)) return uint8_t(sign | 0x7f);
  const float a = std::fabs(f);
  if (a >= 448.0f) return uint8_t(sign | 0x7e);
  if (a == 0.0f) return sign;
  int e = 0;
  std::frexp(a, &e);                   // a in [2^(e-1), 2^e)
  const int exp = std::max(e - 1, -6);  // subnormals share the step of the lowest binade
  const float step = std::ldexp(1.0f, exp - 3);
  const float q = std::nearbyint(a / step);  // a / step is exact; default rounding: ties to even
  int units = int(q);                         // value = units * step
  int field = exp + 7;
  if (exp == -6 && units < 8) return uint8_t(sign | units);  // subnormal (or zero)
  if (units == 16) {  // rounded up into the next binade
    units = 8;
    ++field;
  }
  return uint8_t(sign | (field << 3) | (units - 8));
}

// The E2M1 code nearest to x, ties to the even code (the one with mantissa bit 0), magnitudes
// above 6 saturating to 6. The sign bit is set for every x < 0, also when the magnitude rounds to
// 0. x must not be NaN.
inline uint8_t f32_to_e2m1(float x) {
  const float a = std::fabs(x);
  uint8_t m;
  if (a <= 0.25f) m = 0;        // 0.25 is a tie between 0 and 0.5: even code 0
  else if (a < 0.75f) m = 1;    // 0.75 ties to 1.0 (code 2)
  else if (a <= 1.25f) m = 2;   // 1.25 ties to 1.0
  else if (a < 1.75f) m = 3;    // 1.75 ties to 2.0 (code 4)
  else if (a <= 2.5f) m = 4;    // 2.5 ties to 2.0
  else if (a < 3.5f) m = 5;     // 3.5 ties to 4.0 (code 6)
  else if (a <= 5.0f) m = 6;    // 5.0 ties to 4.0
  else m = 7;
  return uint8_t(m | (x < 0 ? 0x8 : 0x0));
}

}  // namespace kestrel
