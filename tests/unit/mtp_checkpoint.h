// A quantized checkpoint with an MTP layer, for tests (the NVFP4 fixtures hold none): the
// fixture with its last layer's tensors copied to the MTP slot (quantized or not by the same
// settings), an NVFP4 eh_proj, neither shared_head.head nor embed_tokens, and
// num_nextn_predict_layers 1 in config.json.
#pragma once
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/error.h"
#include "fixture.h"
#include "formats/checkpoint.h"
#include "formats/json_file.h"
#include "st_writer.h"

namespace kestrel::test {

inline void write_quantized_mtp_checkpoint(const std::string& fixture, const std::filesystem::path& out) {
  const std::string dir = fixture_dir(fixture);
  nlohmann::json cfg = read_json_file(dir + "/config.json");
  const int64_t L = cfg.at("num_hidden_layers").get<int64_t>(), H = cfg.at("hidden_size").get<int64_t>();
  cfg["num_nextn_predict_layers"] = 1;
  const bool ct = cfg.at("quantization_config").at("quant_method") == "compressed-tensors";
  Checkpoint ck(dir);
  std::vector<StTensor> ts;
  auto copy = [](const std::string& name, const TensorView& t) {
    return StTensor{name, std::string(dtype_name(t.dtype)), t.shape, std::vector<uint8_t>(t.data, t.data + t.nbytes)};
  };
  const std::string from = cat("model.layers.", L - 1, "."), to = cat("model.layers.", L, ".");
  for (const auto& [name, t] : ck.tensors()) {
    ts.push_back(copy(name, *t));
    if (name.compare(0, from.size(), from) == 0) ts.push_back(copy(to + name.substr(from.size()), *t));
  }
  auto ones = [&](const std::string& n) {
    std::vector<uint8_t> b;
    for (int64_t i = 0; i < H; ++i) b.insert(b.end(), {0x80, 0x3f});  // BF16 1.0
    ts.push_back({n, "BF16", {H}, b});
  };
  ones(to + "enorm.weight");
  ones(to + "hnorm.weight");
  ones(to + "shared_head.norm.weight");
  std::vector<uint8_t> codes(size_t(H * H));
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = uint8_t((i * 37 + 11) & 0x77);  // small magnitudes, both signs
  ts.push_back({to + (ct ? "eh_proj.weight_packed" : "eh_proj.weight"), "U8", {H, H}, codes});
  ts.push_back({to + "eh_proj.weight_scale", "F8_E4M3", {H, 2 * H / 16}, std::vector<uint8_t>(size_t(H * 2 * H / 16), 0x30)});
  if (ct) ts.push_back({to + "eh_proj.weight_global_scale", "F32", {1}, f32_bytes({20.0f})});
  else ts.push_back({to + "eh_proj.weight_scale_2", "F32", {}, f32_bytes({0.05f})});
  std::ofstream(out / "config.json") << cfg.dump();
  write_file(out / "model.safetensors", safetensors_image(ts));
}

}  // namespace kestrel::test
