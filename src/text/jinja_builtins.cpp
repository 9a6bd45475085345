#include "text/jinja_builtins.h"

#include <algorithm>
#include <cfenv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <initializer_list>

#include "text/jinja_interp.h"

namespace kestrel::jinja {
namespace {

// ---- argument helpers -------------------------------------------------------------------

// Positional argument i, else keyword `name`, else null.
const Value* arg(const Args& a, size_t i, const char* name) {
  if (i < a.pos.size()) return &a.pos[i];
  return name ? a.kwarg(name) : nullptr;
}

void check_args(Interpreter& in, const Args& a, const std::string& what, size_t max_pos,
                std::initializer_list<const char*> names) {
  if (a.pos.size() > max_pos) in.fail(cat(what, " takes at most ", max_pos, " positional argument(s), got ", a.pos.size()));
  for (const auto& [k, v] : a.kw) {
    bool known = false;
    size_t idx = 0;
    for (const char* n : names) {
      if (k == n) {
        known = true;
        if (idx < a.pos.size()) in.fail(cat(what, " got multiple values for argument '", k, "'"));
      }
      ++idx;
    }
    if (!known) in.fail(cat(what, " got an unexpected keyword argument '", k, "'"));
  }
}

const std::string& need_str(Interpreter& in, const Value& v, const std::string& what) {
  if (!v.is_string()) in.fail(cat(what, " must be a string, not ", v.type_name()));
  return v.str();
}

int64_t need_int(Interpreter& in, const Value& v, const std::string& what) {
  if (!v.is_int() && !v.is_bool()) in.fail(cat(what, " must be an integer, not ", v.type_name()));
  return v.as_int();
}

// ---- Python string operations --------------------------------------------------------------

bool in_set(char32_t c, const std::u32string* chars) {
  if (!chars) return py_isspace(c);
  return chars->find(c) != std::u32string::npos;
}

std::string py_strip(const std::string& s, const Value* chars, bool left, bool right) {
  std::u32string set;
  const std::u32string* cs = nullptr;
  if (chars && !chars->is_none()) {
    set = utf8_decode(chars->str());
    cs = &set;
  }
  if (is_ascii(s) && (!cs || is_ascii(chars->str()))) {
    size_t a = 0, b = s.size();
    if (left)
      while (a < b && in_set(char32_t(static_cast<unsigned char>(s[a])), cs)) ++a;
    if (right)
      while (b > a && in_set(char32_t(static_cast<unsigned char>(s[b - 1])), cs)) --b;
    return s.substr(a, b - a);
  }
  std::u32string u = utf8_decode(s);
  size_t a = 0, b = u.size();
  if (left)
    while (a < b && in_set(u[a], cs)) ++a;
  if (right)
    while (b > a && in_set(u[b - 1], cs)) --b;
  return utf8_encode(u.substr(a, b - a));
}

List py_split(Interpreter& in, const std::string& s, const Value* sep, int64_t maxsplit, bool from_right) {
  List out;
  if (!sep || sep->is_none()) {
    std::u32string u = utf8_decode(s);
    std::vector<std::pair<size_t, size_t>> words;
    size_t i = 0;
    while (i < u.size()) {
      while (i < u.size() && py_isspace(u[i])) ++i;
      if (i >= u.size()) break;
      size_t j = i;
      while (j < u.size() && !py_isspace(u[j])) ++j;
      words.emplace_back(i, j);
      i = j;
    }
    if (maxsplit < 0 || size_t(maxsplit) >= words.size()) {
      for (auto [a, b] : words) out.emplace_back(utf8_encode(u.substr(a, b - a)));
      return out;
    }
    if (!from_right) {
      for (int64_t k = 0; k < maxsplit; ++k) out.emplace_back(utf8_encode(u.substr(words[size_t(k)].first, words[size_t(k)].second - words[size_t(k)].first)));
      size_t rest = words[size_t(maxsplit)].first;
      out.emplace_back(utf8_encode(u.substr(rest)));
    } else {
      size_t nw = words.size();
      size_t first_kept = nw - size_t(maxsplit);
      out.emplace_back(utf8_encode(u.substr(0, words[first_kept - 1].second)));
      for (size_t k = first_kept; k < nw; ++k) out.emplace_back(utf8_encode(u.substr(words[k].first, words[k].second - words[k].first)));
    }
    return out;
  }
  const std::string& sp = need_str(in, *sep, "separator");
  if (sp.empty()) in.fail("empty separator");
  std::vector<std::string> parts;
  if (!from_right) {
    size_t start = 0;
    int64_t n = 0;
    for (;;) {
      if (maxsplit >= 0 && n >= maxsplit) break;
      size_t p = s.find(sp, start);
      if (p == std::string::npos) break;
      parts.push_back(s.substr(start, p - start));
      start = p + sp.size();
      ++n;
    }
    parts.push_back(s.substr(start));
  } else {
    size_t end = s.size();
    int64_t n = 0;
    std::vector<std::string> rev;
    for (;;) {
      if (maxsplit >= 0 && n >= maxsplit) break;
      if (end < sp.size()) break;
      size_t p = s.rfind(sp, end - sp.size());
      if (p == std::string::npos) break;
      rev.push_back(s.substr(p + sp.size(), end - p - sp.size()));
      end = p;
      ++n;
    }
    parts.push_back(s.substr(0, end));
    for (auto it = rev.rbegin(); it != rev.rend(); ++it) parts.push_back(*it);
  }
  in.tick(int64_t(parts.size()));
  for (auto& p : parts) out.emplace_back(std::move(p));
  return out;
}

std::string py_replace(Interpreter& in, const std::string& s, const std::string& old, const std::string& rep, int64_t count) {
  std::string out;
  if (old.empty()) {
    std::u32string u = utf8_decode(s);
    int64_t n = 0;
    for (size_t i = 0; i <= u.size(); ++i) {
      if (count < 0 || n < count) {
        out += rep;
        ++n;
      }
      if (i < u.size()) utf8_append(out, u[i]);
      in.check_size(out.size());
    }
    return out;
  }
  size_t start = 0;
  int64_t n = 0;
  for (;;) {
    if (count >= 0 && n >= count) break;
    size_t p = s.find(old, start);
    if (p == std::string::npos) break;
    out.append(s, start, p - start);
    out += rep;
    in.check_size(out.size());
    start = p + old.size();
    ++n;
  }
  out.append(s, start, std::string::npos);
  return out;
}

bool is_cased(char32_t c) { return py_upper(c) != c || py_lower(c) != c; }

std::string py_title(const std::string& s) {
  std::string out;
  bool prev_cased = false;
  for (char32_t c : utf8_decode(s)) {
    if (prev_cased) utf8_append(out, py_lower(c));
    else utf8_append(out, py_upper(c));
    prev_cased = is_cased(c);
  }
  return out;
}

std::string py_capitalize(const std::string& s) {
  std::u32string u = utf8_decode(s);
  std::string out;
  for (size_t i = 0; i < u.size(); ++i) utf8_append(out, i == 0 ? py_upper(u[i]) : py_lower(u[i]));
  return out;
}

// jinja2's title filter: capitalize every word, words starting after '-', whitespace or ({[<.
std::string jinja_title(const std::string& s) {
  std::u32string u = utf8_decode(s);
  std::string out;
  bool start = true;
  for (char32_t c : u) {
    bool delim = c == '-' || py_isspace(c) || c == '(' || c == '{' || c == '[' || c == '<';
    if (delim) {
      utf8_append(out, c);
      start = true;
    } else {
      utf8_append(out, start ? py_upper(c) : py_lower(c));
      start = false;
    }
  }
  return out;
}

std::vector<std::string> py_splitlines(const std::string& s, bool keepends) {
  std::vector<std::string> lines;
  std::u32string u = utf8_decode(s);
  size_t i = 0, start = 0;
  while (i < u.size()) {
    char32_t c = u[i];
    bool brk = c == '\n' || c == '\r' || c == 0x0b || c == 0x0c || c == 0x1c || c == 0x1d || c == 0x1e || c == 0x85 ||
               c == 0x2028 || c == 0x2029;
    if (!brk) {
      ++i;
      continue;
    }
    size_t eol = i + ((c == '\r' && i + 1 < u.size() && u[i + 1] == '\n') ? 2 : 1);
    lines.push_back(utf8_encode(u.substr(start, (keepends ? eol : i) - start)));
    start = i = eol;
  }
  if (start < u.size()) lines.push_back(utf8_encode(u.substr(start)));
  return lines;
}

std::string py_center(const std::string& s, int64_t width, char32_t fill) {
  int64_t len = int64_t(py_len(s));
  if (width <= len) return s;
  int64_t marg = width - len;
  int64_t left = marg / 2 + (marg & width & 1);
  std::string out;
  for (int64_t i = 0; i < left; ++i) utf8_append(out, fill);
  out += s;
  for (int64_t i = 0; i < marg - left; ++i) utf8_append(out, fill);
  return out;
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

// Python's int(str, base) and float(str); false when the text is not a number.
bool parse_py_int(std::string s, int base, int64_t& out) {
  s = py_strip(s, nullptr, true, true);
  if (s.empty()) return false;
  bool neg = false;
  size_t i = 0;
  if (s[0] == '+' || s[0] == '-') {
    neg = s[0] == '-';
    i = 1;
  }
  if (i + 1 < s.size() && s[i] == '0') {
    char p = char(s[i + 1] | 0x20);
    int pb = p == 'x' ? 16 : p == 'o' ? 8 : p == 'b' ? 2 : 0;
    if (pb && (base == 0 || base == pb)) {
      base = pb;
      i += 2;
      if (i < s.size() && s[i] == '_') ++i;
    }
  }
  if (base == 0) base = 10;
  if (i >= s.size()) return false;
  unsigned __int128 v = 0;
  bool prev_digit = false;
  for (; i < s.size(); ++i) {
    char c = s[i];
    if (c == '_') {
      if (!prev_digit || i + 1 >= s.size()) return false;
      prev_digit = false;
      continue;
    }
    int d = (c >= '0' && c <= '9') ? c - '0' : (c >= 'a' && c <= 'z') ? c - 'a' + 10 : (c >= 'A' && c <= 'Z') ? c - 'A' + 10 : 99;
    if (d >= base) return false;
    v = v * unsigned(base) + unsigned(d);
    if (v > (unsigned __int128)(INT64_MAX) + 1) return false;
    prev_digit = true;
  }
  if (!neg && v > (unsigned __int128)INT64_MAX) return false;
  out = neg ? int64_t(-(__int128)v) : int64_t(v);
  return true;
}

bool parse_py_float(std::string s, double& out) {
  s = py_strip(s, nullptr, true, true);
  std::string t;
  for (char c : s) t += char(c | ((c >= 'A' && c <= 'Z') ? 0x20 : 0));
  size_t i = (t.size() && (t[0] == '+' || t[0] == '-')) ? 1 : 0;
  std::string body = t.substr(i);
  double sign = (i && t[0] == '-') ? -1.0 : 1.0;
  if (body == "inf" || body == "infinity") {
    out = sign * HUGE_VAL;
    return true;
  }
  if (body == "nan") {
    out = std::nan("");
    return true;
  }
  std::string clean;
  bool digits = false, dot = false, exp = false;
  for (size_t k = 0; k < body.size(); ++k) {
    char c = body[k];
    if (c >= '0' && c <= '9') {
      digits = true;
      clean += c;
    } else if (c == '_') {
      if (k == 0 || k + 1 >= body.size() || !isdigit(static_cast<unsigned char>(body[k - 1])) ||
          !isdigit(static_cast<unsigned char>(body[k + 1])))
        return false;
    } else if (c == '.' && !dot && !exp) {
      dot = true;
      clean += c;
    } else if (c == 'e' && digits && !exp) {
      exp = true;
      clean += c;
      if (k + 1 < body.size() && (body[k + 1] == '+' || body[k + 1] == '-')) clean += body[++k];
      if (k + 1 >= body.size()) return false;
    } else {
      return false;
    }
  }
  if (!digits) return false;
  out = sign * std::strtod(clean.c_str(), nullptr);
  return true;
}

// ---- attribute paths (jinja2's make_attrgetter) ---------------------------------------------

Value attr_path(Interpreter& in, const Value& item, const std::string& attribute) {
  Value v = item;
  size_t start = 0;
  for (;;) {
    size_t dot = attribute.find('.', start);
    std::string part = attribute.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
    v = digits ? in.getitem(v, Value(int64_t(std::strtoll(part.c_str(), nullptr, 10)))) : in.getitem(v, Value(part));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return v;
}

Value fold_case(const Value& v, bool case_sensitive) {
  if (!case_sensitive && v.is_string()) return Value(py_lower_str(v.str()));
  return v;
}

bool less_or_fail(Interpreter& in, const Value& a, const Value& b) {
  if (a.is_undefined()) in.fail_undefined(a);
  if (b.is_undefined()) in.fail_undefined(b);
  std::string err;
  bool r = py_less(a, b, &err);
  if (!err.empty()) in.fail(err);
  return r;
}

// ---- str.format ----------------------------------------------------------------------------

std::string format_spec(Interpreter& in, const Value& v, const std::string& spec) {
  if (spec.empty()) return v.to_str();
  // [[fill]align][sign][0][width][,][.precision][type]
  size_t i = 0;
  char32_t fill = ' ';
  char align = 0;
  std::u32string u = utf8_decode(spec);
  auto is_align = [](char32_t c) { return c == '<' || c == '>' || c == '^' || c == '='; };
  if (u.size() >= 2 && is_align(u[1])) {
    fill = u[0];
    align = char(u[1]);
    i = 2;
  } else if (!u.empty() && is_align(u[0])) {
    align = char(u[0]);
    i = 1;
  }
  char sign = 0;
  if (i < u.size() && (u[i] == '+' || u[i] == '-' || u[i] == ' ')) sign = char(u[i++]);
  if (i < u.size() && u[i] == '0') {
    fill = '0';
    if (!align) align = '=';
    ++i;
  }
  int64_t width = 0;
  while (i < u.size() && u[i] >= '0' && u[i] <= '9') width = width * 10 + (u[i++] - '0');
  int precision = -1;
  if (i < u.size() && u[i] == '.') {
    ++i;
    precision = 0;
    while (i < u.size() && u[i] >= '0' && u[i] <= '9') precision = precision * 10 + int(u[i++] - '0');
  }
  char type = 0;
  if (i < u.size()) type = char(u[i++]);
  if (i != u.size() || width > 100000 || precision > 1000) in.fail(cat("unsupported format spec '", spec, "'"));
  std::string body;
  if (type == 0 || type == 's') {
    if (v.is_string() || type == 's') {
      body = v.to_str();
      if (precision >= 0) body = utf8_encode(utf8_decode(body).substr(0, size_t(precision)));
      if (!align) align = '<';
    } else if (v.is_float() && precision >= 0) {
      type = 'g';
    } else {
      body = v.to_str();
    }
  }
  if (body.empty() && type != 0 && type != 's') {
    if (!v.is_number()) in.fail(cat("unknown format code '", std::string(1, type), "' for object of type '", v.type_name(), "'"));
    char buf[128];
    if (type == 'd') {
      if (v.is_float()) in.fail("unknown format code 'd' for object of type 'float'");
      std::snprintf(buf, sizeof buf, "%lld", (long long)v.as_int());
    } else if (type == 'x' || type == 'X' || type == 'o' || type == 'b') {
      if (v.is_float()) in.fail(cat("unknown format code '", std::string(1, type), "' for object of type 'float'"));
      long long x = v.as_int();
      unsigned long long ux = x < 0 ? 0ULL - (unsigned long long)x : (unsigned long long)x;
      std::string digs;
      int base = type == 'o' ? 8 : type == 'b' ? 2 : 16;
      do {
        int d = int(ux % unsigned(base));
        digs += char(d < 10 ? '0' + d : (type == 'X' ? 'A' : 'a') + d - 10);
        ux /= unsigned(base);
      } while (ux);
      std::reverse(digs.begin(), digs.end());
      std::snprintf(buf, sizeof buf, "%s%s", x < 0 ? "-" : "", digs.c_str());
    } else if (type == 'f' || type == 'F' || type == 'e' || type == 'E' || type == '%') {
      double d = v.as_double() * (type == '%' ? 100.0 : 1.0);
      char t = type == '%' ? 'f' : type;
      std::snprintf(buf, sizeof buf, (std::string("%.*") + t).c_str(), precision < 0 ? 6 : precision, d);
      if (type == '%') std::strncat(buf, "%", sizeof buf - std::strlen(buf) - 1);
    } else if (type == 'g' || type == 'G') {
      std::snprintf(buf, sizeof buf, (std::string("%.*") + type).c_str(), precision < 0 ? 6 : std::max(precision, 1), v.as_double());
    } else {
      in.fail(cat("unsupported format type '", std::string(1, type), "'"));
    }
    body = buf;
  }
  if (sign == '+' && v.is_number() && !body.empty() && body[0] != '-') body = "+" + body;
  if (sign == ' ' && v.is_number() && !body.empty() && body[0] != '-') body = " " + body;
  int64_t len = int64_t(py_len(body));
  if (width <= len) return body;
  if (!align) align = v.is_number() ? '>' : '<';
  int64_t pad = width - len;
  std::string f;
  utf8_append(f, fill);
  auto rep = [&](int64_t n) {
    std::string r;
    for (int64_t k = 0; k < n; ++k) r += f;
    return r;
  };
  switch (align) {
    case '<': return body + rep(pad);
    case '^': return rep(pad / 2) + body + rep(pad - pad / 2);
    case '=':
      if (!body.empty() && (body[0] == '-' || body[0] == '+' || body[0] == ' ')) return body.substr(0, 1) + rep(pad) + body.substr(1);
      return rep(pad) + body;
    default: return rep(pad) + body;
  }
}

std::string str_format(Interpreter& in, const std::string& fmt, const Args& args) {
  std::string out;
  size_t auto_idx = 0;
  for (size_t i = 0; i < fmt.size(); ++i) {
    char c = fmt[i];
    if (c == '}') {
      if (i + 1 < fmt.size() && fmt[i + 1] == '}') {
        out += '}';
        ++i;
        continue;
      }
      in.fail("Single '}' encountered in format string");
    }
    if (c != '{') {
      out += c;
      continue;
    }
    if (i + 1 < fmt.size() && fmt[i + 1] == '{') {
      out += '{';
      ++i;
      continue;
    }
    size_t j = fmt.find('}', i);
    if (j == std::string::npos) in.fail("Single '{' encountered in format string");
    std::string field = fmt.substr(i + 1, j - i - 1);
    std::string spec, conv;
    size_t colon = field.find(':');
    if (colon != std::string::npos) {
      spec = field.substr(colon + 1);
      field = field.substr(0, colon);
    }
    size_t bang = field.find('!');
    if (bang != std::string::npos) {
      conv = field.substr(bang + 1);
      field = field.substr(0, bang);
    }
    size_t k = 0;
    while (k < field.size() && field[k] != '.' && field[k] != '[') ++k;
    std::string head = field.substr(0, k);
    Value v;
    if (head.empty()) {
      if (auto_idx >= args.pos.size()) in.fail(cat("Replacement index ", auto_idx, " out of range for positional args tuple"));
      v = args.pos[auto_idx++];
    } else if (std::all_of(head.begin(), head.end(), [](char ch) { return ch >= '0' && ch <= '9'; })) {
      size_t idx = size_t(std::strtoull(head.c_str(), nullptr, 10));
      if (idx >= args.pos.size()) in.fail(cat("Replacement index ", idx, " out of range for positional args tuple"));
      v = args.pos[idx];
    } else {
      const Value* kv = args.kwarg(head);
      if (!kv) in.fail(cat("KeyError: '", head, "'"));
      v = *kv;
    }
    while (k < field.size()) {
      if (field[k] == '.') {
        size_t e = k + 1;
        while (e < field.size() && field[e] != '.' && field[e] != '[') ++e;
        v = in.getattr(v, field.substr(k + 1, e - k - 1));
        k = e;
      } else {
        size_t e = field.find(']', k);
        if (e == std::string::npos) in.fail("Missing ']' in format string");
        std::string key = field.substr(k + 1, e - k - 1);
        bool digits = !key.empty() && std::all_of(key.begin(), key.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
        v = in.getitem(v, digits ? Value(int64_t(std::strtoll(key.c_str(), nullptr, 10))) : Value(key));
        k = e + 1;
      }
    }
    if (conv == "r") v = Value(v.repr());
    else if (conv == "s") v = Value(v.to_str());
    else if (!conv.empty()) in.fail(cat("Unknown conversion specifier ", conv));
    out += format_spec(in, v, spec);
    in.check_size(out.size());
    i = j;
  }
  return out;
}

// ---- methods ----------------------------------------------------------------------------

bool str_method_exists(const std::string& n) {
  static const char* names[] = {"strip", "lstrip", "rstrip", "split", "rsplit", "splitlines", "startswith", "endswith",
                                "replace", "upper", "lower", "title", "capitalize", "swapcase", "casefold", "find",
                                "rfind", "index", "rindex", "count", "join", "format", "isdigit", "isalpha", "isalnum",
                                "isspace", "isupper", "islower", "isnumeric", "isdecimal", "zfill", "center", "ljust",
                                "rjust", "partition", "rpartition", "removeprefix", "removesuffix"};
  for (const char* x : names)
    if (n == x) return true;
  return false;
}

Value py_find(Interpreter& in, const std::string& s, const Args& a, bool reverse, bool raise_missing) {
  const Value* sub = arg(a, 0, nullptr);
  if (!sub) in.fail("find() takes at least 1 argument");
  const std::string& needle = need_str(in, *sub, "substring");
  std::u32string u = utf8_decode(s), n = utf8_decode(needle);
  int64_t len = int64_t(u.size());
  auto bound = [&](const Value* v, int64_t def) {
    if (!v || v->is_none()) return def;
    int64_t x = need_int(in, *v, "index");
    if (x < 0) x = std::max<int64_t>(0, x + len);
    return std::min(x, len);
  };
  int64_t b = bound(arg(a, 1, nullptr), 0), e = bound(arg(a, 2, nullptr), len);
  int64_t r = -1;
  if (e >= b && int64_t(n.size()) <= e - b) {
    std::u32string_view hay = std::u32string_view(u).substr(size_t(b), size_t(e - b));
    size_t p = reverse ? hay.rfind(n) : hay.find(n);
    if (p != std::u32string_view::npos) r = b + int64_t(p);
  }
  if (r < 0 && raise_missing) in.fail("substring not found");
  return Value(r);
}

Value call_str_method(Interpreter& in, const std::string& s, const std::string& m, Args& a) {
  auto str_arg = [&](size_t i, const char* what) -> const std::string& {
    const Value* v = arg(a, i, nullptr);
    if (!v) in.fail(cat(m, "() missing argument: ", what));
    return need_str(in, *v, cat(m, "() argument"));
  };
  if (m == "strip" || m == "lstrip" || m == "rstrip") {
    const Value* chars = arg(a, 0, "chars");
    if (chars && !chars->is_none()) need_str(in, *chars, m + "() argument");
    return Value(py_strip(s, chars, m != "rstrip", m != "lstrip"));
  }
  if (m == "split" || m == "rsplit") {
    const Value* sep = arg(a, 0, "sep");
    const Value* maxs = arg(a, 1, "maxsplit");
    return Value::list(py_split(in, s, sep, maxs ? need_int(in, *maxs, "maxsplit") : -1, m == "rsplit"));
  }
  if (m == "splitlines") {
    const Value* keep = arg(a, 0, "keepends");
    List out;
    for (auto& l : py_splitlines(s, keep && keep->truthy())) out.emplace_back(std::move(l));
    return Value::list(std::move(out));
  }
  if (m == "startswith" || m == "endswith") {
    const Value* p = arg(a, 0, nullptr);
    if (!p) in.fail(cat(m, "() takes at least 1 argument"));
    std::string sub = s;
    if (arg(a, 1, nullptr) || arg(a, 2, nullptr)) {
      std::u32string u = utf8_decode(s);
      int64_t len = int64_t(u.size());
      auto bound = [&](const Value* v, int64_t def) {
        if (!v || v->is_none()) return def;
        int64_t x = need_int(in, *v, "index");
        if (x < 0) x = std::max<int64_t>(0, x + len);
        return std::min(x, len);
      };
      int64_t b = bound(arg(a, 1, nullptr), 0), e = bound(arg(a, 2, nullptr), len);
      sub = e >= b ? utf8_encode(u.substr(size_t(b), size_t(e - b))) : std::string();
    }
    auto test = [&](const std::string& x) {
      if (x.size() > sub.size()) return false;
      return m == "startswith" ? sub.compare(0, x.size(), x) == 0 : sub.compare(sub.size() - x.size(), x.size(), x) == 0;
    };
    if (p->is_string()) return Value(test(p->str()));
    if (p->kind() == Kind::Tuple) {
      for (const auto& x : p->items())
        if (test(need_str(in, x, m + "() tuple item"))) return Value(true);
      return Value(false);
    }
    in.fail(cat(m, " first arg must be str or a tuple of str, not ", p->type_name()));
  }
  if (m == "replace") {
    const Value* cnt = arg(a, 2, "count");
    return Value(py_replace(in, s, str_arg(0, "old"), str_arg(1, "new"), cnt ? need_int(in, *cnt, "count") : -1));
  }
  if (m == "upper") return Value(py_upper_str(s));
  if (m == "lower" || m == "casefold") return Value(py_lower_str(s));
  if (m == "title") return Value(py_title(s));
  if (m == "capitalize") return Value(py_capitalize(s));
  if (m == "swapcase") {
    std::string out;
    for (char32_t c : utf8_decode(s)) utf8_append(out, py_upper(c) != c ? py_upper(c) : py_lower(c));
    return Value(out);
  }
  if (m == "find") return py_find(in, s, a, false, false);
  if (m == "rfind") return py_find(in, s, a, true, false);
  if (m == "index") return py_find(in, s, a, false, true);
  if (m == "rindex") return py_find(in, s, a, true, true);
  if (m == "count") {
    const std::string& sub = str_arg(0, "sub");
    if (sub.empty()) return Value(int64_t(py_len(s) + 1));
    int64_t n = 0;
    for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
    return Value(n);
  }
  if (m == "join") {
    const Value* it = arg(a, 0, nullptr);
    if (!it) in.fail("join() takes exactly one argument");
    List items = iterate(in, *it);
    std::string out;
    for (size_t i = 0; i < items.size(); ++i) {
      if (!items[i].is_string())
        in.fail(cat("sequence item ", i, ": expected str instance, ", items[i].type_name(), " found"));
      if (i) out += s;
      out += items[i].str();
      in.check_size(out.size());
    }
    return Value(out);
  }
  if (m == "format") return Value(str_format(in, s, a));
  if (m == "isdigit" || m == "isnumeric" || m == "isdecimal") {
    if (s.empty()) return Value(false);
    for (char32_t c : utf8_decode(s))
      if (!(c >= '0' && c <= '9')) return Value(false);
    return Value(true);
  }
  if (m == "isalpha" || m == "isalnum") {
    if (s.empty()) return Value(false);
    for (char32_t c : utf8_decode(s)) {
      bool alpha = is_cased(c) || (c >= 0x80 && !py_isspace(c) && c > 0x2e80);
      bool ok = alpha || (m == "isalnum" && c >= '0' && c <= '9');
      if (!ok) return Value(false);
    }
    return Value(true);
  }
  if (m == "isspace") {
    if (s.empty()) return Value(false);
    for (char32_t c : utf8_decode(s))
      if (!py_isspace(c)) return Value(false);
    return Value(true);
  }
  if (m == "isupper" || m == "islower") {
    bool any = false;
    for (char32_t c : utf8_decode(s)) {
      if (!is_cased(c)) continue;
      any = true;
      bool up = py_lower(c) != c;
      if ((m == "isupper") != up) return Value(false);
    }
    return Value(any);
  }
  if (m == "zfill" || m == "center" || m == "ljust" || m == "rjust") {
    const Value* w = arg(a, 0, nullptr);
    if (!w) in.fail(cat(m, "() takes at least 1 argument"));
    int64_t width = need_int(in, *w, "width");
    in.check_size(size_t(std::max<int64_t>(0, width)));
    char32_t fill = ' ';
    if (const Value* f = arg(a, 1, nullptr)) {
      std::u32string fu = utf8_decode(need_str(in, *f, "fill character"));
      if (fu.size() != 1) in.fail("The fill character must be exactly one character long");
      fill = fu[0];
    }
    int64_t len = int64_t(py_len(s));
    if (width <= len) return Value(s);
    std::string pad;
    for (int64_t i = 0; i < width - len; ++i) utf8_append(pad, m == "zfill" ? char32_t('0') : fill);
    if (m == "center") return Value(py_center(s, width, fill));
    if (m == "ljust") return Value(s + pad);
    if (m == "rjust") return Value(pad + s);
    if (!s.empty() && (s[0] == '-' || s[0] == '+')) return Value(s.substr(0, 1) + pad + s.substr(1));
    return Value(pad + s);
  }
  if (m == "partition" || m == "rpartition") {
    const std::string& sep = str_arg(0, "sep");
    if (sep.empty()) in.fail("empty separator");
    size_t p = m == "partition" ? s.find(sep) : s.rfind(sep);
    if (p == std::string::npos) {
      if (m == "partition") return Value::tuple({Value(s), Value(""), Value("")});
      return Value::tuple({Value(""), Value(""), Value(s)});
    }
    return Value::tuple({Value(s.substr(0, p)), Value(sep), Value(s.substr(p + sep.size()))});
  }
  if (m == "removeprefix") {
    const std::string& p = str_arg(0, "prefix");
    return Value(s.compare(0, p.size(), p) == 0 ? s.substr(p.size()) : s);
  }
  if (m == "removesuffix") {
    const std::string& p = str_arg(0, "suffix");
    if (!p.empty() && p.size() <= s.size() && s.compare(s.size() - p.size(), p.size(), p) == 0)
      return Value(s.substr(0, s.size() - p.size()));
    return Value(s);
  }
  in.fail(cat("'str' object has no attribute '", m, "'"));
}

Value call_dict_method(Interpreter& in, const Value& d, const std::string& m, Args& a) {
  const Dict& dict = d.dict_ref();
  if (m == "items") {
    List out;
    for (const auto& [k, v] : dict.entries) out.push_back(Value::tuple({k, v}));
    return Value::list(std::move(out));
  }
  if (m == "keys" || m == "values") {
    List out;
    for (const auto& [k, v] : dict.entries) out.push_back(m == "keys" ? k : v);
    return Value::list(std::move(out));
  }
  if (m == "get") {
    const Value* key = arg(a, 0, nullptr);
    if (!key) in.fail("get expected at least 1 argument, got 0");
    if (const Value* v = dict.find(*key)) return *v;
    const Value* def = arg(a, 1, nullptr);
    return def ? *def : Value(nullptr);
  }
  if (m == "copy") return Value::dict(dict);
  in.fail(cat("'dict' object has no attribute '", m, "'"));
}

Value call_list_method(Interpreter& in, const Value& l, const std::string& m, Args& a) {
  const List& items = l.items();
  if (m == "index" || m == "count") {
    const Value* x = arg(a, 0, nullptr);
    if (!x) in.fail(cat(m, "() takes at least 1 argument"));
    int64_t n = 0;
    for (size_t i = 0; i < items.size(); ++i) {
      if (py_equal(items[i], *x)) {
        if (m == "index") return Value(int64_t(i));
        ++n;
      }
    }
    if (m == "index") in.fail(cat(x->repr(), " is not in list"));
    return Value(n);
  }
  if (m == "copy") return Value::list(items);
  in.fail(cat("'", l.type_name(), "' object has no attribute '", m, "'"));
}

// ---- filters ----------------------------------------------------------------------------

using FilterFn = Value (*)(Interpreter&, const Value&, Args&);

Value f_tojson(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "tojson()", 4, {"ensure_ascii", "indent", "separators", "sort_keys"});
  JsonStyle st;
  if (const Value* x = arg(a, 0, "ensure_ascii")) st.ensure_ascii = x->truthy();
  const Value* indent = arg(a, 1, "indent");
  if (indent && !indent->is_none()) {
    if (indent->is_string()) {
      st.indent_is_str = true;
      st.indent_str = indent->str();
    } else {
      st.indent = int(std::clamp<int64_t>(need_int(in, *indent, "indent"), 0, 1000));
    }
    st.item_sep = ",";
  }
  if (const Value* sep = arg(a, 2, "separators"); sep && !sep->is_none()) {
    if (!sep->is_sequence() || sep->items().size() != 2) in.fail("separators must be a pair of strings");
    st.item_sep = need_str(in, sep->items()[0], "item separator");
    st.key_sep = need_str(in, sep->items()[1], "key separator");
  }
  if (const Value* x = arg(a, 3, "sort_keys")) st.sort_keys = x->truthy();
  std::string out, err;
  if (!py_json_dumps(v, st, out, &err)) in.fail(err);
  in.check_size(out.size());
  return Value(std::move(out));
}

Value f_length(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "length()", 0, {});
  switch (v.kind()) {
    case Kind::Undefined: return Value(int64_t(0));
    case Kind::String: return Value(int64_t(py_len(v.str())));
    case Kind::List:
    case Kind::Tuple: return Value(int64_t(v.items().size()));
    case Kind::Dict: return Value(int64_t(v.dict_ref().size()));
    default: in.fail(cat("object of type '", v.type_name(), "' has no len()"));
  }
}

Value f_default(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "default()", 2, {"default_value", "boolean"});
  const Value* def = arg(a, 0, "default_value");
  const Value* boolean = arg(a, 1, "boolean");
  if (v.is_undefined() || (boolean && boolean->truthy() && !v.truthy())) return def ? *def : Value("");
  return v;
}

Value f_join(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "join()", 2, {"d", "attribute"});
  const Value* d = arg(a, 0, "d");
  const Value* attribute = arg(a, 1, "attribute");
  std::string sep = d ? d->to_str() : "";
  std::string out;
  List items = iterate(in, v);
  in.tick(int64_t(items.size()));
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += sep;
    Value x = (attribute && !attribute->is_none()) ? attr_path(in, items[i], attribute->to_str()) : items[i];
    out += x.to_str();
    in.check_size(out.size());
  }
  return Value(std::move(out));
}

Value f_first(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "first()", 0, {});
  List items = iterate(in, v);
  if (items.empty()) return Value::undefined("No first item, sequence was empty.");
  return items.front();
}

Value f_last(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "last()", 0, {});
  List items = iterate(in, v);
  if (items.empty()) return Value::undefined("No last item, sequence was empty.");
  return items.back();
}

Value f_list(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "list()", 0, {});
  return Value::list(iterate(in, v));
}

Value f_items(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "items()", 0, {});
  if (v.is_undefined()) return Value::list();
  if (!v.is_dict()) in.fail("Can only get item pairs from a mapping.");
  return call_dict_method(in, v, "items", a);
}

Value f_upper(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "upper()", 0, {});
  return Value(py_upper_str(v.to_str()));
}
Value f_lower(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "lower()", 0, {});
  return Value(py_lower_str(v.to_str()));
}
Value f_capitalize(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "capitalize()", 0, {});
  return Value(py_capitalize(v.to_str()));
}
Value f_title(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "title()", 0, {});
  return Value(jinja_title(v.to_str()));
}

Value f_trim(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "trim()", 1, {"chars"});
  const Value* chars = arg(a, 0, "chars");
  if (chars && !chars->is_none()) need_str(in, *chars, "trim() argument");
  return Value(py_strip(v.to_str(), chars, true, true));
}

Value f_replace(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "replace()", 3, {"old", "new", "count"});
  const Value* old = arg(a, 0, "old");
  const Value* rep = arg(a, 1, "new");
  const Value* count = arg(a, 2, "count");
  if (!old || !rep) in.fail("replace() needs 'old' and 'new'");
  return Value(py_replace(in, v.to_str(), old->to_str(), rep->to_str(),
                          count && !count->is_none() ? need_int(in, *count, "count") : -1));
}

Value f_string(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "string()", 0, {});
  return Value(v.to_str());
}

Value f_safe(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "safe()", 0, {});
  return Value(v.to_str());
}

Value f_escape(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "escape()", 0, {});
  return Value(html_escape(v.to_str()));
}

Value f_int(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "int()", 2, {"default", "base"});
  const Value* def = arg(a, 0, "default");
  const Value* base = arg(a, 1, "base");
  int b = base ? int(need_int(in, *base, "base")) : 10;
  Value fallback = def ? *def : Value(int64_t(0));
  if (v.is_int() || v.is_bool()) return Value(v.as_int());
  if (v.is_float()) {
    double d = v.as_double();
    if (!std::isfinite(d) || std::fabs(d) >= 9.2e18) return fallback;
    return Value(int64_t(d));
  }
  if (v.is_string()) {
    int64_t r;
    if (parse_py_int(v.str(), b, r)) return Value(r);
    double d;
    if (parse_py_float(v.str(), d) && std::isfinite(d) && std::fabs(d) < 9.2e18) return Value(int64_t(d));
  }
  return fallback;
}

Value f_float(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "float()", 1, {"default"});
  const Value* def = arg(a, 0, "default");
  if (v.is_number()) return Value(v.as_double());
  double d;
  if (v.is_string() && parse_py_float(v.str(), d)) return Value(d);
  return def ? *def : Value(0.0);
}

Value f_abs(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "abs()", 0, {});
  if (v.is_float()) return Value(std::fabs(v.as_double()));
  if (v.is_int() || v.is_bool()) {
    if (v.as_int() == INT64_MIN) in.fail("integer overflow");
    return Value(v.as_int() < 0 ? -v.as_int() : v.as_int());
  }
  if (v.is_undefined()) in.fail_undefined(v);
  in.fail(cat("bad operand type for abs(): '", v.type_name(), "'"));
}

Value f_round(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "round()", 2, {"precision", "method"});
  const Value* p = arg(a, 0, "precision");
  const Value* m = arg(a, 1, "method");
  int64_t prec = p ? need_int(in, *p, "precision") : 0;
  std::string method = m ? need_str(in, *m, "method") : "common";
  if (method != "common" && method != "floor" && method != "ceil") in.fail("method must be common, ceil or floor");
  if (v.is_undefined()) in.fail_undefined(v);
  if (!v.is_number()) in.fail(cat("type ", v.type_name(), " doesn't define __round__ method"));
  if (method == "common") {
    if (!v.is_float()) return Value(v.as_int());
    double d = v.as_double();
    if (!std::isfinite(d)) return Value(d);
    if (prec == 0) {
      std::fesetround(FE_TONEAREST);
      return Value(std::nearbyint(d));
    }
    if (prec < 0 || prec > 300) {
      double f = std::pow(10.0, double(prec));
      return Value(std::nearbyint(d * f) / f);
    }
    char buf[512];
    std::snprintf(buf, sizeof buf, "%.*f", int(prec), d);
    return Value(std::strtod(buf, nullptr));
  }
  double f = std::pow(10.0, double(prec));
  double x = v.as_double() * f;
  return Value((method == "floor" ? std::floor(x) : std::ceil(x)) / f);
}

Value f_center(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "center()", 1, {"width"});
  const Value* w = arg(a, 0, "width");
  int64_t width = w ? need_int(in, *w, "width") : 80;
  in.check_size(size_t(std::max<int64_t>(0, width)));
  return Value(py_center(v.to_str(), width, ' '));
}

Value f_indent(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "indent()", 3, {"width", "first", "blank"});
  const Value* w = arg(a, 0, "width");
  const Value* first = arg(a, 1, "first");
  const Value* blank = arg(a, 2, "blank");
  std::string ind;
  if (w && w->is_string()) ind = w->str();
  else ind = std::string(size_t(std::clamp<int64_t>(w ? need_int(in, *w, "width") : 4, 0, 10000)), ' ');
  std::string s = v.to_str() + "\n";
  std::vector<std::string> lines = py_splitlines(s, false);
  std::string rv;
  if (blank && blank->truthy()) {
    for (size_t i = 0; i < lines.size(); ++i) {
      if (i) rv += "\n" + ind;
      rv += lines[i];
    }
  } else {
    rv = lines.empty() ? "" : lines[0];
    for (size_t i = 1; i < lines.size(); ++i) rv += "\n" + (lines[i].empty() ? lines[i] : ind + lines[i]);
  }
  if (first && first->truthy()) rv = ind + rv;
  in.check_size(rv.size());
  return Value(rv);
}

Value f_wordcount(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "wordcount()", 0, {});
  int64_t n = 0;
  bool inword = false;
  for (char32_t c : utf8_decode(v.to_str())) {
    bool w = (c >= '0' && c <= '9') || is_cased(c) || c == '_' || (c >= 0x80 && !py_isspace(c) && c > 0x2e80);
    if (w && !inword) ++n;
    inword = w;
  }
  return Value(n);
}

Value f_truncate(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "truncate()", 4, {"length", "killwords", "end", "leeway"});
  const Value* l = arg(a, 0, "length");
  const Value* kill = arg(a, 1, "killwords");
  const Value* end = arg(a, 2, "end");
  const Value* lee = arg(a, 3, "leeway");
  int64_t length = l ? need_int(in, *l, "length") : 255;
  int64_t leeway = lee && !lee->is_none() ? need_int(in, *lee, "leeway") : 5;
  std::string e = end ? end->to_str() : "...";
  std::u32string s = utf8_decode(v.to_str());
  int64_t elen = int64_t(utf8_decode(e).size());
  if (length < elen) in.fail(cat("expected length >= ", elen, ", got ", length));
  if (leeway < 0) in.fail(cat("expected leeway >= 0, got ", leeway));
  if (int64_t(s.size()) <= length + leeway) return Value(utf8_encode(s));
  std::u32string cut = s.substr(0, size_t(length - elen));
  if (kill && kill->truthy()) return Value(utf8_encode(cut) + e);
  size_t sp = cut.rfind(U' ');
  if (sp != std::u32string::npos) cut = cut.substr(0, sp);
  return Value(utf8_encode(cut) + e);
}

Value f_format(Interpreter& in, const Value& v, Args& a) {
  if (!a.pos.empty() && !a.kw.empty()) in.fail("can't handle positional and keyword arguments at the same time");
  Value args;
  if (!a.kw.empty()) {
    Dict d;
    for (auto& [k, x] : a.kw) d.set(Value(k), x);
    args = Value::dict(std::move(d));
  } else {
    args = Value::tuple(a.pos);
  }
  return Value(percent_format(in, v.to_str(), args));
}

Value f_attr(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "attr()", 1, {"name"});
  const Value* n = arg(a, 0, "name");
  if (!n) in.fail("attr() needs a name");
  return in.getattr(v, n->to_str());
}

Value f_reverse(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "reverse()", 0, {});
  if (v.is_string()) {
    std::u32string u = utf8_decode(v.str());
    std::reverse(u.begin(), u.end());
    return Value(utf8_encode(u));
  }
  List items = iterate(in, v);
  std::reverse(items.begin(), items.end());
  return Value::list(std::move(items));
}

Value sort_key(Interpreter& in, const Value& x, const Value* attribute, bool case_sensitive) {
  Value k = (attribute && !attribute->is_none()) ? attr_path(in, x, attribute->to_str()) : x;
  return fold_case(k, case_sensitive);
}

Value f_sort(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "sort()", 3, {"reverse", "case_sensitive", "attribute"});
  const Value* rev = arg(a, 0, "reverse");
  const Value* cs = arg(a, 1, "case_sensitive");
  const Value* attribute = arg(a, 2, "attribute");
  List items = iterate(in, v);
  in.tick(int64_t(items.size()));
  std::vector<std::pair<Value, Value>> keyed;
  for (auto& x : items) keyed.emplace_back(sort_key(in, x, attribute, cs && cs->truthy()), x);
  bool reverse = rev && rev->truthy();
  std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& p, const auto& q) {
    return reverse ? less_or_fail(in, q.first, p.first) : less_or_fail(in, p.first, q.first);
  });
  List out;
  for (auto& [k, x] : keyed) out.push_back(std::move(x));
  return Value::list(std::move(out));
}

Value f_dictsort(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "dictsort()", 3, {"case_sensitive", "by", "reverse"});
  const Value* cs = arg(a, 0, "case_sensitive");
  const Value* by = arg(a, 1, "by");
  const Value* rev = arg(a, 2, "reverse");
  if (!v.is_dict()) in.fail("dictsort() needs a mapping");
  int pos = 0;
  if (by) {
    std::string b = by->to_str();
    if (b == "value") pos = 1;
    else if (b != "key") in.fail("You can only sort by either \"key\" or \"value\"");
  }
  std::vector<std::pair<Value, Value>> entries = v.dict_ref().entries;
  bool reverse = rev && rev->truthy();
  bool sens = cs && cs->truthy();
  std::stable_sort(entries.begin(), entries.end(), [&](const auto& p, const auto& q) {
    Value x = fold_case(pos ? p.second : p.first, sens), y = fold_case(pos ? q.second : q.first, sens);
    return reverse ? less_or_fail(in, y, x) : less_or_fail(in, x, y);
  });
  List out;
  for (auto& [k, x] : entries) out.push_back(Value::tuple({k, x}));
  return Value::list(std::move(out));
}

Value f_unique(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "unique()", 2, {"case_sensitive", "attribute"});
  const Value* cs = arg(a, 0, "case_sensitive");
  const Value* attribute = arg(a, 1, "attribute");
  List items = iterate(in, v);
  in.tick(int64_t(items.size()) * int64_t(items.size()) / 16 + int64_t(items.size()));
  List seen, out;
  for (auto& x : items) {
    Value k = sort_key(in, x, attribute, cs && cs->truthy());
    bool dup = false;
    for (const auto& s : seen)
      if (py_equal(s, k)) dup = true;
    if (dup) continue;
    seen.push_back(k);
    out.push_back(x);
  }
  return Value::list(std::move(out));
}

Value min_max(Interpreter& in, const Value& v, Args& a, bool want_max) {
  check_args(in, a, want_max ? "max()" : "min()", 2, {"case_sensitive", "attribute"});
  const Value* cs = arg(a, 0, "case_sensitive");
  const Value* attribute = arg(a, 1, "attribute");
  List items = iterate(in, v);
  if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
  size_t best = 0;
  Value bk = sort_key(in, items[0], attribute, cs && cs->truthy());
  for (size_t i = 1; i < items.size(); ++i) {
    Value k = sort_key(in, items[i], attribute, cs && cs->truthy());
    if (want_max ? less_or_fail(in, bk, k) : less_or_fail(in, k, bk)) {
      best = i;
      bk = k;
    }
  }
  return items[best];
}
Value f_max(Interpreter& in, const Value& v, Args& a) { return min_max(in, v, a, true); }
Value f_min(Interpreter& in, const Value& v, Args& a) { return min_max(in, v, a, false); }

Value f_sum(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "sum()", 2, {"attribute", "start"});
  const Value* attribute = arg(a, 0, "attribute");
  const Value* start = arg(a, 1, "start");
  Value total = start ? *start : Value(int64_t(0));
  for (const auto& x : iterate(in, v)) {
    Value y = (attribute && !attribute->is_none()) ? attr_path(in, x, attribute->to_str()) : x;
    if (!total.is_number() || !y.is_number())
      in.fail(cat("unsupported operand type(s) for +: '", total.type_name(), "' and '", y.type_name(), "'"));
    if (total.is_float() || y.is_float()) total = Value(total.as_double() + y.as_double());
    else {
      int64_t r;
      if (__builtin_add_overflow(total.as_int(), y.as_int(), &r)) in.fail("integer overflow");
      total = Value(r);
    }
  }
  return total;
}

Value f_map(Interpreter& in, const Value& v, Args& a) {
  List items = iterate(in, v);
  in.tick(int64_t(items.size()));
  List out;
  if (a.pos.empty()) {
    const Value* attribute = a.kwarg("attribute");
    const Value* def = a.kwarg("default");
    for (const auto& [k, x] : a.kw)
      if (k != "attribute" && k != "default") in.fail(cat("Unexpected keyword argument '", k, "'"));
    if (!attribute) in.fail("map() needs a filter name or attribute=");
    for (const auto& x : items) {
      Value y = attr_path(in, x, attribute->to_str());
      if (y.is_undefined() && def) y = *def;
      out.push_back(std::move(y));
    }
    return Value::list(std::move(out));
  }
  std::string name = need_str(in, a.pos[0], "map() filter name");
  if (!is_filter(name)) in.fail(cat("No filter named '", name, "'."));
  for (const auto& x : items) {
    Args fa;
    fa.pos.assign(a.pos.begin() + 1, a.pos.end());
    fa.kw = a.kw;
    out.push_back(apply_filter(in, name, x, fa));
  }
  return Value::list(std::move(out));
}

Value select_impl(Interpreter& in, const Value& v, Args& a, bool by_attr, bool keep) {
  List items = iterate(in, v);
  in.tick(int64_t(items.size()));
  size_t i = 0;
  std::string attribute;
  if (by_attr) {
    if (a.pos.empty()) in.fail("selectattr() and rejectattr() need an attribute");
    attribute = a.pos[0].to_str();
    i = 1;
  }
  std::string test;
  if (i < a.pos.size()) test = need_str(in, a.pos[i++], "test name");
  if (!test.empty() && !is_test(test)) in.fail(cat("No test named '", test, "'."));
  List out;
  for (const auto& x : items) {
    Value subject = by_attr ? attr_path(in, x, attribute) : x;
    bool r;
    if (test.empty()) {
      r = subject.truthy();
    } else {
      Args ta;
      ta.pos.assign(a.pos.begin() + long(i), a.pos.end());
      ta.kw = a.kw;
      r = apply_test(in, test, subject, ta);
    }
    if (r == keep) out.push_back(x);
  }
  return Value::list(std::move(out));
}
Value f_select(Interpreter& in, const Value& v, Args& a) { return select_impl(in, v, a, false, true); }
Value f_reject(Interpreter& in, const Value& v, Args& a) { return select_impl(in, v, a, false, false); }
Value f_selectattr(Interpreter& in, const Value& v, Args& a) { return select_impl(in, v, a, true, true); }
Value f_rejectattr(Interpreter& in, const Value& v, Args& a) { return select_impl(in, v, a, true, false); }

Value f_pprint(Interpreter& in, const Value& v, Args& a) {
  check_args(in, a, "pprint()", 0, {});
  return Value(v.repr());
}

struct FilterEntry {
  const char* name;
  FilterFn fn;
};

const FilterEntry kFilters[] = {
    {"abs", f_abs},         {"attr", f_attr},           {"capitalize", f_capitalize}, {"center", f_center},
    {"count", f_length},    {"d", f_default},           {"default", f_default},       {"dictsort", f_dictsort},
    {"e", f_escape},        {"escape", f_escape},       {"first", f_first},           {"float", f_float},
    {"forceescape", f_escape}, {"format", f_format},    {"indent", f_indent},         {"int", f_int},
    {"items", f_items},     {"join", f_join},           {"last", f_last},             {"length", f_length},
    {"list", f_list},       {"lower", f_lower},         {"map", f_map},               {"max", f_max},
    {"min", f_min},         {"pprint", f_pprint},       {"reject", f_reject},         {"rejectattr", f_rejectattr},
    {"replace", f_replace}, {"reverse", f_reverse},     {"round", f_round},           {"safe", f_safe},
    {"select", f_select},   {"selectattr", f_selectattr}, {"sort", f_sort},           {"string", f_string},
    {"sum", f_sum},         {"title", f_title},         {"tojson", f_tojson},         {"trim", f_trim},
    {"truncate", f_truncate}, {"unique", f_unique},     {"upper", f_upper},           {"wordcount", f_wordcount},
};

FilterFn find_filter(std::string_view name) {
  for (const auto& f : kFilters)
    if (name == f.name) return f.fn;
  return nullptr;
}

// ---- tests ------------------------------------------------------------------------------

const char* kTests[] = {"defined", "undefined", "none", "boolean", "false", "true", "integer", "float", "number",
                        "string", "mapping", "iterable", "sequence", "callable", "sameas", "escaped", "in", "eq",
                        "equalto", "==", "ne", "!=", "lt", "lessthan", "<", "le", "<=", "gt", "greaterthan", ">",
                        "ge", ">=", "odd", "even", "divisibleby", "lower", "upper", "filter", "test"};

}  // namespace

bool is_filter(std::string_view name) { return find_filter(name) != nullptr; }

bool is_test(std::string_view name) {
  for (const char* t : kTests)
    if (name == t) return true;
  return false;
}

Value apply_filter(Interpreter& in, const std::string& name, const Value& v, Args& args) {
  FilterFn f = find_filter(name);
  if (!f) in.fail(cat("No filter named '", name, "'."));
  return f(in, v, args);
}

bool apply_test(Interpreter& in, const std::string& t, const Value& v, Args& a) {
  const Value* other = arg(a, 0, nullptr);
  auto need_other = [&]() -> const Value& {
    if (!other) in.fail(cat("test '", t, "' needs an argument"));
    return *other;
  };
  if (t == "defined") return !v.is_undefined();
  if (t == "undefined") return v.is_undefined();
  if (t == "none") return v.is_none();
  if (t == "boolean") return v.is_bool();
  if (t == "false") return v.is_bool() && !v.as_bool();
  if (t == "true") return v.is_bool() && v.as_bool();
  if (t == "integer") return v.is_int();
  if (t == "float") return v.is_float();
  if (t == "number") return v.is_number();
  if (t == "string") return v.is_string();
  if (t == "mapping") return v.is_dict();
  if (t == "iterable") return v.is_undefined() || v.is_string() || v.is_sequence() || v.is_dict();
  if (t == "sequence") return v.is_undefined() || v.is_string() || v.is_sequence() || v.is_dict();
  if (t == "callable") return v.is_callable() || v.is_undefined();
  if (t == "sameas") return v.same_object(need_other());
  if (t == "escaped") return false;
  if (t == "in") {
    const Value& c = need_other();
    if (c.is_string()) {
      if (!v.is_string()) in.fail(cat("'in <string>' requires string as left operand, not ", v.type_name()));
      return c.str().find(v.str()) != std::string::npos;
    }
    if (c.is_undefined()) return false;
    if (c.is_dict()) return c.dict_ref().find(v) != nullptr;
    if (!c.is_sequence()) in.fail(cat("argument of type '", c.type_name(), "' is not iterable"));
    for (const auto& x : c.items())
      if (py_equal(x, v)) return true;
    return false;
  }
  if (t == "eq" || t == "equalto" || t == "==") return py_equal(v, need_other());
  if (t == "ne" || t == "!=") return !py_equal(v, need_other());
  if (t == "lt" || t == "lessthan" || t == "<") return less_or_fail(in, v, need_other());
  if (t == "le" || t == "<=") return !less_or_fail(in, need_other(), v);
  if (t == "gt" || t == "greaterthan" || t == ">") return less_or_fail(in, need_other(), v);
  if (t == "ge" || t == ">=") return !less_or_fail(in, v, need_other());
  if (t == "odd" || t == "even" || t == "divisibleby") {
    if (v.is_undefined()) in.fail_undefined(v);
    if (!v.is_number()) in.fail(cat("unsupported operand type(s) for %: '", v.type_name(), "' and 'int'"));
    int64_t m = 2;
    if (t == "divisibleby") {
      const Value& d = need_other();
      if (!(d.is_int() || d.is_bool())) in.fail("divisibleby needs an integer");
      m = d.as_int();
      if (m == 0) in.fail("integer division or modulo by zero");
    }
    if (v.is_float()) {
      double r = std::fmod(v.as_double(), double(m));
      return t == "odd" ? (r != 0.0) : (r == 0.0);
    }
    int64_t r = m == -1 ? 0 : v.as_int() % m;
    return t == "odd" ? (r != 0) : (r == 0);
  }
  if (t == "lower" || t == "upper") {
    Args none;
    return call_str_method(in, v.to_str(), t == "lower" ? "islower" : "isupper", none).as_bool();
  }
  if (t == "filter") return v.is_string() && is_filter(v.str());
  if (t == "test") return v.is_string() && is_test(v.str());
  in.fail(cat("No test named '", t, "'."));
}

bool is_unsafe_method(const Value& obj, const std::string& name) {
  if (obj.kind() == Kind::List) {
    static const char* m[] = {"append", "extend", "insert", "pop", "remove", "reverse", "sort", "clear"};
    for (const char* x : m)
      if (name == x) return true;
  }
  if (obj.is_dict()) {
    static const char* m[] = {"clear", "pop", "popitem", "setdefault", "update"};
    for (const char* x : m)
      if (name == x) return true;
  }
  return false;
}

Value bound_method(const Value& obj, const std::string& name) {
  bool ok = false;
  if (obj.is_string()) ok = str_method_exists(name);
  else if (obj.is_dict()) ok = name == "items" || name == "keys" || name == "values" || name == "get" || name == "copy";
  else if (obj.is_sequence()) ok = name == "index" || name == "count" || (name == "copy" && obj.kind() == Kind::List);
  if (!ok) return Value::undefined("");
  auto c = std::make_shared<Callable>();
  c->name = obj.type_name() + "." + name;
  Value self = obj;
  c->fn = [self, name](Interpreter& in, Args& a) -> Value {
    if (self.is_string()) return call_str_method(in, self.str(), name, a);
    if (self.is_dict()) return call_dict_method(in, self, name, a);
    return call_list_method(in, self, name, a);
  };
  return Value::callable(c);
}

// ---- % formatting -------------------------------------------------------------------------

std::string percent_format(Interpreter& in, const std::string& fmt, const Value& args) {
  List pos;
  const Dict* mapping = nullptr;
  if (args.kind() == Kind::Tuple) pos = args.items();
  else if (args.is_dict()) mapping = &args.dict_ref();
  else pos.push_back(args);
  size_t next = 0;
  std::string out;
  for (size_t i = 0; i < fmt.size(); ++i) {
    if (fmt[i] != '%') {
      out += fmt[i];
      continue;
    }
    if (++i >= fmt.size()) in.fail("incomplete format");
    if (fmt[i] == '%') {
      out += '%';
      continue;
    }
    Value v;
    bool have = false;
    if (fmt[i] == '(') {
      size_t e = fmt.find(')', i);
      if (e == std::string::npos || !mapping) in.fail("format requires a mapping");
      const Value* x = mapping->find(std::string_view(fmt).substr(i + 1, e - i - 1));
      if (!x) in.fail(cat("KeyError: '", fmt.substr(i + 1, e - i - 1), "'"));
      v = *x;
      have = true;
      i = e + 1;
    }
    std::string flags;
    while (i < fmt.size() && std::string_view("-+ #0").find(fmt[i]) != std::string_view::npos) flags += fmt[i++];
    std::string width, prec;
    while (i < fmt.size() && fmt[i] >= '0' && fmt[i] <= '9') width += fmt[i++];
    if (i < fmt.size() && fmt[i] == '.') {
      ++i;
      prec = "0";
      while (i < fmt.size() && fmt[i] >= '0' && fmt[i] <= '9') prec += fmt[i++];
    }
    if (i >= fmt.size()) in.fail("incomplete format");
    char conv = fmt[i];
    if (!have) {
      if (next >= pos.size()) in.fail("not enough arguments for format string");
      v = pos[next++];
    }
    if (width.size() > 5 || prec.size() > 5) in.fail("format width too large");
    char buf[512];
    std::string body;
    std::string pspec = "%" + flags + width + (prec.empty() ? "" : "." + std::to_string(std::stoi(prec)));
    switch (conv) {
      case 's':
      case 'r':
      case 'a': {
        body = conv == 's' ? v.to_str() : v.repr();
        if (!prec.empty()) body = utf8_encode(utf8_decode(body).substr(0, size_t(std::stoi(prec))));
        int64_t w = width.empty() ? 0 : std::stoll(width);
        int64_t len = int64_t(py_len(body));
        if (w > len) body = flags.find('-') != std::string::npos ? body + std::string(size_t(w - len), ' ')
                                                                 : std::string(size_t(w - len), ' ') + body;
        break;
      }
      case 'd':
      case 'i':
      case 'u': {
        if (!v.is_number()) in.fail(cat("%", std::string(1, conv), " format: a real number is required, not ", v.type_name()));
        long long x = v.is_float() ? (long long)std::trunc(v.as_double()) : (long long)v.as_int();
        std::snprintf(buf, sizeof buf, (pspec + "lld").c_str(), x);
        body = buf;
        break;
      }
      case 'x':
      case 'X':
      case 'o': {
        if (!(v.is_int() || v.is_bool())) in.fail(cat("%", std::string(1, conv), " format: an integer is required, not ", v.type_name()));
        std::snprintf(buf, sizeof buf, (pspec + "ll" + conv).c_str(), (long long)v.as_int());
        body = buf;
        break;
      }
      case 'f':
      case 'F':
      case 'e':
      case 'E':
      case 'g':
      case 'G': {
        if (!v.is_number()) in.fail(cat("must be real number, not ", v.type_name()));
        std::snprintf(buf, sizeof buf, (pspec + conv).c_str(), v.as_double());
        body = buf;
        break;
      }
      case 'c': body = v.is_string() ? v.str() : std::string(1, char(v.as_int())); break;
      default: in.fail(cat("unsupported format character '", std::string(1, conv), "'"));
    }
    out += body;
    in.check_size(out.size());
  }
  if (!mapping && next < pos.size()) in.fail("not all arguments converted during string formatting");
  return out;
}

// ---- globals ------------------------------------------------------------------------------

namespace {

Value make_dict_from(Interpreter& in, Args& a, const char* what) {
  Dict d;
  if (a.pos.size() > 1) in.fail(cat(what, " expected at most 1 positional argument, got ", a.pos.size()));
  if (!a.pos.empty()) {
    const Value& src = a.pos[0];
    if (src.is_dict() || src.is_namespace()) {
      d = src.dict_ref();
    } else {
      for (const auto& item : iterate(in, src)) {
        if (!item.is_sequence() || item.items().size() != 2)
          in.fail("dictionary update sequence element has the wrong length; 2 is required");
        d.set(item.items()[0], item.items()[1]);
      }
    }
  }
  for (auto& [k, v] : a.kw) d.set(Value(k), v);
  return Value::dict(std::move(d));
}

std::shared_ptr<Callable> fn(const char* name, std::function<Value(Interpreter&, Args&)> f) {
  auto c = std::make_shared<Callable>();
  c->name = name;
  c->fn = std::move(f);
  return c;
}

}  // namespace

void install_globals(Dict& g) {
  g.set(Value("range"), Value::callable(fn("range", [](Interpreter& in, Args& a) -> Value {
          if (!a.kw.empty()) in.fail("range() takes no keyword arguments");
          if (a.pos.empty() || a.pos.size() > 3) in.fail(cat("range expected 1 to 3 arguments, got ", a.pos.size()));
          int64_t start = 0, stop, step = 1;
          for (const auto& x : a.pos)
            if (!(x.is_int() || x.is_bool())) in.fail(cat("'", x.type_name(), "' object cannot be interpreted as an integer"));
          if (a.pos.size() == 1) stop = a.pos[0].as_int();
          else {
            start = a.pos[0].as_int();
            stop = a.pos[1].as_int();
            if (a.pos.size() == 3) step = a.pos[2].as_int();
          }
          if (step == 0) in.fail("range() arg 3 must not be zero");
          __int128 n = 0;
          if (step > 0 && stop > start) n = ((__int128)stop - start + step - 1) / step;
          if (step < 0 && stop < start) n = ((__int128)start - stop - step - 1) / -step;
          if (n > in.limits().max_range)
            in.fail(cat("Range too big. The sandbox blocks ranges larger than MAX_RANGE (", in.limits().max_range, ")."));
          in.tick(int64_t(n));
          List out;
          out.reserve(size_t(n));
          for (int64_t k = 0; k < int64_t(n); ++k) out.emplace_back(start + k * step);
          return Value::list(std::move(out));
        })));
  g.set(Value("dict"), Value::callable(fn("dict", [](Interpreter& in, Args& a) { return make_dict_from(in, a, "dict"); })));
  g.set(Value("namespace"), Value::callable(fn("namespace", [](Interpreter& in, Args& a) -> Value {
          Value d = make_dict_from(in, a, "namespace");
          for (const auto& [k, v] : d.dict_ref().entries)
            if (k.is_string() && !k.str().empty() && k.str()[0] == '_')
              in.fail(cat("Chat templates cannot store underscore-prefixed attributes on a namespace, but got '",
                          k.str(), "'. Please rename the attribute."));
          return Value::namespace_obj(d.dict_ref());
        })));
  g.set(Value("raise_exception"), Value::callable(fn("raise_exception", [](Interpreter& in, Args& a) -> Value {
          const Value* m = arg(a, 0, "message");
          in.raise(m ? m->to_str() : std::string());
        })));
  g.set(Value("strftime_now"), Value::callable(fn("strftime_now", [](Interpreter& in, Args& a) -> Value {
          const Value* f = arg(a, 0, "format");
          if (!f) in.fail("strftime_now() missing argument 'format'");
          const std::string& format = need_str(in, *f, "strftime_now() format");
          std::time_t now = std::time(nullptr);
          std::tm tm{};
          localtime_r(&now, &tm);
          if (format.empty()) return Value("");
          std::string buf(format.size() * 8 + 64, '\0');
          size_t n = std::strftime(buf.data(), buf.size(), format.c_str(), &tm);
          buf.resize(n);
          return Value(buf);
        })));
}

}  // namespace kestrel::jinja
