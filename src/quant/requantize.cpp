#include "quant/requantize.h"

#include <cstdio>
#include <map>

#include "quant/nvfp4_quantize.h"
#include "quant/targets.h"

namespace kestrel {

int requantize_nvfp4(Model& m, const QuantConfig& settings, ThreadPool& pool, bool progress) {
  std::vector<QuantTarget> todo;
  for (QuantTarget& t : quant_targets(m))
    if (t.linear->format != WeightFormat::NVFP4 && settings.quantizes(t.module)) todo.push_back(t);
  // Group maxima first: every member of a group must be quantized with the same scale_2.
  std::map<int, float> group_amax;
  for (const QuantTarget& t : todo) {
    float& a = group_amax[t.group];
    a = std::max(a, weight_amax(*t.linear, pool));
  }
  int n = 0;
  for (const QuantTarget& t : todo) {
    Nvfp4Matrix q = quantize_linear(*t.linear, group_amax[t.group], pool);
    Linear& l = *t.linear;
    m.owned.push_back(std::move(q.packed));
    l.data = m.owned.back().data();
    m.owned.push_back(std::move(q.scales));
    l.scales = m.owned.back().data();
    l.scale2 = q.scale2;
    l.format = WeightFormat::NVFP4;
    if (progress) std::fprintf(stderr, "\rrequantizing to NVFP4: %d/%zu linears", ++n, todo.size());
    else ++n;
  }
  if (progress && !todo.empty()) std::fprintf(stderr, "\n");
  m.config.quant = settings;
  return n;
}

}  // namespace kestrel
