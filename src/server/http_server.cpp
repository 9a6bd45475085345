#include "server/http_server.h"

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <random>

#include "common/error.h"
#include "runtime/sampler.h"
#include "server/openai_api.h"
#include "server/openapi.h"
#include "text/detokenize.h"

namespace kestrel::server {
namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The seed of a request that gave none: sampled requests without a seed differ from call to
// call, as with OpenAI's API (a request with a seed repeats). A counter from a random start,
// mixed (splitmix64), so concurrent requests never share one.
uint64_t fresh_seed() {
  static std::atomic<uint64_t> next{(uint64_t(std::random_device{}()) << 32) ^ uint64_t(unix_now())};
  uint64_t z = next.fetch_add(0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::string new_id(Endpoint e) {
  static std::atomic<uint64_t> counter{0};
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s-%llx%06llx", e == Endpoint::Chat ? "chatcmpl" : "cmpl",
                (unsigned long long)unix_now(), (unsigned long long)(++counter));
  return buf;
}

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(error_body(e), "application/json");
}

}  // namespace

// One request's generation: the engine's events of its choices turned into text, stop strings
// and log-probabilities, choice by choice.
struct HttpServer::Generation {
  struct ChoiceState {
    text::StreamDecoder decoder;
    StopMatcher stop;
    clock_type::time_point last_token;
    int64_t tokens = 0;
    bool finished = false;
    bool started = false;  // a chunk of it was streamed
    ChoiceState(const text::Tokenizer& t, std::vector<std::string> stops) : decoder(t, true), stop(std::move(stops)) {}
  };

  ApiRequest req;
  Completion c;
  std::vector<ChoiceState> state;  // per choice, beside c.choices
  int open;                        // choices not finished
  std::shared_ptr<RequestStream> stream;
  const text::Tokenizer& tok;
  Metrics& metrics;
  clock_type::time_point start = clock_type::now();

  Generation(ApiRequest r, const text::Tokenizer& t, Metrics& m) : req(std::move(r)), open(req.n), tok(t), metrics(m) {
    c.choices.resize(size_t(req.n));
    for (int i = 0; i < req.n; ++i) state.emplace_back(t, req.stop);
  }
  bool finished() const { return open == 0; }

  // Waits for the next event of any choice. Returns its choice, with the new text and tokens in
  // `delta` and `tokens`, and c.choices[i].finish_reason set when it ended the choice; -1 for an
  // event of a choice that already ended (a stop string cancelled it). Throws ApiError when the
  // engine failed or shut down.
  int advance(std::string& delta, std::vector<TokenInfo>& tokens) {
    TokenEvent e;
    if (!stream->next(e)) throw ApiError(500, "the request's stream ended without a result");
    const int i = e.index;
    if (i < 0 || i >= req.n) throw ApiError(500, "an event of choice " + std::to_string(i) + " the request does not have");
    ChoiceState& st = state[size_t(i)];
    if (st.finished) return -1;
    if (e.finish == Finish::None) {
      ++st.tokens;
      ++c.usage.completion_tokens;
      const auto now = clock_type::now();
      if (c.usage.completion_tokens == 1) metrics.first_token(seconds_since(start));
      if (st.tokens > 1) metrics.inter_token(std::chrono::duration<double>(now - st.last_token).count());
      st.last_token = now;
      std::string piece = st.stop.push(st.decoder.push(e.token));
      if (req.top_logprobs >= 0) {
        TokenInfo info{tok.decode(std::span<const int32_t>(&e.token, 1)), e.logprob, {}};
        for (const TokenLogprob& t : e.top) info.top.emplace_back(tok.decode(std::span<const int32_t>(&t.token, 1)), t.logprob);
        tokens.push_back(std::move(info));
      }
      delta += piece;
      if (st.stop.stopped()) {
        stream->cancel(i);
        end(i, "stop");
      }
      return i;
    }
    switch (e.finish) {
      case Finish::Error: throw ApiError(500, "generation failed: " + e.error);
      case Finish::Cancelled: throw ApiError(503, e.error.empty() ? "the request was cancelled" : e.error);
      default: break;
    }
    delta += st.stop.push(st.decoder.flush());
    if (!st.stop.stopped()) delta += st.stop.flush();
    end(i, e.finish == Finish::Length && !st.stop.stopped() ? "length" : "stop");
    return i;
  }

  void end(int i, const char* reason) {
    c.choices[size_t(i)].finish_reason = reason;
    state[size_t(i)].finished = true;
    if (--open == 0) metrics.request_time(seconds_since(start));
  }
};

HttpServer::HttpServer(Engine& engine, const text::Tokenizer& tok, std::optional<text::ModelChat> chat, ServerOptions o)
    : engine_(engine), tok_(tok), chat_(std::move(chat)), o_(std::move(o)), svr_(std::make_unique<httplib::Server>()),
      created_(unix_now()) {
  const int threads = o_.threads;
  svr_->new_task_queue = [threads] { return new httplib::ThreadPool(size_t(threads)); };
  svr_->set_payload_max_length(8u << 20);
  // Streamed chunks are small writes; with Nagle's algorithm each waits for the client's
  // (delayed) ACK of the one before.
  svr_->set_tcp_nodelay(true);
  routes();
}

HttpServer::~HttpServer() = default;

int HttpServer::bind() {
  if (o_.port == 0) {
    const int port = svr_->bind_to_any_port(o_.host);
    if (port < 0) fail("cannot listen on ", o_.host, " (any port)");
    return port;
  }
  if (!svr_->bind_to_port(o_.host, o_.port)) fail("cannot listen on ", o_.host, ":", o_.port, " (in use, or not an address of this machine)");
  return o_.port;
}

void HttpServer::serve() { svr_->listen_after_bind(); }

void HttpServer::stop() { svr_->stop(); }

void HttpServer::routes() {
  auto authorized = [this](const httplib::Request& req, httplib::Response& res) {
    if (o_.api_key.empty()) return true;
    if (req.get_header_value("Authorization") == "Bearer " + o_.api_key) return true;
    send_error(res, ApiError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')"));
    return false;
  };

  svr_->Get("/health", [](const httplib::Request&, httplib::Response& res) { res.set_content("{\"status\":\"ok\"}", "application/json"); });

  svr_->Get("/v1/models", [this, authorized](const httplib::Request& req, httplib::Response& res) {
    if (!authorized(req, res)) return;
    json m = {{"id", o_.model_name}, {"object", "model"}, {"created", created_}, {"owned_by", "kestrel"},
              {"max_model_len", engine_.context()}};
    res.set_content(dump(json{{"object", "list"}, {"data", json::array({m})}}), "application/json");
  });

  svr_->Get("/openapi.json", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(dump(openapi_spec(o_.model_name, engine_.context(), std::min(kMaxChoices, engine_.max_batch()))),
                    "application/json");
  });

  svr_->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_.render(engine_.stats()), "text/plain; version=0.0.4");
  });

  auto generate = [this, authorized](Endpoint endpoint, const std::string& name) {
    return [this, authorized, endpoint, name](const httplib::Request& req, httplib::Response& res) {
      if (!authorized(req, res)) return metrics_.request(name, res.status);
      std::shared_ptr<Generation> g;
      try {
        ApiRequest r = parse_request(endpoint, req.body);
        if (r.model != o_.model_name)
          throw ApiError(404, "the model '" + r.model + "' does not exist; this server serves '" + o_.model_name + "'", "model");
        GenerationRequest gr;
        if (endpoint == Endpoint::Chat) {
          if (!chat_) throw ApiError(400, "this model has no chat template; use /v1/completions", "messages");
          try {
            gr.prompt = tok_.encode(chat_->prompt(r.messages), false, true);
          } catch (const Error& e) {
            throw ApiError(400, std::string("the chat template failed on these messages: ") + e.what(), "messages");
          }
        } else {
          gr.prompt = r.prompt_tokens.empty() ? tok_.encode(r.prompt, true, true) : r.prompt_tokens;
        }
        if (gr.prompt.empty()) throw ApiError(400, "the prompt encodes to no tokens", "prompt");
        const int64_t room = engine_.context() - int64_t(gr.prompt.size());
        if (room < 1)
          throw ApiError(400, "the prompt has " + std::to_string(gr.prompt.size()) + " tokens; the context holds " +
                                  std::to_string(engine_.context()),
                         endpoint == Endpoint::Chat ? "messages" : "prompt");
        gr.max_tokens = r.max_tokens ? *r.max_tokens : int(endpoint == Endpoint::Chat ? room : std::min<int64_t>(16, room));
        gr.sampling = r.sampling;
        if (!r.seeded) gr.sampling.seed = fresh_seed();
        gr.top_logprobs = r.top_logprobs;
        gr.ignore_eos = r.ignore_eos;
        gr.n = r.n;
        const int64_t prompt_tokens = int64_t(gr.prompt.size());
        g = std::make_shared<Generation>(std::move(r), tok_, metrics_);
        try {
          g->stream = engine_.submit(std::move(gr));
        } catch (const EngineStopped& e) {
          throw ApiError(503, e.what());
        } catch (const RequestError& e) {
          throw ApiError(400, e.what(), e.field);
        } catch (const Error& e) {
          throw ApiError(400, e.what());
        }
        g->c.id = new_id(endpoint);
        g->c.model = o_.model_name;
        g->c.created = unix_now();
        g->c.usage.prompt_tokens = prompt_tokens;
      } catch (const ApiError& e) {
        send_error(res, e);
        return metrics_.request(name, res.status);
      }

      const bool logprobs = g->req.top_logprobs >= 0;
      if (!g->req.stream) {
        try {
          while (!g->finished()) {
            std::string delta;
            std::vector<TokenInfo> tokens;
            const int i = g->advance(delta, tokens);
            if (i < 0) continue;
            Choice& ch = g->c.choices[size_t(i)];
            ch.text += delta;
            for (TokenInfo& t : tokens) ch.tokens.push_back(std::move(t));
          }
        } catch (const ApiError& e) {
          g->stream->cancel();
          send_error(res, e);
          return metrics_.request(name, res.status);
        }
        res.set_content(dump(response_json(endpoint, g->c, logprobs)), "application/json");
        return metrics_.request(name, 200);
      }

      metrics_.request(name, 200);
      res.set_header("Cache-Control", "no-cache");
      res.set_chunked_content_provider(
          "text/event-stream",
          [g, endpoint, logprobs](size_t, httplib::DataSink& sink) {
            auto write = [&](const std::string& s) { return sink.write(s.data(), s.size()); };
            try {
              // One chunk per event of a choice (its first always, for the chat role), and one
              // with its finish_reason when it ends.
              while (!g->finished()) {
                std::string delta;
                std::vector<TokenInfo> tokens;
                const int i = g->advance(delta, tokens);
                if (i < 0) continue;
                Generation::ChoiceState& st = g->state[size_t(i)];
                bool ok = true;
                if (!delta.empty() || !tokens.empty() || !st.started) {
                  ok = write(sse(chunk_json(endpoint, g->c, i, delta, tokens, logprobs, "", !st.started)));
                  st.started = true;
                }
                if (ok && st.finished)
                  ok = write(sse(chunk_json(endpoint, g->c, i, "", {}, false, g->c.choices[size_t(i)].finish_reason, false)));
                if (!ok) {
                  g->stream->cancel();  // the client went away: every choice ends
                  return false;
                }
              }
              if (g->req.include_usage) write(sse(usage_chunk_json(endpoint, g->c)));
            } catch (const ApiError& e) {
              g->stream->cancel();
              write("data: " + error_body(e) + "\n\n");
            }
            write("data: [DONE]\n\n");
            sink.done();
            return true;
          },
          [g](bool) { g->stream->cancel(); });
    };
  };
  svr_->Post("/v1/completions", generate(Endpoint::Completions, "completions"));
  svr_->Post("/v1/chat/completions", generate(Endpoint::Chat, "chat_completions"));

  svr_->set_error_handler([](const httplib::Request&, httplib::Response& res) {
    if (!res.body.empty()) return;
    const int status = res.status;
    send_error(res, ApiError(status, status == 404 ? "no such endpoint" : "request failed with HTTP " + std::to_string(status)));
    res.status = status;
  });
  svr_->set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "internal error";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    send_error(res, ApiError(500, what));
  });
}

}  // namespace kestrel::server
