// `kestrel serve`'s HTTP side: the OpenAI-compatible endpoints over the engine's request queue.
// GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions (JSON or
// server-sent events), GET /metrics. Text is tokenized, templated and detokenized here; the
// engine sees token ids only.
#pragma once
#include <memory>
#include <optional>
#include <string>

#include "runtime/engine.h"
#include "server/metrics.h"
#include "text/model_chat.h"
#include "text/tokenizer.h"

namespace httplib {
class Server;
}

namespace kestrel::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;            // 0: any free port
  std::string api_key;        // empty: no authentication
  std::string model_name;     // the id clients must ask for
  int threads = 128;          // connections served at once
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
  void routes();

  Engine& engine_;
  const text::Tokenizer& tok_;
  std::optional<text::ModelChat> chat_;
  ServerOptions o_;
  Metrics metrics_;
  std::unique_ptr<httplib::Server> svr_;
  int64_t created_;
};

}  // namespace kestrel::server
