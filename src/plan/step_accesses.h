// A plan's accesses walked in program order, the one mechanism behind the builder's edges and
// the checker's proof: for each instruction, every earlier instruction it must follow (the last
// writer of each segment it reads or writes, and the readers since of each segment it writes),
// then its own accesses recorded. Segments: each buffer cut at every begin and end that some
// instruction names, so a span is a run of whole segments and two spans overlap exactly when
// they share one.
#pragma once
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "plan/step_plan.h"

namespace kestrel {

struct StepSegments {
  explicit StepSegments(const StepPlan& p);
  std::pair<int64_t, int64_t> of(const StepSpan& s) const;  // [first, last) segment
  int64_t count(StepBuf b) const { return int64_t(cuts[size_t(b)].size()) - 1; }
  std::vector<std::vector<int64_t>> cuts;  // per buffer, sorted, from 0 to its units
};

enum class StepHazard { ReadAfterWrite, WriteAfterWrite, WriteAfterRead };

class StepAccesses {
 public:
  explicit StepAccesses(const StepPlan& p) : p_(p), seg_(p), last_(kStepBufCount), readers_(kStepBufCount) {
    for (int b = 0; b < kStepBufCount; ++b) {
      last_[size_t(b)].assign(size_t(seg_.count(StepBuf(b))), -1);
      readers_[size_t(b)].assign(size_t(seg_.count(StepBuf(b))), {});
    }
  }

  // Instructions in program order: f(j, hazard, span, first unit of the segment) for each earlier
  // instruction j that instruction i must follow, then i's accesses are recorded.
  template <class F>
  void visit(int32_t i, F&& f) {
    const StepInstr& in = p_.instrs[size_t(i)];
    for (const StepSpan& s : in.reads) {
      const auto [u0, u1] = seg_.of(s);
      for (int64_t u = u0; u < u1; ++u) {
        const int32_t w = last_[size_t(s.buf)][size_t(u)];
        if (w >= 0 && w != i) f(w, StepHazard::ReadAfterWrite, s, unit(s, u));
      }
    }
    for (const StepSpan& s : in.writes) {
      const auto [u0, u1] = seg_.of(s);
      for (int64_t u = u0; u < u1; ++u) {
        const int32_t w = last_[size_t(s.buf)][size_t(u)];
        if (w >= 0 && w != i) f(w, StepHazard::WriteAfterWrite, s, unit(s, u));
        for (int32_t r : readers_[size_t(s.buf)][size_t(u)])
          if (r != i) f(r, StepHazard::WriteAfterRead, s, unit(s, u));
      }
    }
    for (const StepSpan& s : in.reads) {
      const auto [u0, u1] = seg_.of(s);
      for (int64_t u = u0; u < u1; ++u) readers_[size_t(s.buf)][size_t(u)].push_back(i);
    }
    for (const StepSpan& s : in.writes) {
      const auto [u0, u1] = seg_.of(s);
      for (int64_t u = u0; u < u1; ++u) {
        readers_[size_t(s.buf)][size_t(u)].clear();
        last_[size_t(s.buf)][size_t(u)] = i;
      }
    }
  }

 private:
  int64_t unit(const StepSpan& s, int64_t segment) const { return seg_.cuts[size_t(s.buf)][size_t(segment)]; }

  const StepPlan& p_;
  StepSegments seg_;
  std::vector<std::vector<int32_t>> last_;
  std::vector<std::vector<std::vector<int32_t>>> readers_;
};

}  // namespace kestrel
