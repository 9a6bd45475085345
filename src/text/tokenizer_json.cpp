#include "text/tokenizer_json.h"

#include "text/utf8.h"

namespace kestrel::text::tj {

char32_t one_char(const Json& j, const char* key, const std::string& where) {
  const std::string s = str(j, key, where);
  char32_t c = 0;
  const size_t n = s.empty() ? 0 : utf8_decode(s, 0, c);
  if (n == 0 || n != s.size()) fail(sub(where, key), ": must be exactly one character, got \"", s, "\"");
  return c;
}

Regex pattern(const Json& j, const char* key, const std::string& where) {
  const Json& p = field(j, key, where);
  const std::string w = sub(where, key);
  if (p.is_object() && p.size() == 1) {
    if (p.contains("String") && p.at("String").is_string()) return Regex::literal(p.at("String").get<std::string>(), w);
    if (p.contains("Regex") && p.at("Regex").is_string()) return Regex(p.at("Regex").get<std::string>(), w);
  }
  fail(w, ": must be {\"String\": ...} or {\"Regex\": ...}, got ", p.dump().substr(0, 80));
}

}  // namespace kestrel::text::tj
