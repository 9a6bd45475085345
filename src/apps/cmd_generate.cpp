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
  int max_tokens = 128;
  SamplerOptions sampling;
  std::vector<std::string> stops;
  int threads = 0;
  std::string device = "auto";
};

void emit(const std::string& s) {
  if (s.empty()) return;
  std::fwrite(s.data(), 1, s.size(), stdout);
  std::fflush(stdout);
}

}  // namespace

Run add_generate(CLI::App& app) {
  auto o = std::make_shared<Options>();
  app.add_option("--model", o->model, "Model: Hugging Face folder, .gguf file, or a folder holding one .gguf")->required();
  app.add_option("--prompt", o->prompt, "Prompt text")->required();
  app.add_flag("--chat", o->chat, "Wrap the prompt in the model's chat template as a user message");
  app.add_option("--system", o->system, "System message (with --chat)");
  app.add_option("--max-tokens", o->max_tokens, "Most tokens to generate (default 128)");
  app.add_option("--temperature", o->sampling.temperature, "Sampling temperature; 0 is greedy (default 0)");
  app.add_option("--top-k", o->sampling.top_k, "Keep the k most likely tokens (0: off)");
  app.add_option("--top-p", o->sampling.top_p, "Keep the smallest set of tokens whose probability reaches p (1: off)");
  app.add_option("--min-p", o->sampling.min_p, "Drop tokens less likely than p times the most likely (0: off)");
  app.add_option("--repetition-penalty", o->sampling.repetition_penalty, "Penalty for tokens already seen (1: off)");
  app.add_option("--presence-penalty", o->sampling.presence_penalty, "Subtracted from tokens already generated (0: off)");
  app.add_option("--frequency-penalty", o->sampling.frequency_penalty,
                 "Subtracted per occurrence of a token already generated (0: off)");
  app.add_option("--seed", o->sampling.seed, "Random seed (default 0)");
  app.add_option("--stop", o->stops, "Stop when this text appears (repeatable)");
  app.add_option("--threads", o->threads, "CPU threads (default: all cores)");
  app.add_option("--device", o->device, "auto (the GPU when it can run the model), cpu or cuda");
  return [o]() {
    check_device_option(o->device);
    if (o->max_tokens < 0) fail("--max-tokens: must be >= 0, got ", o->max_tokens);
    if (!o->system.empty() && !o->chat) fail("--system: needs --chat");
    check_sampler_options(o->sampling);
    if (!std::filesystem::exists(o->model)) fail(o->model, ": no such file or folder");

    const text::Tokenizer tok = text::load_tokenizer_for_model(o->model);
    auto model = load_model(o->model);

    std::vector<int32_t> prompt;
    if (o->chat) {
      nlohmann::ordered_json messages = nlohmann::ordered_json::array();
      if (!o->system.empty()) messages.push_back({{"role", "system"}, {"content", o->system}});
      messages.push_back({{"role", "user"}, {"content", o->prompt}});
      const std::string text = text::load_model_chat(*model, o->model).prompt(messages);
      prompt = tok.encode(text, false, true);
    } else {
      prompt = tok.encode(o->prompt, true, true);
    }
    if (prompt.empty()) fail("--prompt: the prompt encodes to no tokens");

    const int64_t V = model->config.vocab_size;
    for (int32_t id : prompt)
      if (id < 0 || id >= V) fail("--prompt: token id ", id, " is outside the model's vocabulary of ", V);
    const std::vector<int64_t>& eos = model->config.eos_token_ids;
    auto is_eos = [&](int32_t id) { return std::find(eos.begin(), eos.end(), int64_t(id)) != eos.end(); };

    auto runner = Runner::make(*model, o->device, int64_t(prompt.size()) + o->max_tokens + 1, o->threads);
    Sampler sampler(o->sampling);
    text::StreamDecoder stream(tok, true);
    StopMatcher stop(o->stops);

    using clock = std::chrono::steady_clock;
    std::vector<float> last(static_cast<size_t>(V));
    const auto t0 = clock::now();
    runner->run(prompt, last.data(), false);
    const double prefill_s = std::chrono::duration<double>(clock::now() - t0).count();

    std::vector<int32_t> history = prompt;
    int generated = 0, decode_steps = 0;
    double decode_s = 0;
    while (generated < o->max_tokens) {
      const int32_t next = sampler.sample(last, history, prompt.size());
      if (is_eos(next)) break;
      history.push_back(next);
      ++generated;
      emit(stop.push(stream.push(next)));
      if (stop.stopped() || generated == o->max_tokens) break;
      const auto t = clock::now();
      runner->run({&next, 1}, last.data(), false);
      decode_s += std::chrono::duration<double>(clock::now() - t).count();
      ++decode_steps;
    }
    if (!stop.stopped()) {
      emit(stop.push(stream.flush()));
      emit(stop.flush());
    }
    emit("\n");
    std::fprintf(stderr,
                 "prompt tokens: %zu, generated tokens: %d, prefill: %.1f tokens/s, decode: %.1f tokens/s (%s)\n",
                 prompt.size(), generated, double(prompt.size()) / prefill_s,
                 decode_steps ? double(decode_steps) / decode_s : 0.0, runner->describe().c_str());
    return 0;
  };
}

}  // namespace kestrel::apps
