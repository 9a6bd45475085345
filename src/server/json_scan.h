// Where a scan of JSON text is outside its strings, for the checks that run on raw text before
// (or instead of) parsing it: a request's nesting depth, the separators between tool calls.
#pragma once

namespace kestrel::server {

class JsonStringScan {
 public:
  // Feeds the next character; true when it is outside every string (quotes count as inside).
  bool outside(char c) {
    if (in_string_) {
      if (escaped_) escaped_ = false;
      else if (c == '\\') escaped_ = true;
      else if (c == '"') in_string_ = false;
      return false;
    }
    if (c == '"') {
      in_string_ = true;
      return false;
    }
    return true;
  }

 private:
  bool in_string_ = false, escaped_ = false;
};

}  // namespace kestrel::server
