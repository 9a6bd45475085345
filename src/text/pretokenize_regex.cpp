#include "text/pretokenize_regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cctype>

#include "common/error.h"
#include "text/utf8.h"

namespace kestrel::text {

struct Regex::Code {
  pcre2_code* code = nullptr;
  ~Code() { pcre2_code_free(code); }
};

namespace {

struct MatchData {
  pcre2_match_data* md;
  explicit MatchData(const pcre2_code* code) : md(pcre2_match_data_create_from_pattern(code, nullptr)) {}
  ~MatchData() { pcre2_match_data_free(md); }
};

// The White_Space property, which Oniguruma's \s matches. PCRE2's \s also takes U+180E, which
// left White_Space in Unicode 6.3, so \s and \S are spelled out.
constexpr std::string_view kWhiteSpace =
    "\\t\\n\\x{0B}\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}";

std::string with_white_space(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 64);
  bool in_class = false;
  for (size_t i = 0; i < p.size();) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char d = p[i + 1];
      if (d == 's') {
        if (in_class) out += kWhiteSpace;
        else out.append("[").append(kWhiteSpace).append("]");
      } else if (d == 'S' && !in_class) {
        out.append("[^").append(kWhiteSpace).append("]");
      } else if (d == 'Q') {
        const size_t end = p.find("\\E", i + 2);
        const size_t stop = end == std::string_view::npos ? p.size() : end + 2;
        out.append(p.substr(i, stop - i));
        i = stop;
        continue;
      } else {
        out += c;
        out += d;
      }
      i += 2;
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      ++i;
      if (i < p.size() && p[i] == '^') out += p[i++];
      if (i < p.size() && p[i] == ']') out += p[i++];  // a leading ] is literal
      continue;
    }
    if (in_class && c == '[' && i + 1 < p.size() && p[i + 1] == ':') {
      const size_t end = p.find(":]", i + 2);
      const size_t stop = end == std::string_view::npos ? i + 1 : end + 2;
      out.append(p.substr(i, stop - i));
      i = stop;
      continue;
    }
    if (in_class && c == ']') in_class = false;
    out += c;
    ++i;
  }
  return out;
}

}  // namespace

Regex::Regex(std::string_view pattern_in, const std::string& where) : code_(std::make_unique<Code>()), where_(where) {
  int err = 0;
  PCRE2_SIZE offset = 0;
  const std::string pattern = with_white_space(pattern_in);
  code_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP, &err,
                              &offset, nullptr);
  if (!code_->code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    fail(where, ": bad regex at offset ", offset, ": ", reinterpret_cast<const char*>(msg));
  }
  // Without JIT support PCRE2 falls back to its interpreter, so a failure here only costs speed.
  pcre2_jit_compile(code_->code, PCRE2_JIT_COMPLETE);
}

Regex Regex::literal(std::string_view literal, const std::string& where) {
  std::string p;
  for (char c : literal) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x80 && !std::isalnum(u)) p += '\\';
    p += c;
  }
  return Regex(p, where);
}

Regex::Regex(Regex&&) noexcept = default;
Regex& Regex::operator=(Regex&&) noexcept = default;
Regex::~Regex() = default;

std::vector<std::pair<size_t, size_t>> Regex::find_all(std::string_view s) const {
  std::vector<std::pair<size_t, size_t>> out;
  MatchData md(code_->code);
  if (!md.md) fail(where_, ": out of memory for regex match data");
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  size_t pos = 0;
  bool have_last = false;
  size_t last_end = 0;
  while (pos <= s.size()) {
    int rc = pcre2_match(code_->code, subject, s.size(), pos, PCRE2_NO_UTF_CHECK, md.md, nullptr);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
      rc = pcre2_match(code_->code, subject, s.size(), pos, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md.md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      fail(where_, ": regex match failed: ", reinterpret_cast<const char*>(msg));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.md);
    const size_t b = ov[0], e = ov[1];
    if (e < b || e > s.size()) fail(where_, ": regex reported a match that ends before it starts");
    if (b == e && have_last && last_end == e) {
      // Step over one character and search again.
      pos += pos < s.size() ? utf8_len(static_cast<unsigned char>(s[pos])) : 1;
      continue;
    }
    out.emplace_back(b, e);
    pos = e;
    have_last = true;
    last_end = e;
  }
  return out;
}

}  // namespace kestrel::text
