// A persistent step's plan (plan/step_plan.h) run on the CPU: every instruction in program
// order, each computing exactly its tile with the reference kernels (rows of a product, one KV
// head's rotary and cache store, one split of the positions and the combine, the routing, one
// expert position's rows). Since check_step_plan proves every timing of the queues equivalent to
// program order, logits equal to cpu::Forward's prove the tiles compute the model.
#pragma once
#include <cstdint>
#include <span>

#include "model/weights.h"
#include "plan/step_plan.h"
#include "runtime/kv_cache.h"

namespace kestrel::cpu {

// One decode step: token b at the next position of caches[b] (appended there), for the plan's
// batch of sequences. logits: [batch, vocab].
void run_step_plan(const StepPlan& plan, const Model& model, std::span<const int32_t> tokens,
                   std::span<KvCache* const> caches, float* logits);

}  // namespace kestrel::cpu
