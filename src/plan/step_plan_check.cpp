#include "plan/step_plan_check.h"

#include <algorithm>
#include <random>

#include "common/error.h"
#include "plan/step_accesses.h"

namespace kestrel {

std::string describe_instr(const StepPlan& p, int32_t i) {
  if (i < 0 || size_t(i) >= p.instrs.size()) return "instruction " + std::to_string(i) + " (none)";
  const StepInstr& in = p.instrs[size_t(i)];
  std::string s = in.layer >= 0 ? "layer " + std::to_string(in.layer) + " " : "";
  s += step_op_name(in.op);
  switch (in.op) {
    case StepOp::AttnCombine: s += " kv head " + std::to_string(in.a); break;
    case StepOp::AttnSplit: s += " kv head " + std::to_string(in.a) + " split " + std::to_string(in.b); break;
    case StepOp::Route: break;
    case StepOp::ExpertGateUp:
      s += " expert " + std::to_string(in.c) + " [" + std::to_string(in.a) + ", " + std::to_string(in.b) + ")";
      break;
    default: s += " [" + std::to_string(in.a) + ", " + std::to_string(in.b) + ")";
  }
  if (in.tail) return s + " (#" + std::to_string(i) + ", a tail)";
  return s + " (#" + std::to_string(i) + ", SM " + std::to_string(in.sm) + " slot " + std::to_string(in.slot) + ")";
}

namespace {

std::string span_text(const StepSpan& s, int64_t u) {
  return std::string(step_buf_name(s.buf)) + "[" + std::to_string(u) + "...]";
}

}  // namespace

void check_step_plan(const StepPlan& p) {
  const size_t N = p.instrs.size(), S = p.queues.size(), K = p.counters.size();
  const auto name = [&](int32_t i) { return describe_instr(p, i); };
  if (S == 0) fail("plan: no queues");
  // Structure.
  std::vector<int32_t> signals(K, 0);
  for (size_t sm = 0; sm < S; ++sm) {
    const auto& q = p.queues[sm];
    for (size_t k = 0; k < q.size(); ++k) {
      const int32_t i = q[k];
      if (i < 0 || size_t(i) >= N) fail("plan: SM ", sm, " slot ", k, " holds instruction ", i, " of ", N);
      const StepInstr& in = p.instrs[size_t(i)];
      if (in.sm != int32_t(sm) || in.slot != int32_t(k)) fail("plan: ", name(i), " is in the queue of SM ", sm, " slot ", k);
      if (k > 0 && q[k - 1] >= i) fail("plan: SM ", sm, " runs ", name(q[k - 1]), " before ", name(i), " (out of program order)");
    }
  }
  size_t queued = 0;
  for (const auto& q : p.queues) queued += q.size();
  if (queued + p.tails.size() != N) fail("plan: ", N, " instructions, ", queued, " in the queues and ", p.tails.size(), " tails");
  // A tail: in no queue, one wait, the only tail of that counter. To the clocks it is a queue of
  // its own after the SMs' (lane_of / slot_of).
  std::vector<int32_t> lane_of(N, -1), slot_of(N, 0), tail_of(K, -1);
  for (int32_t i = 0; i < int32_t(N); ++i)
    if (!p.instrs[size_t(i)].tail) lane_of[size_t(i)] = p.instrs[size_t(i)].sm, slot_of[size_t(i)] = p.instrs[size_t(i)].slot;
  for (size_t t = 0; t < p.tails.size(); ++t) {
    const int32_t i = p.tails[t];
    if (i < 0 || size_t(i) >= N || !p.instrs[size_t(i)].tail) fail("plan: tail ", t, " is instruction ", i, ", not a tail");
    const StepInstr& in = p.instrs[size_t(i)];
    if (in.waits.size() != 1) fail("plan: the tail ", name(i), " waits on ", in.waits.size(), " counters, not one");
    if (in.waits[0] < 0 || size_t(in.waits[0]) >= K) fail("plan: ", name(i), " waits on counter ", in.waits[0], " of ", K);
    if (tail_of[size_t(in.waits[0])] >= 0) fail("plan: the tails ", name(tail_of[size_t(in.waits[0])]), " and ", name(i), " wait on one counter");
    tail_of[size_t(in.waits[0])] = i;
    if (t > 0 && p.tails[t - 1] >= i) fail("plan: the tails are out of program order");
    lane_of[size_t(i)] = int32_t(S + t);
  }
  for (int32_t i = 0; i < int32_t(N); ++i)
    if (lane_of[size_t(i)] < 0) fail("plan: ", name(i), " is neither queued nor a tail");
  if (p.units.size() != size_t(kStepBufCount)) fail("plan: units of ", p.units.size(), " buffers, not ", kStepBufCount);
  std::vector<std::vector<int32_t>> producers(K);
  for (int32_t i = 0; i < int32_t(N); ++i) {
    const StepInstr& in = p.instrs[size_t(i)];
    for (const auto* list : {&in.reads, &in.writes})
      for (const StepSpan& s : *list)
        if (s.begin < 0 || s.end > p.units[size_t(s.buf)] || s.begin >= s.end)
          fail("plan: ", name(i), list == &in.reads ? " reads " : " writes ", step_buf_name(s.buf), "[", s.begin, ", ",
               s.end, ") of ", p.units[size_t(s.buf)]);
    if (in.signal < 0 || size_t(in.signal) >= K) fail("plan: ", name(i), " advances counter ", in.signal, " of ", K);
    producers[size_t(in.signal)].push_back(i);
    for (size_t w = 0; w < in.waits.size(); ++w) {
      const int32_t k = in.waits[w];
      if (k < 0 || size_t(k) >= K) fail("plan: ", name(i), " waits on counter ", k, " of ", K);
      if (w > 0 && in.waits[w - 1] >= k) fail("plan: ", name(i), " lists its waits out of order");
    }
  }
  for (size_t k = 0; k < K; ++k) {
    if (int32_t(producers[k].size()) != p.counters[k].producers)
      fail("plan: counter ", k, " expects ", p.counters[k].producers, " producers, ", producers[k].size(), " advance it");
    if (producers[k].empty()) fail("plan: counter ", k, " has no producer");
  }
  for (int32_t i = 0; i < int32_t(N); ++i)
    for (int32_t k : p.instrs[size_t(i)].waits)
      if (producers[size_t(k)].back() >= i)
        fail("plan: ", name(i), " waits on counter ", k, ", which ", name(producers[size_t(k)].back()),
             " advances later in program order");

  // Happens-before: start[i][s] = instructions of queue s complete when instruction i may start.
  const size_t Q = S + p.tails.size();
  std::vector<std::vector<int32_t>> start(N), counter_clock(K);
  std::vector<std::vector<int32_t>> sm_clock(Q, std::vector<int32_t>(Q, 0));
  for (int32_t i = 0; i < int32_t(N); ++i) {
    const StepInstr& in = p.instrs[size_t(i)];
    const size_t lane = size_t(lane_of[size_t(i)]);
    std::vector<int32_t> vc = sm_clock[lane];
    for (int32_t k : in.waits)
      for (size_t s = 0; s < Q; ++s) vc[s] = std::max(vc[s], counter_clock[size_t(k)].empty() ? 0 : counter_clock[size_t(k)][s]);
    start[size_t(i)] = vc;
    vc[lane] = slot_of[size_t(i)] + 1;
    auto& ck = counter_clock[size_t(in.signal)];
    if (ck.empty()) ck.assign(Q, 0);
    for (size_t s = 0; s < Q; ++s) ck[s] = std::max(ck[s], vc[s]);
    sm_clock[lane] = std::move(vc);
  }
  // j happens before i.
  auto before = [&](int32_t j, int32_t i) { return start[size_t(i)][size_t(lane_of[size_t(j)])] > slot_of[size_t(j)]; };
  // Hazards, in program order (StepAccesses).
  StepAccesses accesses(p);
  for (int32_t i = 0; i < int32_t(N); ++i)
    accesses.visit(i, [&](int32_t j, StepHazard h, const StepSpan& s, int64_t unit) {
      if (before(j, i)) return;
      fail("plan: ", name(i), h == StepHazard::ReadAfterWrite ? " may read " : " may write ", span_text(s, unit),
           " before ", name(j), h == StepHazard::WriteAfterRead ? " reads it" : " writes it", ": no wait orders them");
    });
}

std::vector<int32_t> simulate_step_plan(const StepPlan& p, uint64_t seed) {
  const size_t S = p.queues.size();
  std::vector<int32_t> value(p.counters.size(), 0), order;
  std::vector<size_t> head(S, 0);
  const std::vector<int32_t> tail_of = p.tail_of_counters();
  std::mt19937_64 rng(seed);
  auto ready = [&](size_t sm) {
    if (head[sm] >= p.queues[sm].size()) return false;
    for (int32_t k : p.instrs[size_t(p.queues[sm][head[sm]])].waits)
      if (value[size_t(k)] < p.counters[size_t(k)].producers) return false;
    return true;
  };
  std::vector<size_t> can;
  while (order.size() < p.instrs.size()) {
    can.clear();
    for (size_t sm = 0; sm < S; ++sm)
      if (ready(sm)) can.push_back(sm);
    if (can.empty()) {
      std::string blocked;
      for (size_t sm = 0; sm < S && blocked.size() < 600; ++sm) {
        if (head[sm] >= p.queues[sm].size()) continue;
        const int32_t i = p.queues[sm][head[sm]];
        blocked += "\n  " + describe_instr(p, i) + " waits on";
        for (int32_t k : p.instrs[size_t(i)].waits)
          if (value[size_t(k)] < p.counters[size_t(k)].producers)
            blocked += " counter " + std::to_string(k) + " (" + std::to_string(value[size_t(k)]) + " of " +
                       std::to_string(p.counters[size_t(k)].producers) + ")";
      }
      fail("plan: the queues stop after ", order.size(), " of ", p.instrs.size(), " instructions:", blocked);
    }
    const size_t sm = can[rng() % can.size()];
    int32_t i = p.queues[sm][head[sm]++];
    // The tile, then the tail of each counter it completes.
    while (i >= 0) {
      order.push_back(i);
      const int32_t k = p.instrs[size_t(i)].signal;
      i = ++value[size_t(k)] == p.counters[size_t(k)].producers ? tail_of[size_t(k)] : -1;
    }
  }
  for (size_t k = 0; k < value.size(); ++k)
    if (value[k] != p.counters[k].producers)
      fail("plan: counter ", k, " ends at ", value[k], " of ", p.counters[k].producers);
  return order;
}

}  // namespace kestrel
