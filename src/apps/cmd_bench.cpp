// kestrel bench: decode steps on the GPU, timed with and without the CUDA graph, against the
// floor (bytes the step must read / measured memory bandwidth).
#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <cstdio>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "apps/commands.h"
#include "apps/model_options.h"
#include "apps/svg_bars.h"
#include "backend/cuda/check.h"
#include "backend/cuda/decoder.h"
#include "backend/cuda/device_model.h"
#include "backend/cuda/graph_profile.h"
#include "backend/cuda/op_timer.h"
#include "backend/cuda/prefill_gemm.h"
#include "backend/cuda/stages/stage_step.h"
#include "backend/cuda/rank_group.h"
#include "backend/cuda/read_chain.h"
#include "backend/cuda/session.h"
#include "backend/cuda/upload.h"
#include "formats/json_file.h"
#include "model/weights.h"
#include "parallel/shard.h"
#include "plan/decode_cost.h"
#include "plan/gpus.h"
#include "plan/roofline.h"

namespace kestrel::apps {
namespace {

struct Options {
  std::string model, config;
  bool random_weights = false;
  std::string batches = "1,8";
  int64_t context = 1024;
  int64_t capacity = 0;  // 0: context + 2 steps + 8
  int steps = 100;
  std::string json, plot;
  bool ops = false;
  int64_t layers = 0;  // 0: all
  Layout layout;
  std::string prefill;  // prompt lengths to prefill, comma-separated; empty: none
  int chunk = cuda::Session::kDefaultChunk;
  int gemm_chunk = cuda::Session::kDefaultGemmChunk;  // 0: the decode step's chunks only
  double tflops = 790;  // dense BF16 the compute floor assumes (issue 31: what an H200 reaches)
  std::string kv_dtype = "auto";
  bool stages = false;      // also time the stage step (1 to 8 sequences)
  int speculative = 0;      // also time checks of 2 .. this + 1 tokens against one token's step
};

struct OpRow {
  std::string name;
  int calls = 0;
  double bytes = 0;
  std::vector<double> ms;  // per step
};

// Bytes per cached value of a decoder's KV cache (the floor's KV reads).
double kv_value_bytes(const cuda::Decoder& dec) { return double(cuda::kv_type_bytes(dec.kv_type())); }

// Per-op times inside the step's CUDA graph (cuda::profile_graph): each op alone against its
// floor, and the rest of the step as time between ops, so the rows add up to the step. Returns
// the rows for a plot.
std::vector<BarRow> print_graph_ops(cuda::Decoder& dec, const ModelConfig& c, int B, int64_t context, int replays,
                                    double bw, cudaStream_t s, nlohmann::json& out) {
  // The attention op is charged with its layer's share of the KV cache reads (MLA: the latent rows
  // it attends to and the indexer keys it scores).
  const double kv_per_layer = decode_cost(c, B, context, kv_value_bytes(dec)).kv_cache / double(c.num_layers);
  const cuda::GraphProfile p = cuda::profile_graph(dec, B, replays, s);
  std::printf("  per op at batch %d, inside the step's CUDA graph (the op's nodes alone, %d replays each)\n", B, replays);
  std::printf("  %-16s %5s %6s %10s %7s %10s %7s %9s %9s %9s %8s\n", "op", "calls", "nodes", "time us", "share", "MB",
              "GB/s", "floor us", "chain us", "early us", "x floor");
  std::vector<BarRow> bars;
  double sum = 0;
  for (const auto& o : p.ops) {
    const double bytes = o.bytes + (o.name == "attention" ? kv_per_layer * o.calls : 0.0);
    const double floor_us = bytes / bw * 1e6, us = o.alone_ms * 1e3;
    // As many kernels as the op's nodes, each only reading an equal share of its bytes.
    auto chain = [&](bool early) {
      return bytes > 0 && o.nodes > 0 ? o.nodes * cuda::chained_read_us(size_t(bytes / o.nodes), early, s) : 0.0;
    };
    const double chain_us = chain(false), early_us = chain(true);
    sum += us;
    std::printf("  %-16s %5d %6d %10.1f %6.1f%% %10.2f %7.0f %9.1f %9.1f %9.1f %8.1f\n", o.name.c_str(), o.calls,
                o.nodes, us, 100.0 * o.alone_ms / p.step_ms, bytes / 1e6, us > 0 ? bytes / us / 1e3 : 0.0, floor_us,
                chain_us, early_us, floor_us > 0 ? us / floor_us : 0.0);
    out.push_back({{"op", o.name}, {"batch", B}, {"calls", o.calls}, {"nodes", o.nodes}, {"us", us}, {"bytes", bytes},
                   {"floor_us", floor_us}, {"chain_us", chain_us}, {"early_us", early_us}});
    bars.push_back({o.name, us, floor_us, chain_us});
  }
  const double between = p.step_ms * 1e3 - sum;
  std::printf("  %-16s %5s %6s %10.1f %6.1f%%\n", "between ops", "", "", between, 100.0 * between / (p.step_ms * 1e3));
  std::printf("  %-16s %5s %6s %10.1f\n", "step (graph)", "", "", p.step_ms * 1e3);
  std::printf("  between ops: each kernel's wait for its predecessor in the chain, less the overlap an op gets\n"
              "  when replayed alone (its kernels may start early across the disabled nodes: ops of many tiny\n"
              "  kernels, like rms_norm, read low); the empty graph (%.1f us) is taken off every op\n"
              "  chain us: as many kernels as the op's nodes, in a chain where each only waits for the one before\n"
              "  and then streams its share of the op's bytes (cuda::chained_read_us): what launching, filling and\n"
              "  draining kernels of that size costs anyway; early us: the same kernels reading before they wait\n"
              "  (as weights may be read behind the kernel before)\n",
              p.empty_ms * 1e3);
  if (!p.note.empty()) std::printf("  profiled step: %s\n", p.note.c_str());
  out.push_back({{"op", "between_ops"}, {"batch", B}, {"us", between}, {"step_us", p.step_ms * 1e3}});
  bars.push_back({"between ops", between, 0.0});
  return bars;
}

// The stage step at `context` (it does not advance the positions), from one graph: its time
// against the floor, then each kind of stage's time per step (every block's run and whole time,
// averaged over the blocks, from one traced step) against the bytes it must read.
nlohmann::json bench_stages(const cuda::DeviceModel& dm, cuda::Decoder& dec, int B, int64_t context, int steps,
                            double bw, double floor_ms, const std::function<void()>& reset, cudaStream_t s) {
  const ModelConfig& c = dm.config();
  cuda::StageStep st(dm, dec, B);
  reset();
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  KESTREL_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  st.run(s);
  KESTREL_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  KESTREL_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  for (int i = 0; i < 3; ++i) KESTREL_CUDA_CHECK(cudaGraphLaunch(exec, s));
  cudaEventRecord(e0, s);
  for (int i = 0; i < steps; ++i) KESTREL_CUDA_CHECK(cudaGraphLaunch(exec, s));
  cudaEventRecord(e1, s);
  KESTREL_CUDA_CHECK(cudaEventSynchronize(e1));
  st.check();
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  const double sm = double(ms) / steps;
  std::printf("%6s stage step: %.3f ms (%.2f x floor, %d blocks, %d barriers)\n", "", sm, sm / floor_ms, st.blocks(),
              st.barriers());
  // Bytes each kind of stage reads per step.
  const DecodeCost cost = decode_cost(c, B, context, kv_value_bytes(dec));
  const double share = c.num_experts > 0 ? cost.expected_experts / double(c.num_experts) : 0.0;
  std::map<cuda::Stage, double> bytes;
  for (const cuda::DLayer& L : dm.layers()) {
    bytes[cuda::Stage::Qkv] += double(L.q.bytes() + L.k.bytes() + L.v.bytes());
    bytes[cuda::Stage::O] += double(L.o.bytes());
    if (L.is_moe) {
      const cuda::DMoe& m = L.moe;
      bytes[cuda::Stage::Router] += double(m.router.w.bytes());
      const double ex = double(m.expert_gate.bytes()) * double(c.num_experts) * share;  // gate, up, down alike
      bytes[cuda::Stage::ExpertGateUp] += 2 * ex + (m.has_shared ? double(m.shared_gate.bytes() + m.shared_up.bytes()) : 0);
      bytes[cuda::Stage::ExpertDown] += ex + (m.has_shared ? double(m.shared_down.bytes()) : 0);
    } else {
      bytes[cuda::Stage::MlpGateUp] += double(L.gate.bytes() + L.up.bytes());
      bytes[cuda::Stage::MlpDown] += double(L.down.bytes());
    }
  }
  bytes[cuda::Stage::Attention] = cost.kv_cache;
  bytes[cuda::Stage::Head] = double(dm.lm_head().bytes());
  int khz = 0, dev = 0;
  KESTREL_CUDA_CHECK(cudaGetDevice(&dev));
  KESTREL_CUDA_CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev));
  const double per_ms = double(khz);  // cycles of one SM in a millisecond
  std::printf("%6s %-17s %6s %9s %9s %9s %8s %9s\n", "", "stage", "count", "run ms", "stage ms", "MB", "floor ms",
              "x floor");
  nlohmann::json stages = nlohmann::json::array();
  for (const auto& t : st.trace(s)) {
    const double mb = bytes.count(t.stage) ? bytes[t.stage] / 1e6 : 0.0, fl = mb * 1e6 / bw * 1e3;
    const double wall = t.wall_cycles / per_ms;
    std::printf("%6s %-17s %6d %9.3f %9.3f %9.1f %8.3f", "", cuda::stage_name(t.stage), t.count, t.run_cycles / per_ms,
                wall, mb, fl);
    if (fl > 0) std::printf(" %9.2f\n", wall / fl);
    else std::printf(" %9s\n", "-");
    stages.push_back({{"stage", cuda::stage_name(t.stage)}, {"count", t.count}, {"run_ms", t.run_cycles / per_ms},
                      {"stage_ms", wall}, {"bytes", mb * 1e6}});
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return {{"stage_ms", sm}, {"stages", stages}};
}

// Per-op times of `steps` plain-launch steps at batch B with an event after each op (a split
// model: its collectives need every rank to run the same nodes, so the graph profile does not
// apply), summed per op name within a step; the median over steps is reported, with how far the
// sum is from the step timed without events (graph_ms, no_graph_ms). Returns the rows for a plot.
std::vector<BarRow> print_event_ops(cuda::Decoder& dec, const ModelConfig& c, int B, int64_t context, int steps, double bw,
                              double graph_ms, double no_graph_ms, cudaStream_t s, nlohmann::json& out) {
  cuda::OpTimer timer;
  std::vector<OpRow> rows;
  // The attention op is charged with its layer's share of the KV cache reads (MLA: the latent rows
  // it attends to and the indexer keys it scores).
  const double kv_per_layer = decode_cost(c, B, context, kv_value_bytes(dec)).kv_cache / double(c.num_layers);
  for (int i = 0; i < steps + 2; ++i) {
    dec.step(B, s, &timer);
    const auto ops = timer.finish();
    if (i < 2) continue;  // warm-up
    std::vector<double> step_ms(rows.size(), 0.0);
    for (const auto& o : ops) {
      auto it = std::find_if(rows.begin(), rows.end(), [&](const OpRow& r) { return r.name == o.name; });
      if (it == rows.end()) {
        rows.push_back(OpRow{o.name, 0, 0.0, {}});
        step_ms.push_back(0.0);
        it = rows.end() - 1;
      }
      const size_t k = size_t(it - rows.begin());
      step_ms[k] += o.ms;
      if (i == 2) {
        it->calls += 1;
        it->bytes += o.bytes + (o.name == "attention" ? kv_per_layer : 0.0);
      }
    }
    for (size_t k = 0; k < rows.size(); ++k) rows[k].ms.push_back(step_ms[k]);
  }
  double total = 0;
  for (auto& r : rows) {
    std::sort(r.ms.begin(), r.ms.end());
    total += r.ms[r.ms.size() / 2];
  }
  std::printf("  per op at batch %d (plain launches, an event after each op; median of %d steps)\n", B, steps);
  std::printf("  %-14s %6s %10s %8s %10s %10s %9s\n", "op", "calls", "time us", "share", "MB", "floor us", "x floor");
  for (const auto& r : rows) {
    const double ms = r.ms[r.ms.size() / 2], floor_us = r.bytes / bw * 1e6;
    std::printf("  %-14s %6d %10.1f %7.1f%% %10.2f %10.1f %9.1f\n", r.name.c_str(), r.calls, ms * 1e3,
                100.0 * ms / total, r.bytes / 1e6, floor_us, floor_us > 0 ? ms * 1e3 / floor_us : 0.0);
    out.push_back({{"op", r.name}, {"batch", B}, {"calls", r.calls}, {"us", ms * 1e3}, {"bytes", r.bytes},
                   {"floor_us", floor_us}});
  }
  std::printf("  %-14s %6s %10.1f\n", "total", "", total * 1e3);
  std::printf("  the same step without events: %.1f us with plain launches, %.1f us as one CUDA graph;\n"
              "  the events between ops add %.1f us (%.0f%%), and the graph saves %.1f us of launch gaps\n",
              no_graph_ms * 1e3, graph_ms * 1e3, (total - no_graph_ms) * 1e3, 100.0 * (total - no_graph_ms) / no_graph_ms,
              (no_graph_ms - graph_ms) * 1e3);
  std::vector<BarRow> bars;
  for (const auto& r : rows) bars.push_back({r.name, r.ms[r.ms.size() / 2] * 1e3, r.bytes / bw * 1e6});
  return bars;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// How long a checkpoint took from opening to being on the GPU(s), by phase.
void print_ready(double open_s, double cuda_s, double upload_s, double total_s) {
  std::printf("ready on the GPU %.1f s after opening the checkpoint (config and headers %.2f s, GPU start-up %.2f s, "
              "weight upload %.2f s)\n",
              total_s, open_s, cuda_s, upload_s);
}

// Device-to-device copy of 4 GiB: bytes read + written over time (the bandwidth ceiling).
double measure_bandwidth() {
  const size_t n = size_t(2) << 30;
  void *a, *b;
  KESTREL_CUDA_CHECK(cudaMalloc(&a, n));
  KESTREL_CUDA_CHECK(cudaMalloc(&b, n));
  KESTREL_CUDA_CHECK(cudaMemset(a, 1, n));
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<float> ms;
  for (int i = 0; i < 6; ++i) {
    cudaEventRecord(e0);
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice));
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float t;
    cudaEventElapsedTime(&t, e0, e1);
    if (i) ms.push_back(t);
  }
  cudaFree(a);
  cudaFree(b);
  std::sort(ms.begin(), ms.end());
  return 2.0 * double(n) / (double(ms[ms.size() / 2]) * 1e-3);
}

std::vector<int> parse_list(const std::string& s, const char* flag, int most) {
  std::vector<int> v;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    try {
      v.push_back(std::stoi(item));
    } catch (const std::exception&) {
      fail(flag, ": '", item, "' is not a number");
    }
    if (v.back() < 1 || v.back() > most) fail(flag, ": ", v.back(), " is outside 1..", most);
  }
  return v;
}

// Weights one token multiplies, all layers: the attention projections (MLA: the latent ones;
// without GLM-5's indexer), the router and the top-k and shared experts, or the dense MLP. Not
// the embedding (a row read) nor the LM head (the last position only).
double active_weights(const ModelConfig& c) {
  const double H = double(c.hidden_size), nq = double(c.num_heads);
  double attention = H * double(c.head_dim) * (2 * nq + 2 * double(c.num_kv_heads));
  if (c.is_mla()) {
    const MlaConfig& m = c.mla;
    const double q = m.q_lora_rank > 0 ? H * double(m.q_lora_rank) + double(m.q_lora_rank) * nq * double(m.qk_head_dim())
                                       : H * nq * double(m.qk_head_dim());
    attention = q + H * double(m.kv_lora_rank + m.qk_rope_head_dim) +
                double(m.kv_lora_rank) * nq * double(m.qk_nope_head_dim + m.v_head_dim) + nq * double(m.v_head_dim) * H;
  }
  double total = 0;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    total += attention;
    if (c.is_moe_layer(l))
      total += H * double(c.num_experts) +
               3 * H * double(c.moe_intermediate_size) * double(c.experts_per_token + c.num_shared_experts);
    else
      total += 3 * H * double(c.intermediate_size);
  }
  return total;
}

// The arithmetic of a prompt of n tokens: 2 flops per active weight per token, causal attention
// (scores and values: 4 x head_dim flops per query head and (query, key) pair; MLA: the latent
// width) and the LM head for the last position.
double prefill_flops(const ModelConfig& c, int64_t n) {
  const double pairs = double(n) * double(n + 1) / 2;
  const double width = c.is_mla() ? double(c.mla.kv_lora_rank + c.mla.qk_rope_head_dim) + double(c.mla.kv_lora_rank)
                                  : 2 * double(c.head_dim);
  const double attention = double(c.num_layers) * pairs * double(c.num_heads) * 2 * width;
  return 2 * active_weights(c) * double(n) + attention + 2 * double(c.vocab_size) * double(c.hidden_size);
}

// Prefill of one prompt per length through a Session (what generate and chat run), host time
// from the first copy to the last position's logits on the host (median of 3 after a warm-up
// run that captures the graphs), by both paths: the decode step's chunks of `chunk` positions
// and the GEMM prefill's chunks of `gemm_chunk` (prefill_gemm.h; 0 or a model it does not take:
// not run). Two floors: the weights each chunk's tokens touch, read once per chunk (what the
// decode step's chunks near), and the arithmetic at `tflops` of dense BF16 (what the GEMMs near).
nlohmann::json bench_prefill(const cuda::DeviceModel& dm, const std::vector<int>& lengths, int chunk, int gemm_chunk,
                             cuda::KvType kv, double bw, double tflops) {
  const ModelConfig& c = dm.config();
  nlohmann::json out = nlohmann::json::array();
  const std::string why = cuda::GemmPrefill::unsupported(dm);
  if (gemm_chunk > 0 && !why.empty()) std::printf("(the GEMM prefill does not take %s: not run)\n", why.c_str());
  const bool gemm = gemm_chunk > 0 && why.empty();
  std::printf("prefill (one sequence, last position's logits): decode step in chunks of %d", chunk);
  if (gemm) std::printf(", GEMM prefill in chunks of %d", gemm_chunk);
  std::printf("; compute floor at %.0f TFLOP/s\n", tflops);
  std::printf("%8s %6s %11s %9s %12s %14s %8s %14s %9s\n", "tokens", "path", "ms", "tok/s", "ms per step",
              "weights floor", "x floor", "compute floor", "x compute");
  std::vector<float> logits(size_t(c.vocab_size));
  const double kvb = double(cuda::kv_type_bytes(kv));
  for (int n : lengths) {
    std::vector<int32_t> tok(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) tok[size_t(i)] = int32_t((int64_t(i) * 7919 + 13) % c.vocab_size);
    const double compute_ms = prefill_flops(c, n) / (tflops * 1e12) * 1e3;
    double decode_tps = 0;
    for (const int path_chunk : {0, gemm ? gemm_chunk : -1}) {
      if (path_chunk < 0) continue;
      const bool g = path_chunk > 0;
      // The GEMM prefill at every length, below Session::kGemmMinTokens too (where the crossing lies).
      cuda::Session session(dm, n, chunk, kv, path_chunk, 1);
      std::vector<double> ms;
      for (int round = 0; round < 4; ++round) {
        session.reset();
        const auto t0 = std::chrono::steady_clock::now();
        session.run(tok, logits.data(), false);
        const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        if (round > 0) ms.push_back(t);
      }
      std::sort(ms.begin(), ms.end());
      const double med = ms[ms.size() / 2];
      const int step = g ? path_chunk : chunk, steps = (n + step - 1) / step;
      double floor_ms = 0;
      for (int i = 0; i < steps; ++i) {
        const DecodeCost cost = decode_cost(c, std::min(step, n - i * step), 1, kvb);
        floor_ms += (cost.total() - cost.kv_cache - cost.lm_head) / bw * 1e3;
      }
      floor_ms += decode_cost(c, 1, 1, kvb).lm_head / bw * 1e3;  // the LM head runs for the last row only
      const double tps = n * 1e3 / med;
      std::printf("%8d %6s %11.2f %9.0f %12.3f %14.3f %8.2f %14.3f %9.2f", n, g ? "gemm" : "decode", med, tps,
                  med / steps, floor_ms, med / floor_ms, compute_ms, med / compute_ms);
      if (g && decode_tps > 0) std::printf("  (%.2fx the decode step's)", tps / decode_tps);
      std::printf("\n");
      if (!g) decode_tps = tps;
      out.push_back({{"tokens", n}, {"path", g ? "gemm" : "decode"}, {"chunk", step}, {"ms", med},
                     {"tokens_per_s", tps}, {"weights_floor_ms", floor_ms}, {"compute_floor_ms", compute_ms}});
    }
  }
  return out;
}

// A speculative check at the context: one sequence through a Session (what generate, chat and a
// server's check run) with `context` positions cached, then 1 to max_drafts + 1 tokens in one
// call with every row's logits copied back, rewound after each call (as a check that accepts
// nothing). Host time per call, median of `steps` after two calls that capture the graphs; the
// one-token call is the plain step a check replaces.
nlohmann::json bench_speculative(const cuda::DeviceModel& dm, int64_t context, int max_drafts, cuda::KvType kv,
                                 int steps) {
  const ModelConfig& c = dm.config();
  const int rows_most = max_drafts + 1;
  cuda::Session session(dm, int(context) + rows_most, cuda::Session::kDefaultChunk, kv);
  std::vector<int32_t> tok(size_t(context) + size_t(rows_most));
  for (size_t i = 0; i < tok.size(); ++i) tok[i] = int32_t((int64_t(i) * 7919 + 13) % c.vocab_size);
  std::vector<float> logits(size_t(rows_most) * size_t(c.vocab_size));
  session.run({tok.data(), size_t(context)}, logits.data(), false);
  std::printf("speculative checks (one sequence at context %lld, every row's logits copied back)\n", (long long)context);
  std::printf("%8s %10s %12s %14s\n", "tokens", "ms", "x one token", "ms per token");
  nlohmann::json out = nlohmann::json::array();
  double one = 0;
  for (int r = 1; r <= rows_most; ++r) {
    std::vector<double> ms;
    for (int i = 0; i < steps + 2; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      session.run({tok.data() + context, size_t(r)}, logits.data(), true);
      const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      session.rewind(int(context));
      if (i >= 2) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    const double med = ms[ms.size() / 2];
    if (r == 1) one = med;
    std::printf("%8d %10.3f %12.2f %14.3f\n", r, med, med / one, med / r);
    out.push_back({{"tokens", r}, {"ms", med}, {"x_one_token", med / one}});
  }
  return out;
}


int run_bench(const Options* o);

void add_common(CLI::App& app, Options* o) {
  app.add_option("--model", o->model, "Model folder (its weights are uploaded)");
  app.add_option("--config", o->config, "config.json whose shapes get random weights (with --random-weights)");
  app.add_flag("--random-weights", o->random_weights, "Fill the model's shapes with random weights on the GPU");
  app.add_option("--batch", o->batches, "Batch sizes, comma-separated (bench: 1,8; profile: 1)");
  app.add_option("--context", o->context, "Positions already in each sequence's KV cache (default 1024)");
  app.add_option("--capacity", o->capacity,
                 "Positions each sequence's KV cache is sized for (default: just above --context); a server "
                 "sizes it for its longest request");
  app.add_option("--steps", o->steps, "Timed decode steps per batch size (bench: 100; profile: 30)");
  app.add_option("--json", o->json, "Also write the results as JSON to this file");
  app.add_option("--plot", o->plot, "With the per-op times: an SVG of each op against its floor (first batch size)");
  add_layout_options(app, o->layout);
  app.add_option("--prefill", o->prefill, "Also time the prefill of one prompt of each of these lengths (e.g. 512,4096)");
  app.add_option("--chunk", o->chunk, "Positions per prefill step of the decode step's path (default 64)");
  app.add_option("--gemm-chunk", o->gemm_chunk,
                 "Positions per chunk of the GEMM prefill, timed beside the decode step's (default 4096; 0: not run)");
  app.add_option("--bf16-tflops", o->tflops, "Dense BF16 TFLOP/s of the prefill's compute floor (default 790)");
  app.add_option("--speculative", o->speculative,
                 "Also time a speculative check of 2 .. K + 1 tokens at the context against one token's step "
                 "(K 1..16)");
  add_kv_dtype_option(app, o->kv_dtype);
  app.add_option("--layers", o->layers,
                 "With --random-weights: only the first N layers (a slice of a model larger than the GPU)");
}

// The first n layers of a configuration: the same shapes per layer, a shallower model.
ModelConfig first_layers(ModelConfig c, int64_t n) {
  if (n < 1 || n > c.num_layers) fail("--layers: expected 1..", c.num_layers, ", got ", n);
  c.num_layers = n;
  c.moe_layer.resize(size_t(n));
  if (c.indexer.enabled()) c.indexer.own.resize(size_t(n));
  return c;
}

}  // namespace

Run add_bench(CLI::App& app) {
  auto o = std::make_shared<Options>();
  add_common(app, o.get());
  app.add_flag("--ops", o->ops, "Also time every op of the step and compare each with its floor");
  app.add_flag("--stages", o->stages,
               "Also time the stage step (batches of 1 to 8: one launch, a grid barrier between stages) and each "
               "stage against its floor");
  return [o]() { return run_bench(o.get()); };
}

// kestrel profile: the per-op view of bench (where the time of a step goes), batch 1 by default.
Run add_profile(CLI::App& app) {
  auto o = std::make_shared<Options>();
  o->ops = true;
  o->batches = "1";
  o->steps = 30;
  add_common(app, o.get());
  return [o]() { return run_bench(o.get()); };
}

namespace {

// The tokens of a benchmark batch: different ids, so that the rows route to different experts as
// real sequences do (identical rows would select the same experts and flatter the MoE kernels).
std::vector<int32_t> bench_tokens(int batch, int64_t vocab) {
  std::vector<int32_t> tok(static_cast<size_t>(batch));
  for (int b = 0; b < batch; ++b) tok[size_t(b)] = int32_t((int64_t(b) * 7919) % vocab);
  return tok;
}

// A split model: rank r's part on GPU r, each rank timing its own stream (the ranks move in
// lock step through their collectives); the floor is the roofline of the same layout.
int run_split_bench(const Options* o, const std::vector<int>& batches) {
  const Layout& layout = o->layout;
  std::unique_ptr<Model> host;
  ModelConfig full;
  const auto t0 = std::chrono::steady_clock::now();
  double open_s = 0;
  if (!o->model.empty() && !o->random_weights) {
    host = load_model(o->model, Progress::Off);  // no read pass: the upload's threads read the weights
    full = host->config;
    open_s = seconds_since(t0);
  } else {
    full = o->model.empty() ? parse_model_config_and_quant(read_json_file(o->config), o->config)
                            : load_model_config(o->model);
    if (o->layers) full = first_layers(full, o->layers);
  }
  cuda::RankGroup group(layout.ranks());
  const double cuda_s = seconds_since(t0) - open_s;
  std::vector<std::unique_ptr<cuda::DeviceModel>> models(size_t(layout.ranks()));
  cuda::UploadMeter meter(layout.ranks());
  cuda::UploadOptions uo;
  uo.meter = &meter;
  group.run([&](int r) {
    models[size_t(r)] = host ? cuda::DeviceModel::upload(*shard_model(*host, layout, r), uo)
                             : cuda::DeviceModel::random(full, 1, layout, r);
  });
  if (host) {
    const double upload_s = meter.seconds();
    meter.report();
    print_ready(open_s, cuda_s, upload_s, seconds_since(t0));
  }
  const double bw = measure_bandwidth();
  const cuda::KvType kv = kv_type_for(full, o->kv_dtype);
  std::printf("model: %s, %lld layers%s, %s over %d GPUs, %.2f GiB of weights on GPU 0, %s KV cache\n",
              full.architecture.c_str(), (long long)full.num_layers,
              o->layers ? " (a slice: the first layers of the configuration)" : "", layout.str().c_str(),
              layout.ranks(), double(models[0]->bytes()) / (1ull << 30), cuda::kv_type_name(kv));
  std::printf("measured copy bandwidth: %.0f GB/s on GPU 0 (4 GiB device-to-device, read + write)\n", bw / 1e9);
  std::printf("%6s %9s %11s %11s %9s %9s %8s %9s %10s\n", "batch", "context", "graph ms", "no-graph ms", "floor ms",
              "comm ms", "x floor", "tok/s", "launches");
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  const int cap = int(std::max<int64_t>(o->context + o->steps * 2 + 8, o->capacity));
  std::vector<std::unique_ptr<cuda::Decoder>> decs(models.size());
  group.run([&](int r) {
    cuda::KvSource own;
    own.type = kv;
    decs[size_t(r)] = std::make_unique<cuda::Decoder>(*models[size_t(r)], max_batch, cap, false, group.link(r), own);
  });
  const StepShapes shapes = step_shapes(full);
  nlohmann::json results = nlohmann::json::array();
  for (int B : batches) {
    std::vector<double> graph_ms(models.size()), plain_ms(models.size());
    group.run([&](int r) {
      cuda::Decoder& dec = *decs[size_t(r)];
      const cudaStream_t s = group.stream(r);
      const std::vector<int32_t> tok = bench_tokens(B, full.vocab_size), pos(static_cast<size_t>(B), int32_t(o->context));
      cudaEvent_t e0, e1;
      KESTREL_CUDA_CHECK(cudaEventCreate(&e0));
      KESTREL_CUDA_CHECK(cudaEventCreate(&e1));
      auto time = [&](bool graph) {
        for (int round = 0; round < 2; ++round) {  // warm-up, then timed
          KESTREL_CUDA_CHECK(cudaMemcpyAsync(dec.tokens(), tok.data(), size_t(B) * 4, cudaMemcpyHostToDevice, s));
          KESTREL_CUDA_CHECK(cudaMemcpyAsync(dec.positions(), pos.data(), size_t(B) * 4, cudaMemcpyHostToDevice, s));
          const int n = round == 0 ? 3 : o->steps;
          KESTREL_CUDA_CHECK(cudaEventRecord(e0, s));
          for (int i = 0; i < n; ++i) graph ? dec.step_graph(B, true, s) : dec.step(B, s);
          KESTREL_CUDA_CHECK(cudaEventRecord(e1, s));
          KESTREL_CUDA_CHECK(cudaEventSynchronize(e1));
        }
        float ms;
        cudaEventElapsedTime(&ms, e0, e1);
        return double(ms) / o->steps;
      };
      graph_ms[size_t(r)] = time(true);
      plain_ms[size_t(r)] = time(false);
      cudaEventDestroy(e0);
      cudaEventDestroy(e1);
    });
    const double g = *std::max_element(graph_ms.begin(), graph_ms.end());
    const double ng = *std::max_element(plain_ms.begin(), plain_ms.end());
    const Roofline rf =
        roofline(shapes, layout, B, o->context, kv_value_bytes(*decs[0]), bw / 1e9, find_gpu("h200"));
    std::printf("%6d %9lld %11.3f %11.3f %9.3f %9.3f %8.2f %9.0f %10d\n", B, (long long)o->context, g, ng, rf.floor_ms,
                rf.comm_ms, g / rf.floor_ms, B * 1e3 / g, decs[0]->launches_per_step());
    results.push_back({{"batch", B}, {"context", o->context}, {"tp", layout.tp}, {"ep", layout.ep}, {"graph_ms", g},
                       {"no_graph_ms", ng}, {"floor_ms", rf.floor_ms}, {"memory_floor_ms", rf.memory_ms},
                       {"comm_floor_ms", rf.comm_ms}, {"bytes_per_gpu", rf.total_bytes()}, {"bandwidth_gbs", bw / 1e9},
                       {"launches", decs[0]->launches_per_step()}, {"rank_graph_ms", graph_ms}});
  }
  // Per op on GPU 0 while the other ranks run the same plain steps: its all-reduce ops hold the
  // communication and any wait for a slower rank.
  nlohmann::json ops = nlohmann::json::array();
  if (o->ops)
    for (size_t i = 0; i < batches.size(); ++i) {
      const int B = batches[i], steps = 10;
      std::printf("GPU 0 of %d:\n", layout.ranks());
      group.run([&](int r) {
        cuda::Decoder& dec = *decs[size_t(r)];
        const cudaStream_t s = group.stream(r);
        const std::vector<int32_t> tok = bench_tokens(B, full.vocab_size), pos(static_cast<size_t>(B), int32_t(o->context));
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(dec.tokens(), tok.data(), size_t(B) * 4, cudaMemcpyHostToDevice, s));
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(dec.positions(), pos.data(), size_t(B) * 4, cudaMemcpyHostToDevice, s));
        if (r == 0) {
          print_event_ops(dec, models[0]->config(), B, o->context, steps, bw, results[i]["graph_ms"].get<double>(),
                    results[i]["no_graph_ms"].get<double>(), s, ops);
        } else {
          for (int k = 0; k < steps + 2; ++k) dec.step(B, s);  // print_ops' warm-up and timed steps
          KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
        }
      });
    }
  group.run([&](int r) {
    decs[size_t(r)].reset();
    models[size_t(r)].reset();
  });
  if (!o->json.empty()) {
    FILE* f = std::fopen(o->json.c_str(), "w");
    if (!f) fail(o->json, ": cannot open for writing");
    std::fputs(nlohmann::json({{"steps", results}, {"ops", ops}}).dump(2).c_str(), f);
    std::fclose(f);
  }
  return 0;
}

int run_bench(const Options* o) {
  {
    if (o->model.empty() == o->config.empty()) fail("bench: give either --model DIR or --config FILE --random-weights");
    if (!o->config.empty() && !o->random_weights) fail("bench: --config needs --random-weights");
    if (o->steps < 1) fail("bench: --steps must be positive");
    if (o->layers && !o->random_weights) fail("--layers: only with --random-weights");
    const std::vector<int> batches = parse_list(o->batches, "--batch", 256);
    const std::vector<int> prefill = o->prefill.empty() ? std::vector<int>{} : parse_list(o->prefill, "--prefill", 1 << 20);
    if (o->speculative < 0 || o->speculative > 16) fail("--speculative: expected 1..16 drafted tokens, got ", o->speculative);
    if (o->speculative && o->context < 1) fail("--speculative: needs a --context of at least 1 position");
    check_kv_dtype_option(o->kv_dtype);
    if (o->chunk < 1 || o->chunk > 256) fail("--chunk: ", o->chunk, " is outside 1..256");
    if (o->gemm_chunk < 0 || o->gemm_chunk > (1 << 16)) fail("--gemm-chunk: ", o->gemm_chunk, " is outside 0..65536");
    if (!(o->tflops > 0)) fail("--bf16-tflops: expected a positive rate, got ", o->tflops);
    if (o->context < 0 || o->context > (1 << 24)) fail("--context: ", o->context, " is outside 0..", 1 << 24);
    if (o->capacity < 0 || o->capacity > (1 << 24)) fail("--capacity: ", o->capacity, " is outside 0..", 1 << 24);
    if (o->layout.split()) {
      if (!prefill.empty()) fail("--prefill: not measured on a split model yet (drop --tp/--ep)");
      if (o->speculative) fail("--speculative: not measured on a split model yet (drop --tp/--ep)");
      return run_split_bench(o, batches);
    }
    std::unique_ptr<Model> host;
    std::unique_ptr<cuda::DeviceModel> dm;
    if (!o->model.empty() && !o->random_weights) {
      const auto t0 = std::chrono::steady_clock::now();
      host = load_model(o->model, Progress::Off);  // no read pass: the upload's threads read the weights
      const double open_s = seconds_since(t0);
      KESTREL_CUDA_CHECK(cudaFree(nullptr));  // CUDA's start-up, outside the upload's time
      const double cuda_s = seconds_since(t0) - open_s;
      cuda::UploadMeter meter(1);
      cuda::UploadOptions uo;
      uo.meter = &meter;
      dm = cuda::DeviceModel::upload(*host, uo);
      const double upload_s = meter.seconds();
      meter.report();
      print_ready(open_s, cuda_s, upload_s, seconds_since(t0));
    } else {
      ModelConfig full =
          o->model.empty() ? parse_model_config_and_quant(read_json_file(o->config), o->config) : load_model_config(o->model);
      dm = cuda::DeviceModel::random(o->layers ? first_layers(full, o->layers) : full);
    }
    const ModelConfig& c = dm->config();
    const double bw = measure_bandwidth();
    const cuda::KvType kv = kv_type_for(c, o->kv_dtype);
    std::printf("model: %s, %lld layers%s, weights %.2f GiB on the GPU, %s KV cache\n", c.architecture.c_str(),
                (long long)c.num_layers, o->layers ? " (a slice: the first layers of the configuration)" : "",
                double(dm->bytes()) / (1ull << 30), cuda::kv_type_name(kv));
    std::printf("measured copy bandwidth: %.0f GB/s (4 GiB device-to-device, read + write)\n", bw / 1e9);
    std::printf("%6s %9s %11s %11s %9s %8s %9s %10s\n", "batch", "context", "graph ms", "no-graph ms", "floor ms",
                "x floor", "tok/s", "launches");
    nlohmann::json results = nlohmann::json::array();
    const int max_batch = *std::max_element(batches.begin(), batches.end());
    const int cap = int(std::max<int64_t>(o->context + o->steps * 2 + 8, o->capacity));
    cuda::KvSource own;
    own.type = kv;
    cuda::Decoder dec(*dm, max_batch, cap, false, nullptr, own);
    cudaStream_t s;
    KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    for (int B : batches) {
      const std::vector<int32_t> tok = bench_tokens(B, c.vocab_size), pos(static_cast<size_t>(B), int32_t(o->context));
      auto reset = [&] {
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(dec.tokens(), tok.data(), size_t(B) * 4, cudaMemcpyHostToDevice, s));
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(dec.positions(), pos.data(), size_t(B) * 4, cudaMemcpyHostToDevice, s));
      };
      auto time = [&](bool graph) {
        reset();
        for (int i = 0; i < 3; ++i) graph ? dec.step_graph(B, true, s) : dec.step(B, s);  // warm-up
        reset();
        cudaEventRecord(e0, s);
        for (int i = 0; i < o->steps; ++i) graph ? dec.step_graph(B, true, s) : dec.step(B, s);
        cudaEventRecord(e1, s);
        KESTREL_CUDA_CHECK(cudaEventSynchronize(e1));
        float ms;
        cudaEventElapsedTime(&ms, e0, e1);
        return double(ms) / o->steps;
      };
      const double g = time(true), ng = time(false);
      const DecodeCost cost = decode_cost(c, B, o->context, kv_value_bytes(dec));
      const double floor_ms = cost.total() / bw * 1e3;
      std::printf("%6d %9lld %11.3f %11.3f %9.3f %8.2f %9.0f %10d\n", B, (long long)o->context, g, ng, floor_ms,
                  g / floor_ms, B * 1e3 / g, dec.launches_per_step());
      nlohmann::json parts = nlohmann::json::object();
      for (const auto& [name, bytes] : cost.parts()) parts[name] = bytes;
      results.push_back({{"batch", B}, {"context", o->context}, {"graph_ms", g}, {"no_graph_ms", ng},
                         {"floor_ms", floor_ms}, {"bytes_per_step", cost.total()}, {"bytes", parts},
                         {"bandwidth_gbs", bw / 1e9}, {"launches", dec.launches_per_step()}});
      if (o->stages && B <= 8) {
        nlohmann::json r = bench_stages(*dm, dec, B, o->context, o->steps, bw, floor_ms, reset, s);
        results.back()["stage_ms"] = r["stage_ms"];
        results.back()["stages"] = r["stages"];
      }
    }
    nlohmann::json ops = nlohmann::json::array();
    if (o->ops)
      for (size_t i = 0; i < batches.size(); ++i) {
        const int B = batches[i];
        const std::vector<int32_t> tok = bench_tokens(B, c.vocab_size), pos(static_cast<size_t>(B), int32_t(o->context));
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(dec.tokens(), tok.data(), size_t(B) * 4, cudaMemcpyHostToDevice, s));
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(dec.positions(), pos.data(), size_t(B) * 4, cudaMemcpyHostToDevice, s));
        const auto bars = print_graph_ops(dec, c, B, o->context, std::max(10, o->steps / 2), bw, s, ops);
        if (i == 0 && !o->plot.empty()) {
          const std::string svg = svg_bars(c.architecture + ", batch " + std::to_string(B) + ", context " +
                                               std::to_string(o->context) + ": time per op and step",
                                           "us per step", bars);
          FILE* f = std::fopen(o->plot.c_str(), "w");
          if (!f) fail(o->plot, ": cannot open for writing");
          std::fputs(svg.c_str(), f);
          std::fclose(f);
          std::printf("  plot: %s\n", o->plot.c_str());
        }
      }
    nlohmann::json pre = nlohmann::json::array();
    if (!prefill.empty()) {
      KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
      pre = bench_prefill(*dm, prefill, o->chunk, o->gemm_chunk, dec.kv_type(), bw, o->tflops);
    }
    nlohmann::json spec = nlohmann::json::array();
    if (o->speculative > 0) {
      KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
      spec = bench_speculative(*dm, o->context, o->speculative, dec.kv_type(), std::max(5, std::min(o->steps, 50)));
    }
    if (!o->json.empty()) {
      results = {{"steps", results}, {"ops", ops}, {"prefill", pre}, {"speculative", spec}};
      FILE* f = std::fopen(o->json.c_str(), "w");
      if (!f) fail(o->json, ": cannot open for writing");
      std::fputs(results.dump(2).c_str(), f);
      std::fclose(f);
    }
    return 0;
  }
}

}  // namespace
}  // namespace kestrel::apps
