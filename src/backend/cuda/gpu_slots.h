// The engine's sequences on the GPU (runtime/sequence_slots.h): slot i is row i of one batched
// decoder; a step runs one token for every slot that decodes as one CUDA graph replay (per GPU
// when split), and a chunk of prompt tokens for every slot that prefills, in the slot's blocks:
// through the GEMM prefill (prefill_gemm.h) where the model takes it and the prompt has
// kGemmMinPrompt tokens or more, else on a one-sequence decoder per GPU, 64 at a time. A job
// that offers to sample with options the GPU can apply (no penalties) gets its token drawn inside the graph (sample.h) and copied back (4
// bytes); the others get their logits copied back for the host's samplers, and a verification
// (speculative decoding) every row's.
// The KV cache is one pool of blocks of 16 positions per GPU that the slots share: a sequence
// holds the blocks of the positions it reserved (kv_block_tables.h), not a whole context.
#pragma once
#include <cuda_runtime.h>

#include <memory>
#include <vector>

#include "backend/cuda/decoder.h"
#include "backend/cuda/gpu_model.h"
#include "backend/cuda/prefill_gemm.h"
#include "runtime/kv_block_tables.h"
#include "runtime/sequence_slots.h"

namespace kestrel::cuda {

class GpuSlots final : public SequenceSlots {
 public:
  // Sequences per batched step. The decode kernels take any batch (linear and gated products in
  // passes of 8 tokens; the expert-grouped MoE kernels up to 256 tokens, the per-slot ones any);
  // 64 bounds the graphs captured and the scratch held per batch row.
  static constexpr int kMaxSlots = 64;
  // `kv_positions`: the KV pool the slots share (whole blocks of 16, at least one). 0: enough for
  // every slot to hold a whole context, or what 90% of the free memory of each GPU holds if less.
  // kv: the type of the cached keys and values (KvSource::type).
  // prefix_cache: blocks of prompts are shared across sequences (runtime/kv_blocks.h).
  GpuSlots(const GpuModel& model, int slots, int context, int64_t kv_positions, KvType kv = KvType::F32,
           bool prefix_cache = true);
  ~GpuSlots() override;

  int slots() const override { return tables_.slots(); }
  // Positions per step of the one-sequence decoder (as Session's chunk: each step reads the
  // weights its tokens touch once).
  static constexpr int kPrefillChunk = 64;
  // Positions per GEMM prefill chunk: a prompt's chunk is one step of the engine, which the
  // decoding streams wait for (serve's --prefill-chunk and --step-tokens bound it). Its scratch
  // (~0.4 GB at 2048 on Qwen3-30B-A3B shapes, ~1 GB on GLM-4.5-Air's) is taken on the first
  // chunk that uses it, from what the KV pool left; where it does not fit, prompts stay on the
  // decoder (announced once).
  static constexpr int kGemmChunk = 2048;
  // Prompts of this many tokens and more prefill through the GEMM prefill, every chunk of them,
  // so that a prompt's path depends on its length, not on how a step's budget cut it: the GEMM
  // prefill's BF16 products differ from the decoder's by ~1e-3 (docs/PERF.md v42), and a reply
  // should be the same alone or among many. Shorter prompts stay on the decoder.
  static constexpr int kGemmMinPrompt = 256;
  // Tokens per slot and step: the GEMM prefill's chunk where it takes the model, else 64.
  int64_t max_chunk() const override { return gemm_chunk_ > 0 ? gemm_chunk_ : kPrefillChunk; }
  // Whether long prompts go through the GEMM prefill (one GPU, a model it takes, its scratch fits).
  bool gemm_prefill() const { return gemm_chunk_ > 0; }
  Opened open(int64_t positions, std::span<const int32_t> prompt) override;
  void close(int slot) override { tables_.close(slot); }
  bool prefix_cache() const override { return tables_.ids().prefix_cache(); }
  PrefixCacheStats prefix_stats() const override { return tables_.ids().stats(); }
  void run(std::span<const Job> jobs) override;
  // A verification (2 to 64 tokens) runs as a prefill step whose every row's logits come back;
  // rewind() moves the slot's next position back (its blocks stay reserved to the end of the
  // request, so none is given back) and publishes the full blocks the check kept.
  bool can_verify() const override { return true; }
  void rewind(int slot, int64_t position) override;
  int64_t kv_blocks_held() const override { return tables_.ids().held(); }
  std::string describe() const override;

  int64_t kv_positions() const { return tables_.blocks() * KvBlockPool::kBlock; }  // the engine's kv_tokens
  size_t kv_bytes() const { return kv_bytes_; }  // the pool's device memory on the GPU that holds the most
  // "N KV positions (bf16), X GiB" (per GPU when split).
  std::string kv_summary() const;

 private:
  const GpuModel& model_;
  int context_;
  KvBlockTables tables_;
  std::vector<std::unique_ptr<Decoder>> decs_;     // per rank: the batched step over every slot
  std::vector<std::unique_ptr<Decoder>> prefill_;  // per rank: one slot's prompt, in the slot's blocks
  int gemm_chunk_ = 0;                 // the GEMM prefill's chunk where it takes the model (and fits), else 0
  std::vector<char> gemm_prompt_;      // per slot: its prompt is long enough for the GEMM prefill
  std::unique_ptr<GemmPrefill> gemm_;  // made on the first chunk it runs, into prefill_[0]'s cache
  std::vector<int32_t> pos_;  // next position of each slot
  std::vector<PrefixChain> chains_;  // per slot
  float* logits_ = nullptr;   // pinned [slots, vocab]
  int32_t* drawn_ = nullptr;  // pinned [2, slots]: tokens drawn by the batched step, by prefill steps
  int64_t vocab_;
  size_t kv_bytes_ = 0;
};

}  // namespace kestrel::cuda
