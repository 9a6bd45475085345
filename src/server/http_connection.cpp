#include "server/http_connection.h"

#include <sys/socket.h>

#include <boost/asio/post.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/error.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/status.hpp>
#include <cerrno>
#include <chrono>
#include <cstdio>

#include "server/openai_api.h"

namespace kestrel::server {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

namespace {

std::chrono::steady_clock::duration seconds(double s) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(s));
}

std::string chunk(const std::string& data) {
  char size[24];
  std::snprintf(size, sizeof size, "%zx\r\n", data.size());
  return size + data + "\r\n";
}

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(a[i])) != std::tolower(static_cast<unsigned char>(b[i]))) return false;
  return true;
}

std::string bytes_text(uint64_t n) {
  if (n >= (1u << 20) && n % (1u << 20) == 0) return std::to_string(n >> 20) + " MiB";
  if (n >= 1024 && n % 1024 == 0) return std::to_string(n >> 10) + " KiB";
  return std::to_string(n) + " bytes";
}

}  // namespace

std::string_view HttpRequest::header(std::string_view name) const {
  for (const auto& [k, v] : headers)
    if (iequals(k, name)) return v;
  return {};
}

Connection::Connection(tcp::socket socket, HttpFront::Impl& front, std::string client, std::string refusal)
    : stream_(std::move(socket)), front_(front), client_(std::move(client)), refusal_(std::move(refusal)) {
  counted_ = refusal_.empty();
}

Connection::~Connection() {
  if (producer_) producer_->cancel();
  if (counted_) front_.release(client_, this);
}

void Connection::start() {
  if (!refusal_.empty()) {
    // Over a limit: one short answer, then the socket is closed without waiting on the client.
    keep_alive_ = false;
    HttpResponse r;
    r.status = 503;
    r.body = error_body(ApiError(503, refusal_));
    out_ = head(r, r.body.size()) + r.body;
    stream_.expires_after(std::chrono::seconds(1));
    asio::async_write(stream_, asio::buffer(out_), [self = shared_from_this()](beast::error_code, size_t) { self->close_now(); });
    return;
  }
  front_.track(this, shared_from_this());
  beast::error_code ec;
  stream_.socket().set_option(tcp::no_delay(true), ec);  // streamed chunks are small writes
  wait_request();
}

void Connection::shut() {
  asio::post(stream_.get_executor(), [self = shared_from_this()] { self->close_now(); });
}

bool Connection::read_failed(beast::error_code ec) {
  if (ec == beast::error::timeout) {
    ++front_.timed_out;
    return true;
  }
  return ec == http::error::end_of_stream || ec == asio::error::eof || ec == asio::error::connection_reset ||
         ec == asio::error::operation_aborted || ec == asio::error::bad_descriptor;
}

void Connection::wait_request() {
  if (state_ == State::Closed) return;
  state_ = State::Reading;
  parser_.emplace(front_.limits.max_header_bytes, front_.limits.max_headers);
  route_ = nullptr;
  reply_ends_ = streaming_ = chunked_ = false;
  if (buffer_.size() > 0) return read_header();  // a pipelined request is already here
  // Between requests the wait is the idle timeout; from the first byte on, the header timeout.
  stream_.expires_after(seconds(front_.limits.idle_timeout));
  stream_.async_read_some(buffer_.prepare(4096), [self = shared_from_this()](beast::error_code ec, size_t n) {
    if (ec) {
      self->read_failed(ec);
      return self->close_now();
    }
    self->buffer_.commit(n);
    self->read_header();
  });
}

void Connection::read_header() {
  stream_.expires_after(seconds(front_.limits.header_timeout));
  http::async_read_header(stream_, buffer_, *parser_,
                          [self = shared_from_this()](beast::error_code ec, size_t) { self->on_header(ec); });
}

void Connection::on_header(beast::error_code ec) {
  const HttpLimits& L = front_.limits;
  if (ec == http::error::header_limit) {
    return answer(431,
                  parser_->too_many_fields ? "the request has more than " + std::to_string(L.max_headers) +
                                                 " header fields (--max-headers)"
                                           : "the request line and header fields exceed " +
                                                 bytes_text(L.max_header_bytes) + " (--max-header-bytes)",
                  true);
  }
  if (ec) {
    if (read_failed(ec)) return close_now();
    return answer(400, "malformed HTTP request: " + ec.message(), true);
  }
  RequestParser& p = *parser_;
  version_ = p.version;
  keep_alive_ = p.keep_alive();
  req_ = HttpRequest{};
  req_.method = std::move(p.method);
  req_.target = std::move(p.target);
  req_.path = req_.target.substr(0, req_.target.find('?'));
  req_.headers = std::move(p.fields);
  req_.client = client_;
  const bool body_pending = !p.is_done();

  bool path_known = false;
  route_ = front_.find(req_.method, req_.path, path_known);
  if (!route_) {
    if (path_known)
      return answer(405, "'" + req_.path + "' does not take " + req_.method, body_pending,
                    {{"Allow", front_.methods_of(req_.path)}});
    return answer(404, "no such endpoint: " + req_.path, body_pending);
  }
  if (route_->auth && !front_.authorized(req_))
    return answer(401, "missing or wrong API key (send 'Authorization: Bearer KEY')", body_pending);
  if (const auto length = p.content_length(); length && *length > L.max_body)
    return answer(413, "the request body has " + std::to_string(*length) + " bytes; at most " + bytes_text(L.max_body) +
                           " (--max-body)",
                  true);
  if (!body_pending) return dispatch();
  p.limit_body(L.max_body);
  if (iequals(req_.header("Expect"), "100-continue")) {
    static const std::string go = "HTTP/1.1 100 Continue\r\n\r\n";
    return write(go, [this] { read_body(); });
  }
  read_body();
}

void Connection::read_body() {
  stream_.expires_after(seconds(front_.limits.body_timeout));
  http::async_read(stream_, buffer_, *parser_, [self = shared_from_this()](beast::error_code ec, size_t) { self->on_body(ec); });
}

void Connection::on_body(beast::error_code ec) {
  if (ec == http::error::body_limit)
    return answer(413, "the request body exceeds " + bytes_text(front_.limits.max_body) + " (--max-body)", true);
  if (ec) {
    if (read_failed(ec)) return close_now();
    return answer(400, "malformed HTTP request body: " + ec.message(), true);
  }
  dispatch();
}

void Connection::dispatch() {
  req_.body = std::move(parser_->body);
  parser_.reset();
  state_ = State::Handling;
  stream_.expires_never();
  if (!route_->heavy) return begin_reply(run_handler());
  watch_client();
  asio::post(front_.workers, [self = shared_from_this()] {
    HttpReply r = self->run_handler();
    asio::post(self->stream_.get_executor(), [self, r = std::move(r)]() mutable { self->begin_reply(std::move(r)); });
  });
}

HttpReply Connection::run_handler() {
  try {
    return route_->handler(req_);
  } catch (const ApiError& e) {
    HttpReply r;
    r.now.status = e.status;
    r.now.body = error_body(e);
    return r;
  } catch (const std::exception& e) {
    HttpReply r;
    r.now.status = 500;
    r.now.body = error_body(ApiError(500, e.what()));
    return r;
  }
}

void Connection::begin_reply(HttpReply r) {
  if (state_ == State::Closed) {
    if (r.later) r.later->cancel();
    return;
  }
  if (!r.later) return respond(r.now);
  state_ = State::Replying;
  producer_ = std::move(r.later);
  std::weak_ptr<Connection> weak = weak_from_this();
  auto ex = stream_.get_executor();
  producer_->start([weak, ex] {
    asio::post(ex, [weak] {
      if (auto c = weak.lock()) c->pump();
    });
  });
  pump();
}

void Connection::pump() {
  if (state_ != State::Replying || !producer_ || writing_) return;
  HttpProducer::Poll p = producer_->poll();
  std::string out;
  if (p.head) {
    front_.on_response(route_->name, p.head->status);
    if (!p.head->stream) {
      out = head(*p.head, p.head->body.size()) + p.head->body;
      p.done = true;
    } else {
      streaming_ = true;
      chunked_ = version_ >= 11;
      if (!chunked_) keep_alive_ = false;  // HTTP/1.0: the body runs to the end of the connection
      out = head(*p.head, std::nullopt);
    }
  }
  if (streaming_ && !p.body.empty()) out += chunked_ ? chunk(p.body) : p.body;
  if (p.done) {
    if (chunked_) out += "0\r\n\r\n";
    producer_.reset();
    reply_ends_ = true;
  }
  if (out.empty()) {
    if (reply_ends_) end_reply();
    return;
  }
  write(std::move(out), [this] { reply_ends_ ? end_reply() : pump(); });
}

void Connection::end_reply() {
  state_ = State::ReplyDone;
  if (!keep_alive_) return linger();
  // A watch still waiting on the socket is cancelled; its handler then reads the next request.
  if (watching_) {
    beast::error_code ec;
    stream_.socket().cancel(ec);
    return;
  }
  wait_request();
}

void Connection::answer(int status, const std::string& message, bool close,
                        std::vector<std::pair<std::string, std::string>> headers) {
  if (close) keep_alive_ = false;
  HttpResponse r;
  r.status = status;
  r.body = error_body(ApiError(status, message));
  r.headers = std::move(headers);
  respond(r);
}

void Connection::respond(const HttpResponse& r) {
  front_.on_response(route_ ? route_->name : "", r.status);
  state_ = State::Replying;
  reply_ends_ = true;
  write(head(r, r.body.size()) + r.body, [this] { end_reply(); });
}

void Connection::write(std::string data, std::function<void()> then) {
  writing_ = true;
  out_ = std::move(data);
  stream_.expires_after(seconds(front_.limits.write_timeout));
  asio::async_write(stream_, asio::buffer(out_),
                    [self = shared_from_this(), then = std::move(then)](beast::error_code ec, size_t) {
                      self->writing_ = false;
                      if (ec) {
                        if (ec == beast::error::timeout) ++self->front_.timed_out;
                        return self->client_left();
                      }
                      then();
                    });
}

void Connection::watch_client() {
  if (watching_ || state_ == State::Closed) return;
  watching_ = true;
  stream_.socket().async_wait(tcp::socket::wait_read,
                              [self = shared_from_this()](beast::error_code ec) { self->on_watch(ec); });
}

void Connection::on_watch(beast::error_code ec) {
  watching_ = false;
  if (state_ == State::Closed) return;
  if (state_ == State::ReplyDone) return wait_request();  // cancelled by end_reply
  if (ec == asio::error::operation_aborted) return;
  if (ec) return client_left();
  // Readable while the reply is made: the client closed (or reset), or sent its next request.
  char c;
  const ssize_t n = ::recv(stream_.socket().native_handle(), &c, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return client_left();
  if (n < 0) return watch_client();
  // Pipelined bytes: the client is there; they wait in the socket for the next request.
}

void Connection::client_left() {
  if (producer_) {
    producer_->cancel();
    producer_.reset();
    ++front_.client_gone;
  }
  close_now();
}

void Connection::linger() {
  state_ = State::Closed;
  beast::error_code ec;
  stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
  stream_.expires_after(std::chrono::seconds(2));
  struct Drain {
    std::shared_ptr<Connection> self;
    void operator()(beast::error_code ec, size_t) {
      if (ec) return self->close_now();
      self->stream_.async_read_some(asio::buffer(self->drain_), std::move(*this));
    }
  };
  stream_.async_read_some(asio::buffer(drain_), Drain{shared_from_this()});
}

void Connection::close_now() {
  state_ = State::Closed;
  if (producer_) {
    producer_->cancel();
    producer_.reset();
  }
  beast::error_code ec;
  stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
  stream_.close();
}

std::string Connection::head(const HttpResponse& r, std::optional<size_t> length) const {
  const auto reason = http::obsolete_reason(http::int_to_status(unsigned(r.status)));
  std::string h = "HTTP/1.1 " + std::to_string(r.status) + " " + std::string(reason.data(), reason.size()) + "\r\n";
  h += "Content-Type: " + r.content_type + "\r\n";
  for (const auto& [k, v] : r.headers) h += k + ": " + v + "\r\n";
  if (length) h += "Content-Length: " + std::to_string(*length) + "\r\n";
  else if (version_ >= 11) h += "Transfer-Encoding: chunked\r\n";
  if (!keep_alive_) h += "Connection: close\r\n";
  else if (version_ < 11) h += "Connection: keep-alive\r\n";
  return h + "\r\n";
}

}  // namespace kestrel::server
