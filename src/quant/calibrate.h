// Activation calibration: the largest |input| each linear sees while the CPU reference runs a
// calibration text, for the `input_scale` of NVFP4 checkpoints (W4A4 servers quantize each
// linear's input with it).
#pragma once
#include <cstdint>
#include <map>
#include <span>

#include "common/thread_pool.h"
#include "model/weights.h"

namespace kestrel {

// Runs `tokens` through the model in consecutive sequences of at most `window` tokens (each from
// an empty KV cache) and returns, per linear, the largest |x| over its inputs. Experts that no
// token chose get the largest value of the same projection among their layer's experts (their
// inputs come from the same distribution); a linear whose inputs were all zero is left out.
std::map<const Linear*, float> calibrate_input_amax(const Model& m, std::span<const int32_t> tokens, int64_t window,
                                                    ThreadPool& pool, bool progress = false);

}  // namespace kestrel
