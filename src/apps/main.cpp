// kestrel: one binary, one subcommand per job.
#include <cstdio>
#include <map>

#include "apps/commands.h"
#include "common/error.h"

int main(int argc, char** argv) {
  CLI::App app{"kestrel: an inference engine for NVFP4 mixture-of-experts models"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "kestrel 0.1.0");
  std::map<CLI::App*, kestrel::apps::Run> runs;
  auto add = [&](const char* name, const char* help, kestrel::apps::Run (*fn)(CLI::App&)) {
    CLI::App* sub = app.add_subcommand(name, help);
    runs[sub] = fn(*sub);
  };
  add("inspect", "Describe a model folder: architecture, layers, parameters, storage formats", kestrel::apps::add_inspect);
  add("chat", "Talk with a model on the terminal (one user turn per line)", kestrel::apps::add_chat);
  add("logits", "Write the float32 logits of every position of a token sequence", kestrel::apps::add_logits);
  add("generate", "Generate text from a prompt, streamed to stdout", kestrel::apps::add_generate);
#ifdef KESTREL_HAVE_SERVER
  add("serve", "Serve the model over an OpenAI-compatible HTTP API", kestrel::apps::add_serve);
#endif
#ifdef KESTREL_HAVE_LOADGEN
  add("loadgen", "Benchmark an OpenAI-compatible server with concurrent streaming requests (TTFT, ITL, tokens/s)",
      kestrel::apps::add_loadgen);
#endif
  add("quantize", "Write a BF16 Hugging Face folder or a GGUF file as an NVFP4 (ModelOpt) checkpoint",
      kestrel::apps::add_quantize);
  add("perplexity", "Perplexity over a text, and KL divergence and top-1 agreement against a reference model",
      kestrel::apps::add_perplexity);
  add("roofline", "The floor of a decode step for a model, formats, parallel layout and GPU", kestrel::apps::add_roofline);
  add("tokenize", "Encode text to token ids, or decode ids to text, with a tokenizer.json", kestrel::apps::add_tokenize);
#ifdef KESTREL_HAVE_CUDA
  add("bench", "Time decode steps on the GPU against the memory-bandwidth floor", kestrel::apps::add_bench);
  add("profile", "Where a decode step's time goes on the GPU: each op against its floor", kestrel::apps::add_profile);
  add("bench-allreduce", "Latency of the one-shot all-reduce against NCCL's over this machine's GPUs",
      kestrel::apps::add_bench_allreduce);
#endif
  if (argc > 1 && argv[1][0] != '-') {
    bool known = false;
    std::string names;
    for (const auto& [sub, _] : runs) {
      known |= sub->get_name() == argv[1];
      names += (names.empty() ? "" : ", ") + sub->get_name();
    }
    if (!known) {
      std::fprintf(stderr, "kestrel: error: unknown command '%s' (commands: %s)\n", argv[1], names.c_str());
      return 2;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    for (auto& [sub, run] : runs)
      if (sub->parsed()) return run();
  } catch (const kestrel::Error& e) {
    std::fprintf(stderr, "kestrel: error: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "kestrel: error: out of memory\n");
    return 1;
  }
  return 1;
}
