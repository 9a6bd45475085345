#include "quant/calibrate.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "backend/cpu/forward.h"
#include "common/error.h"

namespace kestrel {

std::map<const Linear*, float> calibrate_input_amax(const Model& m, std::span<const int32_t> tokens, int64_t window,
                                                    ThreadPool& pool, bool progress) {
  if (tokens.empty()) fail("calibration: no tokens to run");
  if (window < 1) fail("calibration: window must be positive, got ", window);
  std::map<const Linear*, float> amax;
  cpu::Forward fwd(m, pool);
  fwd.set_observer([&](const Linear& w, const float* x, int64_t n) {
    float a = 0.0f;
    for (int64_t i = 0; i < n * w.in; ++i) a = std::max(a, std::fabs(x[i]));
    float& slot = amax[&w];
    slot = std::max(slot, a);
  });
  KvCache cache = fwd.make_cache(std::min<int64_t>(window, int64_t(tokens.size())));
  for (size_t begin = 0; begin < tokens.size(); begin += size_t(window)) {
    const size_t n = std::min(tokens.size() - begin, size_t(window));
    cache.clear();
    fwd.run(tokens.subspan(begin, n), cache, nullptr);
    if (progress)
      std::fprintf(stderr, "\rcalibrating: %zu/%zu tokens", begin + n, tokens.size());
  }
  if (progress) std::fprintf(stderr, "\n");

  // Experts the calibration never routed to.
  for (const LayerWeights& L : m.weights.layers) {
    if (!L.is_moe) continue;
    for (Linear GatedFfn::*proj : {&GatedFfn::gate, &GatedFfn::up, &GatedFfn::down}) {
      float best = 0.0f;
      for (const GatedFfn& e : L.moe.experts)
        if (auto it = amax.find(&(e.*proj)); it != amax.end()) best = std::max(best, it->second);
      for (const GatedFfn& e : L.moe.experts)
        if (best > 0 && !(amax.count(&(e.*proj)) && amax[&(e.*proj)] > 0)) amax[&(e.*proj)] = best;
    }
  }
  for (auto it = amax.begin(); it != amax.end();) it = it->second > 0 ? std::next(it) : amax.erase(it);
  return amax;
}

}  // namespace kestrel
