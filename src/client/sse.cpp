#include "client/sse.h"

#include "common/error.h"

namespace kestrel::client {

void SseParser::feed(std::string_view bytes, std::vector<SseEvent>& out) {
  size_t i = 0;
  while (i < bytes.size()) {
    if (after_cr_) {
      after_cr_ = false;
      if (bytes[i] == '\n') {  // the LF of a CRLF split across reads, or right after its CR
        ++i;
        continue;
      }
    }
    const size_t end = bytes.find_first_of("\r\n", i);
    const size_t n = (end == std::string_view::npos ? bytes.size() : end) - i;
    if (line_.size() + n + cur_.data.size() > max_bytes_)
      fail("server-sent events: a line or event longer than ", max_bytes_, " bytes");
    line_.append(bytes.substr(i, n));
    if (end == std::string_view::npos) break;
    after_cr_ = bytes[end] == '\r';
    i = end + 1;
    line(out);
  }
}

void SseParser::line(std::vector<SseEvent>& out) {
  std::string_view l = line_;
  if (first_line_) {
    first_line_ = false;
    if (l.substr(0, 3) == "\xEF\xBB\xBF") l.remove_prefix(3);
  }
  if (l.empty()) {  // a blank line ends the event
    if (has_data_) {
      cur_.data.pop_back();  // the "\n" after the last data line
      cur_.id = last_id_;
      out.push_back(std::move(cur_));
    }
    cur_ = SseEvent{};
    has_data_ = false;
  } else if (l[0] == ':') {
    ++comments_;
  } else {
    const size_t colon = l.find(':');
    const std::string_view field = l.substr(0, colon);
    std::string_view value = colon == std::string_view::npos ? std::string_view() : l.substr(colon + 1);
    if (!value.empty() && value[0] == ' ') value.remove_prefix(1);
    if (field == "data") {
      cur_.data.append(value);
      cur_.data.push_back('\n');
      has_data_ = true;
    } else if (field == "event") {
      cur_.event = std::string(value);
    } else if (field == "id") {
      if (value.find('\0') == std::string_view::npos) last_id_ = std::string(value);
    }  // "retry" and unknown fields: nothing for a client that does not reconnect
  }
  line_.clear();
}

}  // namespace kestrel::client
