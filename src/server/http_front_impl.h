// The insides of HttpFront that its connections share: the limits, the routes, the I/O context,
// the worker pool and the accounting of open connections. Internal to http_front.cpp and
// http_connection.cpp.
#pragma once
#include <atomic>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/thread_pool.hpp>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "server/http_front.h"

namespace kestrel::server {

class Connection;

struct HttpFront::Impl {
  Impl(HttpLimits l, std::string key, std::vector<HttpRoute> r, std::function<void(const std::string&, int)> report);

  // The route of (method, path); null when none. `path_known`: some route has that path.
  const HttpRoute* find(const std::string& method, const std::string& path, bool& path_known) const;
  // The methods a known path takes, for a 405's Allow field.
  std::string methods_of(const std::string& path) const;
  // The request carries the API key (always true without one). Compares in constant time.
  bool authorized(const HttpRequest& r) const;

  // Counts a new connection from `client`; false (counted as refused) over a limit, with why.
  bool admit(const std::string& client, std::string& why);
  void track(Connection* c, const std::shared_ptr<Connection>& s);
  // A counted connection ends.
  void release(const std::string& client, Connection* c);

  HttpLimits limits;
  std::string api_key;
  std::vector<HttpRoute> routes;
  std::function<void(const std::string&, int)> on_response;

  // Declared before the I/O context: connections destroyed with it still release here.
  mutable std::mutex mu;
  std::unordered_map<std::string, int> per_client;
  std::unordered_map<Connection*, std::weak_ptr<Connection>> live;
  int64_t open = 0;
  std::atomic<uint64_t> accepted{0}, refused{0}, timed_out{0}, client_gone{0};
  std::atomic<bool> stopped{false};

  boost::asio::io_context io;
  boost::asio::ip::tcp::acceptor acceptor{io};
  boost::asio::thread_pool workers;
};

}  // namespace kestrel::server
