// The load generator against small local servers written here (cpp-httplib on 127.0.0.1, a free
// port): a server that streams a known number of chunks at a known pace, so the measured time to
// first token and inter-token latency must come out at that pace; servers that refuse, fail,
// break off, send garbage or stall; and `kestrel loadgen` itself: its table, --json and exit status.
#include <gtest/gtest.h>
#include <httplib.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "../unit/run_cli.h"
#include "client/loadgen.h"
#include "common/error.h"

namespace kestrel::client {
namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;

// How a test server answers every completion request.
struct Script {
  int status = 200;          // not 200: this status with error_body, no stream
  std::string error_body;
  int first_ms = 100;        // before the first text chunk
  int gap_ms = 20;           // between text chunks
  int chunks = 10;           // text chunks
  int tokens_per_chunk = 1;  // what usage.completion_tokens says per chunk
  bool usage = true;         // a usage chunk at the end when asked for
  int break_after = -1;      // >= 0: after this many text chunks, stop (see `abort`)
  bool abort = true;         // at break_after: drop the connection (true) or end the body cleanly without [DONE]
  std::string inject;        // sent as an event after the first text chunk (an error or garbage)
  bool ragged = false;       // CRLF line ends, each event written in 7-byte pieces after a keep-alive comment
};

class TestServer {
 public:
  explicit TestServer(Script s) : script_(std::move(s)) {
    svr_.new_task_queue = [] { return new httplib::ThreadPool(16); };
    svr_.set_tcp_nodelay(true);  // every write leaves at once, so the pace is what the client sees
    svr_.Get("/v1/models", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(R"({"object":"list","data":[{"id":"listed-model","object":"model"}]})", "application/json");
    });
    svr_.Post("/v1/completions", [this](const httplib::Request& q, httplib::Response& r) { answer(q, r, false); });
    svr_.Post("/v1/chat/completions", [this](const httplib::Request& q, httplib::Response& r) { answer(q, r, true); });
    port_ = svr_.bind_to_any_port("127.0.0.1");
    EXPECT_GT(port_, 0);
    thread_ = std::thread([this] { svr_.listen_after_bind(); });
    while (!svr_.is_running()) std::this_thread::sleep_for(1ms);
  }
  ~TestServer() {
    svr_.stop();
    thread_.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  std::vector<json> bodies() {
    std::lock_guard<std::mutex> lock(mutex_);
    return bodies_;
  }

 private:
  void answer(const httplib::Request& req, httplib::Response& res, bool chat) {
    const json body = json::parse(req.body, nullptr, false);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      bodies_.push_back(body);
    }
    if (script_.status != 200) {
      res.status = script_.status;
      res.set_content(script_.error_body, "application/json");
      return;
    }
    const Script s = script_;
    const bool usage = body.value("stream_options", json::object()).value("include_usage", false);
    res.set_chunked_content_provider("text/event-stream", [s, chat, usage](size_t, httplib::DataSink& sink) {
      const std::string eol = s.ragged ? "\r\n" : "\n";
      auto send = [&](const std::string& data) {
        const std::string e = "data: " + data + eol + eol;
        if (!s.ragged) return sink.write(e.data(), e.size());
        // A keep-alive comment, then the event in pieces of 7 bytes.
        if (!sink.write(": keep-alive\r\n", 14)) return false;
        for (size_t i = 0; i < e.size(); i += 7)
          if (!sink.write(e.data() + i, std::min<size_t>(7, e.size() - i))) return false;
        return true;
      };
      auto chunk = [&](const std::string& text, const char* finish) {
        json c = {{"id", "cmpl-1"}, {"object", chat ? "chat.completion.chunk" : "text_completion"}, {"model", "m"}};
        json choice = {{"index", 0}, {"finish_reason", finish ? json(finish) : json(nullptr)}};
        if (chat) choice["delta"] = {{"content", text}};
        else choice["text"] = text;
        c["choices"] = json::array({choice});
        return c.dump();
      };
      if (chat) send(R"({"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]})");
      std::this_thread::sleep_for(std::chrono::milliseconds(s.first_ms));
      for (int i = 0; i < s.chunks; ++i) {
        if (i == s.break_after) {
          if (s.abort) return false;  // cpp-httplib drops the connection mid-body
          sink.done();
          return true;
        }
        if (i > 0) std::this_thread::sleep_for(std::chrono::milliseconds(s.gap_ms));
        if (!send(chunk(" tok" + std::to_string(i), nullptr))) return false;
        if (i == 0 && !s.inject.empty()) send(s.inject);
      }
      send(chunk("", "length"));
      if (s.usage && usage)
        send(json{{"object", "text_completion"}, {"choices", json::array()},
                  {"usage", {{"prompt_tokens", 7}, {"completion_tokens", s.chunks * s.tokens_per_chunk},
                             {"total_tokens", 7 + s.chunks * s.tokens_per_chunk}}}}.dump());
      send("[DONE]");
      sink.done();
      return true;
    });
  }

  Script script_;
  httplib::Server svr_;
  int port_ = 0;
  std::thread thread_;
  std::mutex mutex_;
  std::vector<json> bodies_;
};

LoadgenOptions options(const TestServer& srv, int streams, int requests) {
  LoadgenOptions o;
  o.url = srv.url();
  o.model = "test-model";
  o.streams = streams;
  o.requests = requests;
  o.prompt_tokens = 32;
  o.max_tokens = 10;
  o.timeout_s = 30;
  return o;
}

// Margins: the server sleeps exactly 100 ms before the first chunk and 20 ms between chunks, so
// a correct client sees TTFT >= 100 ms and gaps of 20 ms plus scheduling delay. On a loaded
// 2-core machine delays of a few milliseconds are common, so medians get +15 ms (TTFT) and
// +-8 ms (ITL); a client that measured at the end of the body (ITL ~0), counted the chat role
// chunk as the first token (TTFT ~0) or divided gaps by the wrong token count (10 or 40 ms)
// fails these.
constexpr double kTtftMs = 100, kItlMs = 20;

void expect_paced(const LoadgenResult& r, int requests, int chunks, int tokens_per_chunk) {
  const RunStats& s = r.stats;
  ASSERT_EQ(s.ok, size_t(requests));
  EXPECT_EQ(s.errors, 0u);
  EXPECT_GE(s.ttft_s.p50 * 1e3, kTtftMs - 1);  // sleeps never end early; 1 ms for clock reading order
  EXPECT_LE(s.ttft_s.p50 * 1e3, kTtftMs + 15);
  const double itl = kItlMs / tokens_per_chunk;
  EXPECT_NEAR(s.itl_s.p50 * 1e3, itl, 8.0 / tokens_per_chunk);
  EXPECT_NEAR(s.itl_s.mean * 1e3, itl, 8.0 / tokens_per_chunk);
  EXPECT_EQ(s.itl_s.count, size_t(requests * (chunks - 1)));
  EXPECT_EQ(s.output_tokens, int64_t(requests) * chunks * tokens_per_chunk);
  // 1000 / 20 = 50 tokens/s per stream at the server's pace; delays only lower it.
  EXPECT_LE(s.decode_tokens_per_s.mean, 1e3 / kItlMs * 1.05);
  EXPECT_GE(s.decode_tokens_per_s.mean, 1e3 / kItlMs * 0.65);
  for (const RequestRecord& q : r.records) {
    EXPECT_TRUE(q.ok) << q.error;
    EXPECT_EQ(q.text_chunks, chunks);
    EXPECT_EQ(q.completion_tokens, chunks * tokens_per_chunk);
    EXPECT_TRUE(q.usage);
    EXPECT_EQ(q.prompt_tokens, 7);
    EXPECT_EQ(q.finish_reason, "length");
  }
  std::printf("measured: TTFT p50 %.2f ms (mean %.2f, p99 %.2f), ITL p50 %.2f ms (mean %.2f, p99 %.2f), "
              "%.1f tokens/s per stream, wall %.3f s\n",
              s.ttft_s.p50 * 1e3, s.ttft_s.mean * 1e3, s.ttft_s.p99 * 1e3, s.itl_s.p50 * 1e3, s.itl_s.mean * 1e3,
              s.itl_s.p99 * 1e3, s.decode_tokens_per_s.mean, s.wall_s);
}

TEST(Loadgen, PacedServerCompletions) {
  TestServer srv(Script{});
  const LoadgenResult r = run_loadgen(options(srv, 4, 8));
  expect_paced(r, 8, 10, 1);
  // 4 streams, 8 requests of 100 + 9 x 20 = 280 ms: two rounds, about 0.56 s; one stream would take 2.24 s.
  EXPECT_LT(r.stats.wall_s, 1.5);
  // What was asked: streaming with usage, max_tokens, temperature 0, each request its own prompt.
  const std::vector<json> bodies = srv.bodies();
  ASSERT_EQ(bodies.size(), 8u);
  std::set<std::string> prompts;
  for (const json& b : bodies) {
    EXPECT_EQ(b["model"], "test-model");
    EXPECT_EQ(b["stream"], true);
    EXPECT_EQ(b["stream_options"]["include_usage"], true);
    EXPECT_EQ(b["max_tokens"], 10);
    EXPECT_EQ(b["temperature"], 0);
    EXPECT_FALSE(b.contains("ignore_eos"));
    prompts.insert(b["prompt"].get<std::string>());
  }
  EXPECT_EQ(prompts.size(), 8u);
  // The streams shared the work.
  std::set<int> streams;
  for (const RequestRecord& q : r.records) streams.insert(q.stream);
  EXPECT_EQ(streams.size(), 4u);
}

// Chat: the role chunk comes at once and carries no text, so TTFT is still the 100 ms of the
// first content; events arrive in 7-byte pieces with CRLF and keep-alive comments in between.
TEST(Loadgen, PacedServerChatInRaggedPieces) {
  Script s;
  s.ragged = true;
  TestServer srv(s);
  LoadgenOptions o = options(srv, 2, 4);
  o.chat = true;
  const LoadgenResult r = run_loadgen(o);
  EXPECT_EQ(r.endpoint, "/v1/chat/completions");
  expect_paced(r, 4, 10, 1);
  for (const json& b : srv.bodies()) {
    ASSERT_TRUE(b["messages"].is_array());
    EXPECT_EQ(b["messages"][0]["role"], "user");
  }
}

// Two tokens per chunk (usage says 20 for 10 chunks): per-token ITL is half the gap.
TEST(Loadgen, ChunksOfTwoTokens) {
  Script s;
  s.tokens_per_chunk = 2;
  TestServer srv(s);
  const LoadgenResult r = run_loadgen(options(srv, 2, 2));
  const RunStats& st = r.stats;
  ASSERT_EQ(st.ok, 2u);
  EXPECT_NEAR(st.itl_s.p50 * 1e3, 10.0, 5.0);
  EXPECT_EQ(st.output_tokens, 40);
  // 2 x 9 = 18 tokens in about 180 ms: 100 tokens/s.
  EXPECT_GE(st.decode_tokens_per_s.mean, 65);
  EXPECT_LE(st.decode_tokens_per_s.mean, 105);
}

TEST(Loadgen, ModelFromTheServersListAndUrlWithV1) {
  Script s;
  s.first_ms = 0, s.gap_ms = 0, s.chunks = 2;
  TestServer srv(s);
  LoadgenOptions o = options(srv, 1, 1);
  o.model = "";
  o.url = srv.url() + "/v1/";
  const LoadgenResult r = run_loadgen(o);
  EXPECT_EQ(r.stats.ok, 1u);
  EXPECT_EQ(r.options.model, "listed-model");
  EXPECT_EQ(srv.bodies().at(0)["model"], "listed-model");
  EXPECT_EQ(r.endpoint, "/v1/completions");
}

void expect_all_fail(const LoadgenResult& r, const std::string& message) {
  EXPECT_EQ(r.stats.ok, 0u);
  EXPECT_EQ(r.stats.errors, r.records.size());
  for (const RequestRecord& q : r.records) EXPECT_NE(q.error.find(message), std::string::npos) << q.error;
  EXPECT_EQ(r.stats.error_counts.size(), 1u);  // one message for all
}

TEST(Loadgen, FailuresAreCountedWithTheirMessages) {
  {
    Script s;
    s.status = 401;
    s.error_body = R"({"error":{"message":"invalid API key","type":"authentication_error"}})";
    TestServer srv(s);
    const LoadgenResult r = run_loadgen(options(srv, 2, 3));
    expect_all_fail(r, "HTTP 401: invalid API key");
    EXPECT_EQ(r.records[0].http_status, 401);
  }
  {
    Script s;
    s.status = 500;
    s.error_body = R"({"error":{"message":"out of memory","type":"server_error"}})";
    TestServer srv(s);
    expect_all_fail(run_loadgen(options(srv, 2, 2)), "HTTP 500: out of memory");
  }
  {
    Script s;
    s.first_ms = 0, s.gap_ms = 5, s.break_after = 3;  // the connection drops after 3 chunks
    TestServer srv(s);
    const LoadgenResult r = run_loadgen(options(srv, 2, 4));
    expect_all_fail(r, "the connection closed mid-stream (after 3 text chunks)");
    for (const RequestRecord& q : r.records) EXPECT_EQ(q.text_chunks, 3);
  }
  {
    Script s;
    s.first_ms = 0, s.gap_ms = 5, s.break_after = 3, s.abort = false;  // a clean end, but no [DONE]
    TestServer srv(s);
    expect_all_fail(run_loadgen(options(srv, 2, 2)), "the stream ended before 'data: [DONE]' (after 3 text chunks)");
  }
  {
    Script s;
    s.first_ms = 0, s.gap_ms = 0, s.inject = R"({"error":{"message":"the engine shut down"}})";
    TestServer srv(s);
    expect_all_fail(run_loadgen(options(srv, 1, 2)), "error in the stream: the engine shut down");
  }
  {
    Script s;
    s.first_ms = 0, s.gap_ms = 0, s.inject = "<html>oops";
    TestServer srv(s);
    expect_all_fail(run_loadgen(options(srv, 1, 2)), "malformed stream");
  }
  {
    Script s;
    s.first_ms = 1500;  // longer than the timeout
    TestServer srv(s);
    LoadgenOptions o = options(srv, 2, 2);
    o.timeout_s = 0.5;
    const auto t0 = std::chrono::steady_clock::now();
    expect_all_fail(run_loadgen(o), "timed out after 0.5 s");
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 1.4);
  }
}

TEST(Loadgen, NothingListening) {
  // A port that was free a moment ago: bound, read back and closed without listening.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  ::close(fd);
  const int port = ntohs(a.sin_port);
  LoadgenOptions o;
  o.url = "http://127.0.0.1:" + std::to_string(port);
  o.model = "m";
  o.streams = 2;
  o.requests = 2;
  o.timeout_s = 5;
  const LoadgenResult r = run_loadgen(o);
  expect_all_fail(r, "could not connect to http://127.0.0.1:" + std::to_string(port));
  EXPECT_EQ(r.records[0].http_status, 0);
}

TEST(Loadgen, OptionsAreChecked) {
  LoadgenOptions o;
  o.model = "m";
  auto message = [](const LoadgenOptions& x) {
    try {
      check_options(x);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(message(o), "");
  for (auto [field, expect] : std::vector<std::pair<std::function<void(LoadgenOptions&)>, std::string>>{
           {[](LoadgenOptions& x) { x.url = "ftp://host"; }, "--url"},
           {[](LoadgenOptions& x) { x.url = "http://"; }, "--url: no host"},
           {[](LoadgenOptions& x) { x.streams = 0; }, "--streams"},
           {[](LoadgenOptions& x) { x.requests = -1; }, "--requests"},
           {[](LoadgenOptions& x) { x.prompt_tokens = 0; }, "--prompt-tokens"},
           {[](LoadgenOptions& x) { x.max_tokens = 0; }, "--max-tokens"},
           {[](LoadgenOptions& x) { x.timeout_s = 0; }, "--timeout"},
       }) {
    LoadgenOptions x = o;
    field(x);
    EXPECT_NE(message(x).find(expect), std::string::npos) << expect << ": " << message(x);
  }
}

// The command: table on stdout, --json with the summary and every request, exit 0; failures
// make it say so and exit 1; bad flags give one clear line.
TEST(LoadgenCommand, TableJsonAndExitStatus) {
  TestServer srv(Script{});
  const std::string json_path = (std::filesystem::temp_directory_path() / ("loadgen-" + std::to_string(::getpid()) + ".json")).string();
  auto r = test::run_kestrel("loadgen --url " + srv.url() + " --model test-model --streams 2 --requests 4 --prompt-tokens 16 "
                             "--max-tokens 10 --json " + json_path);
  ASSERT_EQ(r.status, 0) << r.output;
  for (const char* s : {"4 ok, 0 failed", "TTFT (ms)", "ITL (ms)", "stream tokens/s", "output tokens     40",
                        "prompt tokens     7.0 per request", "ITL distribution"})
    EXPECT_NE(r.output.find(s), std::string::npos) << s << "\n" << r.output;
  std::ifstream f(json_path);
  const json j = json::parse(f);
  std::filesystem::remove(json_path);
  EXPECT_EQ(j["summary"]["ok"], 4);
  EXPECT_EQ(j["summary"]["errors"], 0);
  EXPECT_EQ(j["summary"]["output_tokens"], 40);
  EXPECT_EQ(j["records"].size(), 4u);
  EXPECT_EQ(j["records"][0]["itl_ms"].size(), 9u);
  EXPECT_GE(j["summary"]["ttft_ms"]["p50"].get<double>(), kTtftMs - 1);
  EXPECT_NEAR(j["summary"]["itl_ms"]["p50"].get<double>(), kItlMs, 8);
  EXPECT_FALSE(j["summary"]["itl_histogram"].empty());
}

TEST(LoadgenCommand, FailuresExitNonZero) {
  Script s;
  s.status = 401;
  s.error_body = R"({"error":{"message":"invalid API key"}})";
  TestServer srv(s);
  auto r = test::run_kestrel("loadgen --url " + srv.url() + " --model m --streams 2 --requests 3 --max-tokens 4");
  EXPECT_EQ(r.status, 1) << r.output;
  for (const char* m : {"0 ok, 3 failed", "3 x HTTP 401: invalid API key", "3 of 3 requests failed"})
    EXPECT_NE(r.output.find(m), std::string::npos) << m << "\n" << r.output;
}

TEST(LoadgenCommand, BadFlags) {
  struct Case {
    std::string args, expect;
  } cases[] = {
      {"loadgen --streams 0 --model m", "--streams: must be at least 1"},
      {"loadgen --url localhost:8000 --model m", "--url: expected http://"},
      {"loadgen --streams many", "--streams"},
      {"loadgen --timeout -1 --model m", "--timeout"},
      {"loadgen --no-such-flag", "--no-such-flag"},
      {"loadgen --model m --json /nonexistent/dir/x.json", "/nonexistent/dir/x.json"},
  };
  for (const Case& c : cases) {
    auto r = test::run_kestrel(c.args);
    EXPECT_NE(r.status, 0) << c.args;
    EXPECT_NE(r.output.find(c.expect), std::string::npos) << c.args << "\n" << r.output;
  }
}

}  // namespace
}  // namespace kestrel::client
