// Block layouts follow ggml (ggml-common.h): every block starts at a byte offset that is only
// 2-aligned at best, so multi-byte fields are read bytewise. Block pointers are __restrict: codes
// read through uint8_t* could otherwise alias the float output and keep the loops scalar. The
// order of the float operations matches ggml's reference dequantization (and gguf-py's), and this
// file is compiled without floating-point contraction so that a * b + c is never fused: results
// are bit-exact.
#include "formats/ggml_quants.h"

#include <array>
#include <cmath>
#include <cstring>

#include "common/error.h"
#include "common/numeric.h"

namespace kestrel {
namespace {

struct Entry {
  uint32_t id;
  GgmlTypeInfo info;
};

constexpr std::array<Entry, 35> kTypes = {{
    {0, {"F32", 1, 4, true}},        {1, {"F16", 1, 2, true}},        {2, {"Q4_0", 32, 18, true}},
    {3, {"Q4_1", 32, 20, true}},     {6, {"Q5_0", 32, 22, true}},     {7, {"Q5_1", 32, 24, true}},
    {8, {"Q8_0", 32, 34, true}},     {9, {"Q8_1", 32, 40, false}},    {10, {"Q2_K", 256, 84, true}},
    {11, {"Q3_K", 256, 110, true}},  {12, {"Q4_K", 256, 144, true}},  {13, {"Q5_K", 256, 176, true}},
    {14, {"Q6_K", 256, 210, true}},  {15, {"Q8_K", 256, 292, false}}, {16, {"IQ2_XXS", 256, 66, false}},
    {17, {"IQ2_XS", 256, 74, false}}, {18, {"IQ3_XXS", 256, 98, false}}, {19, {"IQ1_S", 256, 50, false}},
    {20, {"IQ4_NL", 32, 18, false}}, {21, {"IQ3_S", 256, 110, false}}, {22, {"IQ2_S", 256, 82, false}},
    {23, {"IQ4_XS", 256, 136, false}}, {24, {"I8", 1, 1, false}},     {25, {"I16", 1, 2, false}},
    {26, {"I32", 1, 4, false}},      {27, {"I64", 1, 8, false}},      {28, {"F64", 1, 8, false}},
    {29, {"IQ1_M", 256, 56, false}}, {30, {"BF16", 1, 2, true}},      {34, {"TQ1_0", 256, 54, false}},
    {35, {"TQ2_0", 256, 66, false}}, {39, {"MXFP4", 32, 17, true}},   {40, {"NVFP4", 64, 36, true}},
    {41, {"Q1_0", 128, 18, false}},  {0xffffffffu, {"", 0, 0, false}},
}};

// F16 -> F32 for every bit pattern: F16 tensors convert one value per element.
struct HalfTable {
  std::array<float, 65536> v;
  HalfTable() {
    for (uint32_t i = 0; i < 65536; ++i) v[i] = f16_to_f32(uint16_t(i));
  }
};
const HalfTable& half_table() {
  static const HalfTable t;
  return t;
}

inline uint16_t u16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }
inline uint32_t u32(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}
inline float half(const uint8_t* p) { return half_table().v[u16(p)]; }

// Q4_0: d (f16), 16 bytes of 4-bit codes; low nibbles are values 0..15, high nibbles 16..31.
void q4_0(const uint8_t* __restrict b, float* __restrict y) {
  const float d = half(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) y[j] = float(int(qs[j] & 0xf) - 8) * d;
  for (int j = 0; j < 16; ++j) y[j + 16] = float(int(qs[j] >> 4) - 8) * d;
}

void q4_1(const uint8_t* __restrict b, float* __restrict y) {
  const float d = half(b), m = half(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) y[j] = float(qs[j] & 0xf) * d + m;
  for (int j = 0; j < 16; ++j) y[j + 16] = float(qs[j] >> 4) * d + m;
}

// Q5_0: d, 32 high bits (bit j is the fifth bit of value j), then nibbles as Q4_0.
void q5_0(const uint8_t* __restrict b, float* __restrict y) {
  const float d = half(b);
  const uint32_t qh = u32(b + 2);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) y[j] = float(int((qs[j] & 0xf) | (((qh >> j) << 4) & 0x10)) - 16) * d;
  for (int j = 0; j < 16; ++j) y[j + 16] = float(int((qs[j] >> 4) | ((qh >> (j + 12)) & 0x10)) - 16) * d;
}

void q5_1(const uint8_t* __restrict b, float* __restrict y) {
  const float d = half(b), m = half(b + 2);
  const uint32_t qh = u32(b + 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 16; ++j) y[j] = float((qs[j] & 0xf) | (((qh >> j) << 4) & 0x10)) * d + m;
  for (int j = 0; j < 16; ++j) y[j + 16] = float((qs[j] >> 4) | ((qh >> (j + 12)) & 0x10)) * d + m;
}

void q8_0(const uint8_t* __restrict b, float* __restrict y) {
  const float d = half(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = float(qs[j]) * d;
}

// The 12 scale bytes of Q4_K / Q5_K hold eight 6-bit scales and eight 6-bit mins.
inline void scale_min_k4(int j, const uint8_t* q, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = uint8_t((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4));
    m = uint8_t((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// Q2_K: scales[16] (low nibble scale, high nibble min), qs[64] (2-bit), d, dmin.
void q2_k(const uint8_t* __restrict b, float* __restrict y) {
  const uint8_t* scales = b;
  const uint8_t* q = b + 16;
  const float d = half(b + 80), dmin = half(b + 82);
  int is = 0;
  for (int n = 0; n < 256; n += 128) {
    int shift = 0;
    for (int j = 0; j < 4; ++j) {
      for (int half_ = 0; half_ < 2; ++half_) {
        const uint8_t sc = scales[is++];
        const float dl = d * float(sc & 0xf), ml = dmin * float(sc >> 4);
        const uint8_t* qq = q + 16 * half_;
        for (int l = 0; l < 16; ++l) *y++ = dl * float((qq[l] >> shift) & 3) - ml;
      }
      shift += 2;
    }
    q += 32;
  }
}

// Q3_K: hmask[32] (third bit, inverted: clear means subtract 4), qs[64], scales[12] (sixteen
// 6-bit scales biased by 32), d.
void q3_k(const uint8_t* __restrict b, float* __restrict y) {
  const uint8_t* hm = b;
  const uint8_t* q = b + 32;
  const float d_all = half(b + 108);
  uint32_t aux[4];
  std::memcpy(aux, b + 96, 12);
  const uint32_t kmask1 = 0x03030303u, kmask2 = 0x0f0f0f0fu, tmp = aux[2];
  aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
  aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
  aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
  aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
  uint8_t scales[16];
  std::memcpy(scales, aux, 16);  // byte order of aux on a little-endian host, as ggml
  int is = 0;
  uint8_t m = 1;
  for (int n = 0; n < 256; n += 128) {
    int shift = 0;
    for (int j = 0; j < 4; ++j) {
      for (int half_ = 0; half_ < 2; ++half_) {
        const float dl = d_all * float(int(scales[is++]) - 32);
        const uint8_t* qq = q + 16 * half_;
        const uint8_t* hh = hm + 16 * half_;
        for (int l = 0; l < 16; ++l) *y++ = dl * float(int((qq[l] >> shift) & 3) - ((hh[l] & m) ? 0 : 4));
      }
      shift += 2;
      m = uint8_t(m << 1);
    }
    q += 32;
  }
}

// Q4_K: d, dmin, scales[12], qs[128]; eight sub-blocks of 32 with their own scale and min.
void q4_k(const uint8_t* __restrict b, float* __restrict y) {
  const float d = half(b), dmin = half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  int is = 0;
  for (int j = 0; j < 256; j += 64) {
    uint8_t sc, m;
    scale_min_k4(is, scales, sc, m);
    const float d1 = d * float(sc), m1 = dmin * float(m);
    scale_min_k4(is + 1, scales, sc, m);
    const float d2 = d * float(sc), m2 = dmin * float(m);
    for (int l = 0; l < 32; ++l) *y++ = d1 * float(q[l] & 0xf) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * float(q[l] >> 4) - m2;
    q += 32;
    is += 2;
  }
}

// Q5_K: as Q4_K plus qh[32] holding the fifth bit of every value.
void q5_k(const uint8_t* __restrict b, float* __restrict y) {
  const float d = half(b), dmin = half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + 48;
  int is = 0;
  uint8_t u1 = 1, u2 = 2;
  for (int j = 0; j < 256; j += 64) {
    uint8_t sc, m;
    scale_min_k4(is, scales, sc, m);
    const float d1 = d * float(sc), m1 = dmin * float(m);
    scale_min_k4(is + 1, scales, sc, m);
    const float d2 = d * float(sc), m2 = dmin * float(m);
    for (int l = 0; l < 32; ++l) *y++ = d1 * float((ql[l] & 0xf) + ((qh[l] & u1) ? 16 : 0)) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * float((ql[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) - m2;
    ql += 32;
    is += 2;
    u1 = uint8_t(u1 << 2);
    u2 = uint8_t(u2 << 2);
  }
}

// Q6_K: ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16], d. Each half of 128 values
// is four runs of 32: low nibbles of ql[0..31], of ql[32..63], high nibbles of the same, with
// bits 0-1, 2-3, 4-5, 6-7 of qh[0..31] on top; every 16 values have their own scale.
void q6_k(const uint8_t* __restrict b, float* __restrict y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half(b + 208);
  for (int n = 0; n < 2; ++n) {
    for (int k = 0; k < 4; ++k) {
      const uint8_t* lo = ql + 32 * (k & 1);
      const int nib = 4 * (k >> 1), hs = 2 * k;
      for (int h = 0; h < 2; ++h) {
        const float ds = d * float(sc[2 * k + h]);
        for (int l = 16 * h; l < 16 * h + 16; ++l)
          y[32 * k + l] = ds * float(int(((lo[l] >> nib) & 0xf) | (((qh[l] >> hs) & 3) << 4)) - 32);
      }
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

// E2M1 code -> value x 2: ggml's kvalues_mxfp4, shared by MXFP4 and NVFP4 (the scales absorb the 1/2).
constexpr int8_t kE2m1x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// MXFP4: an E8M0 exponent e, then 16 bytes of E2M1 codes (low nibbles values 0..15, high 16..31).
// Half the scale, 2^(e - 128), as a float bit pattern: subnormal for e < 2, as ggml_e8m0_to_fp32_half.
void mxfp4(const uint8_t* __restrict b, float* __restrict y) {
  const uint32_t e = b[0];
  const uint32_t bits = e < 2 ? 0x00200000u << e : (e - 1) << 23;
  float d;
  std::memcpy(&d, &bits, 4);
  const uint8_t* qs = b + 1;
  for (int j = 0; j < 16; ++j) y[j] = d * float(kE2m1x2[qs[j] & 0xf]);
  for (int j = 0; j < 16; ++j) y[j + 16] = d * float(kE2m1x2[qs[j] >> 4]);
}

// Unsigned E4M3 (bias 7, bit 7 ignored), halved, for every byte; 0x7f (NaN in E4M3) reads as 0,
// as gguf-py decodes it.
struct Ue4m3HalfTable {
  std::array<float, 256> v;
  Ue4m3HalfTable() {
    for (int x = 0; x < 256; ++x) {
      const int exp = (x >> 3) & 0xf, man = x & 7;
      const float f = exp == 0 ? std::ldexp(float(man), -9) : std::ldexp(1.0f + float(man) / 8.0f, exp - 7);
      v[size_t(x)] = x == 0x7f ? 0.0f : f * 0.5f;
    }
  }
};
const Ue4m3HalfTable& ue4m3_half_table() {
  static const Ue4m3HalfTable t;
  return t;
}

// NVFP4 (ggml): four UE4M3 scales, one per 16 values, then 4 x 8 bytes of E2M1 codes; in each
// 16-value sub-block the low nibbles are values 0..7 and the high nibbles 8..15. The per-tensor
// scale is a separate tensor (NAME.scale), applied by the weight view, not here.
void nvfp4(const uint8_t* __restrict b, float* __restrict y) {
  const auto& scale = ue4m3_half_table().v;
  const uint8_t* qs = b + 4;
  for (int s = 0; s < 4; ++s) {
    const float d = scale[b[s]];
    for (int j = 0; j < 8; ++j) {
      const uint8_t q = qs[8 * s + j];
      y[16 * s + j] = d * float(kE2m1x2[q & 0xf]);
      y[16 * s + j + 8] = d * float(kE2m1x2[q >> 4]);
    }
  }
}

template <void (*Block)(const uint8_t*, float*), int N, int Bytes>
void blocks(const uint8_t* src, int64_t n, float* out) {
  for (int64_t i = 0; i < n / N; ++i) Block(src + i * Bytes, out + i * N);
}

}  // namespace

const GgmlTypeInfo* ggml_type_info(uint32_t type) {
  for (const auto& e : kTypes)
    if (e.id == type && e.info.block) return &e.info;
  return nullptr;
}

std::string ggml_type_name(uint32_t type) {
  const GgmlTypeInfo* t = ggml_type_info(type);
  return t ? std::string(t->name) : cat("type ", type);
}

void ggml_dequant_row(GgmlType type, const uint8_t* src, int64_t n, float* out) {
  switch (type) {
    case GgmlType::F32: std::memcpy(out, src, size_t(n) * 4); return;
    case GgmlType::F16: {
      const auto& t = half_table().v;
      for (int64_t i = 0; i < n; ++i) out[i] = t[u16(src + 2 * i)];
      return;
    }
    case GgmlType::BF16:
      for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(u16(src + 2 * i));
      return;
    case GgmlType::Q4_0: return blocks<q4_0, 32, 18>(src, n, out);
    case GgmlType::Q4_1: return blocks<q4_1, 32, 20>(src, n, out);
    case GgmlType::Q5_0: return blocks<q5_0, 32, 22>(src, n, out);
    case GgmlType::Q5_1: return blocks<q5_1, 32, 24>(src, n, out);
    case GgmlType::Q8_0: return blocks<q8_0, 32, 34>(src, n, out);
    case GgmlType::Q2_K: return blocks<q2_k, 256, 84>(src, n, out);
    case GgmlType::Q3_K: return blocks<q3_k, 256, 110>(src, n, out);
    case GgmlType::Q4_K: return blocks<q4_k, 256, 144>(src, n, out);
    case GgmlType::Q5_K: return blocks<q5_k, 256, 176>(src, n, out);
    case GgmlType::Q6_K: return blocks<q6_k, 256, 210>(src, n, out);
    case GgmlType::MXFP4: return blocks<mxfp4, 32, 17>(src, n, out);
    case GgmlType::NVFP4: return blocks<nvfp4, 64, 36>(src, n, out);
    default: break;
  }
  fail("internal: no dequantization for ggml ", ggml_type_name(uint32_t(type)));
}

}  // namespace kestrel
