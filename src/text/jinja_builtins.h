// jinja2's filters and tests, the Python str/dict/list methods templates call, and the globals
// transformers provides (range, dict, namespace, raise_exception, strftime_now).
#pragma once
#include <string>
#include <string_view>

#include "text/jinja_value.h"

namespace kestrel::jinja {

bool is_filter(std::string_view name);
bool is_test(std::string_view name);
Value apply_filter(Interpreter& in, const std::string& name, const Value& v, Args& args);
bool apply_test(Interpreter& in, const std::string& name, const Value& v, Args& args);

// A bound method of a str, dict or list (e.g. "abc".startswith), or an undefined value.
Value bound_method(const Value& obj, const std::string& name);
// Attributes jinja2's immutable sandbox refuses (list.append, dict.update, ...).
bool is_unsafe_method(const Value& obj, const std::string& name);

void install_globals(Dict& globals);

// Python's `fmt % args`.
std::string percent_format(Interpreter& in, const std::string& fmt, const Value& args);

}  // namespace kestrel::jinja
