// Speculation through `kestrel serve`'s endpoints (in process, over HTTP) on the qwen3-chat
// fixture: the text of a server that speculates is the text of one that does not, whole and
// streamed, with stop strings cutting it where they cut the plain text (nothing past a stop,
// the same completion_tokens); usage carries the speculation vendor field only where the server
// speculates, and /metrics counts the checks the replies report.
#include <gtest/gtest.h>
#include <httplib.h>

#include <cmath>
#include <string>
#include <vector>

#include "chat_server.h"

namespace kestrel::server {
namespace {

// A prompt of token ids that repeats itself, so that drafts are proposed from the start.
json repeating_prompt() {
  json p = json::array();
  for (int i = 0; i < 30; ++i) p.push_back(40 + (i * 7) % 5);
  return p;
}

class ServerSpeculation : public ChatServerTest {
 protected:
  // Restarts the server speculating (or not).
  void restart(bool speculate) {
    stop();
    speculation_.method = speculate ? "ngram" : "none";
    start(text::load_model_chat(*model_, dir_));
  }

  json completion(int max_tokens, const std::vector<std::string>& stop = {}, bool stream = false) {
    json body = {{"model", "qwen3-chat"}, {"prompt", repeating_prompt()}, {"max_tokens", max_tokens},
                 {"temperature", 0},      {"ignore_eos", true}};
    if (!stop.empty()) body["stop"] = stop;
    if (!stream) return ok(body.dump(), "/v1/completions");
    body["stream"] = true;
    body["stream_options"] = {{"include_usage", true}};
    const auto [status, text] = post(body.dump(), "/v1/completions");
    EXPECT_EQ(status, 200) << text;
    // The streamed text and the usage chunk, as one reply.
    json r = {{"choices", json::array({{{"text", ""}}})}};
    size_t at = 0;
    while ((at = text.find("data: ", at)) != std::string::npos) {
      const size_t end = text.find("\n\n", at);
      const std::string data = text.substr(at + 6, end - at - 6);
      at = end;
      if (data == "[DONE]") break;
      const json e = json::parse(data);
      if (e.contains("usage") && !e["usage"].is_null()) r["usage"] = e["usage"];
      for (const json& c : e["choices"]) {
        r["choices"][0]["text"] = r["choices"][0]["text"].get<std::string>() + c.value("text", "");
        if (c.contains("finish_reason") && !c["finish_reason"].is_null()) r["choices"][0]["finish_reason"] = c["finish_reason"];
      }
    }
    return r;
  }

  double metric(const std::string& name) {
    httplib::Client cli("127.0.0.1", port_);
    auto r = cli.Get("/metrics");
    EXPECT_TRUE(r && r->status == 200);
    if (!r) return NAN;
    const std::string key = "\n" + name + " ";
    const size_t at = r->body.find(key);
    EXPECT_NE(at, std::string::npos) << name;
    return at == std::string::npos ? NAN : std::stod(r->body.substr(at + key.size()));
  }
};

TEST_F(ServerSpeculation, SameTextUsageAndMetrics) {
  const json plain = completion(60);
  EXPECT_FALSE(plain["usage"].contains("speculation")) << plain["usage"].dump();
  EXPECT_EQ(metric("kestrel_speculation_verifications_total"), 0);
  restart(true);
  for (bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "streamed" : "whole");
    const double checks0 = metric("kestrel_speculation_verifications_total");
    const double drafted0 = metric("kestrel_speculation_draft_tokens_total");
    const double accepted0 = metric("kestrel_speculation_accepted_tokens_total");
    const json got = completion(60, {}, stream);
    EXPECT_EQ(got["choices"][0]["text"], plain["choices"][0]["text"]);
    EXPECT_EQ(got["choices"][0]["finish_reason"], "length");
    EXPECT_EQ(got["usage"]["completion_tokens"], 60);
    ASSERT_TRUE(got["usage"].contains("speculation")) << got["usage"].dump();
    const int64_t drafted = got["usage"]["speculation"]["drafted_tokens"];
    const int64_t accepted = got["usage"]["speculation"]["accepted_tokens"];
    EXPECT_GT(accepted, 0) << "the fixture's reply never repeats: nothing here checks speculation";
    EXPECT_LE(accepted, drafted);
    const double checks = metric("kestrel_speculation_verifications_total") - checks0;
    EXPECT_EQ(metric("kestrel_speculation_draft_tokens_total") - drafted0, drafted);
    EXPECT_EQ(metric("kestrel_speculation_accepted_tokens_total") - accepted0, accepted);
    EXPECT_GT(checks, 0);
    // Each check yields its accepted drafts and one token of the target's: the rest are plain steps.
    EXPECT_LE(checks + accepted, 60 - 1);
  }
  const double checks = metric("kestrel_speculation_verifications_total");
  const double drafted = metric("kestrel_speculation_draft_tokens_total");
  const double accepted = metric("kestrel_speculation_accepted_tokens_total");
  EXPECT_NEAR(metric("kestrel_speculation_acceptance_rate"), accepted / drafted, 1e-6);
  EXPECT_NEAR(metric("kestrel_speculation_mean_accepted_length"), (accepted + checks) / checks, 1e-6);
}

// Stop strings made of the plain reply's own text (inside runs of accepted drafts, most of
// them): the speculating server's text ends where the plain text's first occurrence of the stop
// begins, with the plain server's completion_tokens.
TEST_F(ServerSpeculation, StopStringsCutWhereTheyCutThePlainText) {
  const json plain = completion(60);
  const std::string text = plain["choices"][0]["text"];
  // Two characters of the text where they first occur (most of the fixture's tokens are parts of
  // characters, so the text is short and ASCII only where it is whole characters).
  std::vector<std::string> stops;
  for (size_t at = 0; at + 2 <= text.size(); ++at) {
    const std::string stop = text.substr(at, 2);
    if (uint8_t(stop[0]) < 0x80 && uint8_t(stop[1]) < 0x80 && text.find(stop) == at) stops.push_back(stop);
  }
  ASSERT_GE(stops.size(), 2u);
  std::vector<json> want;
  for (const std::string& stop : stops) want.push_back(completion(60, {stop}));
  restart(true);
  for (size_t i = 0; i < stops.size(); ++i) {
    SCOPED_TRACE("stop " + json(stops[i]).dump());
    EXPECT_EQ(want[i]["choices"][0]["text"], text.substr(0, text.find(stops[i])));
    for (bool stream : {false, true}) {
      const json got = completion(60, {stops[i]}, stream);
      EXPECT_EQ(got["choices"][0]["text"], want[i]["choices"][0]["text"]) << (stream ? "streamed" : "whole");
      EXPECT_EQ(got["choices"][0]["finish_reason"], "stop");
      EXPECT_EQ(got["usage"]["completion_tokens"], want[i]["usage"]["completion_tokens"]);
      EXPECT_LE(got["usage"]["speculation"]["accepted_tokens"].get<int64_t>(),
                got["usage"]["completion_tokens"].get<int64_t>());
    }
  }
}

}  // namespace
}  // namespace kestrel::server
