#include "text/jinja_lexer.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>

#include "common/error.h"

namespace kestrel::jinja {
namespace {

bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_name_start(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || static_cast<unsigned char>(c) >= 0x80;
}
bool is_name_char(char c) { return is_name_start(c) || is_digit(c); }

// Python's str.rstrip() with no argument.
std::string rstrip_py(std::string_view s) {
  std::u32string u = utf8_decode(s);
  while (!u.empty() && py_isspace(u.back())) u.pop_back();
  return utf8_encode(u);
}

bool all_whitespace(std::string_view s) {
  if (s.empty()) return false;
  for (char32_t c : utf8_decode(s))
    if (!py_isspace(c)) return false;
  return true;
}

class Lexer {
 public:
  Lexer(std::string_view source, const std::string& name, const LexOptions& opt) : name_(name), opt_(opt) {
    // Newlines are normalized to \n and one final newline is dropped (keep_trailing_newline=False).
    src_.reserve(source.size());
    for (size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r') {
        src_ += '\n';
        if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
      } else {
        src_ += source[i];
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
    line_starts_.push_back(0);
    for (size_t i = 0; i < src_.size(); ++i)
      if (src_[i] == '\n') line_starts_.push_back(i + 1);
  }

  std::vector<Token> run() {
    const size_t n = src_.size();
    while (pos_ < n) {
      size_t p = pos_;
      while (p + 1 < n && !(src_[p] == '{' && (src_[p + 1] == '{' || src_[p + 1] == '%' || src_[p + 1] == '#'))) ++p;
      if (p + 1 >= n) {
        emit_data(src_.substr(pos_), pos_);
        pos_ = n;
        break;
      }
      const char type = src_[p + 1];
      size_t after = p + 2;
      char sign = 0;
      if (after < n && (src_[after] == '-' || src_[after] == '+')) sign = src_[after++];
      size_t raw_body = 0;
      const bool raw = type == '%' && match_raw_begin(after, raw_body);
      std::string text = src_.substr(pos_, p - pos_);
      apply_left_strip(text, sign, type != '{');
      emit_data(std::move(text), pos_);
      line_starting_ = false;
      if (raw) {
        lex_raw(raw_body);
      } else if (type == '#') {
        lex_comment(p, after);
      } else {
        push(type == '{' ? TokKind::VarBegin : TokKind::BlockBegin, type == '{' ? "{{" : "{%", p);
        pos_ = after;
        lex_tag(type == '{', p);
      }
    }
    push(TokKind::Eof, "", src_.size());
    return std::move(toks_);
  }

 private:
  Loc loc_of(size_t off) const {
    auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), off);
    size_t line = size_t(it - line_starts_.begin());
    return {int(line), int(off - line_starts_[line - 1]) + 1};
  }

  [[noreturn]] void error(size_t off, const std::string& msg) const {
    Loc l = loc_of(off);
    fail(name_, ":", l.line, ":", l.col, ": ", msg);
  }

  void push(TokKind k, std::string text, size_t off) {
    Token t;
    t.kind = k;
    t.text = std::move(text);
    t.loc = loc_of(off);
    toks_.push_back(std::move(t));
  }

  void emit_data(std::string text, size_t off) {
    if (!text.empty()) push(TokKind::Data, std::move(text), off);
  }

  // The text before a tag loses its trailing whitespace for `-`, and (lstrip_blocks, for block
  // and comment tags without `+`) the spaces between the line start and the tag.
  void apply_left_strip(std::string& text, char sign, bool block_or_comment) const {
    if (sign == '-') {
      text = rstrip_py(text);
    } else if (sign != '+' && opt_.lstrip_blocks && block_or_comment) {
      size_t nl = text.rfind('\n');
      size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
      if ((l_pos > 0 || line_starting_) && all_whitespace(std::string_view(text).substr(l_pos))) text.resize(l_pos);
    }
  }

  size_t skip_ws(size_t i) const {
    while (i < src_.size() && is_ws(src_[i])) ++i;
    return i;
  }

  bool starts(size_t i, std::string_view s) const { return src_.compare(i, s.size(), s) == 0; }

  // `{% raw %}` (also `-%}`): sets body to the offset after the opening tag.
  bool match_raw_begin(size_t after, size_t& body) const {
    size_t i = skip_ws(after);
    if (!starts(i, "raw")) return false;
    i = skip_ws(i + 3);
    if (starts(i, "-%}")) {
      body = skip_ws(i + 3);
      return true;
    }
    if (starts(i, "%}")) {
      body = i + 2;
      return true;
    }
    return false;
  }

  // Consumes a block end (`%}`, `-%}` or `+%}`) at i; returns the offset after it.
  size_t block_end_after(size_t i) {
    if (src_[i] == '+') {
      line_starting_ = false;
      return i + 3;
    }
    if (src_[i] == '-') {
      size_t j = skip_ws(i + 3);
      line_starting_ = j > i + 3 && src_[j - 1] == '\n';
      return j;
    }
    i += 2;
    if (opt_.trim_blocks && i < src_.size() && src_[i] == '\n') {
      line_starting_ = true;
      return i + 1;
    }
    line_starting_ = false;
    return i;
  }

  void lex_raw(size_t body) {
    const size_t n = src_.size();
    for (size_t i = body; i + 1 < n; ++i) {
      if (!(src_[i] == '{' && src_[i + 1] == '%')) continue;
      size_t j = i + 2;
      char sign = 0;
      if (j < n && (src_[j] == '-' || src_[j] == '+')) sign = src_[j++];
      j = skip_ws(j);
      if (!starts(j, "endraw")) continue;
      j = skip_ws(j + 6);
      if (!(starts(j, "%}") || starts(j, "-%}") || starts(j, "+%}"))) continue;
      std::string text = src_.substr(body, i - body);
      apply_left_strip(text, sign, true);
      emit_data(std::move(text), body);
      pos_ = block_end_after(j);
      return;
    }
    error(body, "Missing end of raw directive");
  }

  void lex_comment(size_t open, size_t after) {
    const size_t n = src_.size();
    for (size_t i = after; i < n; ++i) {
      if ((src_[i] == '+' || src_[i] == '-') && starts(i + 1, "#}")) {
        pos_ = block_end_after(i);
        return;
      }
      if (starts(i, "#}")) {
        pos_ = block_end_after(i);
        return;
      }
    }
    error(open, "Missing end of comment tag");
  }

  void lex_tag(bool variable, size_t open) {
    std::vector<char> stack;  // closing brackets expected
    const size_t n = src_.size();
    for (;;) {
      pos_ = skip_ws(pos_);
      if (pos_ >= n)
        error(open, variable ? "unexpected end of template inside '{{ ... }}': missing '}}'"
                             : "unexpected end of template inside '{% ... %}': missing '%}'");
      const size_t i = pos_;
      if (stack.empty()) {
        if (variable) {
          if (starts(i, "-}}")) {
            push(TokKind::VarEnd, "}}", i);
            size_t j = skip_ws(i + 3);
            line_starting_ = j > i + 3 && src_[j - 1] == '\n';
            pos_ = j;
            return;
          }
          if (starts(i, "}}")) {
            push(TokKind::VarEnd, "}}", i);
            line_starting_ = false;
            pos_ = i + 2;
            return;
          }
        } else if (starts(i, "%}") || starts(i, "-%}") || starts(i, "+%}")) {
          push(TokKind::BlockEnd, "%}", i);
          pos_ = block_end_after(i);
          return;
        }
      }
      const char c = src_[i];
      if (is_digit(c)) {
        lex_number();
      } else if (is_name_start(c)) {
        size_t j = i;
        while (j < n && is_name_char(src_[j])) ++j;
        push(TokKind::Name, src_.substr(i, j - i), i);
        pos_ = j;
      } else if (c == '\'' || c == '"') {
        lex_string();
      } else {
        static const char* two[] = {"//", "**", "==", "!=", ">=", "<="};
        std::string op;
        for (const char* t : two)
          if (starts(i, t)) op = t;
        if (op.empty()) {
          if (std::string_view("+-/*%~[](){}><=.:|,;").find(c) == std::string_view::npos)
            error(i, cat("unexpected char '", std::string(1, c), "'"));
          op = std::string(1, c);
        }
        if (op == "(" || op == "[" || op == "{") {
          stack.push_back(op == "(" ? ')' : op == "[" ? ']' : '}');
        } else if (op == ")" || op == "]" || op == "}") {
          if (stack.empty()) error(i, cat("unexpected '", op, "'"));
          if (stack.back() != op[0]) error(i, cat("unexpected '", op, "', expected '", std::string(1, stack.back()), "'"));
          stack.pop_back();
        }
        push(TokKind::Op, op, i);
        pos_ = i + op.size();
      }
    }
  }

  // Digits with optional '_' separators, starting at i; returns the end.
  size_t digits(size_t i, bool hex = false) const {
    const size_t n = src_.size();
    auto ok = [&](char c) { return is_digit(c) || (hex && ((c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'))); };
    if (i >= n || !ok(src_[i])) return i;
    size_t j = i + 1;
    while (j < n) {
      if (ok(src_[j])) ++j;
      else if (src_[j] == '_' && j + 1 < n && ok(src_[j + 1])) j += 2;
      else break;
    }
    return j;
  }

  void lex_number() {
    const size_t i = pos_, n = src_.size();
    auto strip_us = [](std::string s) {
      s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
      return s;
    };
    // Float: digits, then a fraction and/or an exponent (jinja2's float_re).
    size_t j = digits(i);
    size_t k = j;
    bool is_float = false;
    if (k < n && src_[k] == '.' && k + 1 < n && is_digit(src_[k + 1])) {
      k = digits(k + 1);
      is_float = true;
    }
    if (k < n && (src_[k] == 'e' || src_[k] == 'E')) {
      size_t e = k + 1;
      if (e < n && (src_[e] == '+' || src_[e] == '-')) ++e;
      size_t ee = digits(e);
      if (ee > e) {
        k = ee;
        is_float = true;
      }
    }
    if (is_float) {
      Token t;
      t.kind = TokKind::Float;
      t.text = src_.substr(i, k - i);
      t.fval = std::strtod(strip_us(t.text).c_str(), nullptr);
      t.loc = loc_of(i);
      toks_.push_back(std::move(t));
      pos_ = k;
      return;
    }
    // Integer: 0b / 0o / 0x prefixes, decimal without leading zeros, or zeros.
    int base = 10;
    size_t start = i, end;
    if (src_[i] == '0' && i + 1 < n && std::string_view("bBoOxX").find(src_[i + 1]) != std::string_view::npos) {
      char p = char(src_[i + 1] | 0x20);
      base = p == 'b' ? 2 : p == 'o' ? 8 : 16;
      start = i + 2;
      if (start < n && src_[start] == '_') ++start;
      end = digits(start, base == 16);
      if (end == start) error(i, "invalid integer literal");
      for (size_t q = start; q < end; ++q)
        if (src_[q] != '_' && ((base == 2 && src_[q] > '1') || (base == 8 && src_[q] > '7')))
          error(i, "invalid integer literal");
    } else if (src_[i] == '0') {
      end = i + 1;
      while (end < n && (src_[end] == '0' || (src_[end] == '_' && end + 1 < n && src_[end + 1] == '0'))) ++end;
    } else {
      end = j;
    }
    std::string digits_only = strip_us(src_.substr(start, end - start));
    errno = 0;
    char* stop = nullptr;
    long long v = std::strtoll(digits_only.c_str(), &stop, base);
    if (errno == ERANGE) error(i, "integer literal too large");
    Token t;
    t.kind = TokKind::Int;
    t.text = src_.substr(i, end - i);
    t.ival = v;
    t.loc = loc_of(i);
    toks_.push_back(std::move(t));
    pos_ = end;
  }

  static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  }

  // A quoted literal, unescaped as Python's unicode-escape codec does.
  void lex_string() {
    const size_t i = pos_, n = src_.size();
    const char q = src_[i];
    size_t j = i + 1;
    while (j < n && src_[j] != q) j += src_[j] == '\\' ? 2 : 1;
    if (j >= n) error(i, cat("unexpected char '", std::string(1, q), "' (unterminated string)"));
    std::string out;
    for (size_t k = i + 1; k < j; ++k) {
      char c = src_[k];
      if (c != '\\') {
        out += c;
        continue;
      }
      char e = src_[++k];
      switch (e) {
        case '\n': break;
        case '\\': out += '\\'; break;
        case '\'': out += '\''; break;
        case '"': out += '"'; break;
        case 'a': out += '\a'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'v': out += '\v'; break;
        case 'x':
        case 'u':
        case 'U': {
          int len = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          char32_t cp = 0;
          for (int d = 0; d < len; ++d) {
            int h = k + 1 + d < j ? hexval(src_[k + 1 + d]) : -1;
            if (h < 0) error(i, cat("truncated \\", std::string(1, e), " escape in string literal"));
            cp = cp * 16 + char32_t(h);
          }
          k += size_t(len);
          if (cp > 0x10ffff) error(i, "illegal Unicode character in string literal");
          if (cp >= 0xd800 && cp <= 0xdfff) cp = 0xfffd;
          utf8_append(out, cp);
          break;
        }
        default:
          if (e >= '0' && e <= '7') {
            char32_t cp = char32_t(e - '0');
            for (int d = 0; d < 2 && k + 1 < j && src_[k + 1] >= '0' && src_[k + 1] <= '7'; ++d)
              cp = cp * 8 + char32_t(src_[++k] - '0');
            utf8_append(out, cp);
          } else if (e == 'N') {
            error(i, "\\N{...} escapes are not supported in string literals");
          } else {
            out += '\\';
            out += e;
          }
      }
    }
    push(TokKind::String, std::move(out), i);
    pos_ = j + 1;
  }

  const std::string& name_;
  LexOptions opt_;
  std::string src_;
  std::vector<size_t> line_starts_;
  std::vector<Token> toks_;
  size_t pos_ = 0;
  bool line_starting_ = true;
};

}  // namespace

std::vector<Token> tokenize(std::string_view source, const std::string& name, const LexOptions& opt) {
  return Lexer(source, name, opt).run();
}

}  // namespace kestrel::jinja
