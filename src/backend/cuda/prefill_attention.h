// Causal attention of a GEMM prefill chunk on tensor cores (prefill_gemm.h): the chunk's rows are
// consecutive positions of one sequence whose keys and values, the chunk's own included, are
// already in the paged KV cache. FlashAttention-2's scheme (query tiles against key/value tiles
// with an online softmax) on mma.sync m16n8k16 with BF16 inputs and float32 accumulation; the
// output is BF16, the input the o projection's GEMM reads. Replaces the decode step's attention
// kernels (CUDA cores) in the GEMM prefill for the head sizes it takes.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "backend/cuda/kv_layer.h"

namespace kestrel::cuda {

// Whether the GEMM prefill runs its attention here for heads of hd values in a cache of `type`:
// hd 16, 32, 64 or 128 (one kernel per size; larger heads would not fit the registers), float32
// or BF16 values.
bool prefill_attention_takes(int hd, KvType type);

// q: float32 [n, nq, hd], ready (QK norm and rotation done), rows = positions pos .. pos + n - 1 of
// the one sequence of `cache` (table_stride 0: its block table is row 0), whose positions
// 0 .. pos + n - 1 are cached (rows of nkv * hd values). Row r's query head h attends to positions
// 0 .. pos + r of KV head h / (nq / nkv) with scores q.k x scale. out: BF16 [n, nq * hd].
// Q, K, V and the softmax weights go into the products as BF16 (the weights sum to one as
// rounded); everything else is float32.
void launch_prefill_attention(const float* q, int n, int nq, int nkv, int hd, float scale, int pos,
                              const KvLayer& cache, __nv_bfloat16* out, cudaStream_t s);

}  // namespace kestrel::cuda
