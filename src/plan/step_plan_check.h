// The proof that a persistent step's plan is safe, on the CPU, before any GPU runs it. A plan is
// safe when every timing of its queues (each SM in queue order, an instruction starting once the
// counters it waits on are full) computes what running the instructions one after another in
// program order computes, and always finishes. Each check fails (kestrel::Error) naming the
// instruction (op, layer, tile, SM and slot), the counter and the buffer range involved.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "plan/step_plan.h"

namespace kestrel {

// Structure: queues in program order, slots and SMs consistent, each instruction advancing one
// counter whose producer count is right, waits only on earlier instructions' counters (which
// makes the queues deadlock-free with every SM resident). Then hazards: with happens-before
// from the waits and the queues (vector clocks over the SMs), every read of a unit is ordered
// after the unit's last writer, and every write after the unit's last writer and every reader
// since.
void check_step_plan(const StepPlan& p);

// Runs the queues as the persistent kernel does, in an interleaving drawn from `seed`: returns
// the instructions in the order they completed. Fails naming the blocked instructions and
// counters if the queues stop, or a counter that ends at another value than its producers.
std::vector<int32_t> simulate_step_plan(const StepPlan& p, uint64_t seed);

// "layer 3 o_proj [0, 16) (#1234, SM 5 slot 12)".
std::string describe_instr(const StepPlan& p, int32_t i);

}  // namespace kestrel
