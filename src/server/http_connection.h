// One client connection of the HTTP front: requests read one after another (keep-alive), each
// under the front's limits and timeouts, routed, answered now or by a producer polled on the
// connection's strand. Internal to the front.
#pragma once
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "server/http_front_impl.h"
#include "server/http_request_parser.h"

namespace kestrel::server {

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  // `refusal`: non-empty for a connection over a limit, answered 503 with it and closed.
  Connection(boost::asio::ip::tcp::socket socket, HttpFront::Impl& front, std::string client, std::string refusal);
  ~Connection();
  void start();
  // From any thread: closes the connection (the server stops).
  void shut();

 private:
  enum class State { Reading, Handling, Replying, ReplyDone, Closed };

  void wait_request();
  void read_header();
  void on_header(boost::beast::error_code ec);
  void read_body();
  void on_body(boost::beast::error_code ec);
  void dispatch();
  HttpReply run_handler();
  void begin_reply(HttpReply r);
  void pump();
  void end_reply();
  // An answer from the front itself (errors, limits); `close` ends the connection after it.
  void answer(int status, const std::string& message, bool close, std::vector<std::pair<std::string, std::string>> headers = {});
  void respond(const HttpResponse& r);
  void write(std::string data, std::function<void()> then);
  void watch_client();
  void on_watch(boost::beast::error_code ec);
  void client_left();
  // After a last response: stop sending, read and drop what the client still sends for a moment
  // (so that closing with unread input does not reset the connection before the response arrives).
  void linger();
  void close_now();
  std::string head(const HttpResponse& r, std::optional<size_t> length) const;
  // A read ended with `ec`: counts timeouts; true when it was the client closing or a timeout.
  bool read_failed(boost::beast::error_code ec);

  boost::beast::tcp_stream stream_;
  HttpFront::Impl& front_;
  std::string client_, refusal_;
  boost::beast::flat_buffer buffer_;
  std::optional<RequestParser> parser_;
  HttpRequest req_;
  const HttpRoute* route_ = nullptr;
  std::shared_ptr<HttpProducer> producer_;
  std::string out_;  // the bytes of the write in flight
  char drain_[16384];
  State state_ = State::Reading;
  int version_ = 11;
  bool counted_ = false;    // in the front's open connections
  bool keep_alive_ = true;
  bool streaming_ = false;  // a streamed reply's head was sent
  bool chunked_ = false;    // ... in chunked transfer encoding (HTTP/1.1)
  bool writing_ = false;
  bool watching_ = false;
  bool reply_ends_ = false;  // the write in flight completes the reply
};

}  // namespace kestrel::server
