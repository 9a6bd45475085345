#include "formats/fp8.h"

#include <array>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "common/error.h"
#include "common/numeric.h"

namespace kestrel {
namespace {

struct Table {
  std::array<float, 256> v;
  Table() {
    for (int b = 0; b < 256; ++b) v[size_t(b)] = e4m3_to_f32(uint8_t(b));
  }
};
const Table kE4m3;

float scale_at(const uint8_t* scales, bool bf16, int64_t i) {
  if (bf16) {
    uint16_t h;
    std::memcpy(&h, scales + 2 * i, 2);
    return bf16_to_f32(h);
  }
  float f;
  std::memcpy(&f, scales + 4 * i, 4);
  return f;
}

}  // namespace

int64_t fp8_find_nan(const uint8_t* codes, int64_t n) {
  // A byte is a NaN code when its low seven bits are all set: adding 1 to them then carries into
  // bit 7, and never further, so eight bytes are tested at once.
  constexpr uint64_t kLow = 0x7f7f7f7f7f7f7f7full, kOne = 0x0101010101010101ull, kHigh = 0x8080808080808080ull;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t x;
    std::memcpy(&x, codes + i, 8);
    if (((x & kLow) + kOne) & kHigh) break;
  }
  for (; i < n; ++i)
    if ((codes[i] & 0x7f) == 0x7f) return i;
  return -1;
}

Fp8Matrix read_fp8_matrix(const TensorView& w, const TensorView& s, int64_t out, int64_t in, Fp8Blocks b) {
  if (w.dtype != DType::F8_E4M3) fail(w.where(), ": FP8 weights must be F8_E4M3, found ", dtype_name(w.dtype));
  if (w.shape.size() != 2 || w.shape[0] != out || w.shape[1] != in)
    fail(w.where(), ": shape ", w.shape_str(), " disagrees with config.json (expected [", out, ", ", in, "])");
  if (s.dtype != DType::F32 && s.dtype != DType::BF16)
    fail(s.where(), ": FP8 scales must be F32 or BF16, found ", dtype_name(s.dtype));
  const int64_t sr = b.scale_rows(out), sc = b.scale_cols(in);
  const bool grid = s.shape.size() == 2 && s.shape[0] == sr && s.shape[1] == sc;
  const bool column = sc == 1 && s.shape.size() == 1 && s.shape[0] == sr;
  const bool scalar = sr == 1 && sc == 1 && s.shape.empty();
  if (!grid && !column && !scalar)
    fail(s.where(), ": shape ", s.shape_str(), " is not the scale grid of the FP8 weight [", out, ", ", in,
         "] in blocks of ", b.rows, " x ", b.cols, " (expected [", sr, ", ", sc, "])");
  Fp8Matrix m;
  m.codes = w.data;
  m.scales = s.data;
  m.bf16_scales = s.dtype == DType::BF16;
  for (int64_t i = 0; i < sr * sc; ++i) {
    const float v = scale_at(m.scales, m.bf16_scales, i);
    if (!std::isfinite(v)) fail(s.where(), ": scale [", i / sc, ", ", i % sc, "] is not finite (", v, ")");
  }
  if (const int64_t i = fp8_find_nan(m.codes, out * in); i >= 0) {
    char code[8];
    std::snprintf(code, sizeof code, "0x%02x", m.codes[i]);
    fail(w.where(), ": weight [", i / in, ", ", i % in, "] is NaN (code ", code, "); FP8 weights must be finite");
  }
  return m;
}

void fp8_dequant_row(const uint8_t* codes, const uint8_t* scale_row, bool bf16_scales, int64_t block_cols, int64_t k,
                     float* out) {
  for (int64_t c0 = 0, j = 0; c0 < k; c0 += block_cols, ++j) {
    const float s = scale_at(scale_row, bf16_scales, j);
    const int64_t c1 = std::min(k, c0 + block_cols);
    for (int64_t c = c0; c < c1; ++c) out[c] = kE4m3.v[codes[c]] * s;
  }
}

}  // namespace kestrel
