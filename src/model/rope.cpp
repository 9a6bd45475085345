#include "model/rope.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"
#include "formats/json_file.h"

namespace kestrel {

std::vector<float> RopeConfig::inv_freq() const {
  const int64_t dim = rotary_dim;
  std::vector<float> f(static_cast<size_t>(dim / 2));
  for (int64_t i = 0; i < dim / 2; ++i) f[size_t(i)] = float(1.0 / std::pow(theta, double(2 * i) / double(dim)));
  if (type == "linear") {
    for (float& x : f) x = float(x / factor);
  } else if (type == "llama3") {
    const double old_len = double(original_max_position_embeddings);
    const double low_wavelen = old_len / low_freq_factor, high_wavelen = old_len / high_freq_factor;
    for (float& x : f) {
      const double wavelen = 2 * M_PI / x;
      double v = x;
      if (wavelen > low_wavelen) v = x / factor;
      if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) {
        const double smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
        v = (1 - smooth) * x / factor + smooth * x;
      }
      x = float(v);
    }
  } else if (type == "yarn") {
    auto correction_dim = [&](double rotations) {
      return (double(dim) * std::log(double(original_max_position_embeddings) / (rotations * 2 * M_PI))) /
             (2 * std::log(theta));
    };
    double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
    if (truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, double(dim - 1));
    if (low == high) high += 0.001;
    for (int64_t i = 0; i < dim / 2; ++i) {
      const double extrapolation = f[size_t(i)];
      const double interpolation = extrapolation / factor;
      const double ramp = std::clamp((double(i) - low) / (high - low), 0.0, 1.0);
      const double keep = 1.0 - ramp;  // share of the extrapolated (unscaled) frequency
      f[size_t(i)] = float(interpolation * (1 - keep) + extrapolation * keep);
    }
  }
  return f;
}

float RopeConfig::attention_scaling() const {
  if (type != "yarn") return 1.0f;
  if (attention_factor > 0) return float(attention_factor);
  auto get_mscale = [](double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; };
  if (mscale != 0 && mscale_all_dim != 0) return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim));
  return float(get_mscale(factor, 1.0));
}

RopeConfig parse_rope(const nlohmann::json& config, const std::string& file, int64_t head_dim, int64_t max_pos) {
  RopeConfig r;
  JsonFields top(config, file);
  double partial = top.get_num("partial_rotary_factor", 1.0);
  r.theta = top.get_num("rope_theta", 10000.0);

  // transformers 5 writes rope_parameters; older configs write rope_scaling (maybe null).
  const nlohmann::json* params = nullptr;
  std::string key;
  for (const char* k : {"rope_parameters", "rope_scaling"}) {
    if (config.contains(k) && !config.at(k).is_null()) {
      params = &config.at(k);
      key = k;
      break;
    }
  }
  if (params) {
    if (!params->is_object()) fail(file, ": '", key, "' must be an object");
    const std::string where = cat(file, " (", key, ")");
    JsonFields p(*params, where);
    r.type = p.get_str("rope_type", p.get_str("type", "default"));
    r.theta = p.get_num("rope_theta", r.theta);
    partial = p.get_num("partial_rotary_factor", partial);
    r.factor = p.get_num("factor", 1.0);
    r.low_freq_factor = p.get_num("low_freq_factor", 1.0);
    r.high_freq_factor = p.get_num("high_freq_factor", 4.0);
    r.original_max_position_embeddings =
        p.get_int("original_max_position_embeddings", top.get_int("original_max_position_embeddings", max_pos));
    r.beta_fast = p.get_num("beta_fast", 32.0);
    r.beta_slow = p.get_num("beta_slow", 1.0);
    r.mscale = p.get_num("mscale", 0.0);
    r.mscale_all_dim = p.get_num("mscale_all_dim", 0.0);
    r.attention_factor = p.get_num("attention_factor", 0.0);
    r.truncate = p.get_bool("truncate", true);
    if (r.type == "yarn" && !p.has("factor") && r.original_max_position_embeddings > 0)
      r.factor = double(max_pos) / double(r.original_max_position_embeddings);
    if (r.type != "default" && r.type != "linear" && r.type != "llama3" && r.type != "yarn")
      fail(where, ": rope type '", r.type, "' is not supported (default, linear, llama3, yarn)");
    if ((r.type == "linear" || r.type == "llama3" || r.type == "yarn") && !(r.factor > 0))
      fail(where, ": rope type '", r.type, "' needs a positive 'factor'");
    if ((r.type == "llama3" || r.type == "yarn") && r.original_max_position_embeddings <= 0)
      fail(where, ": rope type '", r.type, "' needs 'original_max_position_embeddings'");
    if (r.type == "llama3" && !(r.high_freq_factor > r.low_freq_factor))
      fail(where, ": llama3 rope needs high_freq_factor > low_freq_factor");
  }
  if (!(r.theta > 0)) fail(file, ": rope_theta must be positive");
  if (!(partial > 0 && partial <= 1)) fail(file, ": partial_rotary_factor must be in (0, 1], got ", partial);
  r.rotary_dim = int64_t(double(head_dim) * partial);
  if (r.rotary_dim <= 0 || r.rotary_dim % 2 != 0)
    fail(file, ": rotary dimension ", r.rotary_dim, " (head_dim ", head_dim, " x partial_rotary_factor ", partial,
         ") must be a positive even number");
  return r;
}

}  // namespace kestrel
