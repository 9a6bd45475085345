// The roofline of one decode step: from a config.json (every supported family, and the MLA
// families DeepSeek-V3 and GLM-5 by their shapes), the storage format of every module, a
// parallel layout and a GPU, the bytes each GPU must read per step by part of the model, the
// communication between GPUs, and the resulting floor in ms per step. decode_cost (the floor
// the benchmarks report against) is the one-GPU case of this.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "parallel/layout.h"
#include "plan/gpus.h"

namespace kestrel {

// Distinct experts a batch selects among `pool` of a layer's `experts` (top_k per token),
// expected under uniform routing: pool * (1 - (1 - top_k/experts)^batch).
double expected_distinct_experts(double pool, double experts, double top_k, int batch);

enum class Part { Attention, DenseFfn, RoutedExperts, SharedExperts, Router, Embedding, LmHead };
const char* part_name(Part p);

// How a module is laid out under tensor parallelism: split by output rows (column parallel),
// by input columns (row parallel), by KV heads (replicated once there are more ranks than
// heads), by vocabulary, or held whole on every rank.
enum class Split { Column, Row, KvHeads, Vocab, Replicated };

struct ModuleShape {
  std::string name;   // first layer's name, e.g. "model.layers.0.self_attn.q_proj"
  Part part;
  Split split;
  double out, in;
  double count;       // modules of this shape per step (layers; a routed expert: per expert)
  double bytes_per_weight;
};

// Shapes of a decode step, independent of batch and layout.
struct StepShapes {
  std::string architecture;
  int64_t layers = 0, moe_layers = 0, hidden = 0, vocab = 0;
  int64_t kv_heads = 0;          // GQA: KV heads; MLA: 0
  double kv_values_per_position = 0;  // per layer, all heads: GQA 2 * kv_heads * head_dim; MLA kv_lora + rope
  double index_values_per_position = 0;  // DSA indexer keys per layer (read at every position)
  int64_t attended_positions_cap = 0;  // DSA index_topk: attention reads at most this many (0: all)
  int64_t experts = 0, experts_per_token = 0;
  double expert_bytes = 0;       // one routed expert: gate + up + down
  bool mla = false;
  std::vector<ModuleShape> modules;  // everything but routed experts
};

// --quant: the checkpoint's settings, or every linear module of the layers in NVFP4 (what-if),
// or everything in BF16. Routers, embeddings and the LM head stay BF16 in the what-ifs.
enum class QuantWhatIf { Checkpoint, Nvfp4, Bf16 };

// Reads shapes from a parsed config.json (config_path names it in errors), or from a parsed
// ModelConfig (the families the engine runs).
StepShapes step_shapes(const nlohmann::json& config, const std::string& config_path,
                       QuantWhatIf quant = QuantWhatIf::Checkpoint);
struct ModelConfig;
StepShapes step_shapes(const ModelConfig& c, QuantWhatIf quant = QuantWhatIf::Checkpoint);


struct RooflinePart {
  Part part;
  double bytes = 0;   // per GPU per step
  std::string how;    // how it is laid out
};

struct Roofline {
  std::vector<RooflinePart> parts;   // weights by part, then KV cache
  double kv_bytes = 0;               // per GPU per step
  double weight_bytes = 0;           // per GPU per step (parts)
  double expected_experts = 0;       // distinct experts per MoE layer per GPU
  double resident_bytes = 0;         // weights held per GPU (all experts)
  int allreduces = 0;                // per step
  double allreduce_bytes = 0;        // each
  double comm_ms = 0;
  double memory_ms = 0;
  double floor_ms = 0;
  double total_bytes() const { return weight_bytes + kv_bytes; }
};

// kv_bytes: bytes per cached value (4 float32, 2 BF16, 1 FP8).
Roofline roofline(const StepShapes& s, const Layout& layout, int batch, int64_t context, double kv_bytes,
                  double bandwidth_gbs, const GpuSpec& link);

}  // namespace kestrel
