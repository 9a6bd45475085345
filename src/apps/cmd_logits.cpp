#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "apps/commands.h"
#include "apps/model_options.h"
#include "apps/runner.h"
#include "backend/cpu/forward.h"
#include "common/error.h"
#include "model/weights.h"

namespace kestrel::apps {
namespace {

struct Options {
  std::string model, tokens, out;
  bool decode = false;
  bool mtp = false;
  int threads = 0;
  std::string device = "auto", quant = "none";
  Layout layout;
  std::string kv_dtype = "auto";
  Progress progress = Progress::Auto;
};

// The main model over the tokens (its final normed hidden states), then MTP layer 0 over positions
// 0 .. T-2 fed with the token after each; both through the prefill path or one position at a time.
int run_mtp(const Options& o, const Model& model, const std::vector<int32_t>& tokens) {
  if (o.device == "cuda") fail("--mtp runs on the CPU (give --device cpu or auto)");
  if (o.layout.split()) fail("--mtp runs on the unsplit model (without --tp/--ep)");
  if (model.weights.mtp.empty())
    fail(model.config.source, ": --mtp needs MTP layers, and the checkpoint holds none (num_nextn_predict_layers ",
         model.config.num_nextn_predict_layers, ")");
  const int64_t V = model.config.vocab_size, H = model.config.hidden_size, T = int64_t(tokens.size());
  if (T < 2) fail("--tokens: --mtp needs at least 2 tokens (position p reads tokens[p+1])");
  ThreadPool pool(o.threads);
  cpu::Forward fwd(model, pool);
  KvCache cache = fwd.make_cache(T), mtp_cache = fwd.make_mtp_cache(T - 1);
  std::vector<float> hidden(static_cast<size_t>(T * H)), logits(static_cast<size_t>((T - 1) * V));
  const auto t0 = std::chrono::steady_clock::now();
  if (o.decode) {
    for (int64_t t = 0; t < T; ++t) fwd.run({tokens.data() + t, 1}, cache, nullptr, hidden.data() + t * H);
    for (int64_t t = 0; t + 1 < T; ++t)
      fwd.run_mtp({tokens.data() + t + 1, 1}, hidden.data() + t * H, mtp_cache, logits.data() + t * V);
  } else {
    fwd.run(tokens, cache, nullptr, hidden.data());
    fwd.run_mtp({tokens.data() + 1, size_t(T - 1)}, hidden.data(), mtp_cache, logits.data());
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::ofstream out(o.out, std::ios::binary);
  if (!out) fail(o.out, ": cannot open for writing");
  out.write(reinterpret_cast<const char*>(logits.data()), std::streamsize(logits.size() * sizeof(float)));
  if (!out) fail(o.out, ": write failed");
  std::fprintf(stderr, "%lld tokens and MTP layer %lld through the %s path in %.3f s (cpu, %d threads); MTP logits [%lld, %lld] -> %s\n",
               (long long)T, (long long)model.weights.mtp[0].index, o.decode ? "decode" : "prefill", secs, pool.size(),
               (long long)(T - 1), (long long)V, o.out.c_str());
  return 0;
}

}  // namespace

Run add_logits(CLI::App& app) {
  auto o = std::make_shared<Options>();
  app.add_option("--model", o->model, "Hugging Face model folder or .gguf file")->required();
  app.add_option("--tokens", o->tokens, "Comma-separated token ids, e.g. 1,2,3")->required();
  app.add_option("--out", o->out, "Output file: float32 little-endian logits [tokens, vocab]")->required();
  app.add_flag("--decode", o->decode, "Feed the tokens one at a time through the KV cache (decode path)");
  app.add_flag("--mtp", o->mtp,
               "Write the multi-token-prediction layer's logits instead: [tokens - 1, vocab], row p from the "
               "main model's hidden state at p and tokens[p+1], predicting the token after tokens[p+1] (CPU)");
  app.add_option("--threads", o->threads, "CPU threads (default: all cores)");
  app.add_option("--device", o->device, "auto (the GPU when it can run the model), cpu or cuda");
  add_progress_flag(app, o->progress);
  add_quant_option(app, o->quant);
  add_layout_options(app, o->layout);
  add_kv_dtype_option(app, o->kv_dtype);
  return [o]() {
    check_device_option(o->device);
    check_kv_dtype_option(o->kv_dtype);
    check_quant_option(o->quant);
    const std::vector<int32_t> tokens = parse_token_ids(o->tokens, "--tokens");
    auto model = load_model_as(o->model, o->quant, o->progress);
    if (o->mtp) return run_mtp(*o, *model, tokens);
    const int64_t V = model->config.vocab_size, T = int64_t(tokens.size());
    auto runner = Runner::make(*model, o->device, T, o->threads, o->layout, o->kv_dtype);
    std::vector<float> logits(static_cast<size_t>(T * V));
    const auto t0 = std::chrono::steady_clock::now();
    if (o->decode) {
      for (int64_t t = 0; t < T; ++t) runner->run({tokens.data() + t, 1}, logits.data() + t * V, true);
    } else {
      runner->run(tokens, logits.data(), true);
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::ofstream out(o->out, std::ios::binary);
    if (!out) fail(o->out, ": cannot open for writing");
    out.write(reinterpret_cast<const char*>(logits.data()), std::streamsize(logits.size() * sizeof(float)));
    if (!out) fail(o->out, ": write failed");
    std::fprintf(stderr, "%lld tokens through the %s path in %.3f s (%.1f tokens/s, %s); logits [%lld, %lld] -> %s\n",
                 (long long)T, o->decode ? "decode" : "prefill", secs, double(T) / secs, runner->describe().c_str(), (long long)T,
                 (long long)V, o->out.c_str());
    return 0;
  };
}

}  // namespace kestrel::apps
