// MoE routing on the device: router logits, then each token's experts and weights (softmax, or
// sigmoid with a correction bias and group-limited choice; top-k, renormalization, scaling), in
// one launch and without a host synchronization.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/dlinear.h"
#include "model/model_config.h"

namespace kestrel::cuda {

constexpr int kMaxExperts = 1024;

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

// The router takes a batch in chunks of up to kRouteTokens tokens; each chunk needs a counter.
constexpr int kRouteTokens = 8;
inline int route_chunks(int batch) { return (batch + kRouteTokens - 1) / kRouteTokens; }

// Routing in one launch. Writes the router logits [B, experts], experts and weights [B, top_k].
// Up to 4 tokens with a small BF16 or F32 router (route_in_cluster): one cluster of blocks, each
// a slice of the experts' rows, hands its logits to the first block through distributed shared
// memory, and that block selects (a warp per token). Otherwise blocks of a few experts' rows take each chunk of up
// to kRouteTokens rows of x, and the last block of a chunk to finish (counted in done: route_chunks(batch)
// counters, zero before the launch and after it) selects its tokens' experts, a warp per token.
// With norm.w, x is the raw input: the router normalizes it (RMSNorm; inside its own kernel where
// route_fuses_norm says so, else by a separate launch) and leaves the rows in norm.out for the experts,
// and with norm.frag as fragment rows there too (slot_mma.cuh; inputs a multiple of 128 wide).
void launch_route(const DRouter& r, const float* x, int batch, float* logits, uint32_t* done, int32_t* experts,
                  float* weights, cudaStream_t stream, RowNorm norm = {});
bool route_fuses_norm(const DRouter& r, int batch);
bool route_in_cluster(const DRouter& r, int batch);

}  // namespace kestrel::cuda
