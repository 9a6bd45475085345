// The values a Jinja template computes with, modelled on the Python objects jinja2 sees when
// transformers renders a chat template: None, bool, int, float, str, list, tuple, dict (insertion
// ordered), namespace, callables, and jinja2's Undefined. Printing, comparison, truthiness and JSON
// output follow Python's rules, so a rendering matches jinja2 byte for byte.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace kestrel::jinja {

class Value;
class Interpreter;
struct Dict;
struct Callable;
using List = std::vector<Value>;

enum class Kind : uint8_t { Undefined, None, Bool, Int, Float, String, List, Tuple, Dict, Namespace, Callable };

class Value {
 public:
  Value() = default;  // undefined
  Value(std::nullptr_t) : kind_(Kind::None) {}
  Value(bool b) : kind_(Kind::Bool), data_(b) {}
  Value(int v) : kind_(Kind::Int), data_(int64_t(v)) {}
  Value(int64_t v) : kind_(Kind::Int), data_(v) {}
  Value(double v) : kind_(Kind::Float), data_(v) {}
  Value(std::string s) : kind_(Kind::String), data_(std::make_shared<const std::string>(std::move(s))) {}
  Value(std::string_view s) : Value(std::string(s)) {}
  Value(const char* s) : Value(std::string(s)) {}

  // An undefined value; `hint` is the sentence jinja2 would raise if it is used (e.g. "'x' is undefined").
  static Value undefined(std::string hint);
  static Value list(List items = {});
  static Value tuple(List items);
  static Value dict();
  static Value dict(Dict d);
  static Value namespace_obj(Dict d);
  static Value callable(std::shared_ptr<Callable> fn);
  static Value from_json(const nlohmann::ordered_json& j);
  static Value from_json(const nlohmann::json& j);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::Undefined; }
  bool is_none() const { return kind_ == Kind::None; }
  bool is_bool() const { return kind_ == Kind::Bool; }
  bool is_int() const { return kind_ == Kind::Int; }
  bool is_float() const { return kind_ == Kind::Float; }
  bool is_number() const { return kind_ == Kind::Int || kind_ == Kind::Float || kind_ == Kind::Bool; }
  bool is_string() const { return kind_ == Kind::String; }
  bool is_sequence() const { return kind_ == Kind::List || kind_ == Kind::Tuple; }  // list or tuple
  bool is_dict() const { return kind_ == Kind::Dict; }
  bool is_namespace() const { return kind_ == Kind::Namespace; }
  bool is_callable() const { return kind_ == Kind::Callable; }

  bool as_bool() const { return std::get<bool>(data_); }
  int64_t as_int() const;  // int or bool
  double as_double() const;  // int, bool or float
  const std::string& str() const { return *std::get<std::shared_ptr<const std::string>>(data_); }
  const List& items() const { return *std::get<std::shared_ptr<List>>(data_); }
  List& items_mut() { return *std::get<std::shared_ptr<List>>(data_); }
  const Dict& dict_ref() const { return *std::get<std::shared_ptr<Dict>>(data_); }
  Dict& dict_mut() const { return *std::get<std::shared_ptr<Dict>>(data_); }
  const Callable& fn() const { return *std::get<std::shared_ptr<Callable>>(data_); }
  const std::string& undefined_hint() const;

  bool truthy() const;                // Python bool()
  std::string to_str() const;          // Python str(): what {{ x }} prints
  std::string repr() const;            // Python repr()
  std::string type_name() const;       // Python type name, for error messages
  bool same_object(const Value& o) const;  // Python `is`

 private:
  Kind kind_ = Kind::Undefined;
  std::variant<std::monostate, bool, int64_t, double, std::shared_ptr<const std::string>, std::shared_ptr<List>,
               std::shared_ptr<Dict>, std::shared_ptr<Callable>>
      data_;
};

// A dict that keeps insertion order, as Python's does. Lookups are linear: template data is small.
struct Dict {
  std::vector<std::pair<Value, Value>> entries;
  const Value* find(const Value& key) const;
  const Value* find(std::string_view key) const;
  void set(const Value& key, Value v);
  bool erase(const Value& key);
  size_t size() const { return entries.size(); }
};

// Call arguments: positional, then keyword in source order.
struct Args {
  List pos;
  std::vector<std::pair<std::string, Value>> kw;
  const Value* kwarg(std::string_view name) const;
};

struct Callable {
  std::string name;
  std::function<Value(Interpreter&, Args&)> fn;
};

// Python semantics helpers.
bool py_equal(const Value& a, const Value& b);
// Python ordering (<); throws a message naming the types when they cannot be ordered.
bool py_less(const Value& a, const Value& b, std::string* error);
std::string py_float_repr(double d);
std::string py_str_repr(std::string_view s);

struct JsonStyle {
  int indent = -1;                 // < 0: no newlines; otherwise spaces per level
  std::string indent_str;          // used when the indent was given as a string
  bool indent_is_str = false;
  std::string item_sep = ", ";
  std::string key_sep = ": ";
  bool sort_keys = false;
  bool ensure_ascii = false;
};
// json.dumps; returns false and sets *error when a value cannot be serialized.
bool py_json_dumps(const Value& v, const JsonStyle& style, std::string& out, std::string* error);

// UTF-8 helpers: Python strings index by code point.
std::u32string utf8_decode(std::string_view s);
std::string utf8_encode(std::u32string_view s);
void utf8_append(std::string& out, char32_t c);
bool is_ascii(std::string_view s);
bool py_isspace(char32_t c);
char32_t py_upper(char32_t c);
char32_t py_lower(char32_t c);
std::string py_upper_str(std::string_view s);
std::string py_lower_str(std::string_view s);
size_t py_len(std::string_view s);  // code points

}  // namespace kestrel::jinja
