// kestrel generate: text in, text out on the CPU backend, streamed as it is produced.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "apps/commands.h"
#include "apps/model_options.h"
#include "apps/reply.h"
#include "apps/runner.h"
#include "common/error.h"
#include "model/weights.h"
#include "runtime/sampler.h"
#include "text/model_chat.h"
#include "text/gguf_tokenizer.h"
#include "text/tokenizer.h"

namespace kestrel::apps {
namespace {

struct Options {
  std::string model, prompt, system;
  bool chat = false;
  ReplyOptions reply;
  int threads = 0;
  std::string device = "auto";
  Progress progress = Progress::Auto;
  std::string quant = "none";
  Layout layout;
  std::string kv_dtype = "auto";
};


}  // namespace

Run add_generate(CLI::App& app) {
  auto o = std::make_shared<Options>();
  app.add_option("--model", o->model, "Model: Hugging Face folder, .gguf file, or a folder holding one .gguf")->required();
  app.add_option("--prompt", o->prompt, "Prompt text")->required();
  app.add_flag("--chat", o->chat, "Wrap the prompt in the model's chat template as a user message");
  app.add_option("--system", o->system, "System message (with --chat)");
  add_reply_options(app, o->reply);
  app.add_option("--threads", o->threads, "CPU threads (default: all cores)");
  add_quant_option(app, o->quant);
  add_layout_options(app, o->layout);
  add_kv_dtype_option(app, o->kv_dtype);
  app.add_option("--device", o->device, "auto (the GPU when it can run the model), cpu or cuda");
  add_progress_flag(app, o->progress);
  return [o]() {
    check_quant_option(o->quant);
    check_device_option(o->device);
    check_kv_dtype_option(o->kv_dtype);
    if (o->reply.max_tokens < 0) fail("--max-tokens: must be >= 0, got ", o->reply.max_tokens);
    if (!o->system.empty() && !o->chat) fail("--system: needs --chat");
    check_sampler_options(o->reply.sampling);
    check_speculation_options(o->reply.speculation);
    if (!std::filesystem::exists(o->model)) fail(o->model, ": no such file or folder");

    const text::Tokenizer tok = text::load_tokenizer_for_model(o->model);
    auto model = load_model_as(o->model, o->quant, o->progress);

    std::vector<int32_t> prompt;
    if (o->chat) {
      nlohmann::ordered_json messages = nlohmann::ordered_json::array();
      if (!o->system.empty()) messages.push_back({{"role", "system"}, {"content", o->system}});
      messages.push_back({{"role", "user"}, {"content", o->prompt}});
      prompt = text::load_model_chat(*model, o->model).encode(messages, tok, false);
    } else {
      prompt = tok.encode(o->prompt, true, true);
    }
    if (prompt.empty()) fail("--prompt: the prompt encodes to no tokens");

    const int64_t V = model->config.vocab_size;
    for (int32_t id : prompt)
      if (id < 0 || id >= V) fail("--prompt: token id ", id, " is outside the model's vocabulary of ", V);
    auto runner = Runner::make(*model, o->device, int64_t(prompt.size()) + o->reply.max_tokens + 1, o->threads, o->layout,
                               o->kv_dtype, o->reply.speculation.method == "mtp");
    std::vector<int32_t> history = prompt;
    const Reply r = reply(*runner, tok, model->config.eos_token_ids, prompt, history, prompt.size(), o->reply, write_stdout);
    write_stdout("\n");
    std::fprintf(stderr,
                 "prompt tokens: %zu, generated tokens: %d, prefill: %.1f tokens/s, decode: %.1f tokens/s (%s)\n",
                 prompt.size(), r.generated, double(prompt.size()) / r.prefill_s,
                 r.decode_steps ? double(r.decode_steps) / r.decode_s : 0.0, runner->describe().c_str());
    if (o->reply.speculation.method != "none") {
      const SpeculationStats& sp = r.speculation;
      std::fprintf(stderr,
                   "speculative (%s, at most %d drafted per check): %lld checks, %lld of %lld drafted tokens accepted (%.0f%%), "
                   "%.2f tokens per check\n",
                   o->reply.speculation.method.c_str(), o->reply.speculation.draft_tokens, (long long)sp.verifications,
                   (long long)sp.accepted, (long long)sp.drafted, 100.0 * sp.acceptance(), sp.mean_accepted_length());
    }
    return 0;
  };
}

}  // namespace kestrel::apps
