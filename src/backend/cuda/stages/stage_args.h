// What the stage step's kernel reads (stage_step.h): the model's descriptors, the batch's inputs,
// the buffers the stages hand each other through, and the barrier's counters. Plain data, passed
// by value.
#pragma once
#include <cstdint>

#include "backend/cuda/device_model.h"
#include "backend/cuda/kv_layer.h"
#include "backend/cuda/norm_rope.h"

namespace kestrel::cuda {

constexpr int kStageThreads = 512;   // one block per SM
constexpr int kStageMaxHeadDim = 256;
constexpr int kStageTile = 32;       // positions an attention split scores at a time
constexpr int kStageMaxSplits = 256; // of one head's positions

// The stages of a step, in the order a layer runs them (the trace's names: stage_step.cu).
enum class Stage : uint8_t { Embed, Qkv, Attention, Combine, O, Router, ExpertGateUp, ExpertDown, MlpGateUp, MlpDown,
                             Head, Count };

struct SArgs {
  // The model.
  const DLayer* layers = nullptr;  // [n_layers], device copies of the descriptors
  const KvLayer* kv = nullptr;     // [n_layers]
  DLinear embed, lm_head;
  const float* final_norm = nullptr;
  RopeArgs rope;
  float eps = 0, scale = 0;
  int n_layers = 0, batch = 0, hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, splits = 0, vocab = 0;
  int experts = 0;
  int mma = 0;  // NVFP4 products on tensor cores where they fit (stage_mma.cuh): from two tokens on

  // The batch: tokens and positions (the decoder's), and the stages' buffers.
  const int32_t* tokens = nullptr;
  const int32_t* pos = nullptr;
  float* x = nullptr;        // [batch, hidden] the residual stream
  float* qkv = nullptr;      // [batch, (heads + 2 kv_heads) head_dim]
  float* part_ml = nullptr;  // [batch, heads, splits, 2] each split's max and sum
  float* part = nullptr;     // [batch, heads, splits, head_dim] each split's weighted values
  float* att = nullptr;      // [batch, heads head_dim]; fragment rows where o is on tensor cores
  float* rlogits = nullptr;  // [batch, experts]
  float* act = nullptr;      // MoE: [distinct experts, B, expert width]; dense: [batch, intermediate]
  float* act_shared = nullptr;  // [batch, shared expert width] (both as fragment rows on tensor cores)
  float* logits = nullptr;   // [batch, vocab]

  // The grid barrier (grid_barrier.cuh): counts up across steps, never reset.
  uint32_t* arrived = nullptr;
  uint32_t* epoch = nullptr;      // steps run so far: the last block of a step advances it
  uint32_t* blocks_done = nullptr;
  int32_t* error = nullptr;       // 1 + the barrier that timed out, 0 if none
  int barriers = 0;               // per step
  long long timeout_ns = 2000000000;
  // When set: per barrier-delimited stage and block, the SM clock at its start and its end.
  long long* trace = nullptr;
  uint32_t xn_floats = 0;         // dynamic shared memory: the normalized rows [B, hidden], with mma as
                                  // fragment rows too [B, hidden], then scratch
};

}  // namespace kestrel::cuda
