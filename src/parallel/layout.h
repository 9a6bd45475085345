// How a model is split over ranks (GPUs, or threads for the CPU backend): the one description
// `--tp/--ep`, the loaders and `kestrel roofline` share.
//   tp: tensor-parallel ranks. Attention heads (and their KV heads, replicated where there are
//       fewer KV heads than ranks), dense FFNs, shared experts and the LM head (by vocabulary)
//       are split tp ways; norms, routers, embeddings, MLA's low-rank down-projections and the
//       DSA indexer are replicated.
//   ep: 1 (every routed expert split tp ways, like a dense FFN) or tp (whole experts spread over
//       the ranks, num_experts / tp each).
#pragma once
#include <string>

namespace kestrel {

struct Layout {
  int tp = 1;
  int ep = 1;
  int ranks() const { return tp; }
  bool split() const { return tp > 1; }
  std::string str() const { return "TP" + std::to_string(tp) + (ep > 1 ? " EP" + std::to_string(ep) : ""); }
};

// Fails with the flag named when the layout is not one of the above (`experts`: 0 for dense models).
void check_layout(const Layout& l, long experts);

}  // namespace kestrel
