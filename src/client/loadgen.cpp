#include "client/loadgen.h"

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <mutex>
#include <thread>

#include "client/prompt.h"
#include "common/error.h"

namespace kestrel::client {
namespace {

using json = nlohmann::ordered_json;
using clock_type = std::chrono::steady_clock;

struct Url {
  std::string origin;  // scheme://host[:port]
  std::string prefix;  // "" or "/path", without a trailing slash or /v1
};

Url parse_url(const std::string& url) {
  const size_t colon = url.find("://");
  const std::string scheme = colon == std::string::npos ? "" : url.substr(0, colon);
  if (scheme != "http" && scheme != "https")
    fail("--url: expected http://HOST[:PORT][/PATH] or https://..., got '", url, "'");
  const std::string rest = url.substr(colon + 3);
  const size_t slash = rest.find('/');
  Url u;
  u.origin = scheme + "://" + rest.substr(0, slash);
  if (slash == 0 || rest.empty()) fail("--url: no host in '", url, "'");
  u.prefix = slash == std::string::npos ? "" : rest.substr(slash);
  while (!u.prefix.empty() && u.prefix.back() == '/') u.prefix.pop_back();
  if (u.prefix.size() >= 3 && u.prefix.compare(u.prefix.size() - 3, 3, "/v1") == 0) u.prefix.resize(u.prefix.size() - 3);
  return u;
}

void set_timeouts(httplib::Client& cli, double s) {
  const time_t sec = time_t(s);
  const time_t usec = time_t(std::llround((s - double(sec)) * 1e6));
  cli.set_connection_timeout(sec, usec);
  cli.set_read_timeout(sec, usec);
  cli.set_write_timeout(sec, usec);
}

httplib::Headers headers(const LoadgenOptions& o) {
  httplib::Headers h;
  if (!o.api_key.empty()) h.emplace("Authorization", "Bearer " + o.api_key);
  return h;
}

// The first model the server lists.
std::string first_model(const Url& u, const LoadgenOptions& o) {
  httplib::Client cli(u.origin);
  set_timeouts(cli, std::min(o.timeout_s, 30.0));
  const std::string path = u.prefix + "/v1/models";
  auto res = cli.Get(path, headers(o));
  if (!res)
    fail("GET ", u.origin, path, ": ", res.error() == httplib::Error::Connection ? "could not connect" : httplib::to_string(res.error()),
         " (pass --model to skip this)");
  if (res->status != 200) fail("GET ", u.origin, path, ": HTTP ", res->status, " (pass --model to skip this)");
  const json j = json::parse(res->body, nullptr, false);
  if (j.is_discarded() || !j.contains("data") || !j["data"].is_array() || j["data"].empty() ||
      !j["data"][0].is_object() || !j["data"][0].contains("id") || !j["data"][0]["id"].is_string())
    fail("GET ", u.origin, path, ": no model listed (pass --model)");
  return j["data"][0]["id"].get<std::string>();
}

std::string request_body(const LoadgenOptions& o, int index) {
  const std::string prompt = synthetic_prompt(o.prompt_tokens, uint64_t(index));
  json j = {{"model", o.model}};
  if (o.chat) j["messages"] = json::array({{{"role", "user"}, {"content", prompt}}});
  else j["prompt"] = prompt;
  j["max_tokens"] = o.max_tokens;
  j["temperature"] = 0;
  j["stream"] = true;
  j["stream_options"] = {{"include_usage", true}};
  return j.dump();
}

std::string transport_error(httplib::Error e, double elapsed, const LoadgenOptions& o, const Url& u, bool responded) {
  using E = httplib::Error;
  if (e == E::Connection) return cat("could not connect to ", u.origin);
  if (e == E::ConnectionTimeout) return cat("could not connect to ", u.origin, " within ", o.timeout_s, " s");
  if (e == E::SSLConnection || e == E::SSLLoadingCerts || e == E::SSLServerVerification)
    return cat("TLS with ", u.origin, " failed (", httplib::to_string(e), ")");
  if (e == E::Read && elapsed >= o.timeout_s * 0.99) return cat("timed out after ", o.timeout_s, " s");  // the socket's read timeout
  if (!responded) {
    if (e == E::Read) return "the server closed the connection without a response";
    if (e == E::Write) return "could not send the request";
    return cat("no response (", httplib::to_string(e), ")");
  }
  if (e == E::Read) return "the connection closed mid-stream";
  return cat("the connection failed mid-stream (", httplib::to_string(e), ")");
}

}  // namespace

void check_options(const LoadgenOptions& o) {
  parse_url(o.url);
  if (o.streams < 1) fail("--streams: must be at least 1, got ", o.streams);
  if (o.requests < 1) fail("--requests: must be at least 1, got ", o.requests);
  if (o.prompt_tokens < 1) fail("--prompt-tokens: must be at least 1, got ", o.prompt_tokens);
  if (o.max_tokens < 1) fail("--max-tokens: must be at least 1, got ", o.max_tokens);
  if (!(o.timeout_s > 0) || !std::isfinite(o.timeout_s)) fail("--timeout: must be a positive number of seconds, got ", o.timeout_s);
}

LoadgenResult run_loadgen(LoadgenOptions o, const std::function<void(int)>& progress) {
  check_options(o);
  const Url u = parse_url(o.url);
  if (o.model.empty()) o.model = first_model(u, o);
  LoadgenResult result;
  result.origin = u.origin;
  result.endpoint = u.prefix + (o.chat ? "/v1/chat/completions" : "/v1/completions");
  result.records.resize(size_t(o.requests));

  const clock_type::time_point origin = clock_type::now();
  auto now = [origin] { return std::chrono::duration<double>(clock_type::now() - origin).count(); };
  std::atomic<int> next{0};
  std::mutex done_mutex;
  int done = 0;
  auto client = [&](int stream) {
    httplib::Client cli(u.origin);
    cli.set_keep_alive(true);
    cli.set_tcp_nodelay(true);  // the request's head and body leave at once, not after the server's delayed ACK
    set_timeouts(cli, o.timeout_s);
    for (int i; (i = next.fetch_add(1)) < o.requests;) {
      httplib::Request req;
      req.method = "POST";
      req.path = result.endpoint;
      req.headers = headers(o);
      req.headers.emplace("Accept", "text/event-stream");
      req.set_header("Content-Type", "application/json");
      req.body = request_body(o, i);
      httplib::Response res;
      const double t0 = now();
      StreamTracker tracker(t0);
      bool head = false, timed_out = false;
      req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
        const double t = now();
        if (!head) {
          tracker.head(res.status, res.get_header_value("Content-Type"));
          head = true;
        }
        if (t - t0 > o.timeout_s) {
          timed_out = true;
          return false;
        }
        return tracker.body(t, std::string_view(data, n));
      };
      httplib::Error err = httplib::Error::Success;
      const bool sent = cli.send(req, res, err);
      const double t1 = now();
      if (!head && res.status > 0) tracker.head(res.status, res.get_header_value("Content-Type"));
      std::string terr;
      if (timed_out) terr = cat("timed out after ", o.timeout_s, " s");
      else if (!sent && !(err == httplib::Error::Canceled && tracker.failed()))
        terr = transport_error(err, t1 - t0, o, u, res.status > 0);
      RequestRecord r = tracker.finish(t1, terr);
      r.index = i;
      r.stream = stream;
      r.start_s = t0;
      result.records[size_t(i)] = std::move(r);
      if (progress) {
        std::lock_guard<std::mutex> lock(done_mutex);
        progress(++done);
      }
    }
  };
  const int threads = std::min(o.streams, o.requests);
  std::vector<std::thread> pool;
  for (int s = 0; s < threads; ++s) pool.emplace_back(client, s);
  for (std::thread& t : pool) t.join();
  const double wall = now();
  result.options = o;
  result.stats = run_stats(result.records, wall);
  return result;
}

namespace {

json number(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

json summary_json(const Summary& s, double scale = 1) {
  return {{"count", s.count}, {"mean", number(s.mean * scale)}, {"p50", number(s.p50 * scale)},
          {"p90", number(s.p90 * scale)}, {"p99", number(s.p99 * scale)}, {"min", number(s.min * scale)},
          {"max", number(s.max * scale)}};
}

}  // namespace

json result_json(const LoadgenResult& r) {
  const LoadgenOptions& o = r.options;
  const RunStats& s = r.stats;
  json hist = json::array();
  for (const HistogramBin& b : s.itl_histogram) hist.push_back({{"lo_ms", b.lo * 1e3}, {"hi_ms", b.hi * 1e3}, {"count", b.count}});
  json errors = json::array();
  for (const auto& [msg, n] : s.error_counts) errors.push_back({{"error", msg}, {"count", n}});
  json records = json::array();
  for (const RequestRecord& q : r.records) {
    json itl = json::array();
    for (double v : q.itl_s) itl.push_back(v * 1e3);
    records.push_back({{"index", q.index}, {"stream", q.stream}, {"ok", q.ok}, {"error", q.error.empty() ? json(nullptr) : json(q.error)},
                       {"http_status", q.http_status}, {"start_s", q.start_s},
                       {"ttft_ms", q.ttft_s >= 0 ? json(q.ttft_s * 1e3) : json(nullptr)}, {"e2e_ms", q.e2e_s * 1e3},
                       {"text_chunks", q.text_chunks}, {"completion_tokens", q.completion_tokens}, {"usage_reported", q.usage},
                       {"prompt_tokens", q.prompt_tokens >= 0 ? json(q.prompt_tokens) : json(nullptr)},
                       {"decode_tokens_per_s", q.decode_tokens_per_s >= 0 ? json(q.decode_tokens_per_s) : json(nullptr)},
                       {"finish_reason", q.finish_reason.empty() ? json(nullptr) : json(q.finish_reason)}, {"itl_ms", itl}});
  }
  return {
      {"url", o.url},
      {"endpoint", r.endpoint},
      {"model", o.model},
      {"streams", o.streams},
      {"requests", o.requests},
      {"prompt_tokens_requested", o.prompt_tokens},
      {"max_tokens", o.max_tokens},
      {"timeout_s", o.timeout_s},
      {"summary",
       {{"ok", s.ok},
        {"errors", s.errors},
        {"wall_s", s.wall_s},
        {"ttft_ms", summary_json(s.ttft_s, 1e3)},
        {"itl_ms", summary_json(s.itl_s, 1e3)},
        {"e2e_ms", summary_json(s.e2e_s, 1e3)},
        {"stream_tokens_per_s", summary_json(s.decode_tokens_per_s)},
        {"output_tokens", s.output_tokens},
        {"output_tokens_per_s", s.output_tokens_per_s},
        {"prompt_tokens", summary_json(s.prompt_tokens)},
        {"completion_tokens", summary_json(s.completion_tokens)},
        {"itl_histogram", hist},
        {"error_counts", errors}}},
      {"records", records},
  };
}

}  // namespace kestrel::client
