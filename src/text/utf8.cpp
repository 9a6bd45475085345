#include "text/utf8.h"

#include <unicode/uchar.h>

namespace kestrel::text {
namespace {

// Length of the longest valid prefix of a UTF-8 sequence at s[i] (the "maximal subpart"), and
// whether it is a whole character. Follows the Unicode table of well-formed byte sequences.
struct Scan {
  size_t len;
  bool complete;
};

Scan scan(std::string_view s, size_t i) {
  const auto b = static_cast<unsigned char>(s[i]);
  if (b < 0x80) return {1, true};
  size_t width;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) {
    width = 2;
  } else if (b >= 0xE0 && b <= 0xEF) {
    width = 3;
    if (b == 0xE0) lo = 0xA0;
    if (b == 0xED) hi = 0x9F;
  } else if (b >= 0xF0 && b <= 0xF4) {
    width = 4;
    if (b == 0xF0) lo = 0x90;
    if (b == 0xF4) hi = 0x8F;
  } else {
    return {1, false};
  }
  size_t n = 1;
  for (; n < width; ++n) {
    if (i + n >= s.size()) return {n, false};
    const auto c = static_cast<unsigned char>(s[i + n]);
    const unsigned char l = n == 1 ? lo : 0x80, h = n == 1 ? hi : 0xBF;
    if (c < l || c > h) return {n, false};
  }
  return {width, true};
}

}  // namespace

size_t utf8_decode(std::string_view s, size_t i, char32_t& cp) {
  const Scan sc = scan(s, i);
  if (!sc.complete) return 0;
  const auto b = static_cast<unsigned char>(s[i]);
  if (sc.len == 1) {
    cp = b;
    return 1;
  }
  cp = b & (0xFF >> (sc.len + 1));
  for (size_t k = 1; k < sc.len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  return sc.len;
}

void utf8_append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

size_t utf8_invalid_at(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const Scan sc = scan(s, i);
    if (!sc.complete) return i;
    i += sc.len;
  }
  return s.size();
}

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t i = 0;
  while (i < bytes.size()) {
    const Scan sc = scan(bytes, i);
    if (sc.complete) out.append(bytes.substr(i, sc.len));
    else out += kReplacementChar;
    i += sc.len;
  }
  return out;
}

bool is_whitespace(char32_t c) { return u_isUWhiteSpace(static_cast<UChar32>(c)); }

bool is_numeric(char32_t c) {
  const auto mask = U_GET_GC_MASK(static_cast<UChar32>(c));
  return (mask & (U_GC_ND_MASK | U_GC_NL_MASK | U_GC_NO_MASK)) != 0;
}

bool is_alphanumeric(char32_t c) {
  return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_ALPHABETIC) || is_numeric(c);
}

}  // namespace kestrel::text
