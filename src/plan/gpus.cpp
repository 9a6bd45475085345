#include "plan/gpus.h"

#include <algorithm>
#include <cctype>

#include "common/error.h"

namespace kestrel {

const std::vector<GpuSpec>& gpu_table() {
  // All-reduce latency: one-shot over NVLink ~5 us, over PCIe (through the host or a switch)
  // ~15 us for messages of a few KB; stated as assumptions in every report.
  static const std::vector<GpuSpec> t = {
      {"h100", "NVIDIA H100 SXM 80GB", 3350, 80, 132, "NVLink 4", 450, 5},
      {"h200", "NVIDIA H200 141GB", 4800, 141, 132, "NVLink 4", 450, 5},
      {"b200", "NVIDIA B200 180GB", 8000, 180, 148, "NVLink 5", 900, 5},
      {"rtx-pro-6000", "NVIDIA RTX PRO 6000 Blackwell 96GB", 1792, 96, 188, "PCIe 5.0 x16", 64, 15},
      {"rtx-5090", "NVIDIA GeForce RTX 5090 32GB", 1792, 32, 170, "PCIe 5.0 x16", 64, 15},
      {"rtx-4090", "NVIDIA GeForce RTX 4090 24GB", 1008, 24, 128, "PCIe 4.0 x16", 32, 15},
  };
  return t;
}

const GpuSpec& find_gpu(const std::string& name) {
  std::string n = name;
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  std::string known;
  for (const GpuSpec& g : gpu_table()) {
    if (g.name == n) return g;
    known += (known.empty() ? "" : ", ") + g.name;
  }
  fail("--gpu: unknown GPU '", name, "' (known: ", known, "; or give --bandwidth)");
}

}  // namespace kestrel
