// Any byte string given to the safetensors reader either parses into tensors whose bytes lie
// inside the input, or raises kestrel::Error. Nothing else: no crash, no read out of bounds. FP8
// weights among them (NAME.weight beside NAME.weight_scale_inv, or NAME.weight_scale per channel or
// tensor) go through the loader's checks and, when they pass, are dequantized row by row within
// their bytes.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/error.h"
#include "formats/fp8.h"
#include "formats/safetensors.h"

namespace {

void read_fp8(const kestrel::TensorView& w, const kestrel::TensorView& s, kestrel::Fp8Blocks b) {
  if (w.shape.size() != 2 || w.shape[0] < 1 || w.shape[1] < 1) return;
  const int64_t out = w.shape[0], in = w.shape[1];
  try {
    const kestrel::Fp8Matrix m = kestrel::read_fp8_matrix(w, s, out, in, b);
    const size_t es = m.bf16_scales ? 2 : 4;
    std::vector<float> row(static_cast<size_t>(in));
    for (int64_t r = 0; r < out && r < 64; ++r)
      kestrel::fp8_dequant_row(m.codes + r * in, m.scales + size_t(r / b.rows) * size_t(b.scale_cols(in)) * es,
                               m.bf16_scales, b.cols, in, row.data());
  } catch (const kestrel::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    kestrel::SafetensorsIndex idx({data, size}, "fuzz.safetensors");
    for (const auto& [name, t] : idx.tensors()) {
      if (t.data < data || t.data + t.nbytes > data + size) std::abort();
      volatile uint8_t sink = 0;
      for (size_t i = 0; i < t.nbytes; i += 4096) sink = uint8_t(sink ^ t.data[i]);
      (void)sink;
    }
    for (const auto& [name, t] : idx.tensors()) {
      if (!name.ends_with(".weight")) continue;
      const std::string module = name.substr(0, name.size() - 7);
      if (auto s = idx.tensors().find(module + ".weight_scale_inv"); s != idx.tensors().end())
        read_fp8(t, s->second, {kestrel::kFp8Block, kestrel::kFp8Block});
      if (auto s = idx.tensors().find(module + ".weight_scale"); s != idx.tensors().end() && t.shape.size() == 2) {
        // One scale for the tensor (a scalar or [1]), else one per output channel.
        const bool per_tensor = s->second.shape.empty() || s->second.shape == std::vector<int64_t>{1};
        const int64_t rows = per_tensor && t.shape[0] > 0 ? t.shape[0] : 1;
        read_fp8(t, s->second, {rows, t.shape[1] > 0 ? t.shape[1] : 1});
      }
    }
  } catch (const kestrel::Error&) {
  }
  return 0;
}
