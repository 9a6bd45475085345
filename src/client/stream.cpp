#include "client/stream.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "common/error.h"

namespace kestrel::client {
namespace {

using json = nlohmann::json;

// At most n bytes of s on one line, without the whitespace around it.
std::string clip(std::string_view s, size_t n = 200) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string_view::npos) return "";
  s = s.substr(b, s.find_last_not_of(" \t\r\n") + 1 - b);
  std::string out(s.substr(0, n));
  for (char& ch : out)
    if (ch == '\n' || ch == '\r' || ch == '\t') ch = ' ';
  if (s.size() > n) out += "...";
  return out;
}

// The message of an error payload: {"error": {"message": ...}}, {"error": "..."}, {"message": ...}
// or {"detail": ...} (FastAPI); else the payload itself, shortened.
std::string error_message(const json& j, std::string_view raw) {
  const json* e = &j;
  if (j.is_object() && j.contains("error")) e = &j["error"];
  if (e->is_string()) return e->get<std::string>();
  if (e->is_object()) {
    for (const char* key : {"message", "detail"}) {
      auto it = e->find(key);
      if (it != e->end()) return it->is_string() ? it->get<std::string>() : clip(it->dump(-1, ' ', false, json::error_handler_t::replace));
    }
  }
  return clip(raw);
}

int64_t count_field(const json& usage, const char* key) {
  auto it = usage.find(key);
  if (it == usage.end() || !it->is_number_integer()) return -1;
  const int64_t v = it->get<int64_t>();
  return v >= 0 ? v : -1;
}

void append_string(std::string& out, const json& obj, const char* key) {
  auto it = obj.find(key);
  if (it != obj.end() && it->is_string()) out += it->get_ref<const std::string&>();
}

}  // namespace

StreamChunk parse_chunk(std::string_view data, std::string_view event) {
  StreamChunk c;
  if (data == "[DONE]") {
    c.kind = StreamChunk::Kind::Done;
    return c;
  }
  const json j = json::parse(data, nullptr, false);
  if (event == "error") {
    c.kind = StreamChunk::Kind::Error;
    c.message = j.is_discarded() ? clip(data) : error_message(j, data);
    return c;
  }
  if (j.is_discarded() || !j.is_object()) {
    c.kind = StreamChunk::Kind::Malformed;
    c.message = cat("a data payload that is not a JSON object: '", clip(data, 100), "'");
    return c;
  }
  if (auto e = j.find("error"); e != j.end() && !e->is_null()) {
    c.kind = StreamChunk::Kind::Error;
    c.message = error_message(j, data);
    return c;
  }
  if (auto it = j.find("choices"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) {
      c.kind = StreamChunk::Kind::Malformed;
      c.message = "'choices' is not an array";
      return c;
    }
    for (const json& choice : *it) {
      if (!choice.is_object()) continue;
      append_string(c.text, choice, "text");
      if (auto d = choice.find("delta"); d != choice.end() && d->is_object())
        for (const char* key : {"content", "reasoning_content", "reasoning"}) append_string(c.text, *d, key);
      if (auto f = choice.find("finish_reason"); f != choice.end() && f->is_string()) c.finish_reason = f->get<std::string>();
    }
  }
  if (auto u = j.find("usage"); u != j.end() && u->is_object()) {
    c.prompt_tokens = count_field(*u, "prompt_tokens");
    c.completion_tokens = count_field(*u, "completion_tokens");
  }
  return c;
}

void StreamTracker::head(int status, std::string content_type) {
  status_ = status;
  content_type_ = std::move(content_type);
}

bool StreamTracker::body(double t, std::string_view bytes) {
  any_bytes_ = any_bytes_ || !bytes.empty();
  if (status_ < 200 || status_ >= 300) {
    if (error_body_.size() < 65536) error_body_.append(bytes.substr(0, 65536 - error_body_.size()));
    return true;
  }
  if (!error_.empty()) return false;
  try {
    parser_.feed(bytes, events_);
  } catch (const Error& e) {
    error_ = cat("malformed stream: ", e.what());
  }
  for (const SseEvent& e : events_) event(t, e);
  events_.clear();
  return error_.empty();
}

void StreamTracker::event(double t, const SseEvent& e) {
  ++events_seen_;
  if (done_ || !error_.empty()) return;
  const StreamChunk c = parse_chunk(e.data, e.event);
  switch (c.kind) {
    case StreamChunk::Kind::Done: done_ = true; return;
    case StreamChunk::Kind::Error: error_ = "error in the stream: " + c.message; return;
    case StreamChunk::Kind::Malformed: error_ = "malformed stream: " + c.message; return;
    case StreamChunk::Kind::Chunk: break;
  }
  if (!c.text.empty()) text_times_.push_back(t);
  if (c.completion_tokens >= 0) usage_completion_ = c.completion_tokens;
  if (c.prompt_tokens >= 0) usage_prompt_ = c.prompt_tokens;
  if (!c.finish_reason.empty()) finish_reason_ = c.finish_reason;
}

RequestRecord StreamTracker::finish(double t, const std::string& transport_error) {
  RequestRecord r;
  r.http_status = status_;
  r.e2e_s = t - start_;
  r.finish_reason = finish_reason_;
  r.prompt_tokens = usage_prompt_;
  const int64_t chunks = int64_t(text_times_.size());
  r.text_chunks = chunks;
  r.usage = usage_completion_ >= 0;
  r.completion_tokens = r.usage ? usage_completion_ : chunks;
  if (chunks > 0) {
    r.ttft_s = text_times_[0] - start_;
    const double per_chunk = r.usage ? double(r.completion_tokens) / double(chunks) : 1.0;
    const double k = std::max(1.0, std::round(per_chunk));
    for (int64_t i = 1; i < chunks; ++i) r.itl_s.push_back((text_times_[size_t(i)] - text_times_[size_t(i - 1)]) / k);
    const double decode_s = text_times_.back() - text_times_.front();
    if (chunks >= 2 && decode_s > 0) r.decode_tokens_per_s = per_chunk * double(chunks - 1) / decode_s;
  }

  if (status_ == 0) {
    r.error = transport_error.empty() ? "no response" : transport_error;
  } else if (status_ < 200 || status_ >= 300) {
    const json j = json::parse(error_body_, nullptr, false);
    std::string msg = !j.is_discarded() ? error_message(j, error_body_) : clip(error_body_);
    r.error = cat("HTTP ", status_, msg.empty() ? "" : ": ", msg);
  } else if (!error_.empty()) {
    r.error = error_;
  } else if (!transport_error.empty()) {
    r.error = cat(transport_error, " (after ", chunks, " text chunks)");
  } else if (!done_) {
    if (events_seen_ == 0)
      r.error = any_bytes_ ? cat("no server-sent events in the response (Content-Type: ",
                                 content_type_.empty() ? "none" : content_type_, ")")
                           : "an empty response";
    else
      r.error = cat("the stream ended before 'data: [DONE]'", parser_.partial() ? " in the middle of an event" : "",
                    " (after ", chunks, " text chunks)");
  }
  r.ok = r.error.empty();
  return r;
}

}  // namespace kestrel::client
