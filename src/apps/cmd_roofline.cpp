// kestrel roofline: the floor of one decode step for a model, a storage format, a parallel
// layout and a GPU, by part of the model, with the communication between GPUs.
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "apps/commands.h"
#include "apps/model_options.h"
#include "common/error.h"
#include "formats/json_file.h"
#include "plan/roofline.h"

namespace kestrel::apps {
namespace {

struct Options {
  std::string model, gpu = "h200", quant = "checkpoint";
  double bandwidth = 0, kv_bytes = 2;
  Layout layout;
  int batch = 1;
  int64_t context = 4096;
  bool json = false;
};

std::string mb(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", bytes / 1e6);
  return buf;
}

}  // namespace

Run add_roofline(CLI::App& app) {
  auto o = std::make_shared<Options>();
  app.add_option("--model", o->model, "Model folder or its config.json (no weights needed)")->required();
  app.add_option("--gpu", o->gpu, "h100, h200, b200, rtx-pro-6000, rtx-5090, rtx-4090 (default h200)");
  app.add_option("--bandwidth", o->bandwidth, "Memory bandwidth in GB/s, e.g. a measured one (default: the GPU's)");
  add_layout_options(app, o->layout);
  app.add_option("--batch", o->batch, "Sequences decoded together (default 1)");
  app.add_option("--context", o->context, "Cached positions each sequence attends to (default 4096)");
  app.add_option("--kv-bytes", o->kv_bytes, "Bytes per cached value: 2 BF16 (default), 1 FP8, 4 float32");
  app.add_option("--quant", o->quant, "checkpoint (default), nvfp4 or bf16: the formats to assume");
  app.add_flag("--json", o->json, "Print JSON instead of the table");
  return [o]() {
    QuantWhatIf q;
    if (o->quant == "checkpoint") q = QuantWhatIf::Checkpoint;
    else if (o->quant == "nvfp4") q = QuantWhatIf::Nvfp4;
    else if (o->quant == "bf16") q = QuantWhatIf::Bf16;
    else fail("--quant: expected checkpoint, nvfp4 or bf16, got '", o->quant, "'");
    if (o->kv_bytes <= 0) fail("--kv-bytes: must be positive");
    std::string path = o->model;
    if (std::filesystem::is_directory(path)) path = (std::filesystem::path(path) / "config.json").string();
    if (!std::filesystem::exists(path)) fail(path, ": no such file");
    const StepShapes s = step_shapes(read_json_file(path), path, q);
    const GpuSpec& gpu = find_gpu(o->gpu);
    const double bw = o->bandwidth > 0 ? o->bandwidth : gpu.bandwidth_gbs;
    const Roofline r = roofline(s, o->layout, o->batch, o->context, o->kv_bytes, bw, gpu);
    const double tok_s = 1e3 * o->batch / r.floor_ms;

    if (o->json) {
      nlohmann::ordered_json parts = nlohmann::ordered_json::object();
      for (const RooflinePart& p : r.parts) parts[part_name(p.part)] = p.bytes;
      parts["KV cache"] = r.kv_bytes;
      nlohmann::ordered_json j = {
          {"model", path}, {"architecture", s.architecture}, {"gpu", gpu.full_name}, {"bandwidth_gbs", bw},
          {"tp", o->layout.tp}, {"ep", o->layout.ep}, {"batch", o->batch}, {"context", o->context}, {"kv_bytes_per_value", o->kv_bytes},
          {"quant", o->quant}, {"bytes_per_gpu", parts}, {"bytes_per_step", r.total_bytes()},
          {"bytes_per_token", r.total_bytes() / o->batch}, {"expected_experts_per_layer", r.expected_experts},
          {"resident_weight_bytes_per_gpu", r.resident_bytes}, {"allreduces", r.allreduces},
          {"allreduce_bytes", r.allreduce_bytes}, {"allreduce_latency_us", gpu.allreduce_latency_us},
          {"link_gbs", gpu.link_gbs}, {"memory_ms", r.memory_ms}, {"comm_ms", r.comm_ms}, {"floor_ms", r.floor_ms},
          {"tokens_per_s", tok_s}};
      std::printf("%s\n", j.dump(2).c_str());
      return 0;
    }
    std::printf("model: %s (%s), %lld layers (%lld MoE", path.c_str(), s.architecture.c_str(), (long long)s.layers,
                (long long)s.moe_layers);
    if (s.experts) std::printf(": %lld experts, top-%lld", (long long)s.experts, (long long)s.experts_per_token);
    std::printf("), hidden %lld, %s attention\n", (long long)s.hidden, s.mla ? "MLA" : "GQA");
    std::printf("GPUs: %d x %s, %.0f GB/s%s, %s %.0f GB/s; TP %d, EP %d\n", std::max(o->layout.tp, o->layout.ep),
                gpu.full_name.c_str(), bw, o->bandwidth > 0 ? " (given)" : "", gpu.link.c_str(), gpu.link_gbs, o->layout.tp,
                o->layout.ep);
    std::printf("batch %d, context %lld, %g bytes per cached value, formats: %s\n", o->batch, (long long)o->context,
                o->kv_bytes, o->quant.c_str());
    std::printf("weights held per GPU: %.1f GB of %.0f GB%s\n\n", r.resident_bytes / 1e9, gpu.memory_gb,
                r.resident_bytes / 1e9 > gpu.memory_gb ? "  (does not fit)" : "");
    std::printf("bytes read per GPU per step:\n  %-18s %10s %6s  %s\n", "part", "MB", "share", "layout");
    for (const RooflinePart& p : r.parts)
      std::printf("  %-18s %10s %5.1f%%  %s\n", part_name(p.part), mb(p.bytes).c_str(), 100 * p.bytes / r.total_bytes(),
                  p.how.c_str());
    std::printf("  %-18s %10s %5.1f%%  %s\n", "KV cache", mb(r.kv_bytes).c_str(), 100 * r.kv_bytes / r.total_bytes(),
                s.mla ? (s.attended_positions_cap ? "latent of the top positions + indexer keys of all, on every GPU"
                                                  : "latent on every GPU")
                      : (o->layout.tp > s.kv_heads ? "KV heads replicated (fewer heads than GPUs)" : "split by KV head"));
    std::printf("  %-18s %10s\n\n", "total", mb(r.total_bytes()).c_str());
    if (r.allreduces)
      std::printf("communication: %d all-reduces of %.1f KB per step: %.3f ms (%.0f us latency each, assumed for %s;\n"
                  "  + bytes over %.0f GB/s)\n",
                  r.allreduces, r.allreduce_bytes / 1e3, r.comm_ms, gpu.allreduce_latency_us, gpu.link.c_str(), gpu.link_gbs);
    std::printf("floor: memory %.3f ms + communication %.3f ms = %.3f ms per step; %.1f tokens/s per sequence, %.1f in all\n",
                r.memory_ms, r.comm_ms, r.floor_ms, 1e3 / r.floor_ms, tok_s);
    return 0;
  };
}

}  // namespace kestrel::apps
