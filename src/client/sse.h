// An incremental parser of server-sent events (the WHATWG "text/event-stream" format) for
// clients that read a stream as its bytes arrive. Pure: bytes in, events out, no I/O, so that it
// is unit-tested at every split point and fuzzed on its own.
//
// Lines end in CRLF, LF or CR (a CR at the end of one read and an LF at the start of the next are
// one line end). "field: value" lines build an event ("data" lines are joined with "\n", "event"
// and "id" keep their last value, a single space after the colon is dropped, other fields are
// ignored); a line starting with ':' is a comment (keep-alives); a blank line ends the event,
// which is delivered when it holds data. A stream that ends inside an event drops that event.
#pragma once
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace kestrel::client {

struct SseEvent {
  std::string event;  // the "event" field ("" means the default, "message")
  std::string data;   // the "data" lines joined with "\n"
  std::string id;     // the last "id" field seen on the stream
  bool operator==(const SseEvent&) const = default;
};

class SseParser {
 public:
  // max_event_bytes bounds what one line or one event may buffer; beyond it feed() throws
  // kestrel::Error (a stream that never ends a line or an event).
  explicit SseParser(size_t max_event_bytes = size_t(16) << 20) : max_bytes_(max_event_bytes) {}

  // Parses the next bytes of the stream and appends the events they complete to `out`.
  void feed(std::string_view bytes, std::vector<SseEvent>& out);
  std::vector<SseEvent> feed(std::string_view bytes) {
    std::vector<SseEvent> out;
    feed(bytes, out);
    return out;
  }

  // True when bytes of an unfinished line or event are buffered (the stream stopped mid-event).
  bool partial() const { return !line_.empty() || has_data_; }
  size_t comments() const { return comments_; }  // comment lines seen so far

 private:
  void line(std::vector<SseEvent>& out);

  size_t max_bytes_;
  std::string line_;           // the current line, without its end
  bool after_cr_ = false;      // the last byte was a CR: an LF right after it ends nothing
  bool first_line_ = true;     // the stream's first line, which may start with a UTF-8 byte order mark
  bool has_data_ = false;      // the current event has a data field
  SseEvent cur_;
  std::string last_id_;
  size_t comments_ = 0;
};

}  // namespace kestrel::client
