// Fused mixture-of-experts decode: routing on the device (no host synchronization, no
// per-expert counts on the host), then all selected experts' gate/up in one launch and all
// down projections with the weighted sum and the residual add in another.
#pragma once
#include <cuda_runtime.h>

#include "backend/cuda/dlinear.h"
#include "model/model_config.h"

namespace kestrel::cuda {

struct DRouter {
  DLinear w;                        // [experts, hidden]
  const float* bias = nullptr;      // sigmoid routers: correction bias [experts]
  int experts = 0, top_k = 0;
  int sigmoid = 0;                  // 0: softmax router, 1: sigmoid + correction bias
  int norm_topk = 0;
  int n_group = 1, topk_group = 1;
  float scaling = 1.0f;
};

// The router of a family as ModelConfig describes it, over router weights w (and correction bias).
DRouter make_router(const ModelConfig& c, const DLinear& w, const float* bias);

struct DMoe {
  DRouter router;
  const DLinear* gate = nullptr;  // device arrays [local_experts]: experts first_expert ..
  const DLinear* up = nullptr;
  const DLinear* down = nullptr;
  DLinear expert_gate;            // expert 0's gate as the host sees it: shape and format of all experts' gates
  int width = 0;                  // expert intermediate size
  int first_expert = 0;           // an expert-parallel rank holds experts first_expert ..
  int local_experts = 0;          // .. first_expert + local_experts - 1; slots of others are skipped
  int has_shared = 0;
  DLinear shared_gate, shared_up, shared_down;
};

// Scratch for one MoE layer at batch B: expert ids and weights [B, top_k], and the gated
// activations of every (token, slot) pair [B * (top_k + shared), max width].
struct MoeScratch {
  int32_t* experts = nullptr;
  float* weights = nullptr;
  float* act = nullptr;
  int act_stride = 0;
  float* logits = nullptr;  // router logits [B, experts]
};

// The experts after routing (s.experts, s.weights): gate/up of all slots, then down with the
// weighted sum added to the residual.
void launch_moe_experts(const DMoe& m, const float* x, int batch, float* residual, const MoeScratch& s,
                        cudaStream_t stream);

// Routing then experts. x: normalized input [B, hidden]; residual: [B, hidden], receives += MoE output.
void launch_moe(const DMoe& m, const float* x, int batch, float* residual, const MoeScratch& s, cudaStream_t stream);

// Routing: router logits for each of `batch` rows of x (one matrix-vector launch over all
// experts), then the selection (one block per token). Writes experts and weights [B, top_k].
void launch_route(const DRouter& r, const float* x, int batch, float* logits, int32_t* experts, float* weights,
                  cudaStream_t stream);

}  // namespace kestrel::cuda
