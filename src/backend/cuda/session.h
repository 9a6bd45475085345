// One sequence on the GPU: tokens go in after those already run, up to `chunk` consecutive tokens
// per step (one graph replay of a decoder whose batch rows share the sequence's KV cache: a prompt
// is prefilled a chunk at a time, a generated token is one step), and the logits of a token
// come back to the host on request, or the next token drawn on the GPU (sample.h). A split
// model runs the same steps on every rank of its
// RankGroup at once, each rank's graph holding its collectives.
// Prompts of kGemmMinTokens and more run through the GEMM prefill (prefill_gemm.h) instead, in
// chunks of `gemm_chunk` positions, where the model takes it (GemmPrefill::unsupported: one GPU,
// grouped-query attention).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "backend/cuda/decoder.h"

namespace kestrel::cuda {

class GpuModel;
class GemmPrefill;

class Session {
 public:
  // Positions per prefill step: each step reads the weights its tokens touch once, so larger
  // chunks prefill faster, at the price of activation and attention scratch growing with it.
  static constexpr int kDefaultChunk = 64;
  // Positions per chunk of the GEMM prefill: its fixed cost per chunk is converting the dense
  // matrices to BF16 (the experts' NVFP4 is dequantized inside their grouped GEMM), so longer
  // chunks amortize it; its scratch grows with the chunk (~2 GB at 4096 on Qwen3-30B-A3B shapes,
  // allocated on the first prompt that takes the path).
  static constexpr int kDefaultGemmChunk = 4096;
  // Shorter prompts keep the decode step's chunks. Measured on an H100 (docs/PERF.md v42,
  // Qwen3-30B-A3B): the GEMM prefill takes 0.93x the decode step's time at 32 tokens (10.9
  // against 10.1 ms), 1.45x less at 64 (12.0 against 17.5), 2.4x at 128.
  static constexpr int kGemmMinTokens = 64;
  // kv: the type of the cached keys and values (KvSource::type). gemm_chunk: the GEMM prefill's
  // chunk, 0 for none (it is used where GemmPrefill::unsupported says the model can take it);
  // gemm_min_tokens: the shortest run it takes (the bench times it at any length with 1).
  Session(const DeviceModel& model, int max_context, int chunk = kDefaultChunk, KvType kv = KvType::F32,
          int gemm_chunk = kDefaultGemmChunk, int gemm_min_tokens = kGemmMinTokens);
  // A model on the GPUs, split or not (the GEMM prefill runs on one GPU only).
  Session(const GpuModel& model, int max_context, int chunk = kDefaultChunk, KvType kv = KvType::F32,
          int gemm_chunk = kDefaultGemmChunk, int gemm_min_tokens = kGemmMinTokens);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Runs `tokens` at the next positions. When `logits` is not null it receives the logits of
  // every token ([tokens, vocab]) if `all`, else those of the last token only ([vocab]).
  void run(std::span<const int32_t> tokens, float* logits, bool all = false);
  // Runs `tokens` like run() and returns the next token, drawn on the GPU with `params` from the
  // last token's logits: 4 bytes come back instead of the logits.
  int32_t run_sample(std::span<const int32_t> tokens, const SampleParams& params);
  int position() const { return pos_; }
  // Forgets the sequence: the next run starts at position 0 (its cache entries are overwritten).
  void reset() { pos_ = 0; }
  // Forgets the positions from `position` on (their cache entries are overwritten by later runs).
  void rewind(int position) {
    if (position < 0 || position > pos_) fail("session: rewind to ", position, " of ", pos_, " positions");
    pos_ = position;
  }

 private:
  // The steps of `tokens` on one rank's decoder; rank 0 copies the logits out, or with `sample`
  // draws the next token into *token.
  void run_rank(int rank, std::span<const int32_t> tokens, float* logits, bool all, const SampleParams* sample = nullptr,
                int32_t* token = nullptr);
  // How many of `tokens` leading tokens run through the GEMM prefill (0: none).
  size_t gemm_tokens(size_t tokens, bool all, bool sample) const;

  const DeviceModel* gemm_model_ = nullptr;  // the model of the GEMM prefill, where it can take it
  int gemm_chunk_ = 0, gemm_min_tokens_ = kGemmMinTokens;
  std::unique_ptr<GemmPrefill> gemm_;        // made on the first prompt that takes it

  const GpuModel* gpus_ = nullptr;
  std::vector<std::unique_ptr<Decoder>> decs_;
  std::vector<cudaStream_t> streams_;
  cudaStream_t own_stream_ = nullptr;
  int chunk_, pos_ = 0;
  int64_t vocab_;
};

}  // namespace kestrel::cuda
