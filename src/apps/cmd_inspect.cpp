#include <cstdio>
#include <string>

#include "apps/commands.h"
#include "model/weights.h"

namespace kestrel::apps {
namespace {

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u ? "%.2f %s" : "%.0f %s", b, units[u]);
  return buf;
}

std::string human_count(double n) {
  char buf[32];
  if (n >= 1e9) std::snprintf(buf, sizeof buf, "%.2fB", n / 1e9);
  else if (n >= 1e6) std::snprintf(buf, sizeof buf, "%.2fM", n / 1e6);
  else if (n >= 1e3) std::snprintf(buf, sizeof buf, "%.1fK", n / 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f", n);
  return buf;
}

}  // namespace

Run add_inspect(CLI::App& app) {
  auto model = std::make_shared<std::string>();
  app.add_option("--model", *model, "Hugging Face model folder or .gguf file")->required();
  return [model]() {
    auto m = load_model(*model);
    const ModelConfig& c = m->config;
    std::printf("model             %s\n%s", model->c_str(), c.summary().c_str());
    std::string kinds;
    for (size_t l = 0; l < m->weights.layers.size(); ++l) kinds += m->weights.layers[l].is_moe ? 'M' : 'D';
    std::printf("layer layout      %s  (D dense, M MoE)\n", kinds.c_str());
    if (c.num_nextn_predict_layers > 0 && m->weights.mtp.empty())
      std::printf("MTP layers        none in the checkpoint (not loaded)\n");
    for (const MtpLayer& t : m->weights.mtp)
      std::printf("MTP layer         model.layers.%lld: %s, eh_proj %s, %s, %s\n", (long long)t.index,
                  t.layer.is_moe ? "MoE" : "dense", format_name(t.eh_proj.format),
                  t.head.data == m->weights.lm_head.data ? "main lm_head" : "own head",
                  t.embed.data == m->weights.embed.data ? "main embedding" : "own embedding");
    const StorageStats s = storage_stats(*m);
    std::printf("parameters        %s in linears (%s touched per token)\n", human_count(double(s.params)).c_str(),
                human_count(double(s.params_per_token)).c_str());
    std::printf("storage\n");
    for (int f = 0; f < kWeightFormatCount; ++f)
      if (s.linears[f])
        std::printf("  %-16s%s in %zu matrices\n", format_name(WeightFormat(f)), human_bytes(double(s.bytes[f])).c_str(),
                    s.linears[f]);
    std::printf("  other           %s (norms, biases, router bias, scales)\n", human_bytes(double(s.other_bytes)).c_str());
    if (m->checkpoint)
      std::printf("files             %zu safetensors, %zu tensors\n", m->checkpoint->file_count(),
                  m->checkpoint->tensors().size());
    if (m->gguf)
      std::printf("files             1 GGUF (version %u), %zu tensors, %zu metadata keys\n", m->gguf->index().version(),
                  m->gguf->index().tensors().size(), m->gguf->index().metadata().size());
    std::printf("eos token ids     ");
    for (size_t i = 0; i < c.eos_token_ids.size(); ++i) std::printf("%s%lld", i ? "," : "", (long long)c.eos_token_ids[i]);
    std::printf("\n");
    return 0;
  };
}

}  // namespace kestrel::apps
