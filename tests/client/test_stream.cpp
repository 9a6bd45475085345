// One streamed request measured from given arrival times: the chunk payloads, the timing rules of
// client/stream.h on hand-computed data, and every way a request fails.
#include <gtest/gtest.h>

#include "client/stream.h"

namespace kestrel::client {
namespace {

std::string ev(const std::string& data) { return "data: " + data + "\n\n"; }
std::string text_chunk(const std::string& t) { return ev(R"({"object":"text_completion","choices":[{"index":0,"text":")" + t + R"(","finish_reason":null}]})"); }
std::string chat_chunk(const std::string& content) {
  return ev(R"({"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":")" + content + R"("},"finish_reason":null}]})");
}
const std::string kRoleChunk = ev(R"({"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]})");
const std::string kFinish = ev(R"({"choices":[{"index":0,"text":"","finish_reason":"length"}]})");
std::string usage(int prompt, int completion) {
  return ev(R"({"choices":[],"usage":{"prompt_tokens":)" + std::to_string(prompt) + R"(,"completion_tokens":)" +
            std::to_string(completion) + "}}");
}
const std::string kDone = ev("[DONE]");

TEST(StreamChunk, ReadsTextDeltasUsageErrors) {
  StreamChunk c = parse_chunk(R"({"choices":[{"text":"Hi","finish_reason":null}]})");
  EXPECT_EQ(c.kind, StreamChunk::Kind::Chunk);
  EXPECT_EQ(c.text, "Hi");
  EXPECT_EQ(c.completion_tokens, -1);
  c = parse_chunk(R"({"choices":[{"delta":{"content":"a"}}]})");
  EXPECT_EQ(c.text, "a");
  c = parse_chunk(R"({"choices":[{"delta":{"reasoning_content":"think","content":null}}]})");
  EXPECT_EQ(c.text, "think");
  c = parse_chunk(R"({"choices":[{"delta":{"role":"assistant","content":""}}]})");
  EXPECT_EQ(c.text, "");
  c = parse_chunk(R"({"choices":[{"text":"","finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":3}})");
  EXPECT_EQ(c.finish_reason, "stop");
  EXPECT_EQ(c.prompt_tokens, 12);
  EXPECT_EQ(c.completion_tokens, 3);
  c = parse_chunk(R"({"choices":[],"usage":null,"error":null})");
  EXPECT_EQ(c.kind, StreamChunk::Kind::Chunk);
  EXPECT_EQ(parse_chunk("[DONE]").kind, StreamChunk::Kind::Done);

  c = parse_chunk(R"({"error":{"message":"the engine stopped","type":"server_error"}})");
  EXPECT_EQ(c.kind, StreamChunk::Kind::Error);
  EXPECT_EQ(c.message, "the engine stopped");
  c = parse_chunk(R"({"error":"overloaded"})");
  EXPECT_EQ(c.message, "overloaded");
  c = parse_chunk(R"({"message":"bad"})", "error");
  EXPECT_EQ(c.kind, StreamChunk::Kind::Error);
  EXPECT_EQ(c.message, "bad");

  EXPECT_EQ(parse_chunk("{\"choices\":[").kind, StreamChunk::Kind::Malformed);
  EXPECT_EQ(parse_chunk("42").kind, StreamChunk::Kind::Malformed);
  EXPECT_EQ(parse_chunk(R"({"choices":5})").kind, StreamChunk::Kind::Malformed);
}

// start 10.000; text chunks at 10.100, 10.120, 10.150 (gaps 20 ms and 30 ms), the role chunk
// before them and the finish and usage chunks after them carry no text.
TEST(StreamTracker, TimingsOfOneChunkPerToken) {
  StreamTracker t(10.0);
  t.head(200, "text/event-stream");
  EXPECT_TRUE(t.body(10.050, kRoleChunk));
  EXPECT_TRUE(t.body(10.100, chat_chunk("a")));
  EXPECT_TRUE(t.body(10.120, chat_chunk("b")));
  EXPECT_TRUE(t.body(10.150, chat_chunk("c") + kFinish));
  EXPECT_TRUE(t.body(10.160, usage(5, 3) + kDone));
  const RequestRecord r = t.finish(10.200, "");
  EXPECT_TRUE(r.ok) << r.error;
  EXPECT_EQ(r.http_status, 200);
  EXPECT_NEAR(r.ttft_s, 0.100, 1e-9);
  ASSERT_EQ(r.itl_s.size(), 2u);
  EXPECT_NEAR(r.itl_s[0], 0.020, 1e-9);
  EXPECT_NEAR(r.itl_s[1], 0.030, 1e-9);
  EXPECT_EQ(r.text_chunks, 3);
  EXPECT_EQ(r.completion_tokens, 3);
  EXPECT_TRUE(r.usage);
  EXPECT_EQ(r.prompt_tokens, 5);
  EXPECT_EQ(r.finish_reason, "length");
  EXPECT_NEAR(r.e2e_s, 0.200, 1e-9);
  // c = 3 / 3 = 1 token per chunk; 1 x (3 - 1) = 2 tokens over 10.150 - 10.100 = 0.050 s: 40 tokens/s.
  EXPECT_NEAR(r.decode_tokens_per_s, 40.0, 1e-6);
}

// Three text chunks of two tokens each (usage says 6): c = 2, gaps 40 ms and 40 ms become 20 ms
// per token; 2 x (3 - 1) = 4 tokens over 0.080 s: 50 tokens/s.
TEST(StreamTracker, ChunksOfSeveralTokens) {
  StreamTracker t(0.0);
  t.head(200, "text/event-stream");
  t.body(0.10, text_chunk("ab"));
  t.body(0.14, text_chunk("cd"));
  t.body(0.18, text_chunk("ef") + usage(4, 6) + kDone);
  const RequestRecord r = t.finish(0.19, "");
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_EQ(r.completion_tokens, 6);
  ASSERT_EQ(r.itl_s.size(), 2u);
  EXPECT_NEAR(r.itl_s[0], 0.020, 1e-9);
  EXPECT_NEAR(r.itl_s[1], 0.020, 1e-9);
  EXPECT_NEAR(r.decode_tokens_per_s, 50.0, 1e-6);
}

// 4 tokens in 3 text chunks (a token that decoded to no text yet): c = 4/3 rounds to 1, so the
// gaps stay as they are; the rate counts 4/3 x 2 = 8/3 tokens over 0.04 s = 66.67 tokens/s.
TEST(StreamTracker, AFewMoreTokensThanChunksKeepTheGaps) {
  StreamTracker t(0.0);
  t.head(200, "text/event-stream");
  t.body(0.10, text_chunk("a"));
  t.body(0.12, text_chunk("b"));
  t.body(0.14, text_chunk("c") + usage(4, 4) + kDone);
  const RequestRecord r = t.finish(0.15, "");
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_EQ(r.completion_tokens, 4);
  ASSERT_EQ(r.itl_s.size(), 2u);
  EXPECT_NEAR(r.itl_s[0], 0.020, 1e-9);
  EXPECT_NEAR(r.decode_tokens_per_s, (4.0 / 3.0) * 2 / 0.04, 1e-6);
}

TEST(StreamTracker, WithoutUsageTokensAreTextChunks) {
  StreamTracker t(0.0);
  t.head(200, "text/event-stream");
  t.body(0.1, text_chunk("a") + text_chunk("b"));  // one read, two events: the same arrival time
  t.body(0.2, kDone);
  const RequestRecord r = t.finish(0.2, "");
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_FALSE(r.usage);
  EXPECT_EQ(r.completion_tokens, 2);
  EXPECT_EQ(r.prompt_tokens, -1);
  ASSERT_EQ(r.itl_s.size(), 1u);
  EXPECT_EQ(r.itl_s[0], 0.0);
  EXPECT_EQ(r.decode_tokens_per_s, -1);  // no time between the first and the last text chunk
}

TEST(StreamTracker, NoTextIsOkWithoutTimings) {
  StreamTracker t(0.0);
  t.head(200, "text/event-stream");
  t.body(0.1, kFinish + usage(3, 0) + kDone);
  const RequestRecord r = t.finish(0.1, "");
  EXPECT_TRUE(r.ok);
  EXPECT_EQ(r.ttft_s, -1);
  EXPECT_TRUE(r.itl_s.empty());
  EXPECT_EQ(r.completion_tokens, 0);
}

TEST(StreamTracker, DataAfterDoneIsIgnored) {
  StreamTracker t(0.0);
  t.head(200, "text/event-stream");
  t.body(0.1, text_chunk("a") + kDone + text_chunk("b") + ev("not json"));
  const RequestRecord r = t.finish(0.2, "");
  EXPECT_TRUE(r.ok) << r.error;
  EXPECT_EQ(r.text_chunks, 1);
}

RequestRecord failed(int status, const std::string& content_type, const std::string& body, const std::string& transport = "") {
  StreamTracker t(0.0);
  if (status) t.head(status, content_type);
  if (!body.empty()) t.body(0.1, body);
  RequestRecord r = t.finish(0.2, transport);
  EXPECT_FALSE(r.ok);
  return r;
}

TEST(StreamTracker, FailuresSayWhat) {
  EXPECT_EQ(failed(401, "application/json", R"({"error":{"message":"invalid API key","type":"authentication_error"}})").error,
            "HTTP 401: invalid API key");
  EXPECT_EQ(failed(500, "text/plain", "Internal Server Error\n").error, "HTTP 500: Internal Server Error");
  EXPECT_EQ(failed(503, "", "").error, "HTTP 503");
  EXPECT_EQ(failed(422, "application/json", R"({"detail":"field required"})").error, "HTTP 422: field required");
  EXPECT_EQ(failed(0, "", "", "could not connect to http://x:1").error, "could not connect to http://x:1");
  EXPECT_EQ(failed(200, "text/event-stream", text_chunk("a") + text_chunk("b"), "the connection closed mid-stream").error,
            "the connection closed mid-stream (after 2 text chunks)");
  EXPECT_EQ(failed(200, "text/event-stream", text_chunk("a")).error, "the stream ended before 'data: [DONE]' (after 1 text chunks)");
  EXPECT_EQ(failed(200, "text/event-stream", text_chunk("a") + "data: {\"cho").error,
            "the stream ended before 'data: [DONE]' in the middle of an event (after 1 text chunks)");
  EXPECT_EQ(failed(200, "application/json", R"({"choices":[{"text":"whole"}]})").error,
            "no server-sent events in the response (Content-Type: application/json)");
  EXPECT_EQ(failed(200, "text/event-stream", "").error, "an empty response");
  EXPECT_EQ(failed(200, "text/event-stream", text_chunk("a") + ev(R"({"error":{"message":"engine stopped"}})") + kDone).error,
            "error in the stream: engine stopped");
  EXPECT_EQ(failed(200, "text/event-stream", ev("<html>")).error,
            "malformed stream: a data payload that is not a JSON object: '<html>'");

  StreamTracker t(0.0);
  t.head(200, "text/event-stream");
  EXPECT_FALSE(t.body(0.1, ev("garbage")));  // reading on is pointless
  EXPECT_TRUE(t.failed());
  // The first problem is the one reported, not the cancelled transfer that follows it.
  EXPECT_EQ(t.finish(0.2, "").error, "malformed stream: a data payload that is not a JSON object: 'garbage'");
}

}  // namespace
}  // namespace kestrel::client
