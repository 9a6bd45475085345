#include "plan/step_accesses.h"

namespace kestrel {

StepSegments::StepSegments(const StepPlan& p) : cuts(kStepBufCount) {
  for (int b = 0; b < kStepBufCount; ++b) cuts[size_t(b)] = {0, p.units.at(size_t(b))};
  for (const StepInstr& in : p.instrs)
    for (const auto* list : {&in.reads, &in.writes})
      for (const StepSpan& s : *list) {
        cuts[size_t(s.buf)].push_back(s.begin);
        cuts[size_t(s.buf)].push_back(s.end);
      }
  for (auto& c : cuts) {
    std::sort(c.begin(), c.end());
    c.erase(std::unique(c.begin(), c.end()), c.end());
  }
}

std::pair<int64_t, int64_t> StepSegments::of(const StepSpan& s) const {
  const auto& c = cuts[size_t(s.buf)];
  return {std::lower_bound(c.begin(), c.end(), s.begin) - c.begin(), std::lower_bound(c.begin(), c.end(), s.end) - c.begin()};
}

}  // namespace kestrel
