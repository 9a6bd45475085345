// kestrel perplexity: sliding-window perplexity of a model over a text (runtime/perplexity.h
// gives the exact definition), and with --reference the mean KL(reference || model) per scored
// position and the share of positions whose top-1 token agrees. Both models run on the device
// --device picks, window by window in chunks, so memory stays at a few chunks of logits.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "apps/commands.h"
#include "apps/model_options.h"
#include "apps/runner.h"
#include "common/error.h"
#include "common/mapped_file.h"
#include "model/weights.h"
#include "runtime/perplexity.h"
#include "text/gguf_tokenizer.h"

namespace kestrel::apps {
namespace fs = std::filesystem;
namespace {

constexpr int64_t kChunk = 64;  // positions whose logits are held at once, per model

struct Options {
  std::string model, text, reference, device = "auto", quant = "none", json;
  Layout layout;
  std::string kv_dtype = "auto";
  int64_t context = -1, stride = -1, max_tokens = 0;  // -1: not given
  int threads = 0;
};

// One model on its device, with the logits of the chunk it ran last.
struct Scorer {
  std::unique_ptr<Model> model;
  std::unique_ptr<Runner> runner;
  std::vector<float> logits;
};

}  // namespace

Run add_perplexity(CLI::App& app) {
  auto o = std::make_shared<Options>();
  app.add_option("--model", o->model, "Model: Hugging Face folder or .gguf file")->required();
  app.add_option("--text", o->text, "UTF-8 text file to score")->required();
  app.add_option("--context", o->context, "Window length in tokens (default: the model's, at most 1024)");
  app.add_option("--stride", o->stride, "Tokens between window starts, 1..context (default: context / 2)");
  app.add_option("--reference", o->reference, "Reference model (e.g. the BF16 original): KL and top-1 agreement");
  app.add_option("--max-tokens", o->max_tokens, "Score only the first N tokens of the text");
  app.add_option("--json", o->json, "Also write the figures to this JSON file");
  app.add_option("--device", o->device, "auto (the GPU when it can run the model), cpu or cuda");
  app.add_option("--threads", o->threads, "CPU threads (default: all cores)");
  add_quant_option(app, o->quant);
  add_layout_options(app, o->layout);
  add_kv_dtype_option(app, o->kv_dtype);
  return [o]() {
    check_device_option(o->device);
    check_kv_dtype_option(o->kv_dtype);
    check_quant_option(o->quant);
    if (o->context != -1 && o->context < 2) fail("--context: must be at least 2, got ", o->context);
    if (o->stride != -1 && o->stride < 1) fail("--stride: must be at least 1, got ", o->stride);
    if (o->context != -1 && o->stride > o->context)
      fail("--stride: ", o->stride, " exceeds the context of ", o->context, " (tokens between windows would go unscored)");
    if (o->max_tokens < 0 || o->max_tokens == 1) fail("--max-tokens: must be at least 2, got ", o->max_tokens);
    if (!fs::exists(o->model)) fail(o->model, ": no such file or folder");
    if (!o->reference.empty() && !fs::exists(o->reference)) fail("--reference: ", o->reference, ": no such file or folder");
    if (!fs::is_regular_file(o->text)) fail("--text: ", o->text, ": no such file");
    const std::string text = read_text_file(o->text);
    if (text.find_first_not_of(" \t\r\n") == std::string::npos) fail("--text: ", o->text, ": the text is empty");

    const text::Tokenizer tok = text::load_tokenizer_for_model(o->model);
    std::vector<int32_t> ids = tok.encode(text, true, false);
    if (o->max_tokens > 0 && int64_t(ids.size()) > o->max_tokens) ids.resize(size_t(o->max_tokens));
    if (ids.size() < 2)
      fail("--text: ", o->text, " encodes to ", ids.size(), " token(s); perplexity needs at least 2");

    Scorer m, r;
    m.model = load_model_as(o->model, o->quant);
    const ModelConfig& c = m.model->config;
    for (int32_t id : ids)
      if (id >= c.vocab_size) fail(o->model, ": the tokenizer gives id ", id, ", outside the vocabulary of ", c.vocab_size);
    if (!o->reference.empty()) {
      r.model = load_model(o->reference);
      if (r.model->config.vocab_size != c.vocab_size)
        fail("--reference: ", o->reference, " has a vocabulary of ", r.model->config.vocab_size, " tokens, the model ",
             c.vocab_size, ": the distributions cannot be compared");
    }
    const int64_t context = o->context != -1 ? o->context : std::min<int64_t>(1024, c.max_position_embeddings);
    if (context > c.max_position_embeddings)
      fail("--context: ", context, " exceeds the model's max_position_embeddings of ", c.max_position_embeddings);
    if (r.model && context > r.model->config.max_position_embeddings)
      fail("--context: ", context, " exceeds the reference's max_position_embeddings of ",
           r.model->config.max_position_embeddings);
    const int64_t stride = o->stride != -1 ? o->stride : std::max<int64_t>(1, context / 2);
    const std::vector<PerplexityWindow> windows = perplexity_windows(int64_t(ids.size()), context, stride);

    const int64_t V = c.vocab_size;
    m.runner = Runner::make(*m.model, o->device, context, o->threads, o->layout, o->kv_dtype);
    if (r.model) r.runner = Runner::make(*r.model, o->device, context, o->threads, o->layout, o->kv_dtype);
    int64_t to_score = 0;
    for (const auto& w : windows) to_score += w.end - w.first_scored;

    PerplexityStats st;
    const auto t0 = std::chrono::steady_clock::now();
    int64_t ran = 0;
    for (size_t wi = 0; wi < windows.size(); ++wi) {
      const PerplexityWindow& w = windows[wi];
      for (Scorer* s : {&m, &r})
        if (s->runner) s->runner->reset();
      // Context only: positions before the first scored one's predecessor need no logits.
      const std::span<const int32_t> head(ids.data() + w.begin, size_t(w.first_scored - 1 - w.begin));
      for (Scorer* s : {&m, &r})
        if (s->runner && !head.empty()) s->runner->run(head, nullptr, true);
      ran += int64_t(head.size());
      // Row p predicts token p + 1: run [first_scored - 1, end - 1) with logits, chunk by chunk.
      for (int64_t p = w.first_scored - 1; p < w.end - 1; p += kChunk) {
        const int64_t n = std::min(kChunk, w.end - 1 - p);
        const std::span<const int32_t> chunk(ids.data() + p, size_t(n));
        for (Scorer* s : {&m, &r}) {
          if (!s->runner) continue;
          s->logits.resize(size_t(n * V));
          s->runner->run(chunk, s->logits.data(), true);
        }
        for (int64_t i = 0; i < n; ++i)
          st.add(m.logits.data() + i * V, r.runner ? r.logits.data() + i * V : nullptr, V, ids[size_t(p + i + 1)]);
        ran += n;
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::fprintf(stderr, "\rperplexity: window %zu/%zu, %lld/%lld positions scored, %.0f tokens/s per model", wi + 1,
                     windows.size(), (long long)st.scored, (long long)to_score, double(ran) / secs);
      }
    }
    std::fprintf(stderr, "\n");

    std::printf("text: %s, %zu tokens; %zu window(s) of up to %lld tokens, stride %lld; %lld positions scored\n",
                o->text.c_str(), ids.size(), windows.size(), (long long)context, (long long)stride,
                (long long)st.scored);
    std::printf("model: %s%s (%s)\n", o->model.c_str(), o->quant == "nvfp4" ? " requantized to NVFP4" : "",
                m.runner->describe().c_str());
    std::printf("perplexity: %.6f (mean NLL %.6f nats)\n", st.perplexity(), st.nll / double(st.scored));
    nlohmann::ordered_json j;
    j["text"] = o->text;
    j["model"] = o->model;
    j["quant"] = o->quant;
    j["tokens"] = ids.size();
    j["context"] = context;
    j["stride"] = stride;
    j["windows"] = windows.size();
    j["scored"] = st.scored;
    j["perplexity"] = st.perplexity();
    j["mean_nll"] = st.nll / double(st.scored);
    if (r.runner) {
      std::printf("reference: %s, perplexity %.6f\n", o->reference.c_str(), st.ref_perplexity());
      std::printf("mean KL(reference || model): %.6f nats per position\n", st.mean_kl());
      std::printf("top-1 agreement: %.4f (%lld of %lld positions)\n", st.top1(), (long long)st.top1_agree,
                  (long long)st.scored);
      j["reference"] = o->reference;
      j["reference_perplexity"] = st.ref_perplexity();
      j["mean_kl"] = st.mean_kl();
      j["top1_agreement"] = st.top1();
    }
    if (!o->json.empty()) write_text_file(o->json, j.dump(2) + "\n");
    return 0;
  };
}

}  // namespace kestrel::apps
