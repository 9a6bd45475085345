// kestrel plan: the persistent decode step's plan for a model, printed (what runs where, what it
// waits on, what it streams) and checked: per op of a layer its tiles, rows, bytes and waits; the
// instructions of one op; the balance of the SM queues.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>

#include "apps/commands.h"
#include "common/error.h"
#include "formats/json_file.h"
#include "model/model_config.h"
#include "plan/decode_cost.h"
#include "plan/step_plan.h"
#include "plan/step_plan_check.h"

namespace kestrel::apps {
namespace {

struct Options {
  std::string model, op;
  int layer = 0;
  StepPlanOptions plan;
  bool queues = false, check = false;
};

double mb(double bytes) { return bytes / 1e6; }

void print_ops(const StepPlan& p, int layer) {
  struct Row {
    int tiles = 0;
    int64_t rows_min = INT64_MAX, rows_max = 0;
    double weights = 0, cache = 0;
    size_t waits = 0, most_waits = 0;
    std::map<int32_t, int> counters;
  };
  std::vector<std::pair<std::string, Row>> rows;
  for (const StepInstr& in : p.instrs) {
    if (in.layer != layer && in.layer >= 0) continue;
    const std::string name = step_op_name(in.op);
    if (rows.empty() || rows.back().first != name) rows.emplace_back(name, Row{});
    Row& r = rows.back().second;
    ++r.tiles;
    const bool ranged = in.op != StepOp::AttnSplit && in.op != StepOp::AttnCombine &&
                        in.op != StepOp::Route;
    if (ranged) {
      r.rows_min = std::min(r.rows_min, in.b - in.a);
      r.rows_max = std::max(r.rows_max, in.b - in.a);
    }
    r.weights += in.weight_bytes;
    r.cache += in.cache_bytes;
    r.waits += in.waits.size();
    r.most_waits = std::max(r.most_waits, in.waits.size());
    ++r.counters[in.signal];
  }
  std::printf("\n%-16s %6s %11s %10s %9s %8s %9s\n", "op (layer)", "tiles", "rows", "weights MB", "cache MB", "waits", "counters");
  for (const auto& [name, r] : rows) {
    char span[32] = "-";
    if (r.rows_max > 0) {
      if (r.rows_min == r.rows_max) std::snprintf(span, sizeof span, "%lld", (long long)r.rows_max);
      else std::snprintf(span, sizeof span, "%lld-%lld", (long long)r.rows_min, (long long)r.rows_max);
    }
    char waits[32];
    std::snprintf(waits, sizeof waits, "%.1f/%zu", double(r.waits) / r.tiles, r.most_waits);
    std::printf("%-16s %6d %11s %10.3f %9.3f %8s %9zu\n", name.c_str(), r.tiles, span, mb(r.weights), mb(r.cache), waits,
                r.counters.size());
  }
  std::printf("(waits: mean/most per instruction; counters: those the op's tiles advance)\n");
}

void print_op(const StepPlan& p, const std::string& op, int layer) {
  std::printf("\n%s of layer %d:\n", op.c_str(), layer);
  bool any = false;
  for (int32_t i = 0; i < int32_t(p.instrs.size()); ++i) {
    const StepInstr& in = p.instrs[size_t(i)];
    if (step_op_name(in.op) != op || (in.layer != layer && in.layer >= 0)) continue;
    any = true;
    std::string waits;
    for (int32_t k : in.waits) {
      const StepCounter& c = p.counters[size_t(k)];
      const StepInstr& first = p.instrs[size_t(c.first)];
      waits += (waits.empty() ? "" : ", ") + std::to_string(k) + " (" + std::to_string(c.producers) + " of " +
               (first.layer >= 0 ? "layer " + std::to_string(first.layer) + " " : "") + step_op_name(first.op) + ")";
    }
    std::printf("  %s: %.1f KB weights, %.1f KB cache; waits %s; advances %d\n", describe_instr(p, i).c_str(),
                in.weight_bytes / 1e3, in.cache_bytes / 1e3, waits.empty() ? "none" : waits.c_str(), in.signal);
  }
  if (!any) fail("--op ", op, ": no such op in layer ", layer, " of this plan");
}

void print_queues(const StepPlan& p) {
  std::vector<double> bytes(p.queues.size(), 0);
  for (const StepInstr& in : p.instrs)
    if (!in.tail) bytes[size_t(in.sm)] += in.weight_bytes + in.cache_bytes;
  const auto [lo, hi] = std::minmax_element(bytes.begin(), bytes.end());
  double sum = 0;
  size_t most = 0, least = SIZE_MAX;
  for (size_t s = 0; s < bytes.size(); ++s) {
    sum += bytes[s];
    most = std::max(most, p.queues[s].size());
    least = std::min(least, p.queues[s].size());
  }
  std::printf("\nqueues: %zu instructions per SM (%zu to %zu) and %zu tails; bytes per SM %.2f to %.2f MB (mean %.2f, most %.1f%% over)\n",
              (p.instrs.size() - p.tails.size()) / p.queues.size(), least, most, p.tails.size(), mb(*lo), mb(*hi), mb(sum / bytes.size()),
              100.0 * (*hi / (sum / bytes.size()) - 1.0));
}

}  // namespace

Run add_plan(CLI::App& app) {
  auto o = std::make_shared<Options>();
  app.add_option("--model", o->model, "Model folder or a config.json (e.g. configs/qwen3-30b-a3b-nvfp4.json)")->required();
  app.add_option("--batch", o->plan.batch, "Sequences decoded together (default 1)");
  app.add_option("--sms", o->plan.sms, "Persistent blocks, one per SM (default 132, an H200)");
  app.add_option("--context", o->plan.context, "Cached positions attended (default 1024)");
  app.add_option("--layer", o->layer, "The layer whose ops are listed (default 0)");
  app.add_option("--op", o->op, "List every instruction of this op of --layer (e.g. norm_qkv, expert_down)");
  app.add_flag("--queues", o->queues, "Print the balance of the SM queues");
  app.add_flag("--check", o->check, "Prove the plan safe (happens-before of every access) and run its queues once");
  return [o]() {
    std::string path = o->model;
    if (std::filesystem::is_directory(path)) path = (std::filesystem::path(path) / "config.json").string();
    if (!std::filesystem::exists(path)) fail(path, ": no such file");
    const ModelConfig c = parse_model_config_and_quant(read_json_file(path), path);
    if (o->layer < 0 || o->layer >= c.num_layers) fail("--layer: expected 0..", c.num_layers - 1, ", got ", o->layer);
    const StepPlan p = make_step_plan(c, o->plan);
    size_t waits = 0;
    for (const StepInstr& in : p.instrs) waits += in.waits.size();
    const DecodeCost floor = decode_cost(c, o->plan.batch, o->plan.context, o->plan.kv_value_bytes);
    std::printf("%s, batch %d on %d SMs: %zu instructions, %zu counters, %zu waits; %lld attention splits%s",
                p.architecture.c_str(), o->plan.batch, o->plan.sms, p.instrs.size(), p.counters.size(), waits,
                (long long)p.splits, p.mla ? " (every head in each)" : " per KV head");
    if (p.expert_positions) std::printf(", %lld expert positions", (long long)p.expert_positions);
    std::printf("\nstreams %.1f MB of weights and %.1f MB of KV cache per step (the floor counts %.1f MB and %.1f MB)\n",
                mb(p.weight_bytes()), mb(p.cache_bytes()), mb(floor.total() - floor.kv_cache), mb(floor.kv_cache));
    print_ops(p, o->layer);
    if (!o->op.empty()) print_op(p, o->op, o->layer);
    if (o->queues) print_queues(p);
    if (o->check) {
      check_step_plan(p);
      simulate_step_plan(p, 1);
      std::printf("\nchecked: every access ordered by the waits, the queues run to the end with every counter full\n");
    }
    return 0;
  };
}

}  // namespace kestrel::apps
