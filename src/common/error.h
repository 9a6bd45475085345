// Errors that reach the user: one line naming the file, tensor or field and what is wrong.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace kestrel {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream s;
  (s << ... << args);
  return s.str();
}

template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  throw Error(cat(args...));
}

}  // namespace kestrel
