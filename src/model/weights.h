// The weights of a model as views into the mapped checkpoint, in their stored format. Nothing is
// dequantized or copied at load except the small vectors (norms, biases), which become float.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "formats/checkpoint.h"
#include "formats/fp8.h"
#include "formats/ggml_quants.h"
#include "formats/gguf.h"
#include "model/load_progress.h"
#include "model/model_config.h"

namespace kestrel {

// The first four values are mirrored by the CUDA backend; FP8 (CPU only) and the GGUF block
// formats follow. NVFP4 is the Hugging Face (ModelOpt) layout; NVFP4_GGML is ggml's block of 64
// with its scales inside.
enum class WeightFormat : uint8_t {
  F32, F16, BF16, NVFP4, FP8, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4, NVFP4_GGML
};
inline constexpr int kWeightFormatCount = 17;
const char* format_name(WeightFormat f);

// The WeightFormat of a ggml tensor type, if kestrel computes with it.
std::optional<WeightFormat> weight_format_of(GgmlType t);

// A weight matrix W [out, in] applied as y = x W^T (+ bias). For NVFP4, `data` is the packed codes
// [out, in/2], `scales` the E4M3 block scales [out, in/16] and `scale2` the per-tensor scale. For
// FP8, `data` is the E4M3 codes [out, in] and `scales` one F32 (BF16 when `fp8_bf16_scales`) per
// block of `fp8` weights, [ceil(out/rows), ceil(in/cols)] (formats/fp8.h). For the GGUF block
// formats, `data` holds each row as in/block ggml blocks (scales inside the blocks); MXFP4 and
// NVFP4_GGML rows are then multiplied by `scale2` (llama.cpp's NAME.scale tensor).
struct Linear {
  std::string name;  // module name, e.g. "model.layers.0.self_attn.q_proj"
  int64_t out = 0, in = 0;
  WeightFormat format = WeightFormat::BF16;
  const uint8_t* data = nullptr;
  const uint8_t* scales = nullptr;
  float scale2 = 1.0f;
  Fp8Blocks fp8;
  bool fp8_bf16_scales = false;
  float input_scale = 0.0f;  // activation scale of W4A4 checkpoints; unused by weight-only compute
  std::vector<float> bias;   // empty when the module has none

  size_t row_bytes() const;   // stored bytes of one row (scales included; FP8: the codes alone)
  size_t scale_bytes() const; // FP8: stored bytes of the scales; 0 for the other formats
  size_t bytes() const;       // stored bytes of the whole matrix
  int64_t block() const;      // input values per stored block: 1 for F32/F16/BF16, 16 for NVFP4, FP8's
                              // block columns, ggml's block
  void dequant_row(int64_t row, float* out_row) const;
};

// SiLU-gated feed-forward: down(silu(gate x) * up x). Dense MLPs, experts and shared experts.
struct GatedFfn {
  Linear gate, up, down;
};

struct MoeWeights {
  Linear router;                       // [experts, hidden], never quantized
  std::vector<float> correction_bias;  // sigmoid routers only
  std::vector<GatedFfn> experts;      // experts first_expert .. first_expert + size() - 1
  int64_t first_expert = 0;            // nonzero on the ranks of an expert-parallel split
  bool has_shared = false;
  GatedFfn shared;
};

// The DSA indexer of one layer (GLM-5).
struct IndexerWeights {
  Linear wq_b;          // [heads * head_dim, q_lora_rank], reads the normed q latent
  Linear wk;            // [head_dim, hidden]
  std::vector<float> k_norm, k_norm_bias;  // LayerNorm over head_dim
  Linear weights_proj;  // [heads, hidden]: each head's weight in the index score
};

// Multi-head latent attention projections (the output projection is LayerWeights::o).
struct MlaWeights {
  Linear q_a, q_b;                 // q_lora_rank > 0: hidden -> q latent -> heads * qk_head_dim
  std::vector<float> q_a_norm;
  Linear q;                        // q_lora_rank == 0: hidden -> heads * qk_head_dim
  Linear kv_a;                     // hidden -> kv_lora_rank + qk_rope_head_dim
  std::vector<float> kv_a_norm;    // over the kv_lora_rank part
  Linear kv_b;                     // kv latent -> heads * (qk_nope_head_dim + v_head_dim)
  bool has_indexer = false;
  IndexerWeights indexer;
};

struct LayerWeights {
  std::vector<float> attn_norm, ffn_norm;
  Linear q, k, v, o;  // GQA: all four; MLA: o only (the rest is in mla)
  MlaWeights mla;
  std::vector<float> q_norm, k_norm;  // QK norm, over head_dim
  bool is_moe = false;
  GatedFfn mlp;  // dense layers
  MoeWeights moe;

  // The attention linears this layer has (GQA q/k/v/o, or the MLA and indexer projections and o).
  std::vector<const Linear*> attention_linears() const;
};

// A multi-token-prediction (NextN) layer, checkpoint prefix model.layers.{index}. For position p
// with the main model's final normed hidden state h_p and next token t_{p+1}:
//   x = eh_proj([enorm(embed(t_{p+1})), hnorm(h_p)]), y = layer(x) at position p (own KV cache),
//   logits = head(head_norm(y)), a prediction of t_{p+2}.
struct MtpLayer {
  int64_t index = 0;  // checkpoint layer index: num_hidden_layers + k
  std::vector<float> enorm, hnorm;
  Linear eh_proj;  // [hidden, 2 * hidden], embedding half first
  LayerWeights layer;
  std::vector<float> head_norm;  // shared_head.norm
  Linear head;                   // shared_head.head, or a copy of the main lm_head's view
  Linear embed;                  // embed_tokens of the layer, or a copy of the main embedding's view
};

struct ModelWeights {
  Linear embed;                      // [vocab, hidden]
  std::vector<float> final_norm;
  Linear lm_head;                    // [vocab, hidden]; a copy of embed's view when tied
  std::vector<LayerWeights> layers;
  std::vector<MtpLayer> mtp;         // empty when the checkpoint holds no MTP layers
};

// A loaded model: configuration, the mapped weights (a Hugging Face folder or a GGUF file) and
// the weight views into them.
struct Model {
  ModelConfig config;
  std::unique_ptr<Checkpoint> checkpoint;  // Hugging Face folder; null for GGUF
  std::unique_ptr<GgufFile> gguf;          // GGUF file; null for folders
  std::vector<std::vector<uint8_t>> owned; // weights rewritten at load (GGUF llama Q/K rows)
  ModelWeights weights;
};

// Loads config and weights of a Hugging Face model folder, a .gguf file, or a folder holding one
// .gguf file and no config.json, checking every tensor's presence, type and shape against the
// configuration. With progress shown, the weights are read at once with a progress line on
// stderr (load_progress.h); otherwise they are read when first used.
std::unique_ptr<Model> load_model(const std::string& path, Progress progress = Progress::Off);

// Bytes of stored weights per format, and how many linears use each (for `inspect`).
struct StorageStats {
  size_t bytes[kWeightFormatCount] = {};
  size_t linears[kWeightFormatCount] = {};
  size_t other_bytes = 0;  // everything else in the checkpoint: norms, biases, scales of unused modules
  int64_t params = 0;
  int64_t params_per_token = 0;  // parameters one token touches (top-k experts only)
};
StorageStats storage_stats(const Model& m);

}  // namespace kestrel
