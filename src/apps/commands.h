// Subcommands of the kestrel binary. Each registers its options on the CLI and returns the
// function that runs it.
#pragma once
#include <CLI/CLI.hpp>
#include <functional>

namespace kestrel::apps {

using Run = std::function<int()>;

Run add_inspect(CLI::App& app);
Run add_logits(CLI::App& app);
Run add_tokenize(CLI::App& app);
Run add_generate(CLI::App& app);
Run add_chat(CLI::App& app);
Run add_roofline(CLI::App& app);
Run add_quantize(CLI::App& app);
Run add_perplexity(CLI::App& app);
#ifdef KESTREL_HAVE_SERVER
Run add_serve(CLI::App& app);
#endif
#ifdef KESTREL_HAVE_CUDA
Run add_bench(CLI::App& app);
Run add_profile(CLI::App& app);
#endif

}  // namespace kestrel::apps
