// kestrel serve: the OpenAI-compatible HTTP server, on the GPU (one batched decode step per token
// for all running sequences) or the CPU (--device). SIGINT/SIGTERM stop admitting,
// let running requests finish within --grace seconds, cancel the rest and exit 0.
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <pthread.h>
#include <string>
#include <thread>

#include "apps/commands.h"
#include "apps/model_options.h"
#include "apps/runner.h"
#include "common/error.h"
#include "formats/json_file.h"
#include "model/model_config.h"
#include "model/weights.h"
#include "backend/cpu/forward.h"
#include "runtime/engine.h"
#include "runtime/kv_cache.h"
#include "runtime/scripted_slots.h"
#include "server/http_server.h"
#include "text/gguf_tokenizer.h"
#include "text/model_chat.h"
#ifdef KESTREL_HAVE_CUDA
#include <cuda_runtime.h>

#include "backend/cuda/gpu_model.h"
#include "backend/cuda/gpu_slots.h"
#endif

namespace kestrel::apps {
namespace {

#ifdef KESTREL_HAVE_CUDA
constexpr int kMaxGpuBatch = cuda::GpuSlots::kMaxSlots;
#else
constexpr int kMaxGpuBatch = 64;  // cuda::GpuSlots::kMaxSlots, for the help text
#endif

struct Options {
  std::string model, host = "127.0.0.1", api_key, name;
  std::string config, tokenizer;  // --config with --random-weights: a configuration's shapes, random
  bool random_weights = false;
  int port = 8000, max_batch = 16, threads = 0, prefill_chunk = 0, step_tokens = 0;  // 0: the backend's
  int64_t context = 0, kv_tokens = 0, kv_blocks = 0;
  std::string kv_memory;
  double grace = 10.0;
  bool no_prefix_cache = false;
  Progress progress = Progress::Auto;
  std::string quant = "none", device = "auto";
  Layout layout;
  std::string kv_dtype = "auto";
  server::HttpLimits http;
  std::string max_body = "8MiB", max_header_bytes = "32KiB";
  bool allow_special = false;
  SpeculationOptions speculation;
  std::string test_scripted_reply;  // tests only: every reply is this text (runtime/scripted_slots.h)
};

void add_http_options(CLI::App& app, Options& o) {
  server::HttpLimits& h = o.http;
  app.add_option("--max-body", o.max_body, "Largest request body, chunked or not (default 8MiB; 413 beyond)");
  app.add_option("--max-header-bytes", o.max_header_bytes,
                 "Largest request line and headers together (default 32KiB; 431 beyond)");
  app.add_option("--max-headers", h.max_headers, "Most header fields in a request (default 100; 431 beyond)");
  app.add_option("--idle-timeout", h.idle_timeout, "Seconds a connection may wait for its next request (default 60)");
  app.add_option("--header-timeout", h.header_timeout,
                 "Seconds from a request's first byte to its last header (default 10)");
  app.add_option("--body-timeout", h.body_timeout, "Seconds to receive a request's body (default 60)");
  app.add_option("--write-timeout", h.write_timeout,
                 "Seconds a write may wait on a client that does not read (default 60; then the request is cancelled)");
  app.add_option("--max-connections", h.max_connections, "Connections open at once (default 2048; 503 beyond)");
  app.add_option("--max-connections-per-client", h.max_connections_per_client,
                 "Connections open at once from one address (default 512; 503 beyond)");
  app.add_option("--backlog", h.backlog, "Connections the kernel queues before they are accepted (default 1024)");
  app.add_option("--http-threads", h.io_threads, "Threads running the connections' I/O (default 2)");
  app.add_option("--http-workers", h.workers,
                 "Threads preparing requests: JSON, chat templates, tokenizing (default 4)");
  app.add_flag("--allow-special-in-content", o.allow_special,
               "Tokenize special tokens typed in chat messages as special tokens, as transformers does "
               "(default: message text stays text; /v1/completions always parses them)");
}

// The HTTP limits from their flags, checked.
server::HttpLimits http_limits(const Options& o) {
  server::HttpLimits h = o.http;
  h.max_body = parse_size(o.max_body, "--max-body");
  const uint64_t header = parse_size(o.max_header_bytes, "--max-header-bytes");
  if (header < 256 || header > (64u << 20)) fail("--max-header-bytes: expected 256 bytes to 64MiB, got ", o.max_header_bytes);
  h.max_header_bytes = uint32_t(header);
  auto positive = [](double v, const char* flag) {
    if (!(v > 0)) fail(flag, ": must be more than 0 seconds, got ", v);
  };
  positive(h.idle_timeout, "--idle-timeout");
  positive(h.header_timeout, "--header-timeout");
  positive(h.body_timeout, "--body-timeout");
  positive(h.write_timeout, "--write-timeout");
  auto at_least_one = [](int v, const char* flag) {
    if (v < 1) fail(flag, ": must be at least 1, got ", v);
  };
  at_least_one(h.max_headers, "--max-headers");
  at_least_one(h.max_connections, "--max-connections");
  at_least_one(h.max_connections_per_client, "--max-connections-per-client");
  at_least_one(h.backlog, "--backlog");
  at_least_one(h.io_threads, "--http-threads");
  at_least_one(h.workers, "--http-workers");
  return h;
}

// --kv-tokens, --kv-blocks or --kv-memory (at most one) as KV positions; 0: the engine's default.
int64_t kv_positions(const Options& o, const ModelConfig& c) {
  if ((o.kv_tokens > 0) + (o.kv_blocks > 0) + !o.kv_memory.empty() > 1)
    fail("--kv-tokens, --kv-blocks, --kv-memory: give at most one");
  if (o.kv_tokens < 0 || o.kv_blocks < 0) fail("--kv-tokens/--kv-blocks: must be positive");
  if (o.kv_blocks > 0) return o.kv_blocks * KvBlockPool::kBlock;
  if (o.kv_memory.empty()) return o.kv_tokens;
  const double bytes = double(parse_size(o.kv_memory, "--kv-memory"));
  const KvBlockPool probe(c.num_layers, cpu::kv_layout_of(c), 0);
  const int64_t blocks = int64_t(bytes / double(probe.block_bytes()));
  if (blocks < 1)
    fail("--kv-memory ", o.kv_memory, ": less than one block of ", KvBlockPool::kBlock, " positions (", probe.block_bytes(), " bytes)");
  return blocks * KvBlockPool::kBlock;
}



}  // namespace

Run add_serve(CLI::App& app) {
  auto o = std::make_shared<Options>();
  app.add_option("--model", o->model, "Model: Hugging Face folder, .gguf file, or a folder holding one .gguf");
  app.add_option("--config", o->config,
                 "config.json whose shapes get random weights on the GPU (with --random-weights and --tokenizer): "
                 "serving measured at a real model's size without its weights");
  app.add_flag("--random-weights", o->random_weights, "With --config: random weights (the replies are noise)");
  app.add_option("--tokenizer", o->tokenizer,
                 "With --random-weights: a folder with tokenizer.json (and tokenizer_config.json for chat)");
  app.add_option("--host", o->host, "Address to listen on (default 127.0.0.1: this machine only)");
  app.add_option("--port", o->port, "Port (default 8000; 0 picks a free one)");
  app.add_option("--api-key", o->api_key, "Require 'Authorization: Bearer KEY' (default: no key)");
  app.add_option("--served-model-name", o->name, "Model id clients ask for (default: the model's file or folder name)");
  app.add_option("--max-batch", o->max_batch, "Sequences running at once (default 16)");
  app.add_option("--prefill-chunk", o->prefill_chunk,
                 "Prompt tokens one sequence runs per step (default: 2048 on a GPU whose GEMM prefill takes the "
                 "model, its most; else 64, and the GPU's decode step runs at most 64; 0: the default)");
  app.add_option("--step-tokens", o->step_tokens,
                 "Prompt tokens per step over all sequences, the earliest request's first (default: the prefill "
                 "chunk, at least 256; 0: the default): bounds the time between the running streams' tokens "
                 "while prompts are prefilled");
  app.add_option("--context", o->context, "Most positions per sequence (default: the model's, at most 8192)");
  app.add_option("--kv-tokens", o->kv_tokens,
                 "KV cache positions shared by all sequences (default: on the GPU max batch x context, or what fits "
                 "in 90% of the free GPU memory if less; on the CPU 32 x context)");
  app.add_option("--kv-blocks", o->kv_blocks, "The same in blocks of 16 positions");
  app.add_option("--kv-memory", o->kv_memory, "The same as memory (e.g. 8GiB, 512MB)");
  app.add_option("--grace", o->grace, "Seconds running requests get to finish on SIGINT/SIGTERM (default 10)");
  app.add_option("--threads", o->threads, "CPU threads (default: all cores)");
  app.add_flag("--no-prefix-cache", o->no_prefix_cache,
               "Compute every prompt from its first token (default: reuse the KV blocks of prompts' shared beginnings)");
  add_progress_flag(app, o->progress);
  add_quant_option(app, o->quant);
  add_layout_options(app, o->layout);
  add_kv_dtype_option(app, o->kv_dtype);
  add_http_options(app, *o);
  add_speculation_options(app, o->speculation);
  app.add_option("--device", o->device,
                 "auto (the GPU when one is present and reads the model's formats), cpu or cuda (at most " +
                     std::to_string(kMaxGpuBatch) + " sequences at once on the GPU)");
  // Hidden from --help: a hook for the server's tests (tests/server/test_tool_calls_server.py).
  app.add_option("--test-scripted-reply", o->test_scripted_reply,
                 "Tests only: every reply (without logprobs) is this text, tokenized, then end of sequence")
      ->group("");
  return [o]() {
    check_quant_option(o->quant);
    check_device_option(o->device);
    check_kv_dtype_option(o->kv_dtype);
    check_speculation_options(o->speculation);
    const bool speculating = o->speculation.method != "none", mtp = o->speculation.method == "mtp";
    if (mtp && (o->device == "cuda" || o->random_weights))
      fail("--speculative mtp: drafting with the MTP layer is not built yet on the GPU (--device cpu runs it)");
    if (speculating && !o->test_scripted_reply.empty())
      fail("--test-scripted-reply: not with --speculative (scripted replies are the backend's draws, which a check "
           "does not offer)");
    if (o->port < 0 || o->port > 65535) fail("--port: expected 0..65535, got ", o->port);
    if (o->grace < 0) fail("--grace: must be >= 0");
    const server::HttpLimits limits = http_limits(*o);
    if (o->model.empty() == o->config.empty()) fail("serve: give either --model PATH or --config FILE --random-weights");
    if (!o->config.empty() && !o->random_weights) fail("serve: --config needs --random-weights");
    if (o->random_weights && o->config.empty()) fail("serve: --random-weights needs --config FILE");
    if (o->random_weights == o->tokenizer.empty())
      fail(o->random_weights ? "serve: --random-weights needs --tokenizer DIR (the configuration has no tokenizer)"
                             : "serve: --tokenizer: only with --random-weights (a model brings its own)");
    const std::string& source = o->random_weights ? o->tokenizer : o->model;  // tokenizer and chat template
    if (!std::filesystem::exists(o->random_weights ? o->config : o->model))
      fail(o->random_weights ? o->config : o->model, ": no such file or folder");
    if (o->random_weights && !std::filesystem::exists(o->tokenizer)) fail(o->tokenizer, ": no such file or folder");
    // Signals go to the waiting thread below, not to whichever thread they happen to hit.
    sigset_t signals;
    sigemptyset(&signals);
    sigaddset(&signals, SIGINT);
    sigaddset(&signals, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &signals, nullptr);

    const text::Tokenizer tok = text::load_tokenizer_for_model(source);
    std::unique_ptr<Model> model;
    if (o->random_weights) {  // the configuration alone: the engine reads it, the GPU holds the weights
      if (o->quant != "none") fail("--quant: not with --random-weights (the configuration says the formats)");
      if (o->device == "cpu") fail("--random-weights: the weights are made on the GPU (not --device cpu)");
      model = std::make_unique<Model>();
      model->config = parse_model_config_and_quant(read_json_file(o->config), o->config);
      if (int64_t(tok.vocab_size()) > model->config.vocab_size)
        fail("--tokenizer ", o->tokenizer, ": ", tok.vocab_size(), " tokens, more than the configuration's vocabulary of ",
             model->config.vocab_size);
    } else {
      model = load_model_as(o->model, o->quant, o->progress);
    }
    std::optional<text::ModelChat> chat;
    try {
      chat = text::load_model_chat(*model, source);
    } catch (const Error& e) {
      std::fprintf(stderr, "kestrel: no chat template (%s); /v1/chat/completions will answer 400\n", e.what());
    }
    EngineOptions eo;
    eo.max_batch = o->max_batch;
    eo.context = o->context;
    bool gemm_prefill = false;  // the GPU's slots run long prompt chunks through the GEMM prefill
    const int64_t kv_given = kv_positions(*o, model->config);  // 0: the device's default
    eo.kv_tokens = kv_given;
    eo.threads = o->threads;
    eo.layout = o->layout;
    eo.prefix_cache = !o->no_prefix_cache;
    eo.speculation = o->speculation;
    check_layout(eo.layout, long(model->config.num_experts));
    std::unique_ptr<SequenceSlots> slots;
#ifdef KESTREL_HAVE_CUDA
    std::unique_ptr<cuda::GpuModel> gpus;
    if (o->random_weights && !gpu_present()) fail("--random-weights: no CUDA GPU is visible (the weights are made on it)");
    if (mtp && o->device == "auto" && gpu_present())
      std::fprintf(stderr, "kestrel: serving on the CPU: --speculative mtp drafts on the CPU only\n");
    if (o->device == "cuda" || (o->device == "auto" && gpu_present() && !mtp)) {
      const cuda::KvType kv = kv_type_for(model->config, o->kv_dtype);  // a refused --kv-dtype is the user's error
      // --kv-memory was counted in float32 positions: a BF16 pool holds twice as many.
      const int64_t kv_gpu = o->kv_memory.empty() ? kv_given : kv_given * 4 / int64_t(cuda::kv_type_bytes(kv));
      try {
        if (!gpu_present()) fail("--device cuda: no CUDA GPU is visible");
        if (eo.max_batch > kMaxGpuBatch) {
          std::fprintf(stderr, "kestrel: --max-batch %d: the GPU runs at most %d sequences at once; using %d\n",
                       eo.max_batch, kMaxGpuBatch, kMaxGpuBatch);
          eo.max_batch = kMaxGpuBatch;
        }
        if (o->random_weights && eo.layout.split()) fail("--random-weights: one GPU (no --tp/--ep)");
        gpus = o->random_weights ? std::make_unique<cuda::GpuModel>(model->config)
                                 : std::make_unique<cuda::GpuModel>(*model, eo.layout);
        auto gpu_slots =
            std::make_unique<cuda::GpuSlots>(*gpus, eo.max_batch, int(engine_context(*model, eo)), kv_gpu, kv,
                                             eo.prefix_cache);
        eo.kv_tokens = gpu_slots->kv_positions();  // the engine admits what the pool holds
        gemm_prefill = gpu_slots->gemm_prefill();
        if (kv_given == 0)
          std::fprintf(stderr, "kestrel: GPU KV cache: %s (%s)\n", gpu_slots->kv_summary().c_str(),
                       eo.kv_tokens >= int64_t(eo.max_batch) * engine_context(*model, eo)
                           ? "a whole context for every sequence of --max-batch"
                           : "what fits in 90% of the free GPU memory; --kv-tokens/--kv-memory set it");
        slots = std::move(gpu_slots);
      } catch (const Error& e) {
        if (o->device == "cuda" || o->random_weights) throw;
        std::fprintf(stderr, "kestrel: serving on the CPU: %s\n", e.what());
        slots.reset();
        gpus.reset();
        gemm_prefill = false;
        eo.max_batch = o->max_batch;
        eo.kv_tokens = kv_given;
      }
    }
#else
    if (o->device == "cuda") fail("--device cuda: this kestrel was built without CUDA");
    if (o->random_weights) fail("--random-weights: this kestrel was built without CUDA");
#endif
    if (!slots && o->kv_dtype == "bf16") fail("--kv-dtype bf16: the CPU backend caches keys and values as float32");
    if (!o->test_scripted_reply.empty()) {
      if (slots) fail("--test-scripted-reply: runs on the CPU only (--device cpu)");
      if (model->config.eos_token_ids.empty()) fail("--test-scripted-reply: the model has no end-of-sequence token");
      const int64_t kv = kv_given > 0 ? kv_given : 32 * engine_context(*model, eo);  // the engine's default
      eo.kv_tokens = kv;
      slots = std::make_unique<ScriptedSlots>(
          make_cpu_slots(*model, eo.max_batch, eo.threads, eo.layout, kv, eo.prefix_cache), model->config.vocab_size,
          int32_t(model->config.eos_token_ids[0]), tok.encode(o->test_scripted_reply, false, true));
    }
    if (o->prefill_chunk < 0) fail("--prefill-chunk: must be at least 1, got ", o->prefill_chunk);
    if (o->step_tokens < 0) fail("--step-tokens: must be at least 1, got ", o->step_tokens);
    eo.prefill_chunk = o->prefill_chunk > 0 ? o->prefill_chunk
                       : gemm_prefill       ? int(slots->max_chunk())
                                            : EngineOptions{}.prefill_chunk;
    eo.step_tokens = o->step_tokens > 0 ? o->step_tokens : std::max(EngineOptions{}.step_tokens, eo.prefill_chunk);
    Engine engine(*model, eo, std::move(slots));

    server::ServerOptions so;
    so.host = o->host;
    so.port = o->port;
    so.api_key = o->api_key;
    so.limits = limits;
    so.allow_special_in_content = o->allow_special;
    const std::filesystem::path named = o->random_weights ? o->config : o->model;
    so.model_name = !o->name.empty()        ? o->name
                    : o->random_weights ? named.stem().string() + "-random"
                                        : named.filename().replace_extension().string();
    if (so.model_name.empty()) so.model_name = "model";
    server::HttpServer http(engine, tok, chat, so);
    const int port = http.bind();
    const std::string spec =
        speculating ? cat(", speculative ", o->speculation.method, " up to ", o->speculation.draft_tokens, " drafted") : "";
    std::fprintf(stderr, "kestrel: serving %s on http://%s:%d (%s; context %lld, max batch %d, %lld KV positions%s)\n",
                 so.model_name.c_str(), so.host.c_str(), port, engine.describe().c_str(), (long long)engine.context(),
                 eo.max_batch, (long long)engine.stats().kv_capacity, spec.c_str());
    std::fflush(stderr);

    std::thread waiter([&] {
      int sig = 0;
      sigwait(&signals, &sig);
      if (sig == 0) return;  // woken by the exit path below
      std::fprintf(stderr, "kestrel: %s: finishing running requests (up to %.0f s), then exiting\n",
                   sig == SIGINT ? "SIGINT" : "SIGTERM", o->grace);
      engine.shutdown(o->grace);
      http.stop();
    });
    http.serve();
    pthread_kill(waiter.native_handle(), SIGTERM);  // no-op when the waiter already returned
    waiter.join();
    engine.shutdown(0);
    std::fprintf(stderr, "kestrel: stopped\n");
    return 0;
  };
}

}  // namespace kestrel::apps
