// GPUs as data for the roofline: memory bandwidth and size, SMs, the link between GPUs of one
// host and the latency assumed for one small all-reduce over it. Bandwidths are the vendors'
// figures; measured ones (kestrel bench prints the card's copy bandwidth) go in --bandwidth.
#pragma once
#include <string>
#include <vector>

namespace kestrel {

struct GpuSpec {
  std::string name;          // as `--gpu` takes it, e.g. "h200"
  std::string full_name;
  double bandwidth_gbs;      // memory bandwidth, GB/s
  double memory_gb;
  int sms;
  std::string link;          // "NVLink 4", "PCIe 5.0 x16"
  double link_gbs;           // per direction, per GPU
  double allreduce_latency_us;  // fixed cost of one decode-sized all-reduce over the link (assumed)
};

const std::vector<GpuSpec>& gpu_table();
// Case-insensitive; fails listing the known names.
const GpuSpec& find_gpu(const std::string& name);

}  // namespace kestrel
