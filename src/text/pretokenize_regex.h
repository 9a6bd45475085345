// The regular expressions of tokenizer.json (Oniguruma syntax in the reference library), run
// with PCRE2 in UTF + UCP mode, which agrees on the constructs the model families use:
// \p{L}, \p{N}, \s, (?i:...), look-ahead and possessive quantifiers. Characters assigned after
// the Unicode version of the system's PCRE2 (e.g. U+1C89, new in Unicode 16) are unassigned here
// and may be split differently.
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kestrel::text {

class Regex {
 public:
  // Throws kestrel::Error naming `where` if the pattern does not compile.
  Regex(std::string_view pattern, const std::string& where);
  // A pattern matching `literal` exactly.
  static Regex literal(std::string_view literal, const std::string& where);
  Regex(Regex&&) noexcept;
  Regex& operator=(Regex&&) noexcept;
  ~Regex();

  // Non-overlapping matches from left to right as [begin, end) byte ranges. An empty match right
  // after the previous match is skipped, as Rust's find_iter does. `s` must be valid UTF-8.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view s) const;

 private:
  struct Code;
  std::unique_ptr<Code> code_;
  std::string where_;
};

}  // namespace kestrel::text
