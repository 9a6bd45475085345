// kestrel chat: a conversation on the terminal. Each line read from stdin is a user turn; the
// whole conversation is rendered with the model's chat template and only the tokens the model
// has not seen yet are run (the KV cache keeps the earlier turns). /reset starts over, /quit or
// end of input ends.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <iostream>
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
#include "text/gguf_tokenizer.h"
#include "text/model_chat.h"

namespace kestrel::apps {
namespace {

struct Options {
  std::string model, system, device = "auto";
  ReplyOptions reply;
  int64_t context = 4096;
  int threads = 0;
  Progress progress = Progress::Auto;
  std::string quant = "none";
  Layout layout;
  std::string kv_dtype = "auto";
};


}  // namespace

Run add_chat(CLI::App& app) {
  auto o = std::make_shared<Options>();
  o->reply.max_tokens = 512;
  app.add_option("--model", o->model, "Model: Hugging Face folder, .gguf file, or a folder holding one .gguf")->required();
  app.add_option("--system", o->system, "System message");
  app.add_option("--context", o->context, "Most positions the conversation may use (default 4096)");
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
    check_sampler_options(o->reply.sampling);
    check_speculation_options(o->reply.speculation);
    if (o->reply.max_tokens < 1) fail("--max-tokens: must be >= 1, got ", o->reply.max_tokens);
    if (o->context < 2) fail("--context: must be at least 2, got ", o->context);
    if (!std::filesystem::exists(o->model)) fail(o->model, ": no such file or folder");
    const text::Tokenizer tok = text::load_tokenizer_for_model(o->model);
    auto model = load_model_as(o->model, o->quant, o->progress);
    const text::ModelChat chat = text::load_model_chat(*model, o->model);
    if (model->config.max_position_embeddings > 0) o->context = std::min(o->context, model->config.max_position_embeddings);
    auto runner = Runner::make(*model, o->device, o->context, o->threads, o->layout, o->kv_dtype,
                               o->reply.speculation.method == "mtp");
    const bool tty = isatty(STDIN_FILENO);
    std::fprintf(stderr, "kestrel chat (%s, context %lld): /reset starts over, /quit or Ctrl-D ends\n",
                 runner->describe().c_str(), (long long)o->context);

    nlohmann::ordered_json messages = nlohmann::ordered_json::array();
    if (!o->system.empty()) messages.push_back({{"role", "system"}, {"content", o->system}});
    const size_t base = messages.size();
    std::vector<int32_t> held;  // the tokens the runner holds, in order
    std::string line;
    while (true) {
      if (tty) std::fprintf(stderr, "> ");
      if (!std::getline(std::cin, line)) break;
      if (line == "/quit") break;
      if (line == "/reset") {
        messages.erase(messages.begin() + long(base), messages.end());
        std::fprintf(stderr, "(conversation cleared)\n");
        continue;
      }
      if (line.empty()) continue;
      messages.push_back({{"role", "user"}, {"content", line}});
      const std::vector<int32_t> all = chat.encode(messages, tok, false);
      if (int64_t(all.size()) + o->reply.max_tokens > o->context) {
        std::fprintf(stderr, "kestrel: the conversation would need %zu + %d positions, more than the context of %lld; "
                             "/reset to start over\n", all.size(), o->reply.max_tokens, (long long)o->context);
        messages.erase(messages.end() - 1);
        continue;
      }
      // Run only what the cache lacks; if the template rendered earlier turns differently than
      // the cache holds them, start the cache over.
      size_t keep = 0;
      while (keep < held.size() && keep < all.size() && held[keep] == all[keep]) ++keep;
      if (keep < held.size() || keep == all.size()) {
        runner->reset();
        held.clear();
        keep = 0;
      }
      std::vector<int32_t> history = all;
      const std::span<const int32_t> fresh(all.data() + keep, all.size() - keep);
      const Reply r = reply(*runner, tok, model->config.eos_token_ids, fresh, history, all.size(), o->reply, write_stdout);
      write_stdout("\n");
      held.assign(all.begin(), all.begin() + long(keep));
      held.insert(held.end(), r.ran.begin(), r.ran.end());
      messages.push_back({{"role", "assistant"}, {"content", r.text}});
      std::fprintf(stderr, "(%zu new prompt tokens, %d generated, %.1f tokens/s", fresh.size(), r.generated,
                   r.decode_steps ? r.decode_steps / r.decode_s : 0.0);
      if (r.speculation.verifications)
        std::fprintf(stderr, "; %.0f%% of drafted tokens accepted, %.2f tokens per check", 100.0 * r.speculation.acceptance(),
                     r.speculation.mean_accepted_length());
      std::fprintf(stderr, ")\n");
    }
    return 0;
  };
}

}  // namespace kestrel::apps
