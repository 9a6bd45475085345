// Fused mixture-of-experts decode: routing on the device (no host synchronization, no
// per-expert counts on the host), then all selected experts' gate/up in one launch and all
// down projections with the weighted sum and the residual add in another.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "backend/cuda/dlinear.h"
#include "backend/cuda/route.h"
#include "model/model_config.h"

namespace kestrel::cuda {

struct DMoe {
  DRouter router;
  const DLinear* gate = nullptr;  // device arrays [local_experts]: experts first_expert ..
  const DLinear* up = nullptr;
  const DLinear* down = nullptr;
  DLinear expert_gate;            // expert 0's gate as the host sees it: shape and format of all experts' gates
  int tensor_cores = 0;           // every expert matrix is NVFP4 or BF16 with inputs a multiple of 64 wide
  int slot_down_mma = 0;          // every expert's down matrix is NVFP4 with inputs a multiple of 128 wide
  int frag_gate_up = 0;           // so are every expert's gate and up matrices
  int width = 0;                  // expert intermediate size
  int first_expert = 0;           // an expert-parallel rank holds experts first_expert ..
  int local_experts = 0;          // .. first_expert + local_experts - 1; slots of others are skipped
  int has_shared = 0;
  DLinear shared_gate, shared_up, shared_down;
};

// Sets m.expert_gate, m.tensor_cores, m.slot_down_mma and m.frag_gate_up from the local experts' matrices (host copies of the
// device arrays m.gate, m.up, m.down).
void describe_experts(DMoe& m, const std::vector<DLinear>& gate, const std::vector<DLinear>& up,
                      const std::vector<DLinear>& down);

// Scratch for one MoE layer at batch B: expert ids and weights [B, top_k], and the gated
// activations of every (token, slot) pair [B * (top_k + shared), max width].
struct MoeScratch {
  int32_t* experts = nullptr;
  float* weights = nullptr;
  float* act = nullptr;
  int act_stride = 0;
  float* logits = nullptr;         // router logits [B, experts]
  uint32_t* route_done = nullptr;  // router chunk counters [route_chunks(B)], zeroed once: each launch leaves them 0
  float* out = nullptr;            // weighted down outputs of every slot [B * (top_k + shared), hidden]; with
                                   // it, batches of 2+ (fragment rows) or 4+ tokens take the grouped kernels
  uint32_t* xf = nullptr;          // the input split into fragment rows [B, hidden] for the grouped kernels
                                   // and one token's gate/up (m.frag_gate_up; null: each tile splits it)
};

// Whether the grouped kernels take m's input as fragment rows (MoeScratch::xf): NVFP4 gate and up
// matrices with inputs a multiple of 128 wide, unless KESTREL_MOE_FRAG=0 (for A/B runs).
bool moe_takes_fragment_rows(const DMoe& m);

// Whether one token's gate/up runs on tensor cores when the caller leaves its input in
// MoeScratch::xf as fragment rows (the router's normalization does, RowNorm::frag): as above,
// unless KESTREL_MOE_ONE_TOKEN_MMA=0 (for A/B runs).
bool moe_one_token_takes_fragment_rows(const DMoe& m);

// Whether launch_moe_experts reads s.xf for this batch: one token's gate/up as above, the grouped
// kernels from 2 tokens. A caller that leaves x there as fragment rows (xf_made) saves the split.
bool moe_reads_fragment_rows(const DMoe& m, int batch, const MoeScratch& s);

// The experts after routing (s.experts, s.weights): gate/up of all slots, then down with the
// weighted sum added to the residual. xf_made: s.xf already holds x as fragment rows (where
// moe_reads_fragment_rows). One token, and 2-3 without fragment rows (s.xf and
// moe_takes_fragment_rows): a launch per step with one block row per slot, on CUDA cores (at one
// token, gate/up on tensor cores with xf_made and moe_one_token_takes_fragment_rows, down where
// m.slot_down_mma says it can). From 2 tokens with fragment rows, else from 4 (with s.out and
// m.tensor_cores): the slots are grouped by expert inside each block, so every selected expert's
// weights (and the shared expert's) are read once for all the tokens that chose it, on tensor
// cores (x split into s.xf first unless xf_made); then the weighted outputs are added to the
// residual in slot order.
// Returns the number of kernels launched (2 per-slot, 3 or 4 grouped).
int launch_moe_experts(const DMoe& m, const float* x, int batch, float* residual, const MoeScratch& s,
                       cudaStream_t stream, bool xf_made = false);

// Routing then experts. x: normalized input [B, hidden]; residual: [B, hidden], receives += MoE output.
// One token with s.xf: x split into fragment rows first (what the router's normalization does in a
// decode step), so that gate/up takes the tensor cores as it does there.
void launch_moe(const DMoe& m, const float* x, int batch, float* residual, const MoeScratch& s, cudaStream_t stream);

}  // namespace kestrel::cuda
