// Options shared by the commands that load and run a model: token id lists, `--quant`, which
// keeps the weights as stored or requantizes them to NVFP4 at load, and the split `--tp/--ep`.
#pragma once
#include <CLI/CLI.hpp>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/kv_layer.h"
#include "model/load_progress.h"
#include "model/weights.h"
#include "parallel/layout.h"
#include "runtime/speculative.h"

namespace kestrel::apps {

// Comma-separated non-negative token ids ("1,2,3"); errors name `option`.
std::vector<int32_t> parse_token_ids(const std::string& s, const std::string& option);

// A size in bytes: "5GB", "500MB", "64KiB", "16K" (K, M, G: binary), "1000000"; errors name `option`.
uint64_t parse_size(const std::string& s, const std::string& option);

// --quant none|nvfp4 (default none).
void add_quant_option(CLI::App& app, std::string& quant);
void check_quant_option(const std::string& quant);

// --tp N --ep M: how the model is split over GPUs (threads on the CPU); see parallel/layout.h.
void add_layout_options(CLI::App& app, Layout& layout);

// --speculative none|ngram|mtp --draft-tokens K: speculation by prompt lookup
// (runtime/speculative.h) or with the model's MTP layer (runtime/mtp_drafter.h), the same flags
// for generate, chat and serve; check_speculation_options checks them.
void add_speculation_options(CLI::App& app, SpeculationOptions& o);

// --kv-dtype auto|f32|bf16: the type of the GPU's KV cache. auto: bf16 for grouped-query
// attention, f32 for MLA (the GPU caches its latents as float32); the CPU always caches float32.
void add_kv_dtype_option(CLI::App& app, std::string& kv);
void check_kv_dtype_option(const std::string& kv);
// The option's KV type for a model on the GPU (an MLA model refuses bf16).
cuda::KvType kv_type_for(const ModelConfig& c, const std::string& kv);

// load_model, then with quant "nvfp4" every linear ModelOpt would quantize (all but the LM head,
// routers and embeddings) requantized to NVFP4 in memory, by the quantizer of `kestrel quantize`.
std::unique_ptr<Model> load_model_as(const std::string& path, const std::string& quant,
                                     Progress progress = Progress::Auto);

}  // namespace kestrel::apps
