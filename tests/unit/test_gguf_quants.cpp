// ggml block dequantization (MXFP4 and ggml's NVFP4 included): hand-made blocks whose values are
// worked out below, and random blocks of every supported type against gguf-py's dequantization
// (tests/fixtures/gguf/quants.gguf, made by scripts/make_gguf_fixtures.py), bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "fixture.h"
#include "formats/ggml_quants.h"
#include "formats/gguf.h"
#include "model/weights.h"

namespace kestrel {
namespace {

constexpr uint16_t kHalf0_5 = 0x3800, kHalf1 = 0x3c00, kHalf2 = 0x4000, kHalfMinus1 = 0xbc00;

void put16(std::vector<uint8_t>& b, size_t at, uint16_t v) {
  b[at] = uint8_t(v);
  b[at + 1] = uint8_t(v >> 8);
}

std::vector<float> dequant(GgmlType t, const std::vector<uint8_t>& b) {
  const GgmlTypeInfo* info = ggml_type_info(uint32_t(t));
  EXPECT_EQ(b.size(), info->bytes);
  std::vector<float> y(info->block, NAN);
  ggml_dequant_row(t, b.data(), info->block, y.data());
  return y;
}

TEST(GgmlQuants, TypeTable) {
  EXPECT_EQ(ggml_type_info(12)->name, "Q4_K");
  EXPECT_EQ(ggml_type_info(12)->block, 256u);
  EXPECT_EQ(ggml_type_info(12)->bytes, 144u);
  EXPECT_EQ(ggml_type_info(14)->bytes, 210u);
  EXPECT_EQ(ggml_type_info(8)->bytes, 34u);
  EXPECT_EQ(ggml_type_info(3)->bytes, 20u);
  EXPECT_FALSE(ggml_type_info(16)->dequant);  // IQ2_XXS: known layout, not computed with
  EXPECT_EQ(ggml_type_info(4), nullptr);      // removed Q4_2
  EXPECT_EQ(ggml_type_info(1000), nullptr);
  EXPECT_EQ(ggml_type_name(1000), "type 1000");
}

TEST(GgmlQuants, Q8_0ByHand) {
  std::vector<uint8_t> b(34);
  put16(b, 0, kHalf0_5);
  for (int j = 0; j < 32; ++j) b[size_t(2 + j)] = uint8_t(int8_t(j - 16));
  const auto y = dequant(GgmlType::Q8_0, b);
  for (int j = 0; j < 32; ++j) EXPECT_EQ(y[size_t(j)], float(j - 16) * 0.5f) << j;
}

TEST(GgmlQuants, Q4_0AndQ4_1ByHand) {
  std::vector<uint8_t> b(18);
  put16(b, 0, kHalf2);
  for (int j = 0; j < 16; ++j) b[size_t(2 + j)] = uint8_t(j | ((15 - j) << 4));
  auto y = dequant(GgmlType::Q4_0, b);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[size_t(j)], float((j - 8) * 2)) << j;              // low nibbles: values 0..15
    EXPECT_EQ(y[size_t(j + 16)], float((15 - j - 8) * 2)) << j;    // high nibbles: values 16..31
  }
  std::vector<uint8_t> c(20);
  put16(c, 0, kHalf0_5);
  put16(c, 2, kHalfMinus1);
  for (int j = 0; j < 16; ++j) c[size_t(4 + j)] = uint8_t(j | (j << 4));
  y = dequant(GgmlType::Q4_1, c);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[size_t(j)], float(j) * 0.5f - 1.0f);
    EXPECT_EQ(y[size_t(j + 16)], float(j) * 0.5f - 1.0f);
  }
}

TEST(GgmlQuants, Q5_0AndQ5_1ByHand) {
  // Q5_0: nibbles 1 (low) and 2 (high) everywhere; fifth bits set for values 3 and 20 only.
  std::vector<uint8_t> b(22);
  put16(b, 0, kHalf1);
  const uint32_t qh = (1u << 3) | (1u << 20);
  for (int i = 0; i < 4; ++i) b[size_t(2 + i)] = uint8_t(qh >> (8 * i));
  for (int j = 0; j < 16; ++j) b[size_t(6 + j)] = 0x21;
  auto y = dequant(GgmlType::Q5_0, b);
  for (int j = 0; j < 32; ++j) {
    const float want = j == 3 ? 1 : j == 20 ? 2 : j < 16 ? 1 - 16 : 2 - 16;
    EXPECT_EQ(y[size_t(j)], want) << j;
  }
  // Q5_1: every fifth bit set, low nibbles 0, high nibbles 15: 16 and 31, plus m = 0.5.
  std::vector<uint8_t> c(24, 0xff);
  put16(c, 0, kHalf1);
  put16(c, 2, kHalf0_5);
  for (int j = 0; j < 16; ++j) c[size_t(8 + j)] = 0xf0;
  y = dequant(GgmlType::Q5_1, c);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[size_t(j)], 16.5f);
    EXPECT_EQ(y[size_t(j + 16)], 31.5f);
  }
}

TEST(GgmlQuants, Q2_KByHand) {
  // Every 16-value group: scale 1, min 2; d 1, dmin 0.5; codes 0,1,2,3 in the four bit pairs.
  std::vector<uint8_t> b(84);
  for (int i = 0; i < 16; ++i) b[size_t(i)] = 0x21;
  for (int i = 0; i < 64; ++i) b[size_t(16 + i)] = 0xe4;
  put16(b, 80, kHalf1);
  put16(b, 82, kHalf0_5);
  const auto y = dequant(GgmlType::Q2_K, b);
  // Each 128-value half runs the bit pairs 0..3 in turn, 32 values each: y = code - 1.
  for (int k = 0; k < 256; ++k) EXPECT_EQ(y[size_t(k)], float((k % 128) / 32 - 1)) << k;
}

TEST(GgmlQuants, Q4_KByHand) {
  std::vector<uint8_t> b(144);
  put16(b, 0, kHalf1);
  put16(b, 2, kHalf0_5);
  // Scales of sub-blocks 0-3 in bytes 0-3, mins in 4-7; sub-blocks 4-7 take their low 4 bits
  // from bytes 8-11 and their top 2 bits from the top bits of bytes 0-3 (scale) and 4-7 (min).
  const uint8_t sc[12] = {uint8_t(2 | (1 << 6)), 3, 4, 5, uint8_t(1 | (2 << 6)), 1, 1, 1, 0x21, 0x21, 0x21, 0x21};
  std::memcpy(b.data() + 4, sc, 12);
  for (int i = 0; i < 128; ++i) b[size_t(16 + i)] = 0x73;  // low nibble 3, high nibble 7
  const auto y = dequant(GgmlType::Q4_K, b);
  // value = d * scale * code - dmin * min; sub-block 2c uses low nibbles, 2c+1 high nibbles.
  const float want[8] = {2 * 3 - 0.5f,  3 * 7 - 0.5f,  4 * 3 - 0.5f, 5 * 7 - 0.5f,
                         17 * 3 - 17.0f, 1 * 7 - 1.0f, 1 * 3 - 1.0f, 1 * 7 - 1.0f};
  for (int k = 0; k < 256; ++k) EXPECT_EQ(y[size_t(k)], want[k / 32]) << k;
}

TEST(GgmlQuants, Q6_KByHand) {
  std::vector<uint8_t> b(210);
  for (int i = 0; i < 128; ++i) b[size_t(i)] = 0x21;        // ql: low nibble 1, high nibble 2
  for (int i = 0; i < 64; ++i) b[size_t(128 + i)] = 0xe4;   // qh: bit pairs 0, 1, 2, 3
  for (int i = 0; i < 16; ++i) b[size_t(192 + i)] = 1;
  b[192] = 2;
  b[193] = uint8_t(int8_t(-1));
  put16(b, 208, kHalf0_5);
  const auto y = dequant(GgmlType::Q6_K, b);
  // Runs of 32: codes (1|0<<4)-32 = -31, (1|1<<4)-32 = -15, (2|2<<4)-32 = 2, (2|3<<4)-32 = 18.
  for (int k = 0; k < 256; ++k) {
    const int run = (k % 128) / 32;
    const float code = run == 0 ? -31 : run == 1 ? -15 : run == 2 ? 2 : 18;
    float scale = 1;
    if (k < 16) scale = 2;
    else if (k < 32) scale = -1;
    EXPECT_EQ(y[size_t(k)], 0.5f * scale * code) << k;
  }
}

TEST(GgmlQuants, Mxfp4ByHand) {
  // e = 128: half the scale is 2^0, so values are the doubled E2M1 table; e = 1 is 2^-127.
  std::vector<uint8_t> b(17);
  b[0] = 128;
  for (int j = 0; j < 16; ++j) b[size_t(1 + j)] = uint8_t(j | ((15 - j) << 4));
  const float e2m1x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
  auto y = dequant(GgmlType::MXFP4, b);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[size_t(j)], e2m1x2[j]) << j;             // low nibbles: values 0..15
    EXPECT_EQ(y[size_t(j + 16)], e2m1x2[15 - j]) << j;   // high nibbles: values 16..31
  }
  b[0] = 1;
  y = dequant(GgmlType::MXFP4, b);
  EXPECT_EQ(y[7], std::ldexp(12.0f, -127));
  b[0] = 0;
  y = dequant(GgmlType::MXFP4, b);
  EXPECT_EQ(y[1], std::ldexp(1.0f, -128));
}

TEST(GgmlQuants, Nvfp4ByHand) {
  // Scales 1.0 (0x38), 2.0 (0x40), 0.5 (0x30) and 0x7f (E4M3's NaN, read as 0); codes: byte j of
  // each sub-block holds value j (low nibble) and value j + 8 (high nibble).
  std::vector<uint8_t> b(36);
  const uint8_t scales[4] = {0x38, 0x40, 0x30, 0x7f};
  std::memcpy(b.data(), scales, 4);
  for (int s = 0; s < 4; ++s)
    for (int j = 0; j < 8; ++j) b[size_t(4 + 8 * s + j)] = uint8_t(j | ((8 + j) << 4));
  const float e2m1[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  const float scale[4] = {1, 2, 0.5f, 0};
  const auto y = dequant(GgmlType::NVFP4, b);
  for (int k = 0; k < 64; ++k) EXPECT_EQ(y[size_t(k)], e2m1[k % 16] * scale[k / 16]) << k;
}

TEST(GgmlQuants, GgufFp4ViewsApplyTheTensorScale) {
  // llama.cpp keeps NVFP4's per-tensor scale in a separate NAME.scale tensor; the view applies it.
  std::vector<uint8_t> b(36, 0x22);  // codes 2 (= 1.0) everywhere, scales set to 1.0 below
  std::memcpy(b.data(), "\x38\x38\x38\x38", 4);
  Linear l;
  l.out = 1;
  l.in = 64;
  l.format = WeightFormat::NVFP4_GGML;
  l.data = b.data();
  l.scale2 = 0.25f;
  std::vector<float> y(64, NAN);
  l.dequant_row(0, y.data());
  for (float v : y) EXPECT_EQ(v, 0.25f);
}

TEST(GgmlQuants, RandomBlocksMatchGgufPyBitForBit) {
  GgufFile f(test::fixture_dir("gguf") + "/quants.gguf");
  const GgufIndex& g = f.index();
  int checked = 0;
  for (const char* name : {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4",
                           "NVFP4", "F16", "BF16", "F32"}) {
    const GgufTensor& t = g.tensor(name);
    const GgufTensor& e = g.tensor(std::string(name) + ".expected");
    ASSERT_EQ(ggml_type_name(uint32_t(t.type)), name);
    ASSERT_EQ(e.type, GgmlType::F32);
    ASSERT_EQ(t.dims, e.dims);
    const int64_t n = t.dims[0];
    const size_t row_bytes = t.nbytes / size_t(t.rows());
    std::vector<float> want(static_cast<size_t>(n)), got(static_cast<size_t>(n));
    for (int64_t r = 0; r < t.rows(); ++r) {
      ggml_dequant_row(t.type, t.data + size_t(r) * row_bytes, n, got.data());
      std::memcpy(want.data(), e.data + size_t(r * n) * 4, size_t(n) * 4);
      for (int64_t i = 0; i < n; ++i)
        ASSERT_EQ(got[size_t(i)], want[size_t(i)]) << name << " row " << r << " value " << i;

      // The same rows through a Linear view in the matching WeightFormat.
      auto fmt = weight_format_of(t.type);
      ASSERT_TRUE(fmt) << name;
      Linear l;
      l.out = t.rows();
      l.in = n;
      l.format = *fmt;
      l.data = t.data;
      EXPECT_EQ(l.row_bytes(), row_bytes) << name;
      EXPECT_EQ(std::string(format_name(*fmt)), std::string(name) == "NVFP4" ? "NVFP4_GGML" : name);
      std::fill(got.begin(), got.end(), NAN);
      l.dequant_row(r, got.data());
      EXPECT_EQ(0, std::memcmp(got.data(), want.data(), size_t(n) * 4)) << name << " row " << r;
    }
    ++checked;
  }
  EXPECT_EQ(checked, 15);
  EXPECT_FALSE(weight_format_of(GgmlType::IQ2_XXS));
}

}  // namespace
}  // namespace kestrel
