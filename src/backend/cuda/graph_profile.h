// Per-op times of a decode step inside its CUDA graph: the step is captured once with the graph
// nodes of every op noted, then replayed with only one op's nodes enabled (disabled nodes run as
// empty ones), and the empty graph's own time is taken off. Events between ops, the alternative,
// break the graph and PDL's overlap and inflate a step by 30-50%. What the ops alone do not add up
// to is reported as the time between ops: the dependency latency of each kernel in the chain,
// less the overlap PDL gets inside an op replayed alone (its kernels may start early across
// the disabled nodes between them, so ops of many tiny kernels come out lower than in the step).
#pragma once
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "backend/cuda/op_timer.h"

namespace kestrel::cuda {

class Decoder;

struct GraphOpTime {
  std::string name;
  int calls = 0;          // times the op occurs in a step
  int nodes = 0;          // graph nodes (kernels, memsets, copies) of those calls
  double bytes = 0;       // bytes the calls must move at least
  double alone_ms = 0;    // the op's nodes alone, less the empty graph
};

struct GraphProfile {
  double step_ms = 0;   // every node enabled
  double empty_ms = 0;  // every node disabled: the graph's launch and dependency overhead
  std::vector<GraphOpTime> ops;  // in order of first appearance in the step
  std::string note;              // how the profiled step differs from the decoder's own, if it does
};

// Notes, while a step is being captured, which nodes each op added to the graph.
class OpGraph : public OpMarks {
 public:
  void begin(cudaStream_t s) override;
  void mark(const std::string& name, double bytes, cudaStream_t s) override;
  struct Op {
    std::string name;
    double bytes;
    std::vector<cudaGraphNode_t> nodes;
  };
  // After the capture ended: the nodes of each op, in step order.
  std::vector<Op> ops() const;

 private:
  std::vector<Op> ops_;  // nodes: the capture's dependencies right after the op
};

// Captures a step of `batch` (positions not advanced) and times `replays` replays of each
// configuration. Its step launches clusters of at most 8 blocks (cluster_limit()): nodes of
// larger ones cannot be switched back on. Unsplit decoders only: a split step's collectives need every rank to skip the
// same nodes.
GraphProfile profile_graph(Decoder& dec, int batch, int replays, cudaStream_t s);

}  // namespace kestrel::cuda
