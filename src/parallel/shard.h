// One rank's part of a split model (layout.h): the same Model type, with the configuration of
// the part (heads, widths and experts per rank) and weights that are views into the full model's
// mapped checkpoint (row slices) or copies (column slices), so that every backend runs a rank
// with its unsplit code plus the collectives.
#pragma once
#include <cstdint>
#include <memory>

#include "model/weights.h"
#include "parallel/layout.h"

namespace kestrel {

// The vocabulary rows of the LM head on `rank`: [begin, end), padded to `share` rows per rank so
// that the ranks' logits gather into one [ranks * share] row (the tail past the vocabulary unused).
struct VocabShare {
  int64_t share = 0, begin = 0, end = 0;
};
VocabShare vocab_share(int64_t vocab, int ranks, int rank);

// The dimensions of one rank's part; `config` is the part's configuration (heads, KV heads,
// intermediate sizes per rank; the vocabulary and the number of experts stay the model's).
// Fails, naming the flag and the model's dimension, when the layout does not divide the model.
struct ShardDims {
  ModelConfig config;
  int64_t head0 = 0;                       // first attention head
  int64_t kv_head0 = 0;                    // first KV head (GQA)
  int64_t ffn0 = 0;                        // first dense FFN column
  int64_t expert_col0 = 0;                 // first column of each expert (experts split by TP)
  int64_t first_expert = 0, experts = 0;   // resident experts
  int64_t shared_width = 0, shared0 = 0;   // shared experts' width on this rank and its first column
  VocabShare vocab;                        // LM head rows
};
ShardDims shard_dims(const ModelConfig& c, const Layout& layout, int rank);

// Rank `rank` of `full` split by `layout`. `full` must outlive the result. Fails, naming the
// flag and the model's dimension, when the layout does not divide the model evenly.
std::unique_ptr<Model> shard_model(const Model& full, const Layout& layout, int rank);

}  // namespace kestrel
