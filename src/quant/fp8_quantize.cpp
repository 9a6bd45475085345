#include "quant/fp8_quantize.h"

#include <algorithm>
#include <cmath>
#include <mutex>

#include "common/error.h"
#include "common/numeric.h"
#include "formats/fp8.h"

namespace kestrel {

Fp8Quantized fp8_quantize_linear(const Linear& w, ThreadPool& pool) {
  const Fp8Blocks b;
  const int64_t sr = b.scale_rows(w.out), sc = b.scale_cols(w.in);
  Fp8Quantized q;
  q.codes.resize(size_t(w.out) * size_t(w.in));
  q.scales.resize(size_t(sr * sc));
  std::mutex mu;
  int64_t bad_row = -1;
  // One block row per task: its weights dequantized, then each block's scale and codes.
  pool.parallel_for(size_t(sr), 1, [&](size_t begin, size_t end) {
    std::vector<float> rows;
    for (size_t br = begin; br < end; ++br) {
      const int64_t r0 = int64_t(br) * b.rows, n = std::min(b.rows, w.out - r0);
      rows.resize(size_t(n * w.in));
      for (int64_t r = 0; r < n; ++r) w.dequant_row(r0 + r, rows.data() + r * w.in);
      for (int64_t r = 0; r < n; ++r)
        for (int64_t c = 0; c < w.in; ++c)
          if (!std::isfinite(rows[size_t(r * w.in + c)])) {
            std::lock_guard<std::mutex> lock(mu);
            if (bad_row < 0 || r0 + r < bad_row) bad_row = r0 + r;
            return;
          }
      for (int64_t bc = 0; bc < sc; ++bc) {
        const int64_t c0 = bc * b.cols, c1 = std::min(w.in, c0 + b.cols);
        float amax = 0.0f;
        for (int64_t r = 0; r < n; ++r)
          for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(rows[size_t(r * w.in + c)]));
        const float s = amax / kFp8Max;
        q.scales[size_t(int64_t(br) * sc + bc)] = s;
        for (int64_t r = 0; r < n; ++r) {
          uint8_t* out = q.codes.data() + size_t((r0 + r) * w.in);
          for (int64_t c = c0; c < c1; ++c) out[c] = s > 0.0f ? f32_to_e4m3(rows[size_t(r * w.in + c)] / s) : 0;
        }
      }
    }
  });
  if (bad_row >= 0) fail(w.name, ": weight row ", bad_row, " holds a NaN or infinity, which FP8 cannot represent");
  return q;
}

}  // namespace kestrel
