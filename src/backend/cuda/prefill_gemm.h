// Prefill of long prompts with every product on the tensor cores: a chunk of up to max_chunk
// consecutive positions of one sequence runs layer by layer (not the decode step over chunks of
// 64 rows). Each dense linear is a cuBLAS BF16 GEMM with float32 accumulation; NVFP4 weights are
// converted to BF16 one matrix at a time into a scratch buffer, never the whole model. The MoE
// sorts the chunk's (token, slot) pairs by expert on the device (expert_sort.h) and runs the
// routed experts as grouped GEMMs with the NVFP4 dequantized in their main loop and the tiles
// counted on the device (moe_gemm.h): no host synchronization. Attention is causal over the
// cache on tensor cores (prefill_attention.h), or for head sizes that kernel does not take the
// decode step's kernels over the chunk's rows. Keys and values go into a one-sequence Decoder's
// KV cache, so decoding continues there. docs/PERF.md v38 has the design, v40 the grouped
// expert GEMM.
#pragma once
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "backend/cuda/decoder.h"
#include "backend/cuda/expert_sort.h"
#include "backend/cuda/moe_gemm.h"
#include "backend/cuda/weights_bf16.h"

namespace kestrel::cuda {

class GemmPrefill {
 public:
  // Empty when a model can take this path, else why not (MLA models and split models keep the
  // decode step's chunks).
  static std::string unsupported(const DeviceModel& m);

  // cache: the one-sequence decoder whose KV cache the chunks fill (it outlives this).
  GemmPrefill(const DeviceModel& m, const Decoder& cache, int max_chunk);
  ~GemmPrefill();
  GemmPrefill(const GemmPrefill&) = delete;
  GemmPrefill& operator=(const GemmPrefill&) = delete;

  // Runs tokens[0 .. n) (host memory) at positions pos .. pos + n - 1, n <= max_chunk(), on s.
  // With `logits`, the last position's logits are left in logits() ([vocab], device memory).
  // Does not synchronize with the host (but when the attention's scratch grows: a longer prompt).
  void run(const int32_t* tokens, int n, int pos, cudaStream_t s, bool logits);
  const float* logits() const { return out_logits_; }
  int max_chunk() const { return max_chunk_; }

 private:
  // C [n, m] (row-major, ldc) = alpha * B [n, k] (row-major, ldb) x A [m, k]^T (row-major, lda)
  // + beta * C: A the weights, B the activations, C float32.
  struct Gemm {
    const __nv_bfloat16* a = nullptr;
    const __nv_bfloat16* b = nullptr;
    float* c = nullptr;
    int m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldc = 0;
    float alpha = 1.0f, beta = 0.0f;
  };
  void gemm(const Gemm& g);  // one cuBLAS call
  void release();  // every buffer and handle taken so far
  // y [n, w.out] (rows ldy apart) = x [n, w.in] (BF16) x w^T (+ bias); added to y when accumulate.
  void linear(const DLinear& w, const __nv_bfloat16* x, int n, float* y, int ldy, bool accumulate, cudaStream_t s);
  // x_ += down(silu(gate(xb_)) * up(xb_)) for n rows.
  void gated_mlp(const DLinear& gate, const DLinear& up, const DLinear& down, int n, cudaStream_t s);
  void attention(int layer, int n, int pos, cudaStream_t s);
  void moe(int layer, int n, cudaStream_t s);
  template <typename T>
  T* buffer(size_t n);

  const DeviceModel& m_;
  const Decoder& cache_;
  int max_chunk_;
  cublasHandle_t blas_ = nullptr;
  std::vector<void*> buffers_;
  int32_t *tokens_ = nullptr, *positions_ = nullptr;
  float *x_ = nullptr, *xn_ = nullptr, *q_ = nullptr, *k_ = nullptr, *v_ = nullptr;
  float* att_ = nullptr;  // the decode step's attention output, for head sizes prefill_attention_takes refuses
  float *h_ = nullptr, *out_logits_ = nullptr;
  __nv_bfloat16 *xb_ = nullptr, *act_ = nullptr, *w_ = nullptr;  // w_: the converted weights
  float* att_scratch_ = nullptr;  // its split scratch
  size_t att_scratch_floats_ = 0;
  // MoE: router weights as float32 and its logits, each token's experts and weights, the sort,
  // the gathered input rows (in the grouped GEMM's MMA order, as are the routed experts'
  // activations in act_), the experts' outputs per sorted row, and the grouped GEMM's tile lists.
  float *router_w_ = nullptr, *router_logits_ = nullptr, *route_w_ = nullptr, *ys_ = nullptr;
  int32_t *route_e_ = nullptr, *moe_scratch_ = nullptr;
  ExpertSort sort_;
  __nv_bfloat16* xs_ = nullptr;
};

}  // namespace kestrel::cuda
