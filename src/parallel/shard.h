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

// Rank `rank` of `full` split by `layout`. `full` must outlive the result. Fails, naming the
// flag and the model's dimension, when the layout does not divide the model evenly.
std::unique_ptr<Model> shard_model(const Model& full, const Layout& layout, int rank);

}  // namespace kestrel
