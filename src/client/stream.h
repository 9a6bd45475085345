// One streamed OpenAI completion as a client sees it: the "data:" payloads of its server-sent
// events read as chunks, and the measurements of the request made from the times its bytes
// arrived. Pure (times are given, not read from a clock), so it is unit-tested and fuzzed.
//
// Rules:
// - A chunk "carries text" when choices[].text (completions) or choices[].delta.content (or
//   delta.reasoning_content / delta.reasoning, for servers that stream reasoning apart) is not
//   empty; chunks without text (the chat role chunk, the finish_reason chunk, the usage chunk)
//   take no part in the timings.
// - Time to first token: request start to the first chunk carrying text.
// - Completion tokens: the last usage.completion_tokens the server sent, else the number of
//   chunks carrying text.
// - Tokens per text chunk c = completion tokens / text chunks (1 without usage). An inter-token
//   latency sample is the gap between two consecutive text chunks divided by max(1, round(c)), so
//   a server that sends k tokens per chunk gives per-token figures, one sample per gap.
// - Decode rate (tokens/s of the stream): the c x (text chunks - 1) tokens that came after the
//   first text chunk over the time from the first text chunk to the last; needs two text chunks.
// - A request is ok when the status is 2xx, the stream ends with "data: [DONE]", and no error
//   event, malformed payload, transport failure or timeout came first.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "client/sse.h"

namespace kestrel::client {

// What one "data:" payload says.
struct StreamChunk {
  enum class Kind { Chunk, Done, Error, Malformed };
  Kind kind = Kind::Chunk;
  std::string text;                                    // all choices' text or delta content
  std::string finish_reason;                           // "" while the choice goes on
  int64_t prompt_tokens = -1, completion_tokens = -1;  // usage; -1 when absent
  std::string message;                                 // Error: the server's message; Malformed: what is wrong
};

// Reads one event's data: "[DONE]", an {"error": ...} object, a chunk object, or something else
// (Malformed). `event` is the SSE event type; "error" makes the payload an error whatever it holds.
StreamChunk parse_chunk(std::string_view data, std::string_view event = "");

// What was measured of one request. Times in seconds.
struct RequestRecord {
  int index = 0;         // the request's number in the run
  int stream = 0;        // the client thread that sent it
  double start_s = 0;    // since the run began
  bool ok = false;
  std::string error;     // why it failed ("" when ok)
  int http_status = 0;   // 0: no response
  double ttft_s = -1;    // -1: no chunk carried text
  double e2e_s = 0;      // start to the end of the stream (or the failure)
  std::vector<double> itl_s;
  int64_t text_chunks = 0;
  int64_t completion_tokens = 0;
  bool usage = false;           // completion_tokens came from the server's usage
  int64_t prompt_tokens = -1;   // from usage; -1 when the server did not say
  double decode_tokens_per_s = -1;  // -1: fewer than two text chunks
  std::string finish_reason;
};

// Follows one request: the response head, then body bytes with their arrival times, then the end.
class StreamTracker {
 public:
  explicit StreamTracker(double start) : start_(start) {}

  // The status line and Content-Type of the response.
  void head(int status, std::string content_type);
  // Body bytes that arrived at time t. Returns false when reading on is pointless (an error
  // event or a malformed payload arrived; the record already says so).
  bool body(double t, std::string_view bytes);
  // The end at time t; `transport_error` says why the transfer stopped early ("" when it
  // completed). The first problem found is the one reported.
  RequestRecord finish(double t, const std::string& transport_error);

  int64_t text_chunks() const { return int64_t(text_times_.size()); }
  bool failed() const { return !error_.empty(); }

 private:
  void event(double t, const SseEvent& e);

  double start_;
  int status_ = 0;
  std::string content_type_, error_body_, error_;
  SseParser parser_;
  std::vector<SseEvent> events_;
  std::vector<double> text_times_;
  bool done_ = false, any_bytes_ = false;
  int64_t events_seen_ = 0, usage_completion_ = -1, usage_prompt_ = -1;
  std::string finish_reason_;
};

}  // namespace kestrel::client
