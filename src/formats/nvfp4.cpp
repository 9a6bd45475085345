#include "formats/nvfp4.h"

#include <array>

#include "common/numeric.h"

namespace kestrel {
namespace {

struct Tables {
  std::array<float, 512> pair;  // byte -> (low value, high value)
  std::array<float, 256> e4m3;
  Tables() {
    for (int b = 0; b < 256; ++b) {
      pair[size_t(2 * b)] = e2m1_to_f32(uint8_t(b & 0xf));
      pair[size_t(2 * b + 1)] = e2m1_to_f32(uint8_t(b >> 4));
      e4m3[size_t(b)] = e4m3_to_f32(uint8_t(b));
    }
  }
};
const Tables kTables;

}  // namespace

void nvfp4_dequant_row(const uint8_t* packed, const uint8_t* scales, float scale2, int64_t k, float* out) {
  for (int64_t g = 0; g < k / kNvfp4Block; ++g) {
    const float s = kTables.e4m3[scales[g]] * scale2;
    const uint8_t* p = packed + g * (kNvfp4Block / 2);
    float* o = out + g * kNvfp4Block;
    for (int i = 0; i < kNvfp4Block / 2; ++i) {
      o[2 * i] = kTables.pair[size_t(2 * p[i])] * s;
      o[2 * i + 1] = kTables.pair[size_t(2 * p[i] + 1)] * s;
    }
  }
}

}  // namespace kestrel
