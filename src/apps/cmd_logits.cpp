#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "apps/commands.h"
#include "apps/model_options.h"
#include "apps/runner.h"
#include "common/error.h"
#include "model/weights.h"

namespace kestrel::apps {
namespace {

struct Options {
  std::string model, tokens, out;
  bool decode = false;
  int threads = 0;
  std::string device = "auto", quant = "none";
  Layout layout;
  Progress progress = Progress::Auto;
};

}  // namespace

Run add_logits(CLI::App& app) {
  auto o = std::make_shared<Options>();
  app.add_option("--model", o->model, "Hugging Face model folder or .gguf file")->required();
  app.add_option("--tokens", o->tokens, "Comma-separated token ids, e.g. 1,2,3")->required();
  app.add_option("--out", o->out, "Output file: float32 little-endian logits [tokens, vocab]")->required();
  app.add_flag("--decode", o->decode, "Feed the tokens one at a time through the KV cache (decode path)");
  app.add_option("--threads", o->threads, "CPU threads (default: all cores)");
  app.add_option("--device", o->device, "auto (the GPU when it can run the model), cpu or cuda");
  add_progress_flag(app, o->progress);
  add_quant_option(app, o->quant);
  add_layout_options(app, o->layout);
  return [o]() {
    check_device_option(o->device);
    check_quant_option(o->quant);
    const std::vector<int32_t> tokens = parse_token_ids(o->tokens, "--tokens");
    auto model = load_model_as(o->model, o->quant, o->progress);
    const int64_t V = model->config.vocab_size, T = int64_t(tokens.size());
    auto runner = Runner::make(*model, o->device, T, o->threads, o->layout);
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
