#include "server/http_server.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <random>

#include "common/error.h"
#include "runtime/sampler.h"
#include "server/chat_reply.h"
#include "server/openapi.h"
#include "server/reasoning.h"
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

// A tool call's id, unique over the server's life: the mixed counter of fresh_seed() is a bijection.
std::string new_call_id() {
  char buf[32];
  std::snprintf(buf, sizeof buf, "call_%016llx", (unsigned long long)fresh_seed());
  return buf;
}

HttpReply json_reply(std::string body, int status = 200) {
  HttpReply r;
  r.now.status = status;
  r.now.body = std::move(body);
  return r;
}

std::vector<int32_t> end_tokens(const ModelConfig& c) {
  std::vector<int32_t> out;
  for (int64_t t : c.eos_token_ids) out.push_back(int32_t(t));
  return out;
}

HttpResponse error_response(const ApiError& e) {
  HttpResponse r;
  r.status = e.status;
  r.body = error_body(e);
  return r;
}

}  // namespace

// How a chat reply is split (chat_reply.h): whether the model thinks (and starts inside its
// thinking), and the format of tool calls to parse (None: no tools, or tool_choice "none").
struct ReplySplit {
  std::optional<bool> reasoning;
  ToolFormat tools = ToolFormat::None;
  std::map<std::string, std::map<std::string, std::string>> parameter_types;
  bool any() const { return reasoning || tools != ToolFormat::None; }
};

// One request's generation, made as the engine's events arrive: text, stop strings and
// log-probabilities choice by choice (then for chat the reasoning, content and tool calls the text
// holds), sent as one JSON response at the end or as server-sent events while it runs. Polled on
// the connection's strand (HttpProducer).
struct HttpServer::Generation : HttpProducer {
  struct ChoiceState {
    text::StreamDecoder decoder;
    StopMatcher stop;
    std::optional<ChatReply> reply;
    clock_type::time_point last_token;
    int64_t tokens = 0;
    bool finished = false;
    bool started = false;  // a chunk of it was streamed
    // With tools, special tokens are decoded as text: some tokenizers mark the markers of tool
    // calls special, and the parser must see them (end-of-sequence tokens are never text).
    ChoiceState(const text::Tokenizer& t, std::vector<std::string> stops, const ReplySplit& split)
        : decoder(t, split.tools == ToolFormat::None), stop(std::move(stops)) {
      if (split.any()) reply.emplace(split.reasoning, split.tools, split.parameter_types);
    }
  };

  Endpoint endpoint;
  ApiRequest req;
  Completion c;
  std::vector<ChoiceState> state;  // per choice, beside c.choices
  int open;                        // choices not finished
  std::shared_ptr<RequestStream> stream;
  const text::Tokenizer& tok;
  Metrics& metrics;
  clock_type::time_point start_time = clock_type::now();
  bool head_sent = false, over = false;

  Generation(Endpoint e, ApiRequest r, const text::Tokenizer& t, Metrics& m, const ReplySplit& split)
      : endpoint(e), req(std::move(r)), open(req.n), tok(t), metrics(m) {
    c.choices.resize(size_t(req.n));
    for (int i = 0; i < req.n; ++i) state.emplace_back(t, req.stop, split);
  }
  bool finished() const { return open == 0; }
  bool logprobs() const { return req.top_logprobs >= 0; }
  bool forced_calls() const { return req.tool_choice == ToolChoice::Required || req.tool_choice == ToolChoice::Named; }

  void start(std::function<void()> wake) override { stream->set_notify(std::move(wake)); }

  void cancel() override {
    stream->set_notify(nullptr);
    stream->cancel();
  }

  Poll poll() override {
    Poll p;
    if (over) return p;
    if (req.stream && !head_sent) {
      HttpResponse h;
      h.content_type = "text/event-stream";
      h.headers = {{"Cache-Control", "no-cache"}};
      h.stream = true;
      p.head = std::move(h);
      head_sent = true;
    }
    try {
      while (!finished()) {
        std::string delta;
        std::vector<TokenInfo> tokens;
        const auto i = take(delta, tokens);
        if (!i) return p;  // nothing more yet
        if (*i < 0) continue;
        ChoiceState& st = state[size_t(*i)];
        Choice& ch = c.choices[size_t(*i)];
        ReplyPieces piece = reply_pieces(*i, std::move(delta));
        if (req.stream) {
          // One chunk per event of a choice (its first always, for the chat role), two per tool
          // call (its head, then its arguments), and one with its finish_reason when it ends.
          if (!piece.content.empty() || !piece.reasoning.empty() || !tokens.empty() || !st.started) {
            p.body += sse(chunk_json(endpoint, c, *i, piece.content, tokens, logprobs(), "", !st.started, piece.reasoning));
            st.started = true;
          }
          for (ToolCall& t : piece.calls) {
            const int k = int(ch.tool_calls.size());
            p.body += sse(tool_call_chunk_json(c, *i, k, t, true));
            p.body += sse(tool_call_chunk_json(c, *i, k, t, false));
            ch.tool_calls.push_back(std::move(t));
          }
          if (st.finished) p.body += sse(chunk_json(endpoint, c, *i, "", {}, false, ch.finish_reason, false));
        } else {
          ch.text += piece.content;
          ch.reasoning += piece.reasoning;
          for (ToolCall& t : piece.calls) ch.tool_calls.push_back(std::move(t));
          for (TokenInfo& t : tokens) ch.tokens.push_back(std::move(t));
        }
      }
      if (req.stream) {
        if (req.include_usage) p.body += sse(usage_chunk_json(endpoint, c));
        p.body += "data: [DONE]\n\n";
      } else {
        HttpResponse h;
        h.body = dump(response_json(endpoint, c, logprobs()));
        p.head = std::move(h);
      }
    } catch (const ApiError& e) {
      stream->cancel();
      if (req.stream) p.body += "data: " + error_body(e) + "\n\ndata: [DONE]\n\n";
      else p.head = error_response(e);
    }
    stream->set_notify(nullptr);
    over = p.done = true;
    return p;
  }

  // Takes the next event of any choice when one is queued: its choice, with the new text and
  // tokens in `delta` and `tokens`, and c.choices[i].finish_reason set when it ended the choice;
  // -1 for an event of a choice that already ended (a stop string cancelled it); nothing when no
  // event is queued. Throws ApiError when the engine failed or shut down.
  std::optional<int> take(std::string& delta, std::vector<TokenInfo>& tokens) {
    TokenEvent e;
    bool ended = false;
    if (!stream->try_next(e, ended)) {
      if (ended) throw ApiError(500, "the request's stream ended without a result");
      return std::nullopt;
    }
    c.usage.cached_tokens = stream->cached_tokens();  // set before the first event
    const int i = e.index;
    if (i < 0 || i >= req.n) throw ApiError(500, "an event of choice " + std::to_string(i) + " the request does not have");
    ChoiceState& st = state[size_t(i)];
    if (st.finished) return -1;
    if (e.finish == Finish::None) {
      ++st.tokens;
      ++c.usage.completion_tokens;
      c.usage.drafted_tokens += e.drafted;
      c.usage.accepted_tokens += e.accepted_draft;
      const auto now = clock_type::now();
      if (c.usage.completion_tokens == 1) metrics.first_token(seconds_since(start_time));
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

  // Choice i's new text as reasoning, content and tool calls (all content without a reply
  // splitter), the rest of it too when the choice ended. The calls get their ids (only the first
  // is kept without parallel_tool_calls), and a choice that made any ends with "tool_calls".
  ReplyPieces reply_pieces(int i, std::string delta) {
    ChoiceState& st = state[size_t(i)];
    Choice& ch = c.choices[size_t(i)];
    ReplyPieces r;
    if (!st.reply) {
      r.content = std::move(delta);
      return r;
    }
    r = st.reply->push(delta);
    if (st.finished) {
      ReplyPieces last = st.reply->finish();
      r.reasoning += last.reasoning;
      r.content += last.content;
      for (ToolCall& t : last.calls) r.calls.push_back(std::move(t));
    }
    // A forced call's grammar allows nothing but calls: what is left is the separators between them.
    if (forced_calls() && r.content.find_first_not_of(" \t\r\n") == std::string::npos) r.content.clear();
    if (!req.parallel_tool_calls && ch.tool_calls.size() + r.calls.size() > 1)
      r.calls.resize(ch.tool_calls.empty() ? 1 : 0);
    for (ToolCall& t : r.calls) t.id = new_call_id();
    if (st.finished && !(ch.tool_calls.empty() && r.calls.empty())) ch.finish_reason = "tool_calls";
    return r;
  }

  void end(int i, const char* reason) {
    c.choices[size_t(i)].finish_reason = reason;
    state[size_t(i)].finished = true;
    if (--open == 0) metrics.request_time(seconds_since(start_time));
  }
};

HttpServer::HttpServer(Engine& engine, const text::Tokenizer& tok, std::optional<text::ModelChat> chat, ServerOptions o)
    : engine_(engine),
      tok_(tok),
      chat_(std::move(chat)),
      o_(std::move(o)),
      grammars_(tok, engine.model().config.vocab_size, end_tokens(engine.model().config)),
      created_(unix_now()) {
  front_ = std::make_unique<HttpFront>(o_.limits, o_.api_key, routes(),
                                       [this](const std::string& route, int status) { metrics_.request(route, status); });
}

HttpServer::~HttpServer() = default;

int HttpServer::bind() { return front_->bind(o_.host, o_.port); }

void HttpServer::serve() { front_->serve(); }

void HttpServer::stop() { front_->stop(); }

std::vector<HttpRoute> HttpServer::routes() {
  std::vector<HttpRoute> r;
  r.push_back({"GET", "/health", "health", false, false, [](const HttpRequest&) { return json_reply("{\"status\":\"ok\"}"); }});
  r.push_back({"GET", "/v1/models", "models", true, false, [this](const HttpRequest&) {
                 json m = {{"id", o_.model_name}, {"object", "model"}, {"created", created_}, {"owned_by", "kestrel"},
                           {"max_model_len", engine_.context()}};
                 return json_reply(dump(json{{"object", "list"}, {"data", json::array({m})}}));
               }});
  r.push_back({"GET", "/openapi.json", "openapi", false, false, [this](const HttpRequest&) {
                 return json_reply(dump(openapi_spec(o_.model_name, engine_.context(), std::min(kMaxChoices, engine_.max_batch()))));
               }});
  r.push_back({"GET", "/metrics", "metrics", false, false, [this](const HttpRequest&) {
                 HttpReply m = json_reply(metrics_.render(engine_.stats(), front_->stats()));
                 m.now.content_type = "text/plain; version=0.0.4";
                 return m;
               }});
  r.push_back({"POST", "/v1/completions", "completions", true, true,
               [this](const HttpRequest& q) { return generate(Endpoint::Completions, q); }});
  r.push_back({"POST", "/v1/chat/completions", "chat_completions", true, true,
               [this](const HttpRequest& q) { return generate(Endpoint::Chat, q); }});
  return r;
}

HttpReply HttpServer::generate(Endpoint endpoint, const HttpRequest& http) {
  ApiRequest r = parse_request(endpoint, http.body);
  if (r.model != o_.model_name)
    throw ApiError(404, "the model '" + r.model + "' does not exist; this server serves '" + o_.model_name + "'", "model");
  GenerationRequest gr;
  ReplySplit split;
  if (endpoint == Endpoint::Chat) {
    if (!chat_) throw ApiError(400, "this model has no chat template; use /v1/completions", "messages");
    // With tool_choice "none" the tools are not rendered (as vLLM does): a model shown tools may
    // call one, and with nothing parsing the call it would come back as content.
    const bool with_tools = r.tool_choice != ToolChoice::None;
    const std::string& source = chat_->template_for(with_tools);
    const ToolFormat format = tool_format_of_template(source);
    if (r.tool_choice == ToolChoice::Auto && format == ToolFormat::None)
      throw ApiError(400, "the chat template of '" + o_.model_name +
                              "' renders no tools (or renders them in a format kestrel does not parse: it parses "
                              "Hermes/Qwen, GLM, DeepSeek and Llama JSON tool calls)",
                     "tools");
    try {
      gr.prompt = chat_->encode(template_messages(r.messages, format != ToolFormat::DeepSeek), tok_,
                                o_.allow_special_in_content, with_tools ? r.tools : json(nullptr));
    } catch (const Error& e) {
      throw ApiError(400, std::string("the chat template failed on these messages: ") + e.what(), "messages");
    }
    if (template_reasons(source)) {
      // The generation prompt is the prompt's end: its last tokens tell whether it opened <think>.
      const size_t tail = std::min<size_t>(gr.prompt.size(), 8);
      split.reasoning = prompt_opens_thinking(tok_.decode(std::span<const int32_t>(gr.prompt).last(tail), false));
    }
    if (with_tools) {
      // A forced call of a model without a format of its own is the Llama JSON form (grammar.h).
      split.tools = format == ToolFormat::None ? ToolFormat::LlamaJson : format;
      split.parameter_types = tool_parameter_types(r.tools);
    }
    if (r.tool_choice == ToolChoice::Required || r.tool_choice == ToolChoice::Named) {
      try {
        gr.constraint = grammars_.tool_calls(r.tools, format, r.tool_name, r.parallel_tool_calls,
                                             split.reasoning.value_or(false), source.find("```json") != std::string::npos);
      } catch (const RequestError& e) {
        throw ApiError(400, e.what(), e.field);
      } catch (const Error& e) {
        throw ApiError(400, e.what(), "tool_choice");
      }
    }
  } else {
    // The client writes the whole prompt here, template markers included: specials are parsed.
    gr.prompt = r.prompt_tokens.empty() ? tok_.encode(r.prompt, true, true) : r.prompt_tokens;
  }
  if (gr.prompt.empty()) throw ApiError(400, "the prompt encodes to no tokens", "prompt");
  try {
    const bool thinking = split.reasoning.value_or(false);
    if (r.response_format == ResponseFormat::JsonObject)
      gr.constraint = grammars_.json_object(thinking);
    else if (r.response_format == ResponseFormat::JsonSchema)
      gr.constraint = grammars_.json_schema(r.response_schema, r.schema_strict, "response_format.json_schema.schema", thinking);
  } catch (const RequestError& e) {
    throw ApiError(400, e.what(), e.field);
  } catch (const Error& e) {
    throw ApiError(400, e.what(), "response_format");
  }
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
  auto g = std::make_shared<Generation>(endpoint, std::move(r), tok_, metrics_, split);
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
  g->c.usage.speculating = engine_.speculating();
  HttpReply reply;
  reply.later = std::move(g);
  return reply;
}

}  // namespace kestrel::server
