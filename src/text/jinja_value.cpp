#include "text/jinja_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

namespace kestrel::jinja {

// ---- construction and access --------------------------------------------------------------

Value Value::undefined(std::string hint) {
  Value v;
  v.data_ = std::make_shared<const std::string>(std::move(hint));
  return v;
}

Value Value::list(List items) {
  Value v;
  v.kind_ = Kind::List;
  v.data_ = std::make_shared<List>(std::move(items));
  return v;
}

Value Value::tuple(List items) {
  Value v = list(std::move(items));
  v.kind_ = Kind::Tuple;
  return v;
}

Value Value::dict() { return dict(Dict{}); }

Value Value::dict(Dict d) {
  Value v;
  v.kind_ = Kind::Dict;
  v.data_ = std::make_shared<Dict>(std::move(d));
  return v;
}

Value Value::namespace_obj(Dict d) {
  Value v = dict(std::move(d));
  v.kind_ = Kind::Namespace;
  return v;
}

Value Value::callable(std::shared_ptr<Callable> fn) {
  Value v;
  v.kind_ = Kind::Callable;
  v.data_ = std::move(fn);
  return v;
}

template <typename J>
static Value value_from_json(const J& j) {
  switch (j.type()) {
    case J::value_t::null: return Value(nullptr);
    case J::value_t::boolean: return Value(j.template get<bool>());
    case J::value_t::number_integer: return Value(j.template get<int64_t>());
    case J::value_t::number_unsigned: {
      uint64_t u = j.template get<uint64_t>();
      if (u > uint64_t(INT64_MAX)) return Value(double(u));
      return Value(int64_t(u));
    }
    case J::value_t::number_float: return Value(j.template get<double>());
    case J::value_t::string: return Value(j.template get<std::string>());
    case J::value_t::array: {
      List items;
      items.reserve(j.size());
      for (const auto& x : j) items.push_back(value_from_json(x));
      return Value::list(std::move(items));
    }
    case J::value_t::object: {
      Dict d;
      d.entries.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it) d.entries.emplace_back(Value(it.key()), value_from_json(it.value()));
      return Value::dict(std::move(d));
    }
    default: return Value(nullptr);  // binary and discarded values have no template meaning
  }
}

Value Value::from_json(const nlohmann::ordered_json& j) { return value_from_json(j); }
Value Value::from_json(const nlohmann::json& j) { return value_from_json(j); }

int64_t Value::as_int() const {
  if (kind_ == Kind::Bool) return as_bool() ? 1 : 0;
  return std::get<int64_t>(data_);
}

double Value::as_double() const {
  if (kind_ == Kind::Float) return std::get<double>(data_);
  return double(as_int());
}

const std::string& Value::undefined_hint() const {
  static const std::string none;
  if (auto p = std::get_if<std::shared_ptr<const std::string>>(&data_)) return **p;
  return none;
}

bool Value::truthy() const {
  switch (kind_) {
    case Kind::Undefined:
    case Kind::None: return false;
    case Kind::Bool: return as_bool();
    case Kind::Int: return as_int() != 0;
    case Kind::Float: return as_double() != 0.0;
    case Kind::String: return !str().empty();
    case Kind::List:
    case Kind::Tuple: return !items().empty();
    case Kind::Dict: return dict_ref().size() != 0;
    case Kind::Namespace:
    case Kind::Callable: return true;
  }
  return false;
}

bool Value::same_object(const Value& o) const {
  if (kind_ != o.kind_) return false;
  switch (kind_) {
    case Kind::Undefined:
    case Kind::None: return true;
    case Kind::Bool: return as_bool() == o.as_bool();
    case Kind::Int: return as_int() == o.as_int();  // small ints are interned in CPython
    case Kind::Float: return false;
    case Kind::String: return str() == o.str();
    default: return data_ == o.data_;
  }
}

std::string Value::type_name() const {
  switch (kind_) {
    case Kind::Undefined: return "Undefined";
    case Kind::None: return "NoneType";
    case Kind::Bool: return "bool";
    case Kind::Int: return "int";
    case Kind::Float: return "float";
    case Kind::String: return "str";
    case Kind::List: return "list";
    case Kind::Tuple: return "tuple";
    case Kind::Dict: return "dict";
    case Kind::Namespace: return "Namespace";
    case Kind::Callable: return "function";
  }
  return "object";
}

static std::string repr_items(const List& items, const char* open, const char* close, bool tuple) {
  std::string s = open;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) s += ", ";
    s += items[i].repr();
  }
  if (tuple && items.size() == 1) s += ",";
  s += close;
  return s;
}

static std::string repr_dict(const Dict& d) {
  std::string s = "{";
  for (size_t i = 0; i < d.entries.size(); ++i) {
    if (i) s += ", ";
    s += d.entries[i].first.repr();
    s += ": ";
    s += d.entries[i].second.repr();
  }
  return s + "}";
}

std::string Value::to_str() const {
  switch (kind_) {
    case Kind::Undefined: return "";
    case Kind::None: return "None";
    case Kind::Bool: return as_bool() ? "True" : "False";
    case Kind::Int: return std::to_string(as_int());
    case Kind::Float: return py_float_repr(as_double());
    case Kind::String: return str();
    case Kind::List: return repr_items(items(), "[", "]", false);
    case Kind::Tuple: return repr_items(items(), "(", ")", true);
    case Kind::Dict: return repr_dict(dict_ref());
    case Kind::Namespace: return "<Namespace " + repr_dict(dict_ref()) + ">";
    case Kind::Callable: return "<function " + fn().name + ">";
  }
  return "";
}

std::string Value::repr() const {
  if (kind_ == Kind::String) return py_str_repr(str());
  return to_str();
}

// ---- dict -------------------------------------------------------------------------------

const Value* Dict::find(std::string_view key) const {
  for (const auto& [k, v] : entries)
    if (k.is_string() && k.str() == key) return &v;
  return nullptr;
}

const Value* Dict::find(const Value& key) const {
  if (key.is_string()) return find(std::string_view(key.str()));
  for (const auto& [k, v] : entries)
    if (py_equal(k, key)) return &v;
  return nullptr;
}

void Dict::set(const Value& key, Value v) {
  for (auto& [k, old] : entries) {
    if (py_equal(k, key)) {
      old = std::move(v);
      return;
    }
  }
  entries.emplace_back(key, std::move(v));
}

bool Dict::erase(const Value& key) {
  for (auto it = entries.begin(); it != entries.end(); ++it) {
    if (py_equal(it->first, key)) {
      entries.erase(it);
      return true;
    }
  }
  return false;
}

const Value* Args::kwarg(std::string_view name) const {
  for (const auto& [k, v] : kw)
    if (k == name) return &v;
  return nullptr;
}

// ---- comparison -------------------------------------------------------------------------

bool py_equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Kind::Undefined:
    case Kind::None: return true;
    case Kind::String: return a.str() == b.str();
    case Kind::List:
    case Kind::Tuple: {
      const List &x = a.items(), &y = b.items();
      if (x.size() != y.size()) return false;
      for (size_t i = 0; i < x.size(); ++i)
        if (!py_equal(x[i], y[i])) return false;
      return true;
    }
    case Kind::Dict: {
      const Dict &x = a.dict_ref(), &y = b.dict_ref();
      if (x.size() != y.size()) return false;
      for (const auto& [k, v] : x.entries) {
        const Value* o = y.find(k);
        if (!o || !py_equal(v, *o)) return false;
      }
      return true;
    }
    default: return a.same_object(b);
  }
}

bool py_less(const Value& a, const Value& b, std::string* error) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.as_double() < b.as_double();
    return a.as_int() < b.as_int();
  }
  if (a.is_string() && b.is_string()) return a.str() < b.str();  // UTF-8 byte order is code point order
  if ((a.kind() == Kind::List && b.kind() == Kind::List) || (a.kind() == Kind::Tuple && b.kind() == Kind::Tuple)) {
    const List &x = a.items(), &y = b.items();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (py_equal(x[i], y[i])) continue;
      return py_less(x[i], y[i], error);
    }
    return x.size() < y.size();
  }
  if (error) *error = "'<' not supported between instances of '" + a.type_name() + "' and '" + b.type_name() + "'";
  return false;
}

// ---- number and string formatting --------------------------------------------------------

std::string py_float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);  // e.g. "-1.2345e+02": the shortest digits that round-trip
  bool neg = sci[0] == '-';
  size_t e = sci.find('e');
  std::string mant = sci.substr(neg ? 1 : 0, e - (neg ? 1 : 0));
  int exp = std::stoi(sci.substr(e + 1));
  std::string digits;
  for (char c : mant)
    if (c != '.') digits += c;
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  std::string out = neg ? "-" : "";
  if (exp >= -4 && exp < 16) {
    if (exp >= 0) {
      std::string ip = digits.substr(0, std::min(digits.size(), size_t(exp + 1)));
      while (ip.size() < size_t(exp + 1)) ip += '0';
      std::string fp = digits.size() > size_t(exp + 1) ? digits.substr(exp + 1) : "0";
      out += ip + "." + fp;
    } else {
      out += "0." + std::string(size_t(-exp - 1), '0') + digits;
    }
  } else {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    out += eb;
  }
  return out;
}

// Characters Python's str.isprintable() rejects beyond ASCII (a close approximation of the
// Unicode categories Cc, Cf, Zs, Zl, Zp, Co and a few noncharacters).
static bool py_printable(char32_t c) {
  if (c < 0x20 || c == 0x7f) return false;
  if (c < 0x7f) return true;
  if (c <= 0xa0 || c == 0xad) return false;
  if (c == 0x1680 || (c >= 0x2000 && c <= 0x200f) || (c >= 0x2028 && c <= 0x202f) || (c >= 0x205f && c <= 0x206f) ||
      c == 0x3000 || c == 0xfeff || (c >= 0xfff9 && c <= 0xfffb) || c == 0xfffe || c == 0xffff)
    return false;
  if ((c >= 0x600 && c <= 0x605) || c == 0x61c || c == 0x6dd || c == 0x70f || c == 0x180e) return false;
  if ((c >= 0xd800 && c <= 0xf8ff) || c >= 0xf0000 || (c >= 0xe0000 && c <= 0xe007f)) return false;
  return true;
}

std::string py_str_repr(std::string_view s) {
  bool has_single = s.find('\'') != std::string_view::npos, has_double = s.find('"') != std::string_view::npos;
  char q = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, q);
  for (char32_t c : utf8_decode(s)) {
    char buf[16];
    if (c == '\\') out += "\\\\";
    else if (c == char32_t(q)) out += std::string("\\") + q;
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (py_printable(c)) utf8_append(out, c);
    else {
      if (c < 0x100) std::snprintf(buf, sizeof buf, "\\x%02x", unsigned(c));
      else if (c < 0x10000) std::snprintf(buf, sizeof buf, "\\u%04x", unsigned(c));
      else std::snprintf(buf, sizeof buf, "\\U%08x", unsigned(c));
      out += buf;
    }
  }
  out += q;
  return out;
}

// ---- JSON (Python's json.dumps) ----------------------------------------------------------

static void json_string(std::string_view s, bool ensure_ascii, std::string& out) {
  out += '"';
  auto esc = [&](char32_t c) -> bool {
    switch (c) {
      case '"': out += "\\\""; return true;
      case '\\': out += "\\\\"; return true;
      case '\n': out += "\\n"; return true;
      case '\r': out += "\\r"; return true;
      case '\t': out += "\\t"; return true;
      case '\b': out += "\\b"; return true;
      case '\f': out += "\\f"; return true;
      default: return false;
    }
  };
  char buf[16];
  if (!ensure_ascii) {
    for (char c : s) {
      unsigned char u = static_cast<unsigned char>(c);
      if (esc(u)) continue;
      if (u < 0x20) {
        std::snprintf(buf, sizeof buf, "\\u%04x", unsigned(u));
        out += buf;
      } else {
        out += c;
      }
    }
  } else {
    for (char32_t c : utf8_decode(s)) {
      if (esc(c)) continue;
      if (c >= 0x20 && c <= 0x7e) {
        out += char(c);
      } else if (c < 0x10000) {
        std::snprintf(buf, sizeof buf, "\\u%04x", unsigned(c));
        out += buf;
      } else {
        char32_t v = c - 0x10000;
        std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", unsigned(0xd800 | (v >> 10)), unsigned(0xdc00 | (v & 0x3ff)));
        out += buf;
      }
    }
  }
  out += '"';
}

static std::string json_float(double d) {
  if (std::isnan(d)) return "NaN";
  if (std::isinf(d)) return d < 0 ? "-Infinity" : "Infinity";
  return py_float_repr(d);
}

static bool json_key(const Value& k, std::string& key, std::string* error) {
  switch (k.kind()) {
    case Kind::String: key = k.str(); return true;
    case Kind::Bool: key = k.as_bool() ? "true" : "false"; return true;
    case Kind::None: key = "null"; return true;
    case Kind::Int: key = std::to_string(k.as_int()); return true;
    case Kind::Float: key = json_float(k.as_double()); return true;
    default:
      if (error) *error = "keys must be str, int, float, bool or None, not " + k.type_name();
      return false;
  }
}

static bool json_dump(const Value& v, const JsonStyle& st, int level, std::string& out, std::string* error, int depth) {
  if (depth > 512) {
    if (error) *error = "maximum recursion depth exceeded while encoding a JSON object";
    return false;
  }
  auto newline_indent = [&](int lvl) {
    out += '\n';
    if (st.indent_is_str) {
      for (int i = 0; i < lvl; ++i) out += st.indent_str;
    } else {
      out.append(size_t(st.indent) * size_t(lvl), ' ');
    }
  };
  const bool pretty = st.indent >= 0 || st.indent_is_str;
  switch (v.kind()) {
    case Kind::None: out += "null"; return true;
    case Kind::Bool: out += v.as_bool() ? "true" : "false"; return true;
    case Kind::Int: out += std::to_string(v.as_int()); return true;
    case Kind::Float: out += json_float(v.as_double()); return true;
    case Kind::String: json_string(v.str(), st.ensure_ascii, out); return true;
    case Kind::List:
    case Kind::Tuple: {
      const List& items = v.items();
      if (items.empty()) {
        out += "[]";
        return true;
      }
      out += '[';
      if (pretty) newline_indent(level + 1);
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) {
          out += st.item_sep;
          if (pretty) newline_indent(level + 1);
        }
        if (!json_dump(items[i], st, level + 1, out, error, depth + 1)) return false;
      }
      if (pretty) newline_indent(level);
      out += ']';
      return true;
    }
    case Kind::Dict: {
      const Dict& d = v.dict_ref();
      if (d.size() == 0) {
        out += "{}";
        return true;
      }
      std::vector<std::pair<std::string, const Value*>> kv;
      kv.reserve(d.size());
      for (const auto& [k, val] : d.entries) {
        std::string key;
        if (!json_key(k, key, error)) return false;
        kv.emplace_back(std::move(key), &val);
      }
      if (st.sort_keys)
        std::stable_sort(kv.begin(), kv.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
      out += '{';
      if (pretty) newline_indent(level + 1);
      for (size_t i = 0; i < kv.size(); ++i) {
        if (i) {
          out += st.item_sep;
          if (pretty) newline_indent(level + 1);
        }
        json_string(kv[i].first, st.ensure_ascii, out);
        out += st.key_sep;
        if (!json_dump(*kv[i].second, st, level + 1, out, error, depth + 1)) return false;
      }
      if (pretty) newline_indent(level);
      out += '}';
      return true;
    }
    default:
      if (error) *error = "Object of type " + v.type_name() + " is not JSON serializable";
      return false;
  }
}

bool py_json_dumps(const Value& v, const JsonStyle& style, std::string& out, std::string* error) {
  return json_dump(v, style, 0, out, error, 0);
}

// ---- UTF-8 and Unicode ---------------------------------------------------------------------

std::u32string utf8_decode(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    char32_t cp;
    int n;
    if (c < 0x80) { cp = c; n = 0; }
    else if ((c & 0xe0) == 0xc0) { cp = c & 0x1f; n = 1; }
    else if ((c & 0xf0) == 0xe0) { cp = c & 0x0f; n = 2; }
    else if ((c & 0xf8) == 0xf0) { cp = c & 0x07; n = 3; }
    else { out += char32_t(0xfffd); ++i; continue; }
    bool ok = true;
    for (int k = 1; k <= n; ++k) {
      if (i + k >= s.size() || (static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) {
        ok = false;
        break;
      }
      cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f);
    }
    if (!ok) {
      out += char32_t(0xfffd);
      ++i;
      continue;
    }
    out += cp;
    i += size_t(n) + 1;
  }
  return out;
}

void utf8_append(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += char(c);
  } else if (c < 0x800) {
    out += char(0xc0 | (c >> 6));
    out += char(0x80 | (c & 0x3f));
  } else if (c < 0x10000) {
    out += char(0xe0 | (c >> 12));
    out += char(0x80 | ((c >> 6) & 0x3f));
    out += char(0x80 | (c & 0x3f));
  } else {
    out += char(0xf0 | (c >> 18));
    out += char(0x80 | ((c >> 12) & 0x3f));
    out += char(0x80 | ((c >> 6) & 0x3f));
    out += char(0x80 | (c & 0x3f));
  }
}

std::string utf8_encode(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) utf8_append(out, c);
  return out;
}

bool is_ascii(std::string_view s) {
  for (char c : s)
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  return true;
}

size_t py_len(std::string_view s) {
  size_t n = 0;
  for (char c : s)
    if ((static_cast<unsigned char>(c) & 0xc0) != 0x80) ++n;
  return n;
}

bool py_isspace(char32_t c) {
  return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

// Case mapping for ASCII, Latin-1, Latin Extended-A, Greek and Cyrillic; other scripts are left as
// they are.
char32_t py_upper(char32_t c) {
  if (c >= 'a' && c <= 'z') return c - 32;
  if (c < 0x80) return c;
  if ((c >= 0xe0 && c <= 0xfe && c != 0xf7)) return c - 32;
  if (c == 0xff) return 0x178;
  if (c == 0xb5) return 0x39c;
  if (c >= 0x100 && c <= 0x17f) {
    if ((c >= 0x100 && c <= 0x137) || (c >= 0x14a && c <= 0x177)) return (c & 1) ? c - 1 : c;
    if ((c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17e)) return (c & 1) ? c : c - 1;
    if (c == 0x131) return 'I';
    if (c == 0x17f) return 'S';
    return c;
  }
  if (c >= 0x3b1 && c <= 0x3c9 && c != 0x3c2) return c - 32;
  if (c == 0x3c2) return 0x3a3;
  if (c >= 0x3ac && c <= 0x3af) {
    static const char32_t m[] = {0x386, 0x388, 0x389, 0x38a};
    return m[c - 0x3ac];
  }
  if (c == 0x3cc) return 0x38c;
  if (c == 0x3cd) return 0x38e;
  if (c == 0x3ce) return 0x38f;
  if (c >= 0x430 && c <= 0x44f) return c - 32;
  if (c >= 0x450 && c <= 0x45f) return c - 80;
  return c;
}

char32_t py_lower(char32_t c) {
  if (c >= 'A' && c <= 'Z') return c + 32;
  if (c < 0x80) return c;
  if (c >= 0xc0 && c <= 0xde && c != 0xd7) return c + 32;
  if (c == 0x178) return 0xff;
  if (c >= 0x100 && c <= 0x17f) {
    if ((c >= 0x100 && c <= 0x137) || (c >= 0x14a && c <= 0x177)) return (c & 1) ? c : c + 1;
    if ((c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17e)) return (c & 1) ? c + 1 : c;
    return c;
  }
  if (c >= 0x391 && c <= 0x3a9 && c != 0x3a2) return c + 32;
  if (c == 0x386) return 0x3ac;
  if (c >= 0x388 && c <= 0x38a) return c + 37;
  if (c == 0x38c) return 0x3cc;
  if (c == 0x38e) return 0x3cd;
  if (c == 0x38f) return 0x3ce;
  if (c >= 0x410 && c <= 0x42f) return c + 32;
  if (c >= 0x400 && c <= 0x40f) return c + 80;
  return c;
}

std::string py_upper_str(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  if (is_ascii(s)) {
    for (char c : s) out += (c >= 'a' && c <= 'z') ? char(c - 32) : c;
    return out;
  }
  for (char32_t c : utf8_decode(s)) {
    if (c == 0xdf) out += "SS";
    else utf8_append(out, py_upper(c));
  }
  return out;
}

std::string py_lower_str(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  if (is_ascii(s)) {
    for (char c : s) out += (c >= 'A' && c <= 'Z') ? char(c + 32) : c;
    return out;
  }
  for (char32_t c : utf8_decode(s)) utf8_append(out, py_lower(c));
  return out;
}

}  // namespace kestrel::jinja
