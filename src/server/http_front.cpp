#include "server/http_front.h"

#include <sys/resource.h>

#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <cstdio>
#include <thread>

#include "common/error.h"
#include "server/http_connection.h"

namespace kestrel::server {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

HttpFront::Impl::Impl(HttpLimits l, std::string key, std::vector<HttpRoute> r,
                      std::function<void(const std::string&, int)> report)
    : limits(l), api_key(std::move(key)), routes(std::move(r)), on_response(std::move(report)),
      workers(size_t(std::max(1, l.workers))) {}

const HttpRoute* HttpFront::Impl::find(const std::string& method, const std::string& path, bool& path_known) const {
  path_known = false;
  for (const HttpRoute& r : routes) {
    if (r.path != path) continue;
    path_known = true;
    if (r.method == method) return &r;
  }
  return nullptr;
}

std::string HttpFront::Impl::methods_of(const std::string& path) const {
  std::string out;
  for (const HttpRoute& r : routes)
    if (r.path == path) out += (out.empty() ? "" : ", ") + r.method;
  return out;
}

bool HttpFront::Impl::authorized(const HttpRequest& r) const {
  if (api_key.empty()) return true;
  const std::string want = "Bearer " + api_key;
  const std::string_view got = r.header("Authorization");
  // Every byte compared whatever the first difference, so the time does not tell how much matched.
  unsigned diff = unsigned(got.size() != want.size());
  for (size_t i = 0; i < want.size(); ++i) diff |= unsigned(i < got.size() ? got[i] : 0) ^ unsigned(want[i]);
  return diff == 0;
}

bool HttpFront::Impl::admit(const std::string& client, std::string& why) {
  std::lock_guard<std::mutex> lock(mu);
  int& mine = per_client[client];
  if (open >= limits.max_connections)
    why = "the server has " + std::to_string(open) + " connections open, its limit (--max-connections)";
  else if (mine >= limits.max_connections_per_client)
    why = client + " has " + std::to_string(mine) + " connections open, the limit per client (--max-connections-per-client)";
  if (!why.empty()) {
    if (mine == 0) per_client.erase(client);
    ++refused;
    return false;
  }
  ++mine;
  ++open;
  ++accepted;
  return true;
}

void HttpFront::Impl::track(Connection* c, const std::shared_ptr<Connection>& s) {
  std::lock_guard<std::mutex> lock(mu);
  live[c] = s;
}

void HttpFront::Impl::release(const std::string& client, Connection* c) {
  std::lock_guard<std::mutex> lock(mu);
  live.erase(c);
  --open;
  auto it = per_client.find(client);
  if (it != per_client.end() && --it->second <= 0) per_client.erase(it);
}

namespace {

// Room for every connection the limits allow, plus the model's files and the rest: the soft limit
// on open files raised as far as the hard one allows, and the connection limit lowered, saying
// so, when even that is too few.
void fit_file_limit(HttpLimits& l) {
  rlimit r{};
  if (getrlimit(RLIMIT_NOFILE, &r) != 0) return;
  const rlim_t want = rlim_t(l.max_connections) + 256;
  if (r.rlim_cur < want) {
    r.rlim_cur = r.rlim_max == RLIM_INFINITY ? want : std::min(want, r.rlim_max);
    setrlimit(RLIMIT_NOFILE, &r);
    getrlimit(RLIMIT_NOFILE, &r);
  }
  if (r.rlim_cur != RLIM_INFINITY && r.rlim_cur < want) {
    const int fit = std::max(1, int(r.rlim_cur) - 256);
    std::fprintf(stderr, "kestrel: --max-connections %d: the process may open %llu files; allowing %d connections\n",
                 l.max_connections, (unsigned long long)r.rlim_cur, fit);
    l.max_connections = fit;
  }
}

void accept_next(HttpFront::Impl& f);

// Accept failures that are the machine's state (out of file descriptors) retry after a pause
// instead of spinning; the listening socket closed (stop) ends the loop.
void on_accept(HttpFront::Impl& f, boost::system::error_code ec, tcp::socket socket) {
  if (ec == asio::error::operation_aborted || f.stopped) return;
  if (ec) {
    auto t = std::make_shared<asio::steady_timer>(f.io, std::chrono::milliseconds(50));
    t->async_wait([&f, t](boost::system::error_code) { accept_next(f); });
    return;
  }
  boost::system::error_code aec;
  const auto peer = socket.remote_endpoint(aec);
  const std::string client = aec ? std::string("unknown") : peer.address().to_string();
  std::string why;
  f.admit(client, why);
  std::make_shared<Connection>(std::move(socket), f, client, why)->start();
  accept_next(f);
}

void accept_next(HttpFront::Impl& f) {
  f.acceptor.async_accept(asio::make_strand(f.io),
                          [&f](boost::system::error_code ec, tcp::socket s) { on_accept(f, ec, std::move(s)); });
}

}  // namespace

HttpFront::HttpFront(HttpLimits limits, std::string api_key, std::vector<HttpRoute> routes,
                     std::function<void(const std::string&, int)> on_response)
    : impl_(std::make_unique<Impl>(limits, std::move(api_key), std::move(routes), std::move(on_response))) {}

HttpFront::~HttpFront() {
  stop();
  impl_->workers.join();
}

int HttpFront::bind(const std::string& host, int port) {
  Impl& f = *impl_;
  fit_file_limit(f.limits);
  boost::system::error_code ec;
  tcp::resolver resolver(f.io);
  const auto found = resolver.resolve(host, std::to_string(port), tcp::resolver::numeric_service, ec);
  if (ec || found.empty()) fail("cannot listen on ", host, ":", port, ": ", ec ? ec.message() : "no such address");
  const tcp::endpoint at = found.begin()->endpoint();
  f.acceptor.open(at.protocol(), ec);
  if (!ec) f.acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) f.acceptor.bind(at, ec);
  if (ec)
    fail("cannot listen on ", host, ":", port, " (", ec.message(),
         port ? "; in use, or not an address of this machine)" : ")");
  f.acceptor.listen(f.limits.backlog, ec);
  if (ec) fail("cannot listen on ", host, ":", port, ": ", ec.message());
  return f.acceptor.local_endpoint().port();
}

void HttpFront::serve() {
  Impl& f = *impl_;
  if (f.stopped) return;
  accept_next(f);
  std::vector<std::thread> threads;
  for (int i = 1; i < f.limits.io_threads; ++i) threads.emplace_back([&f] { f.io.run(); });
  f.io.run();
  for (std::thread& t : threads) t.join();
}

void HttpFront::stop() {
  Impl& f = *impl_;
  if (f.stopped.exchange(true)) return;
  asio::post(f.io, [&f] {
    boost::system::error_code ec;
    f.acceptor.close(ec);
    std::vector<std::shared_ptr<Connection>> all;
    {
      std::lock_guard<std::mutex> lock(f.mu);
      for (auto& [c, weak] : f.live)
        if (auto s = weak.lock()) all.push_back(std::move(s));
    }
    for (auto& c : all) c->shut();
    f.io.stop();
  });
}

HttpStats HttpFront::stats() const {
  const Impl& f = *impl_;
  HttpStats s;
  {
    std::lock_guard<std::mutex> lock(f.mu);
    s.open = f.open;
  }
  s.accepted = f.accepted;
  s.refused = f.refused;
  s.timed_out = f.timed_out;
  s.client_gone = f.client_gone;
  return s;
}

const HttpLimits& HttpFront::limits() const { return impl_->limits; }

}  // namespace kestrel::server
