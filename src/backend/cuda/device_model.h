// A model's weights in GPU memory, in their stored formats, as kernel descriptors. Made either
// by uploading a loaded checkpoint (every tensor in one arena, copied through pinned staging
// buffers: upload.h) or by filling the shapes of a configuration with random values on the GPU
// (benchmarks of models too large to download).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/dlinear.h"
#include "backend/cuda/moe.h"
#include "backend/cuda/upload.h"
#include "model/model_config.h"
#include "model/weights.h"
#include "parallel/layout.h"

namespace kestrel::cuda {

// Multi-head latent attention of one layer (see mla.h); kv_b is BF16.
struct DMla {
  DLinear q_a, q_b, q, kv_a, kv_b;
  const float* q_a_norm = nullptr;
  const float* kv_a_norm = nullptr;
  bool has_indexer = false;
  DLinear index_wq_b, index_wk, index_weights;
  const float* index_norm_w = nullptr;
  const float* index_norm_b = nullptr;
};

struct DLayer {
  const float* attn_norm = nullptr;
  const float* ffn_norm = nullptr;
  DLinear q, k, v, o;  // MLA: o only
  DMla mla;
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  bool is_moe = false;
  DLinear gate, up, down;  // dense layers
  DMoe moe;
};

class DeviceModel {
 public:
  // On the current device; o.meter, if any, hears of the bytes copied.
  static std::unique_ptr<DeviceModel> upload(const Model& m, const UploadOptions& o = {});
  // Random weights of the shapes of `c`, or of one rank's part of them when split by `layout`.
  static std::unique_ptr<DeviceModel> random(const ModelConfig& c, uint64_t seed = 1, const Layout& layout = {},
                                             int rank = 0);
  ~DeviceModel();
  DeviceModel(const DeviceModel&) = delete;
  DeviceModel& operator=(const DeviceModel&) = delete;

  const ModelConfig& config() const { return config_; }
  const std::vector<DLayer>& layers() const { return layers_; }
  const DLinear& embed() const { return embed_; }
  const DLinear& lm_head() const { return lm_head_; }
  const float* final_norm() const { return final_norm_; }
  const float* rope_inv_freq() const { return inv_freq_; }
  uint64_t bytes() const { return bytes_; }  // device memory held by the weights
  // Stored bytes of one routed expert (gate + up + down) of MoE layer i; 0 for dense layers.
  uint64_t expert_bytes(size_t layer) const { return expert_bytes_.at(layer); }

 private:
  explicit DeviceModel(const ModelConfig& c) : config_(c) {}
  void* alloc(size_t bytes);
  const float* floats(const std::vector<float>& v);
  // Places every tensor of m in the arena and fills the descriptors with their device addresses.
  void place(const Model& m, WeightArena& a);
  // Rows [row0, row0 + rows) and columns [col0, col0 + cols) of a random matrix with full_in columns.
  struct RandomBlock {
    int64_t full_in, row0, rows, col0, cols;
  };
  DLinear make_random(const std::string& name, const RandomBlock& b, bool nvfp4, uint64_t seed);
  const DLinear* put_array(const std::vector<DLinear>& v);

  ModelConfig config_;
  std::vector<void*> allocations_;
  uint64_t bytes_ = 0;
  std::vector<DLayer> layers_;
  DLinear embed_, lm_head_;
  const float* final_norm_ = nullptr;
  const float* inv_freq_ = nullptr;
  std::vector<uint64_t> expert_bytes_;
};

}  // namespace kestrel::cuda
