// kestrel bench-allreduce: latency of the one-shot all-reduce against NCCL's, per message size,
// over the GPUs of this machine (one thread and stream per GPU). Each kind runs as a CUDA graph
// of kCalls back-to-back calls, as in a captured decode step; a replay's time over kCalls is
// the time per call, and the slowest GPU's replay is the one that counts.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "apps/commands.h"
#include "apps/model_options.h"
#include "backend/cuda/allreduce.h"
#include "backend/cuda/check.h"
#include "backend/cuda/nccl_comm.h"
#include "backend/cuda/rank_threads.h"

namespace kestrel::apps {
namespace {

constexpr int kCalls = 20;  // calls per graph
constexpr int kWarmup = 5;  // replays before timing

struct Options {
  std::string sizes = "4K,16K,64K,256K,1M";
  int gpus = 0;  // 0: every GPU
  int iters = 200;
  std::string json;
};

// "4K,16K,1M": bytes (parse_size: K = 1024, M = 1024 K).
std::vector<int64_t> parse_sizes(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    const int64_t b = int64_t(parse_size(item, "--sizes"));
    if (b % 4) fail("--sizes: ", item, " is not a whole number of floats (4 bytes each)");
    v.push_back(b);
  }
  if (v.empty()) fail("--sizes: no sizes given");
  return v;
}

std::string size_name(int64_t b) {
  if (b % (1024 * 1024) == 0) return std::to_string(b / (1024 * 1024)) + "M";
  if (b % 1024 == 0) return std::to_string(b / 1024) + "K";
  return std::to_string(b);
}

struct GraphExec {
  cudaGraphExec_t g = nullptr;
  ~GraphExec() {
    if (g) cudaGraphExecDestroy(g);
  }
};

// Captures kCalls calls of `call` on s into g.
template <typename F>
void capture(cudaStream_t s, GraphExec& g, F&& call) {
  cudaGraph_t graph;
  KESTREL_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  try {
    for (int i = 0; i < kCalls; ++i) call();
  } catch (...) {
    cudaStreamEndCapture(s, &graph);
    throw;
  }
  KESTREL_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  const cudaError_t e = cudaGraphInstantiate(&g.g, graph, 0);
  cudaGraphDestroy(graph);
  KESTREL_CUDA_CHECK(e);
}

// Microseconds per call of each of `iters` replays, the ranks starting together.
std::vector<double> replay(const GraphExec& g, cudaStream_t s, int iters, cuda::RankThreads& ranks) {
  ranks.sync();
  for (int i = 0; i < kWarmup; ++i) KESTREL_CUDA_CHECK(cudaGraphLaunch(g.g, s));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
  ranks.sync();
  std::vector<cudaEvent_t> ev(size_t(iters) + 1, nullptr);
  for (auto& e : ev) KESTREL_CUDA_CHECK(cudaEventCreate(&e));
  std::vector<double> us(static_cast<size_t>(iters));
  KESTREL_CUDA_CHECK(cudaEventRecord(ev[0], s));
  for (int i = 0; i < iters; ++i) {
    KESTREL_CUDA_CHECK(cudaGraphLaunch(g.g, s));
    KESTREL_CUDA_CHECK(cudaEventRecord(ev[size_t(i) + 1], s));
  }
  const cudaError_t e = cudaStreamSynchronize(s);
  for (int i = 0; i < iters && e == cudaSuccess; ++i) {
    float ms = 0;
    KESTREL_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[size_t(i)], ev[size_t(i) + 1]));
    us[size_t(i)] = double(ms) * 1e3 / kCalls;
  }
  for (auto& x : ev) cudaEventDestroy(x);
  KESTREL_CUDA_CHECK(e);
  return us;
}

// Median and 99th percentile of the slowest rank's time in each replay.
std::pair<double, double> stats(const std::vector<std::vector<double>>& per_rank) {
  std::vector<double> v(per_rank[0].size(), 0.0);
  for (const auto& r : per_rank)
    for (size_t i = 0; i < v.size(); ++i) v[i] = std::max(v[i], r[i]);
  std::sort(v.begin(), v.end());
  const size_t p99 = std::min(v.size() - 1, size_t(double(v.size()) * 0.99));
  return {v[v.size() / 2], v[p99]};
}

// Streams, buffers and communicators of every rank, released in order.
struct Ranks {
  std::vector<int> devices;
  std::vector<cudaStream_t> streams;
  std::vector<float*> partial, out;
  std::vector<std::unique_ptr<cuda::NcclCommunicator>> nccl;
  std::unique_ptr<cuda::OneShotGroup> group;
  std::vector<std::unique_ptr<cuda::OneShotAllReduce>> oneshot;

  Ranks(int n, int64_t max_bytes) {
    for (int r = 0; r < n; ++r) devices.push_back(r);
    for (int d : devices) {
      cuda::DeviceGuard g(d);
      streams.push_back(nullptr);
      KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&streams.back(), cudaStreamNonBlocking));
      partial.push_back(nullptr);
      out.push_back(nullptr);
      KESTREL_CUDA_CHECK(cudaMalloc(&partial.back(), size_t(max_bytes)));
      KESTREL_CUDA_CHECK(cudaMalloc(&out.back(), size_t(max_bytes)));
      KESTREL_CUDA_CHECK(cudaMemset(partial.back(), 0, size_t(max_bytes)));
      KESTREL_CUDA_CHECK(cudaMemset(out.back(), 0, size_t(max_bytes)));
      KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
    }
    nccl = cuda::make_nccl_communicators(devices, streams);
    // Large enough for every size: the benchmark times the one-shot kernel itself at each size.
    group = std::make_unique<cuda::OneShotGroup>(devices, max_bytes / 4);
    for (int r = 0; r < n; ++r)
      oneshot.push_back(std::make_unique<cuda::OneShotAllReduce>(*group, r, streams[size_t(r)], nccl[size_t(r)].get()));
  }
  ~Ranks() {
    for (size_t r = 0; r < streams.size(); ++r) cudaStreamSynchronize(streams[r]);
    oneshot.clear();
    group.reset();
    nccl.clear();
    for (size_t r = 0; r < streams.size(); ++r) {
      cudaFree(partial[r]);
      cudaFree(out[r]);
      cudaStreamDestroy(streams[r]);
    }
  }
};

int run_bench_allreduce(const Options& o) {
  const std::vector<int64_t> sizes = parse_sizes(o.sizes);
  if (o.iters < 1) fail("--iters must be positive");
  int count = 0;
  KESTREL_CUDA_CHECK(cudaGetDeviceCount(&count));
  const int n = o.gpus ? o.gpus : std::min(count, cuda::OneShotGroup::kMaxRanks);
  if (n < 1 || n > count) fail("--gpus: ", o.gpus, " asked for, this machine has ", count);
  if (n > cuda::OneShotGroup::kMaxRanks) fail("--gpus: at most ", cuda::OneShotGroup::kMaxRanks);
  const int64_t max_bytes = *std::max_element(sizes.begin(), sizes.end());
  Ranks ranks(n, max_bytes);
  cuda::RankThreads threads(ranks.devices);

  std::string list;
  for (int d : ranks.devices) list += (list.empty() ? "" : ", ") + std::to_string(d);
  std::printf("all-reduce over %d GPU%s (%s): float32 sum, %d calls per CUDA graph, %d replays;\n", n,
              n > 1 ? "s" : "", list.c_str(), kCalls, o.iters);
  std::printf("microseconds per call, median and p99 over replays (a replay counts its slowest GPU)\n");
  if (n == 1)
    std::printf("one GPU: both columns time the one-rank paths (one-shot: a device copy; NCCL: its one-rank\n"
                "all-reduce); nothing is communicated\n");
  if (max_bytes > cuda::OneShotGroup::kDefaultMaxFloats * 4)
    std::printf("(the engine hands sizes above %s to NCCL; here every size runs one-shot)\n",
                size_name(cuda::OneShotGroup::kDefaultMaxFloats * 4).c_str());
  std::printf("%8s %12s %9s %12s %9s\n", "size", "one-shot", "p99", "nccl", "p99");
  nlohmann::json rows = nlohmann::json::array();
  for (int64_t bytes : sizes) {
    const int64_t floats = bytes / 4;
    std::vector<std::vector<double>> os(static_cast<size_t>(n)), nc(static_cast<size_t>(n));
    threads.run(
        [&](int r) {
          const cudaStream_t s = ranks.streams[size_t(r)];
          GraphExec g_os, g_nc;
          const size_t k = size_t(r);
          capture(s, g_os, [&] { ranks.oneshot[k]->all_reduce_sum(ranks.partial[k], ranks.out[k], floats, s); });
          capture(s, g_nc, [&] { ranks.nccl[k]->all_reduce_sum(ranks.out[k], floats); });
          os[size_t(r)] = replay(g_os, s, o.iters, threads);
          ranks.group->check();
          nc[size_t(r)] = replay(g_nc, s, o.iters, threads);
        },
        [&] {
          ranks.group->abort();
          ranks.nccl[0]->abort();
        });
    const auto [os_med, os_p99] = stats(os);
    const auto [nc_med, nc_p99] = stats(nc);
    std::printf("%8s %12.2f %9.2f %12.2f %9.2f\n", size_name(bytes).c_str(), os_med, os_p99, nc_med, nc_p99);
    std::fflush(stdout);
    rows.push_back({{"bytes", bytes}, {"oneshot_median_us", os_med}, {"oneshot_p99_us", os_p99},
                    {"nccl_median_us", nc_med}, {"nccl_p99_us", nc_p99}});
  }
  if (!o.json.empty()) {
    const nlohmann::json j = {{"gpus", n}, {"devices", ranks.devices}, {"calls_per_graph", kCalls},
                              {"replays", o.iters}, {"sizes", rows}};
    FILE* f = std::fopen(o.json.c_str(), "w");
    if (!f) fail(o.json, ": cannot open for writing");
    std::fputs(j.dump(2).c_str(), f);
    std::fclose(f);
  }
  return 0;
}

}  // namespace

Run add_bench_allreduce(CLI::App& app) {
  auto o = std::make_shared<Options>();
  app.add_option("--sizes", o->sizes,
                 "Message sizes in bytes, comma-separated, K and M allowed (default 4K,16K,64K,256K,1M)");
  app.add_option("--gpus", o->gpus, "GPUs taking part, 0 .. N-1 (default: every GPU)");
  app.add_option("--iters", o->iters, "Timed replays of each graph (default 200)");
  app.add_option("--json", o->json, "Also write the results as JSON to this file");
  return [o]() { return run_bench_allreduce(*o); };
}

}  // namespace kestrel::apps
