// The HTTP/1.1 transport of `kestrel serve`: event-driven connections on Boost.Asio with
// Boost.Beast's request parser, so that a few I/O threads carry any number of open connections and
// an idle or slow client costs a socket and a buffer, never a thread. It owns everything one
// client could use to starve the others: limits on connections (in all and per address), header
// count and bytes, body bytes (chunked bodies too), timeouts for the wait between requests, the
// headers, the body and every write; the API key is checked once the headers are in, before any
// body is read. Handlers see whole requests; a reply made over time (a generation) is a producer
// polled whenever it has something new, while the connection watches for its client leaving.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kestrel::server {

// Every limit is a `kestrel serve` flag (apps/cmd_serve.cpp) with these defaults.
struct HttpLimits {
  uint64_t max_body = 8u << 20;          // bytes of one request body, chunked or not (413)
  uint32_t max_header_bytes = 32u << 10; // the request line and header fields together (431)
  int max_headers = 100;                 // header fields of one request (431)
  double idle_timeout = 60;              // seconds a connection may wait for its next request
  double header_timeout = 10;            // seconds from a request's first byte to its last header
  double body_timeout = 60;              // seconds for the body once the headers are in
  double write_timeout = 60;             // seconds one write may wait on a client that does not read
  int max_connections = 2048;            // open at once in all; more are answered 503 and closed
  int max_connections_per_client = 512;  // open at once from one address; likewise
  int backlog = 1024;                    // connections the kernel queues before they are accepted
  int io_threads = 2;                    // threads running every connection's I/O
  int workers = 4;                       // threads preparing requests (JSON, chat templates, tokenizing)
};

struct HttpRequest {
  std::string method, target, path;  // path: the target without its query
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;
  std::string client;  // the peer's address
  // The first field of that name (case-insensitive), or "".
  std::string_view header(std::string_view name) const;
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;
  bool stream = false;  // the body follows in pieces (chunked transfer encoding)
};

// A reply made over time. The connection calls start() once, then poll() on its own strand after
// start, after every wake() and after every completed write, never while a write is in flight, so
// a client that reads slowly holds the producer back instead of piling up output.
class HttpProducer {
 public:
  virtual ~HttpProducer() = default;
  // `wake` may be called from any thread, any number of times; it only schedules a poll.
  virtual void start(std::function<void()> wake) = 0;
  struct Poll {
    std::optional<HttpResponse> head;  // once: a head that does not stream carries the whole body
    std::string body;                  // more of a streamed body
    bool done = false;                 // the reply is complete
  };
  virtual Poll poll() = 0;
  // The client went away or the server stops: there will be no more polls.
  virtual void cancel() = 0;
};

// What a handler returns: a response now, or a producer.
struct HttpReply {
  HttpResponse now;
  std::shared_ptr<HttpProducer> later;
};

struct HttpRoute {
  std::string method, path;
  std::string name;    // the label of its requests in the metrics
  bool auth = true;    // needs the API key when the server has one
  bool heavy = false;  // runs on a worker thread (parsing, templates, tokenizing), not an I/O thread
  std::function<HttpReply(const HttpRequest&)> handler;
};

struct HttpStats {
  int64_t open = 0;              // connections open now
  uint64_t accepted = 0;         // since start
  uint64_t refused = 0;          // over --max-connections or --max-connections-per-client
  uint64_t timed_out = 0;        // cut by a timeout
  uint64_t client_gone = 0;      // replies cancelled because their client went away
};

class HttpFront {
 public:
  // `on_response(route name, status)` is called for every response begun ("" before a route was
  // found: malformed requests, unknown paths, limits).
  HttpFront(HttpLimits limits, std::string api_key, std::vector<HttpRoute> routes,
            std::function<void(const std::string&, int)> on_response);
  ~HttpFront();
  HttpFront(const HttpFront&) = delete;
  HttpFront& operator=(const HttpFront&) = delete;

  // Listens (fails naming host and port); returns the port (a free one when `port` is 0).
  int bind(const std::string& host, int port);
  // Serves until stop().
  void serve();
  // From any thread: stops accepting, closes every connection and makes serve() return.
  void stop();
  HttpStats stats() const;
  const HttpLimits& limits() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace kestrel::server
