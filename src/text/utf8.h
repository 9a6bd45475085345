// UTF-8 decoding and the few Unicode character properties the tokenizer needs, with the
// semantics of Rust's `char` methods (which the Hugging Face tokenizers library uses).
#pragma once
#include <cstddef>
#include <string>
#include <string_view>

namespace kestrel::text {

// Decodes the code point at s[i]. Returns its length in bytes, or 0 if the bytes there are not
// valid UTF-8 (then cp is unspecified).
size_t utf8_decode(std::string_view s, size_t i, char32_t& cp);

void utf8_append(std::string& out, char32_t cp);

// Offset of the first byte that is not part of valid UTF-8, or s.size() if s is valid.
size_t utf8_invalid_at(std::string_view s);
inline bool utf8_valid(std::string_view s) { return utf8_invalid_at(s) == s.size(); }

// Length of the character that starts at s[i], for valid UTF-8.
inline size_t utf8_len(unsigned char lead) { return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4; }

// Bytes to text, each maximal invalid subsequence replaced by U+FFFD (Rust's from_utf8_lossy).
std::string utf8_lossy(std::string_view bytes);

inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";

bool is_whitespace(char32_t c);    // White_Space property
bool is_numeric(char32_t c);       // general category Nd, Nl or No
bool is_alphanumeric(char32_t c);  // Alphabetic property or numeric

}  // namespace kestrel::text
