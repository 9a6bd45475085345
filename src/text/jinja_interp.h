// Renders a parsed template: scopes, statements, expressions and the Python semantics of the
// operators, with bounds on output size, loop work and call depth so that no template can hang
// or exhaust memory.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "common/error.h"
#include "text/jinja_parser.h"

namespace kestrel::jinja {

struct Limits {
  size_t max_output_bytes = size_t(64) << 20;
  int64_t max_steps = 5'000'000;  // loop iterations, macro calls and filter items together
  int max_call_depth = 100;        // nested macro calls
  int64_t max_range = 100'000;     // jinja2's sandbox limit for range()
};

// raise_exception(msg) in a template: the message is the template author's.
class TemplateRaise : public Error {
 public:
  TemplateRaise(const std::string& where, std::string message)
      : Error(where + message), message_(std::move(message)) {}
  const std::string& message() const { return message_; }

 private:
  std::string message_;
};

struct Scope;
using ScopePtr = std::shared_ptr<Scope>;

struct Scope {
  ScopePtr parent;
  std::vector<std::pair<std::string, Value>> vars;
  Value* find(const std::string& name);
  void set(const std::string& name, Value v);
};

class Interpreter {
 public:
  Interpreter(const ParsedTemplate& t, const Limits& limits);
  ~Interpreter();
  Interpreter(const Interpreter&) = delete;
  Interpreter& operator=(const Interpreter&) = delete;

  std::string render(const Dict& context);

  // For builtins: errors at the expression being evaluated.
  [[noreturn]] void fail(const std::string& msg) const;
  [[noreturn]] void fail_undefined(const Value& v) const;
  [[noreturn]] void raise(const std::string& msg) const;
  Value call(const Value& fn, Args& args);
  Value getattr(const Value& obj, const std::string& name);
  Value getitem(const Value& obj, const Value& key);
  void tick(int64_t n = 1);
  void check_size(size_t bytes) const;
  const Limits& limits() const { return limits_; }
  std::string where() const;

 private:
  enum class Flow { Normal, Break, Continue };

  Flow exec(const Body& body, const ScopePtr& scope);
  Flow exec_stmt(const Stmt& s, const ScopePtr& scope);
  void exec_for(const Stmt& s, const ScopePtr& scope);
  void assign(const Target& t, const Value& v, const ScopePtr& scope);
  Value make_macro(const Stmt& s, const ScopePtr& scope, bool is_caller);
  Value invoke_macro(const Stmt& s, const ScopePtr& closure, Args& args, bool is_caller);
  std::string capture(const Body& body, const ScopePtr& scope);
  Value apply_filter_chain(const std::vector<ExprPtr>& filters, Value v, const ScopePtr& scope);

  Value eval(const Expr& e, const ScopePtr& scope);
  Value eval_call(const Expr& e, const ScopePtr& scope);
  void eval_args(const Expr& e, size_t first, Args& args, const ScopePtr& scope);
  Value lookup(const std::string& name, const ScopePtr& scope);
  Value binary(const std::string& op, const Value& a, const Value& b);
  bool compare(const std::string& op, const Value& a, const Value& b);
  bool contains(const Value& container, const Value& item);
  Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step);
  void write(const std::string& s);

  const ParsedTemplate& t_;
  Limits limits_;
  Dict globals_;
  std::string* out_ = nullptr;
  Loc loc_;
  int64_t steps_ = 0;
  int call_depth_ = 0;
  std::vector<std::shared_ptr<Callable>> macros_;  // their closures are released after rendering
};

// Iterates a value as Python's iter() does (dict: keys; str: characters; Undefined: nothing).
List iterate(Interpreter& in, const Value& v);

}  // namespace kestrel::jinja
