#include <gtest/gtest.h>

#include <cmath>

#include "common/numeric.h"
#include "formats/nvfp4.h"

namespace kestrel {

TEST(Numeric, Bf16RoundTrip) {
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  EXPECT_EQ(bf16_to_f32(0xc000), -2.0f);
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 is halfway between two bf16 values: ties to even (down).
  EXPECT_EQ(f32_to_bf16(1.0f + 1.0f / 256), 0x3f80);
  EXPECT_EQ(f32_to_bf16(1.0f + 3.0f / 256), 0x3f82);
}

TEST(Numeric, F16) {
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_f32(0xc000), -2.0f);
  EXPECT_EQ(f16_to_f32(0x7bff), 65504.0f);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));
  EXPECT_TRUE(std::isinf(f16_to_f32(0x7c00)));
}

TEST(Numeric, E4M3) {
  EXPECT_EQ(e4m3_to_f32(0x38), 1.0f);             // exp 7, man 0
  EXPECT_EQ(e4m3_to_f32(0x7e), 448.0f);           // largest finite
  EXPECT_EQ(e4m3_to_f32(0xfe), -448.0f);
  EXPECT_EQ(e4m3_to_f32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(e4m3_to_f32(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(e4m3_to_f32(0x3c), 1.5f);
  EXPECT_TRUE(std::isnan(e4m3_to_f32(0x7f)));
  EXPECT_TRUE(std::isnan(e4m3_to_f32(0xff)));
  EXPECT_EQ(e4m3_to_f32(0x00), 0.0f);
}

TEST(Numeric, E2M1) {
  const float expect[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(e2m1_to_f32(uint8_t(i)), expect[i]);
    EXPECT_EQ(e2m1_to_f32(uint8_t(i | 8)), -expect[i]);
  }
}

// A hand-made block: codes 0..15 in order, block scale 2.0 (E4M3 0x40), tensor scale 0.5.
TEST(Numeric, Nvfp4DequantRowNibbleOrder) {
  uint8_t packed[8];
  for (int i = 0; i < 8; ++i) packed[i] = uint8_t((2 * i) | ((2 * i + 1) << 4));  // low nibble = even element
  const uint8_t scale = 0x40;  // exp 8, man 0 -> 2.0
  ASSERT_EQ(e4m3_to_f32(scale), 2.0f);
  float out[16];
  nvfp4_dequant_row(packed, &scale, 0.5f, 16, out);
  const float expect[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  for (int i = 0; i < 16; ++i) EXPECT_EQ(out[i], expect[i]) << "element " << i;
}

TEST(Numeric, Nvfp4TwoBlocksUseTheirOwnScale) {
  uint8_t packed[16];
  for (int i = 0; i < 16; ++i) packed[i] = 0x72;  // low: 1.0, high: 6.0
  const uint8_t scales[2] = {0x38, 0x30};         // 1.0, 0.5
  float out[32];
  nvfp4_dequant_row(packed, scales, 3.0f, 32, out);
  EXPECT_EQ(out[0], 3.0f);
  EXPECT_EQ(out[1], 18.0f);
  EXPECT_EQ(out[16], 1.5f);
  EXPECT_EQ(out[17], 9.0f);
}

}  // namespace kestrel
