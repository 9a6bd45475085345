// Rotary position embedding: the inverse frequencies for each scaling type and the factor applied
// to cos/sin, exactly as Hugging Face computes them.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace kestrel {

struct RopeConfig {
  std::string type = "default";  // default, linear, llama3, yarn, dynamic (as default before the limit)
  double theta = 10000.0;
  int64_t rotary_dim = 0;        // head_dim * partial_rotary_factor
  bool interleaved = false;      // pairs (2i, 2i+1) instead of halves (i, i + d/2)
  double factor = 1.0;
  double low_freq_factor = 1.0, high_freq_factor = 4.0;        // llama3
  int64_t original_max_position_embeddings = 0;                 // llama3, yarn
  double beta_fast = 32.0, beta_slow = 1.0;                     // yarn
  double mscale = 0.0, mscale_all_dim = 0.0;                    // yarn (DeepSeek)
  double attention_factor = 0.0;                                // yarn: 0 means derived
  bool truncate = true;                                         // yarn

  std::vector<float> inv_freq() const;  // rotary_dim / 2 entries
  float attention_scaling() const;      // multiplies cos and sin
};

// Reads rope settings from either config.json style: top-level rope_theta / rope_scaling /
// partial_rotary_factor (transformers 4) or the rope_parameters object (transformers 5).
RopeConfig parse_rope(const nlohmann::json& config, const std::string& file, int64_t head_dim, int64_t max_pos);

}  // namespace kestrel
