// Subcommands of the kestrel binary. Each registers its options on the CLI and returns the
// function that runs it.
#pragma once
#include <CLI/CLI.hpp>
#include <functional>

#include "model/load_progress.h"

namespace kestrel::apps {

using Run = std::function<int()>;

// --progress for commands that load weights: Auto (a progress line when stderr is a terminal)
// unless the flag asks for it always.
inline void add_progress_flag(CLI::App& app, Progress& p) {
  app.add_flag_callback("--progress", [&p] { p = Progress::On; },
                        "Show model loading progress on stderr even when it is not a terminal");
}

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
#ifdef KESTREL_HAVE_LOADGEN
Run add_loadgen(CLI::App& app);
#endif
#ifdef KESTREL_HAVE_CUDA
Run add_bench(CLI::App& app);
Run add_profile(CLI::App& app);
Run add_bench_allreduce(CLI::App& app);
#endif

}  // namespace kestrel::apps
