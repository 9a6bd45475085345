// kestrel quantize: a Hugging Face folder (BF16/F16/F32) or a GGUF file written as an NVFP4
// checkpoint in the NVIDIA ModelOpt layout, with input scales from a calibration text run through
// the CPU reference, or (`--format fp8`) as block-scaled FP8 in DeepSeek-V3's layout. `--format
// bf16` writes a GGUF's weights dequantized instead (a Hugging Face folder to compare against).
// docs/QUANTIZE.md describes the algorithms.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "apps/calibration_text.h"
#include "apps/commands.h"
#include "apps/model_options.h"
#include "common/error.h"
#include "common/mapped_file.h"
#include "common/thread_pool.h"
#include "formats/gguf_vocab.h"
#include "model/hf_config.h"
#include "model/weights.h"
#include "quant/calibrate.h"
#include "quant/write_checkpoint.h"
#include "text/gguf_tokenizer.h"

namespace kestrel::apps {
namespace fs = std::filesystem;
namespace {

constexpr int64_t kCalibWindow = 512;

struct Options {
  std::string model, out, calib, calib_tokens, format = "nvfp4", shard_size = "5GB";
  std::vector<std::string> exclude;
  int64_t calib_max_tokens = 4096;
  int threads = 0;
};

// The files beside the weights that describe how to use them: tokenizer, chat template,
// generation settings, license. Model cards and anything else are left behind.
bool is_side_file(const std::string& name) {
  static const char* kNames[] = {"generation_config.json", "tokenizer.json",    "tokenizer_config.json",
                                 "tokenizer.model",        "special_tokens_map.json", "added_tokens.json",
                                 "vocab.json",             "vocab.txt",         "merges.txt",
                                 "chat_template.jinja",    "chat_template.json"};
  for (const char* n : kNames)
    if (name == n) return true;
  return name.starts_with("LICENSE") || name.starts_with("NOTICE");
}

// Tokenizer, chat template and generation settings beside the weights.
void write_side_files(const Model& m, const std::string& model_path, const std::string& out) {
  if (m.checkpoint) {
    for (const auto& e : fs::directory_iterator(model_path)) {
      const std::string name = e.path().filename().string();
      if (e.is_regular_file() && is_side_file(name)) fs::copy_file(e.path(), fs::path(out) / name);
      if (e.is_directory() && name == "additional_chat_templates")
        fs::copy(e.path(), fs::path(out) / name, fs::copy_options::recursive);
    }
    return;
  }
  write_text_file((fs::path(out) / "generation_config.json").string(), hf_generation_config_json(m.config).dump(2) + "\n");
  const GgufIndex& g = m.gguf->index();
  if (!g.has("tokenizer.ggml.model")) {
    std::fprintf(stderr, "kestrel: %s has no vocabulary: no tokenizer written\n", model_path.c_str());
    return;
  }
  const GgufVocab v = read_gguf_vocab(g);
  try {
    write_text_file((fs::path(out) / "tokenizer.json").string(), text::gguf_tokenizer_json(v, m.gguf->path()));
  } catch (const Error& e) {
    std::fprintf(stderr, "kestrel: no tokenizer.json written: %s\n", e.what());
    return;
  }
  nlohmann::ordered_json tc;
  tc["tokenizer_class"] = "PreTrainedTokenizerFast";
  auto token = [&](int64_t id) { return id >= 0 && size_t(id) < v.tokens.size() ? v.tokens[size_t(id)] : std::string(); };
  if (v.bos >= 0) tc["bos_token"] = token(v.bos);
  if (v.eos >= 0) tc["eos_token"] = token(v.eos);
  if (v.unk >= 0) tc["unk_token"] = token(v.unk);
  if (v.pad >= 0) tc["pad_token"] = token(v.pad);
  tc["add_bos_token"] = v.add_bos;
  tc["add_eos_token"] = v.add_eos;
  if (!v.chat_template.empty()) tc["chat_template"] = v.chat_template;
  write_text_file((fs::path(out) / "tokenizer_config.json").string(), tc.dump(2) + "\n");
}

std::vector<int32_t> calibration_tokens(const Options& o, const Model& m) {
  std::vector<int32_t> ids;
  if (!o.calib_tokens.empty()) {
    ids = parse_token_ids(o.calib_tokens, "--calib-tokens");
  } else {
    std::string text = kCalibrationText;
    if (!o.calib.empty()) {
      if (!fs::is_regular_file(o.calib)) fail("--calib: ", o.calib, ": no such file");
      text = read_text_file(o.calib);
      if (text.find_first_not_of(" \t\r\n") == std::string::npos) fail("--calib: ", o.calib, ": the text is empty");
    }
    std::unique_ptr<text::Tokenizer> tok;
    try {
      tok = std::make_unique<text::Tokenizer>(text::load_tokenizer_for_model(o.model));
    } catch (const Error& e) {
      fail(e.what(), " (needed to read the calibration text; give token ids with --calib-tokens instead)");
    }
    ids = tok->encode(text, true, false);
  }
  if (ids.empty()) fail("calibration: the text encodes to no tokens");
  for (int32_t id : ids)
    if (id >= m.config.vocab_size)
      fail("calibration: token id ", id, " is outside the model's vocabulary of ", m.config.vocab_size);
  if (int64_t(ids.size()) > o.calib_max_tokens) ids.resize(size_t(o.calib_max_tokens));
  return ids;
}

}  // namespace

Run add_quantize(CLI::App& app) {
  auto o = std::make_shared<Options>();
  app.add_option("--model", o->model, "Hugging Face folder (BF16, F16 or F32 weights) or .gguf file")->required();
  app.add_option("--out", o->out, "Folder to write the checkpoint into (new or empty)")->required();
  app.add_option("--exclude", o->exclude,
                 "Module pattern to keep dense, fnmatch-style, repeatable (e.g. 'model.layers.*.self_attn*'); "
                 "added to the defaults lm_head and the MoE routers. With --format fp8: a modules_to_not_convert "
                 "entry (a module name, or a regular expression matching from the name's start)");
  app.add_option("--calib", o->calib, "Calibration text for the input scales (default: a built-in English text)");
  app.add_option("--calib-tokens", o->calib_tokens, "Calibration token ids instead of a text, e.g. 1,2,3");
  app.add_option("--calib-max-tokens", o->calib_max_tokens, "Most calibration tokens to run (default 4096)");
  app.add_option("--format", o->format,
                 "nvfp4 (default), fp8 (E4M3 with a scale per 128 x 128 block, as DeepSeek-V3) or bf16 (no "
                 "quantization: a GGUF's weights dequantized)");
  app.add_option("--shard-size", o->shard_size, "Largest shard, e.g. 5GB (default), 500MB");
  app.add_option("--threads", o->threads, "CPU threads (default: all cores)");
  return [o]() {
    const auto t0 = std::chrono::steady_clock::now();
    if (o->format != "nvfp4" && o->format != "fp8" && o->format != "bf16")
      fail("--format: expected nvfp4, fp8 or bf16, got '", o->format, "'");
    if (o->calib_max_tokens < 1) fail("--calib-max-tokens: must be positive, got ", o->calib_max_tokens);
    if (!o->calib.empty() && !o->calib_tokens.empty()) fail("--calib and --calib-tokens: give one of them");
    const bool nvfp4 = o->format == "nvfp4", fp8 = o->format == "fp8";
    if (!nvfp4 && (!o->calib.empty() || !o->calib_tokens.empty()))
      fail("--format ", o->format, " calibrates nothing: --calib and --calib-tokens do not apply");
    if (!nvfp4 && !fp8 && !o->exclude.empty()) fail("--format bf16 quantizes nothing: --exclude does not apply");
    const uint64_t shard_bytes = parse_size(o->shard_size, "--shard-size");
    if (!fs::exists(o->model)) fail(o->model, ": no such file or folder");
    std::error_code ec;
    if (fs::exists(o->out) && fs::equivalent(o->model, o->out, ec))
      fail("--out: ", o->out, " is the model's own folder");
    if (fs::exists(o->out) && (!fs::is_directory(o->out) || !fs::is_empty(o->out)))
      fail("--out: ", o->out, ": exists and is not an empty folder");

    auto model = load_model(o->model, Progress::Auto);
    if (model->checkpoint && model->config.quant.is_quantized())
      fail(model->config.quant.source, ": the model is already quantized (", model->config.quant.describe(), ")");
    nlohmann::ordered_json config;
    if (model->checkpoint) {
      const std::string path = (fs::path(o->model) / "config.json").string();
      config = nlohmann::ordered_json::parse(read_text_file(path), nullptr, false);
      if (!config.is_object()) fail(path, ": not a JSON object");
    } else {
      config = hf_config_json(model->config);
    }

    ThreadPool pool(o->threads);
    std::map<const Linear*, float> input_amax;
    if (nvfp4) {
      const std::vector<int32_t> ids = calibration_tokens(*o, *model);
      const int64_t window = std::min(kCalibWindow, model->config.max_position_embeddings);
      const auto c0 = std::chrono::steady_clock::now();
      input_amax = calibrate_input_amax(*model, ids, window, pool, true);
      std::fprintf(stderr, "calibrated on %zu tokens in %.1f s\n", ids.size(),
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count());
    }
    WriteOptions wo;
    wo.format = nvfp4 ? WriteFormat::Nvfp4 : fp8 ? WriteFormat::Fp8 : WriteFormat::Bf16;
    wo.exclude = o->exclude;
    wo.input_amax = &input_amax;
    wo.shard_bytes = shard_bytes;
    wo.progress = true;
    const WriteSummary s = write_checkpoint(*model, config, o->out, wo, pool);
    write_side_files(*model, o->model, o->out);

    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::fprintf(stderr,
                 "wrote %s: %d tensors in %d shard(s), %.1f MB, %d linears %s, in %.1f s (peak resident %.0f MB)\n",
                 o->out.c_str(), s.tensors, s.shards, double(s.bytes) / 1e6, s.quantized, fp8 ? "FP8" : "NVFP4", secs,
                 double(ru.ru_maxrss) / 1024.0);
    if (nvfp4 || fp8) {
      std::string ex;
      for (const auto& e : s.exclude) ex += (ex.empty() ? "" : ", ") + e;
      std::fprintf(stderr, "%s: %s\n", fp8 ? "modules_to_not_convert" : "exclude_modules", ex.c_str());
    }
    return 0;
  };
}

}  // namespace kestrel::apps
