#include <algorithm>
#include <map>
#include <set>

#include "backend/cuda/check.h"
#include "backend/cuda/decoder.h"
#include "backend/cuda/graph_profile.h"
#include "backend/cuda/launch.cuh"

namespace kestrel::cuda {

void OpGraph::begin(cudaStream_t) { ops_.clear(); }

void OpGraph::mark(const std::string& name, double bytes, cudaStream_t s) {
  cudaStreamCaptureStatus status;
  const cudaGraphNode_t* deps = nullptr;
  size_t n = 0;
  KESTREL_CUDA_CHECK(cudaStreamGetCaptureInfo(s, &status, nullptr, nullptr, &deps, nullptr, &n));
  if (status != cudaStreamCaptureStatusActive) fail("internal: OpGraph used outside a stream capture");
  ops_.push_back({name, bytes, std::vector<cudaGraphNode_t>(deps, deps + n)});
}

std::vector<OpGraph::Op> OpGraph::ops() const {
  // Walk back from each op's last nodes to the nodes of earlier ops: what lies between is its own.
  std::set<cudaGraphNode_t> seen;
  std::vector<Op> out;
  for (const Op& op : ops_) {
    Op mine{op.name, op.bytes, {}};
    std::vector<cudaGraphNode_t> todo(op.nodes.begin(), op.nodes.end());
    while (!todo.empty()) {
      const cudaGraphNode_t node = todo.back();
      todo.pop_back();
      if (!seen.insert(node).second) continue;
      mine.nodes.push_back(node);
      size_t n = 0;
      KESTREL_CUDA_CHECK(cudaGraphNodeGetDependencies(node, nullptr, nullptr, &n));
      std::vector<cudaGraphNode_t> deps(n);
      std::vector<cudaGraphEdgeData> edges(n);  // PDL edges carry data: asking without it is an error
      if (n) KESTREL_CUDA_CHECK(cudaGraphNodeGetDependencies(node, deps.data(), edges.data(), &n));
      todo.insert(todo.end(), deps.begin(), deps.end());
    }
    out.push_back(std::move(mine));
  }
  return out;
}

namespace {

// Nodes cudaGraphNodeSetEnabled can switch off.
bool switchable(cudaGraphNode_t node) {
  cudaGraphNodeType t;
  KESTREL_CUDA_CHECK(cudaGraphNodeGetType(node, &t));
  return t == cudaGraphNodeTypeKernel || t == cudaGraphNodeTypeMemset || t == cudaGraphNodeTypeMemcpy;
}

}  // namespace

GraphProfile profile_graph(Decoder& dec, int batch, int replays, cudaStream_t s) {
  if (s == nullptr) fail("internal: profile_graph needs a stream other than the legacy default stream");
  OpGraph marks;
  cudaGraph_t graph;
  const int limit = cluster_limit();
  cluster_limit() = std::min(limit, 8);
  cluster_lowered() = false;
  KESTREL_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  try {
    dec.step(batch, s, &marks);
  } catch (...) {
    cudaStreamEndCapture(s, &graph);
    cluster_limit() = limit;
    throw;
  }
  cluster_limit() = limit;
  KESTREL_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  const std::vector<OpGraph::Op> ops = marks.ops();
  cudaGraphExec_t exec;
  KESTREL_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  // The ops by name, in order of first appearance.
  GraphProfile p;
  if (cluster_lowered())
    p.note = "the router's cluster is held to 8 blocks here (16 in the decoder's own step), since the driver "
             "cannot switch a node of a larger cluster back on";
  std::map<std::string, size_t> index;
  std::vector<std::vector<cudaGraphNode_t>> nodes_of;
  std::vector<cudaGraphNode_t> all;
  for (const OpGraph::Op& op : ops) {
    auto [it, fresh] = index.emplace(op.name, p.ops.size());
    if (fresh) {
      p.ops.push_back({op.name});
      nodes_of.emplace_back();
    }
    GraphOpTime& t = p.ops[it->second];
    t.calls += 1;
    t.bytes += op.bytes;
    for (cudaGraphNode_t n : op.nodes)
      if (switchable(n)) nodes_of[it->second].push_back(n), all.push_back(n);
    t.nodes = int(nodes_of[it->second].size());
  }
  auto enable = [&](const std::vector<cudaGraphNode_t>& nodes, bool on) {
    for (cudaGraphNode_t n : nodes) KESTREL_CUDA_CHECK(cudaGraphNodeSetEnabled(exec, n, on ? 1 : 0));
  };
  cudaEvent_t e0, e1;
  KESTREL_CUDA_CHECK(cudaEventCreate(&e0));
  KESTREL_CUDA_CHECK(cudaEventCreate(&e1));
  auto time = [&] {  // ms per replay, after 3 replays of warm-up
    for (int i = 0; i < 3; ++i) KESTREL_CUDA_CHECK(cudaGraphLaunch(exec, s));
    KESTREL_CUDA_CHECK(cudaEventRecord(e0, s));
    for (int i = 0; i < replays; ++i) KESTREL_CUDA_CHECK(cudaGraphLaunch(exec, s));
    KESTREL_CUDA_CHECK(cudaEventRecord(e1, s));
    KESTREL_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    KESTREL_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    return double(ms) / replays;
  };
  try {
    p.step_ms = time();
    enable(all, false);
    p.empty_ms = time();
    for (size_t k = 0; k < p.ops.size(); ++k) {
      enable(nodes_of[k], true);
      p.ops[k].alone_ms = std::max(0.0, time() - p.empty_ms);
      enable(nodes_of[k], false);
    }
    enable(all, true);
  } catch (...) {
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    cudaGraphExecDestroy(exec), cudaGraphDestroy(graph);
    throw;
  }
  // One more full replay, so the decoder's buffers hold a real step's values again.
  KESTREL_CUDA_CHECK(cudaGraphLaunch(exec, s));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  cudaGraphExecDestroy(exec), cudaGraphDestroy(graph);
  return p;
}

}  // namespace kestrel::cuda
