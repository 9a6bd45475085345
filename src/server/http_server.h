// `kestrel serve`'s endpoints: the OpenAI-compatible API over the engine's request queue, on the
// HTTP front (http_front.h). GET /health, GET /v1/models, POST /v1/completions, POST
// /v1/chat/completions (JSON or server-sent events), GET /metrics, GET /openapi.json. Text is
// tokenized, templated and detokenized here; the engine sees token ids only.
#pragma once
#include <memory>
#include <optional>
#include <string>

#include "runtime/engine.h"
#include "server/grammar.h"
#include "server/http_front.h"
#include "server/metrics.h"
#include "server/openai_api.h"
#include "text/model_chat.h"
#include "text/tokenizer.h"

namespace kestrel::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;            // 0: any free port
  std::string api_key;        // empty: no authentication
  std::string model_name;     // the id clients must ask for
  HttpLimits limits;
  // Special tokens typed in chat messages become special tokens (transformers' behaviour);
  // by default they stay text.
  bool allow_special_in_content = false;
};

class HttpServer {
 public:
  HttpServer(Engine& engine, const text::Tokenizer& tok, std::optional<text::ModelChat> chat, ServerOptions o);
  ~HttpServer();
  // Binds the socket (fails naming host and port) and returns the port.
  int bind();
  // Serves until stop().
  void serve();
  void stop();

 private:
  struct Generation;
  std::vector<HttpRoute> routes();
  HttpReply generate(Endpoint endpoint, const HttpRequest& req);

  Engine& engine_;
  const text::Tokenizer& tok_;
  std::optional<text::ModelChat> chat_;
  ServerOptions o_;
  Grammars grammars_;  // response_format and tool_choice "required" or named
  Metrics metrics_;
  std::unique_ptr<HttpFront> front_;
  int64_t created_;
};

}  // namespace kestrel::server
