// kestrel loadgen: a streaming benchmark client for any OpenAI-compatible server. Concurrent
// streams, time to first token, inter-token latency and its distribution, tokens/s; a table on
// stdout, everything (with each request) in --json FILE. Exits 1 when any request failed.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "apps/commands.h"
#include "client/loadgen.h"
#include "common/error.h"

namespace kestrel::apps {
namespace {

struct Options {
  client::LoadgenOptions lg;
  std::string json;
};

void row(const char* name, const client::Summary& s, double scale, const char* fmt = "%10.1f") {
  std::printf("  %-17s", name);
  if (!s.count) {
    std::printf("%10s%10s%10s%10s%10s\n", "-", "-", "-", "-", "0");
    return;
  }
  for (double v : {s.p50, s.p90, s.p99, s.mean}) std::printf(fmt, v * scale);
  std::printf("%10zu\n", s.count);
}

void print_table(const client::LoadgenResult& r) {
  const client::LoadgenOptions& o = r.options;
  const client::RunStats& s = r.stats;
  std::printf("kestrel loadgen: %s%s, model %s\n", r.origin.c_str(), r.endpoint.c_str(), o.model.c_str());
  std::printf("  %d streams, %d requests, prompt ~%d tokens, max_tokens %d\n\n", std::min(o.streams, o.requests), o.requests,
              o.prompt_tokens, o.max_tokens);
  std::printf("  requests          %zu ok, %zu failed, %.2f s wall time\n", s.ok, s.errors, s.wall_s);
  std::printf("  %-17s%10s%10s%10s%10s%10s\n", "", "p50", "p90", "p99", "mean", "samples");
  row("TTFT (ms)", s.ttft_s, 1e3);
  row("ITL (ms)", s.itl_s, 1e3, "%10.2f");
  row("E2E (ms)", s.e2e_s, 1e3);
  row("stream tokens/s", s.decode_tokens_per_s, 1);
  std::printf("\n  output tokens     %lld (%.1f per request), %.1f tokens/s over the wall time\n", (long long)s.output_tokens,
              s.ok ? double(s.output_tokens) / double(s.ok) : 0.0, s.output_tokens_per_s);
  if (s.prompt_tokens.count)
    std::printf("  prompt tokens     %.1f per request (server's usage; min %.0f, max %.0f; %d requested)\n",
                s.prompt_tokens.mean, s.prompt_tokens.min, s.prompt_tokens.max, o.prompt_tokens);
  else
    std::printf("  prompt tokens     ~%d per request (the server reported no usage)\n", o.prompt_tokens);

  if (!s.itl_histogram.empty()) {
    size_t most = 0;
    for (const client::HistogramBin& b : s.itl_histogram) most = std::max(most, b.count);
    std::printf("\n  ITL distribution (ms, %zu samples, bins growing geometrically)\n", s.itl_s.count);
    for (const client::HistogramBin& b : s.itl_histogram) {
      const int bar = most ? int(std::lround(40.0 * double(b.count) / double(most))) : 0;
      std::printf("  %9.2f - %9.2f |%-40s %zu\n", b.lo * 1e3, b.hi * 1e3, std::string(size_t(bar), '#').c_str(), b.count);
    }
  }
  if (!s.error_counts.empty()) {
    std::printf("\n  errors\n");
    for (const auto& [msg, n] : s.error_counts) std::printf("  %6zu x %s\n", n, msg.c_str());
  }
  std::fflush(stdout);
}

}  // namespace

Run add_loadgen(CLI::App& app) {
  auto o = std::make_shared<Options>();
  client::LoadgenOptions& lg = o->lg;
  app.add_option("--url", lg.url, "Server address, with or without /v1 (default http://127.0.0.1:8000)");
  app.add_option("--model", lg.model, "Model id to ask for (default: the first one GET /v1/models lists)");
  app.add_option("--streams", lg.streams, "Concurrent client streams (default 8)");
  app.add_option("--requests", lg.requests, "Requests in all, shared by the streams (default 64)");
  app.add_option("--prompt-tokens", lg.prompt_tokens, "Prompt length, about this many tokens of synthetic text (default 128)");
  app.add_option("--max-tokens", lg.max_tokens, "max_tokens of each request (default 128)");
  app.add_flag("--chat", lg.chat, "Use /v1/chat/completions (one user message) instead of /v1/completions");
  app.add_option("--api-key", lg.api_key, "Send 'Authorization: Bearer KEY'");
  app.add_option("--timeout", lg.timeout_s, "Seconds a request may take, connecting included (default 300)");
  app.add_option("--json", o->json, "Write the options, the summary and every request's record to this file");
  return [o]() {
    client::check_options(o->lg);
    std::unique_ptr<std::ofstream> json_out;
    if (!o->json.empty()) {  // before the run, so that a bad path does not cost it
      json_out = std::make_unique<std::ofstream>(o->json);
      if (!*json_out) fail(o->json, ": cannot write");
    }
    const bool tty = ::isatty(STDERR_FILENO);
    const int total = o->lg.requests;
    client::LoadgenResult r;
    try {
      r = client::run_loadgen(o->lg, [tty, total](int done) {
        if (!tty) return;
        std::fprintf(stderr, "\rloadgen: %d/%d requests", done, total);
        if (done == total) std::fprintf(stderr, "\n");
      });
    } catch (const Error&) {  // e.g. no model listed: leave no empty report behind
      if (json_out) {
        json_out.reset();
        std::filesystem::remove(o->json);
      }
      throw;
    }
    print_table(r);
    if (json_out) {
      *json_out << client::result_json(r).dump(2) << "\n";
      json_out->close();
      if (!*json_out) fail(o->json, ": write failed");
    }
    if (r.stats.errors) {
      std::fprintf(stderr, "kestrel: %zu of %d requests failed\n", r.stats.errors, total);
      return 1;
    }
    return 0;
  };
}

}  // namespace kestrel::apps
