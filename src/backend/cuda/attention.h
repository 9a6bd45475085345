// Decode attention: one new query per sequence against that sequence's cached keys/values,
// split over the sequence (flash-decoding) so that long contexts fill the GPU.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/norm_rope.h"

namespace kestrel::cuda {

// How the positions are cut: `splits` blocks per (head group, sequence), fixed for a given
// capacity (and batch) so that one captured graph serves every length up to it. The kernels cut
// each sequence's own length (MLA under DSA: its selected rows) into `splits` chunks of whole
// blocks of the paged cache, so a short sequence in a long-capacity cache uses every split;
// `chunk` is the chunk at full capacity.
struct AttentionSplit {
  int splits = 1, chunk = 1;
  // GQA decode in one kernel (launch_decode_attention): with cluster > 0, each (head group,
  // sequence) is one thread block cluster of `cluster` blocks of 16 warps, which cut the length
  // among them in place of `splits` and merge through distributed shared memory; 0: splits + combine.
  int cluster = 0;
};
// parallel: the blocks of one split (batch x KV heads for launch_decode_attention); with it, the
// splits fill the GPU (two blocks per SM) and cut long contexts into chunks of at most 256
// positions. Without (0): about 64 positions per chunk at full capacity (MLA attention, whose
// blocks serve 8 heads each).
// At most 64 splits.
AttentionSplit attention_split(int max_context, int parallel = 0);

// The cluster for launch_decode_attention over head_blocks (head groups x sequences) blocks: the
// largest of 16, 8, 4, 2, 1 blocks (within cluster_limit()) that keeps the grid within one wave of
// one block per SM, where that is at most 2 blocks (larger clusters measured slower than the
// splits; KESTREL_ATT_CLUSTER=N moves the bound); 0 (splits + combine) otherwise and below Hopper.
int attention_cluster(int head_blocks);

// Query heads that one block of launch_decode_attention serves with each key/value row it loads
// (a divisor of nq / nkv: 8, 4, 2 or 1; 4 at most above head_dim 128, for registers, and for
// batches of fewer than 2 x SMs query heads in all, whose grids need the blocks).
int attention_heads_per_block(int nq, int nkv, int hd, int batch);

// Floats of scratch the split needs: batch * nq * splits * (hd + 2).
inline size_t attention_scratch_floats(int batch, int nq, int hd, const AttentionSplit& s) {
  return size_t(batch) * size_t(nq) * size_t(s.splits) * size_t(hd + 2);
}

// Partials [B][nq][splits][hd + 2] (weighted values, then max and sum of each split) -> out [B, nq, hd]
// (and as fragment rows into out_frag where set: launch_decode_attention).
void launch_attention_combine(const float* part, int batch, int nq, int hd, const AttentionSplit& split, float* out,
                              cudaStream_t s, uint32_t* out_frag = nullptr);

// The step between the QKV projection and attention (launch_qk_rope_store's), done inside the
// attention kernel: a launch and a wait fewer per layer. The kernel's blocks normalize and rotate
// their own query heads; those whose chunk holds a row's new position do the same for its key,
// attend to it from shared memory, and one per KV head stores it and its value to the cache.
struct QkPrep {
  const float* k = nullptr;  // [B, nkv, hd] as projected
  const float* v = nullptr;  // [B, nkv, hd]
  const float* q_norm = nullptr;  // [hd] or null (no QK norm)
  const float* k_norm = nullptr;
  float eps = 0.0f;
  RopeArgs rope;
};

// Whether launch_decode_attention takes the QK step (prep) for this batch: its rows are distinct
// sequences or one row. KESTREL_ATT_QK=0: never (the separate launch; A/B runs).
bool attention_takes_qk_step(const KvLayer& cache, int batch);

// q: [B, nq, hd]; row b attends to positions 0..positions[b] of its sequence in the cache (rows
// of nkv * hd). out: [B, nq, hd]. Returns the kernels launched: 1 in clusters (split.cluster; no
// scratch), else 2 (the splits' partials in scratch, then their combination).
// prep null: q is ready and the cache holds each row's new key and value (launch_qk_rope_store).
// prep set: q is as projected (not changed) and the kernel does that step; the rows must be
// distinct sequences (cache.table_stride != 0) or one row.
// out_frag set: out also as fragment rows [B, nq * hd] (slot_mma.cuh; nq * hd a multiple of 128),
// which the output projection's tensor-core kernel reads instead of splitting out per tile.
int launch_decode_attention(const float* q, int batch, int nq, int nkv, int hd, float scale,
                             const int32_t* positions, KvLayer cache, const AttentionSplit& split, float* scratch,
                             float* out, cudaStream_t s, const QkPrep* prep = nullptr, uint32_t* out_frag = nullptr);

}  // namespace kestrel::cuda
