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

// Partials [B][nq][splits][hd + 2] (weighted values, then max and sum of each split) -> out [B, nq, hd].
void launch_attention_combine(const float* part, int batch, int nq, int hd, const AttentionSplit& split, float* out,
                              cudaStream_t s);

// q: [B, nq, hd]; row b attends to positions 0..positions[b] of its sequence in the cache (rows
// of nkv * hd). out: [B, nq, hd]. Returns the kernels launched: 1 in clusters (split.cluster; no
// scratch), else 2 (the splits' partials in scratch, then their combination).
int launch_decode_attention(const float* q, int batch, int nq, int nkv, int hd, float scale,
                             const int32_t* positions, KvLayer cache, const AttentionSplit& split, float* scratch,
                             float* out, cudaStream_t s);

}  // namespace kestrel::cuda
