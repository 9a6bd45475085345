// A step plan (plan/step_plan.h) as the persistent kernel reads it: instructions of 32 bytes,
// one queue per block, the counters and every buffer and weight the ops touch. Plain data,
// passed to the kernel by value.
#pragma once
#include <cstdint>

#include "backend/cuda/device_model.h"
#include "backend/cuda/kv_layer.h"
#include "backend/cuda/norm_rope.h"

namespace kestrel::cuda {

constexpr uint8_t kTailSignal = 0x80, kSplitNext = 0x40, kWaitCount = 0x3f;
constexpr int kMaxWaits = 3;          // waits per instruction (the plans need at most 2)
constexpr int kPersistentThreads = 256;
constexpr int kMaxHeadDim = 256;      // GQA heads the attention ops take

struct PInstr {
  uint8_t op;      // StepOp
  uint8_t waits;   // how many of wait[] are used, | kTailSignal when a tail waits on `signal`,
                   // | kSplitNext when the next instruction of the queue is an attention split
  int16_t layer;   // -1 outside the layers
  int32_t a, b, c; // the tile (StepInstr)
  int32_t wait[kMaxWaits];
  int32_t signal;
};
static_assert(sizeof(PInstr) == 32, "an instruction is 32 bytes");

// Weight bytes an instruction reads, known before the step (weights.cuh): `rows` runs of `bytes`
// that follow each other from p, copied into the block's stage at `stage`, `stride` bytes apart
// (the tensor-core tiles' padded rows, op_mma.cuh), or (kNotStaged, one run) prefetched into the L2.
constexpr uint32_t kNotStaged = 0xffffffffu;
struct PRange {
  const uint8_t* p;
  uint32_t bytes;
  uint32_t stage;
  uint32_t rows;
  uint32_t stride;
};

constexpr int kTraceMarks = 5;               // points inside an op that the trace times (the last: it returned)
constexpr int kTraceSlots = 3 + kTraceMarks;
constexpr int kPrefetchAhead = 2;             // instructions of its queue a block asks the L2 for ahead
constexpr uint32_t kStageBytes = 128 << 10;   // a block's stage for one instruction's weights
constexpr uint32_t kFragBytes = 36 << 10;     // the tensor-core tiles' activations (op_mma.cuh)

struct PProgram {
  // The queues: block s runs instrs[queue[k]] for k in [queue_begin[s], queue_begin[s + 1]).
  const PInstr* instrs = nullptr;
  const int32_t* queue = nullptr;
  const int32_t* queue_begin = nullptr;
  const int32_t* producers = nullptr;  // per counter: tiles that advance it per step
  const int32_t* tail_of = nullptr;    // per counter: the tail its last producer runs, or -1
  const PRange* ranges = nullptr;      // the instructions' fixed weight ranges: instruction i's are
  const int32_t* range_begin = nullptr;  // ranges[range_begin[i] .. range_begin[i + 1])
  uint32_t* counters = nullptr;        // count up across steps, never reset
  uint32_t* epoch = nullptr;           // steps run so far; the last block of a step advances it
  uint32_t* blocks_done = nullptr;     // blocks finished in this step (back to 0 by the last)
  int32_t* error = nullptr;            // 1 + the first instruction that timed out waiting, 0 if none
  long long timeout_ns = 2000000000;
  // When set, per instruction (kTraceSlots apart): the SM clock when its waits began, the cycles
  // it waited, the cycles it ran, and the cycles from its start to each of its op's marks (0 where
  // the op has none; PersistentStep::trace).
  long long* trace = nullptr;
  uint32_t stage_offset = 0;           // of the weight stage in dynamic shared memory
  uint32_t xn_offset = kNotStaged;     // of the normalized rows there, or kNotStaged: in xn
  uint32_t frag_offset = 0;            // of the tensor-core tiles' fragment rows (kFragBytes)
  uint32_t stage_bytes = 0;            // the stage's size

  // The model.
  const DLayer* layers = nullptr;      // [layers], device copies of the descriptors
  const KvLayer* kv = nullptr;         // [layers]
  DLinear embed, lm_head;
  const float* final_norm = nullptr;
  RopeArgs rope;
  float eps = 0, scale = 0;
  int kv_bf16 = 0;
  int batch = 0, hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, qkv_rows = 0, splits = 0, chunk_max = 0;
  int positions = 0, expert_rows = 0, shared_rows = 0, mlp_rows = 0, vocab = 0, experts = 0, top_k = 0;

  // Inputs and the plan's buffers (one row per token).
  const int32_t* tokens = nullptr;
  const int32_t* pos = nullptr;
  float *x = nullptr, *qkv = nullptr, *part = nullptr, *att = nullptr, *router = nullptr;
  int32_t* route_e = nullptr;       // [batch, top_k]
  float* route_w = nullptr;         // [batch, top_k]
  int32_t* position_expert = nullptr;  // [positions]: the p-th distinct expert, or -1
  int32_t* expert_position = nullptr;  // [experts]: its position, or -1
  float *expert_mid = nullptr, *shared_mid = nullptr, *mid = nullptr, *logits = nullptr;
  float* xn = nullptr;              // per block: [8, hidden] normalized rows (unless in shared memory)
};

}  // namespace kestrel::cuda
