// Two models whose quantizable linears must hold the same NVFP4 bytes (e.g. `--quant nvfp4` at load
// against a checkpoint `kestrel quantize` wrote from the same source).
#pragma once
#include <gtest/gtest.h>

#include <cstring>

#include "model/weights.h"
#include "quant/targets.h"

namespace kestrel::test {

inline void expect_same_nvfp4(Model& expected, Model& got) {
  const auto gt = quant_targets(expected), ht = quant_targets(got);
  ASSERT_EQ(gt.size(), ht.size());
  for (size_t i = 0; i < gt.size(); ++i) {
    const Linear &a = *gt[i].linear, &b = *ht[i].linear;
    ASSERT_EQ(b.format, WeightFormat::NVFP4) << ht[i].module;
    EXPECT_EQ(a.scale2, b.scale2) << ht[i].module;
    EXPECT_EQ(std::memcmp(a.data, b.data, size_t(a.out * a.in / 2)), 0) << ht[i].module;
    EXPECT_EQ(std::memcmp(a.scales, b.scales, size_t(a.out * a.in / 16)), 0) << ht[i].module;
  }
}

}  // namespace kestrel::test
