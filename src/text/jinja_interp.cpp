#include "text/jinja_interp.h"

#include <climits>
#include <cmath>

#include "text/jinja_builtins.h"

namespace kestrel::jinja {

// ---- scopes -------------------------------------------------------------------------------

Value* Scope::find(const std::string& name) {
  for (Scope* s = this; s; s = s->parent.get())
    for (auto& [k, v] : s->vars)
      if (k == name) return &v;
  return nullptr;
}

void Scope::set(const std::string& name, Value v) {
  for (auto& [k, old] : vars) {
    if (k == name) {
      old = std::move(v);
      return;
    }
  }
  vars.emplace_back(name, std::move(v));
}

// ---- setup ------------------------------------------------------------------------------

Interpreter::Interpreter(const ParsedTemplate& t, const Limits& limits) : t_(t), limits_(limits) {
  install_globals(globals_);
}

Interpreter::~Interpreter() {
  for (auto& m : macros_) m->fn = nullptr;  // break scope <-> macro reference cycles
}

std::string Interpreter::where() const { return cat(t_.name, ":", loc_.line, ":", loc_.col, ": "); }

void Interpreter::fail(const std::string& msg) const { throw Error(where() + msg); }

void Interpreter::fail_undefined(const Value& v) const {
  const std::string& hint = v.undefined_hint();
  fail(hint.empty() ? "undefined value used" : hint);
}

void Interpreter::raise(const std::string& msg) const { throw TemplateRaise(where(), msg); }

void Interpreter::tick(int64_t n) {
  steps_ += n;
  if (steps_ > limits_.max_steps) fail(cat("template exceeded its work limit of ", limits_.max_steps, " steps"));
}

void Interpreter::check_size(size_t bytes) const {
  if (bytes > limits_.max_output_bytes)
    fail(cat("template output or string exceeds ", limits_.max_output_bytes, " bytes"));
}

void Interpreter::write(const std::string& s) {
  out_->append(s);
  check_size(out_->size());
}

std::string Interpreter::render(const Dict& context) {
  auto root = std::make_shared<Scope>();
  for (const auto& [k, v] : context.entries)
    if (k.is_string()) root->set(k.str(), v);
  std::string out;
  out_ = &out;
  exec(t_.body, root);
  out_ = nullptr;
  return out;
}

// ---- statements ---------------------------------------------------------------------------

Interpreter::Flow Interpreter::exec(const Body& body, const ScopePtr& scope) {
  for (const auto& s : body) {
    Flow f = exec_stmt(*s, scope);
    if (f != Flow::Normal) return f;
  }
  return Flow::Normal;
}

std::string Interpreter::capture(const Body& body, const ScopePtr& scope) {
  std::string buf;
  std::string* saved = out_;
  out_ = &buf;
  try {
    exec(body, scope);
  } catch (...) {
    out_ = saved;
    throw;
  }
  out_ = saved;
  return buf;
}

Value Interpreter::apply_filter_chain(const std::vector<ExprPtr>& filters, Value v, const ScopePtr& scope) {
  for (const auto& f : filters) {
    Args args;
    eval_args(*f, 1, args, scope);
    loc_ = f->loc;
    v = apply_filter(*this, f->name, v, args);
  }
  return v;
}

Interpreter::Flow Interpreter::exec_stmt(const Stmt& s, const ScopePtr& scope) {
  switch (s.kind) {
    case StmtKind::Output: write(s.text); return Flow::Normal;
    case StmtKind::Print: {
      Value v = eval(*s.expr, scope);
      if (v.is_string()) write(v.str());
      else write(v.to_str());
      return Flow::Normal;
    }
    case StmtKind::If:
      for (const auto& [cond, body] : s.branches) {
        if (!cond || eval(*cond, scope).truthy()) return exec(body, scope);
      }
      return Flow::Normal;
    case StmtKind::For: exec_for(s, scope); return Flow::Normal;
    case StmtKind::Set: assign(s.target, eval(*s.expr, scope), scope); return Flow::Normal;
    case StmtKind::SetBlock: {
      Value v(capture(s.body, scope));
      assign(s.target, apply_filter_chain(s.filters, std::move(v), scope), scope);
      return Flow::Normal;
    }
    case StmtKind::Macro: scope->set(s.name, make_macro(s, scope, false)); return Flow::Normal;
    case StmtKind::CallBlock: {
      const Expr& call = *s.expr;
      Value fn = eval(*call.args[0], scope);
      Args args;
      eval_args(call, 1, args, scope);
      args.kw.emplace_back("caller", make_macro(s, scope, true));
      loc_ = s.loc;
      write(this->call(fn, args).to_str());
      return Flow::Normal;
    }
    case StmtKind::FilterBlock: {
      Value v(capture(s.body, scope));
      write(apply_filter_chain(s.filters, std::move(v), scope).to_str());
      return Flow::Normal;
    }
    case StmtKind::With: {
      auto inner = std::make_shared<Scope>();
      inner->parent = scope;
      for (const auto& [target, expr] : s.assigns) assign(target, eval(*expr, scope), inner);
      return exec(s.body, inner);
    }
    case StmtKind::Break: return Flow::Break;
    case StmtKind::Continue: return Flow::Continue;
    case StmtKind::Generation: return exec(s.body, scope);
  }
  return Flow::Normal;
}

List iterate(Interpreter& in, const Value& v) {
  switch (v.kind()) {
    case Kind::Undefined: return {};
    case Kind::List:
    case Kind::Tuple: return v.items();
    case Kind::Dict: {
      List keys;
      keys.reserve(v.dict_ref().size());
      for (const auto& [k, val] : v.dict_ref().entries) keys.push_back(k);
      return keys;
    }
    case Kind::String: {
      List chars;
      const std::string& s = v.str();
      for (size_t i = 0; i < s.size();) {
        size_t j = i + 1;
        while (j < s.size() && (static_cast<unsigned char>(s[j]) & 0xc0) == 0x80) ++j;
        chars.emplace_back(s.substr(i, j - i));
        i = j;
      }
      return chars;
    }
    default: in.fail(cat("'", v.type_name(), "' object is not iterable"));
  }
}

void Interpreter::exec_for(const Stmt& s, const ScopePtr& scope) {
  Value seq = eval(*s.expr, scope);
  loc_ = s.expr->loc;
  List items = iterate(*this, seq);
  if (s.cond) {
    List kept;
    for (auto& item : items) {
      tick();
      auto tmp = std::make_shared<Scope>();
      tmp->parent = scope;
      assign(s.target, item, tmp);
      if (eval(*s.cond, tmp).truthy()) kept.push_back(std::move(item));
    }
    items = std::move(kept);
  }
  if (items.empty()) {
    exec(s.else_body, scope);
    return;
  }
  const int64_t n = int64_t(items.size());
  // One loop object layout per loop; each iteration copies it and fills in the values.
  auto current = std::make_shared<int64_t>(0);
  auto cyc = std::make_shared<Callable>();
  cyc->name = "cycle";
  cyc->fn = [current](Interpreter& in, Args& a) -> Value {
    if (a.pos.empty()) in.fail("no items for cycling given");
    return a.pos[size_t(*current) % a.pos.size()];
  };
  static const char* const kFields[] = {"index0", "index", "revindex0", "revindex", "first", "last",
                                        "length", "depth0", "depth", "previtem", "nextitem", "cycle"};
  Dict layout;
  for (const char* f : kFields) layout.entries.emplace_back(Value(f), Value());
  layout.entries[6].second = Value(n);
  layout.entries[7].second = Value(0);
  layout.entries[8].second = Value(1);
  layout.entries[11].second = Value::callable(cyc);
  for (int64_t i = 0; i < n; ++i) {
    tick();
    *current = i;
    auto iter = std::make_shared<Scope>();
    iter->parent = scope;
    assign(s.target, items[size_t(i)], iter);
    if (!s.uses_loop) {
      if (exec(s.body, iter) == Flow::Break) break;
      continue;
    }
    Dict loop = layout;
    auto& e = loop.entries;
    e[0].second = Value(i);
    e[1].second = Value(i + 1);
    e[2].second = Value(n - i - 1);
    e[3].second = Value(n - i);
    e[4].second = Value(i == 0);
    e[5].second = Value(i == n - 1);
    e[9].second = i > 0 ? items[size_t(i - 1)] : Value::undefined("there is no previous item");
    e[10].second = i + 1 < n ? items[size_t(i + 1)] : Value::undefined("there is no next item");
    iter->set("loop", Value::namespace_obj(std::move(loop)));
    Flow f = exec(s.body, iter);
    if (f == Flow::Break) break;
  }
}

void Interpreter::assign(const Target& t, const Value& v, const ScopePtr& scope) {
  switch (t.kind) {
    case Target::Kind::Name: scope->set(t.name, v); return;
    case Target::Kind::Attr: {
      Value* obj = scope->find(t.name);
      if (!obj) {
        auto it = globals_.find(std::string_view(t.name));
        if (it) obj = const_cast<Value*>(it);
      }
      loc_ = t.loc;
      if (!obj || !obj->is_namespace()) fail("cannot assign attribute on non-namespace object");
      if (!t.attr.empty() && t.attr[0] == '_')
        fail(cat("Chat templates cannot store underscore-prefixed attributes on a namespace, but got '", t.attr,
                 "'. Please rename the attribute."));
      obj->dict_mut().set(Value(t.attr), v);
      return;
    }
    case Target::Kind::Tuple: {
      loc_ = t.loc;
      if (v.is_undefined()) fail_undefined(v);
      List items = iterate(*this, v);
      if (items.size() > t.items.size()) fail(cat("too many values to unpack (expected ", t.items.size(), ")"));
      if (items.size() < t.items.size())
        fail(cat("not enough values to unpack (expected ", t.items.size(), ", got ", items.size(), ")"));
      for (size_t i = 0; i < items.size(); ++i) assign(t.items[i], items[i], scope);
      return;
    }
  }
}

Value Interpreter::make_macro(const Stmt& s, const ScopePtr& scope, bool is_caller) {
  auto c = std::make_shared<Callable>();
  c->name = is_caller ? "caller" : s.name;
  const Stmt* stmt = &s;
  ScopePtr closure = scope;
  c->fn = [stmt, closure, is_caller](Interpreter& in, Args& args) {
    return in.invoke_macro(*stmt, closure, args, is_caller);
  };
  macros_.push_back(c);
  return Value::callable(c);
}

Value Interpreter::invoke_macro(const Stmt& s, const ScopePtr& closure, Args& args, bool is_caller) {
  const std::string mname = is_caller ? "caller" : s.name;
  if (call_depth_ >= limits_.max_call_depth)
    fail(cat("maximum recursion depth exceeded (", limits_.max_call_depth, " nested macro calls)"));
  tick();
  auto frame = std::make_shared<Scope>();
  frame->parent = closure;
  const size_t np = s.params.size();
  List extra;
  for (size_t i = 0; i < args.pos.size(); ++i) {
    if (i < np) frame->set(s.params[i], args.pos[i]);
    else extra.push_back(args.pos[i]);
  }
  if (!extra.empty() && !s.uses_varargs) fail(cat("macro '", mname, "' takes not more than ", np, " argument(s)"));
  Dict kwargs;
  bool caller_given = false;
  for (auto& [k, v] : args.kw) {
    bool is_param = false;
    for (size_t i = 0; i < np; ++i) {
      if (s.params[i] == k) {
        if (i < args.pos.size()) fail(cat("macro '", mname, "' got multiple values for argument '", k, "'"));
        frame->set(k, v);
        is_param = true;
      }
    }
    if (is_param) continue;
    if (k == "caller" && !is_caller) {
      frame->set("caller", v);
      caller_given = true;
      continue;
    }
    if (!s.uses_kwargs) fail(cat("macro '", mname, "' takes no keyword argument '", k, "'"));
    kwargs.set(Value(k), v);
  }
  for (size_t i = args.pos.size(); i < np; ++i) {
    bool given = false;
    for (auto& kv : args.kw)
      if (kv.first == s.params[i]) given = true;
    if (given) continue;
    if (s.defaults[i]) frame->set(s.params[i], eval(*s.defaults[i], frame));
    else frame->set(s.params[i], Value::undefined(cat("parameter '", s.params[i], "' was not provided")));
  }
  if (!is_caller && !caller_given && s.uses_caller) frame->set("caller", Value::undefined("No caller defined"));
  frame->set("varargs", Value::tuple(std::move(extra)));
  frame->set("kwargs", Value::dict(std::move(kwargs)));
  ++call_depth_;
  std::string result;
  try {
    result = capture(s.body, frame);
  } catch (...) {
    --call_depth_;
    throw;
  }
  --call_depth_;
  return Value(std::move(result));
}

// ---- expressions -------------------------------------------------------------------------

Value Interpreter::lookup(const std::string& name, const ScopePtr& scope) {
  if (Value* v = scope->find(name)) return *v;
  if (const Value* g = globals_.find(std::string_view(name))) return *g;
  return Value::undefined(cat("'", name, "' is undefined"));
}

void Interpreter::eval_args(const Expr& e, size_t first, Args& args, const ScopePtr& scope) {
  for (size_t i = first; i < e.args.size(); ++i) args.pos.push_back(eval(*e.args[i], scope));
  for (const auto& [k, v] : e.kwargs) args.kw.emplace_back(k, eval(*v, scope));
}

Value Interpreter::call(const Value& fn, Args& args) {
  if (fn.is_undefined()) fail_undefined(fn);
  if (!fn.is_callable()) fail(cat("'", fn.type_name(), "' object is not callable"));
  if (!fn.fn().fn) fail("macro called after its template finished rendering");
  return fn.fn().fn(*this, args);
}

Value Interpreter::eval_call(const Expr& e, const ScopePtr& scope) {
  Value fn = eval(*e.args[0], scope);
  Args args;
  eval_args(e, 1, args, scope);
  loc_ = e.loc;
  return call(fn, args);
}

static std::string object_desc(const Value& obj) {
  if (obj.is_none()) return "'None'";
  return "'" + obj.type_name() + " object'";
}

Value Interpreter::getattr(const Value& obj, const std::string& name) {
  if (obj.is_undefined()) fail_undefined(obj);
  // jinja2's sandbox answers an unsafe attribute with an undefined value that fails when used.
  if ((name.size() > 1 && name[0] == '_' && name[1] == '_') || is_unsafe_method(obj, name))
    return Value::undefined(cat("access to attribute '", name, "' of '", obj.type_name(), "' object is unsafe."));
  Value m = bound_method(obj, name);
  if (!m.is_undefined()) return m;
  if (obj.is_dict() || obj.is_namespace()) {
    if (const Value* v = obj.dict_ref().find(std::string_view(name))) return *v;
  }
  return Value::undefined(cat(object_desc(obj), " has no attribute '", name, "'"));
}

Value Interpreter::getitem(const Value& obj, const Value& key) {
  if (obj.is_undefined()) fail_undefined(obj);
  switch (obj.kind()) {
    case Kind::Dict:
      if (const Value* v = obj.dict_ref().find(key)) return *v;
      break;
    case Kind::List:
    case Kind::Tuple:
      if (key.is_int() || key.is_bool()) {
        int64_t i = key.as_int(), n = int64_t(obj.items().size());
        if (i < 0) i += n;
        if (i >= 0 && i < n) return obj.items()[size_t(i)];
      }
      break;
    case Kind::String:
      if (key.is_int() || key.is_bool()) {
        const std::string& s = obj.str();
        int64_t i = key.as_int();
        if (is_ascii(s)) {
          int64_t n = int64_t(s.size());
          if (i < 0) i += n;
          if (i >= 0 && i < n) return Value(s.substr(size_t(i), 1));
        } else {
          std::u32string u = utf8_decode(s);
          int64_t n = int64_t(u.size());
          if (i < 0) i += n;
          if (i >= 0 && i < n) return Value(utf8_encode(u.substr(size_t(i), 1)));
        }
      }
      break;
    default: break;
  }
  if (key.is_string()) {
    if (obj.is_namespace())
      if (const Value* v = obj.dict_ref().find(key)) return *v;
    if (is_unsafe_method(obj, key.str()) || (key.str().size() > 1 && key.str()[0] == '_' && key.str()[1] == '_'))
      return Value::undefined(cat("access to attribute '", key.str(), "' of '", obj.type_name(), "' object is unsafe."));
    Value m = bound_method(obj, key.str());
    if (!m.is_undefined()) return m;
    return Value::undefined(cat(object_desc(obj), " has no attribute '", key.str(), "'"));
  }
  return Value::undefined(cat(object_desc(obj), " has no element ", key.repr()));
}

Value Interpreter::slice(const Value& obj, const Value& start, const Value& stop, const Value& step) {
  if (obj.is_undefined()) fail_undefined(obj);
  for (const Value* v : {&start, &stop, &step})
    if (!(v->is_none() || v->is_int() || v->is_bool())) fail("slice indices must be integers or None or have an __index__ method");
  int64_t st = step.is_none() ? 1 : step.as_int();
  if (st == 0) fail("slice step cannot be zero");
  auto indices = [&](int64_t n, int64_t& a, int64_t& b) {
    auto clamp = [&](const Value& v, int64_t def, bool is_start) -> int64_t {
      if (v.is_none()) return def;
      int64_t x = v.as_int();
      if (x < 0) {
        x += n;
        if (x < 0) x = st < 0 ? -1 : 0;
      } else if (x >= n) {
        x = st < 0 ? n - 1 : n;
      }
      (void)is_start;
      return x;
    };
    a = clamp(start, st < 0 ? n - 1 : 0, true);
    b = clamp(stop, st < 0 ? -1 : n, false);
  };
  auto pick = [&](int64_t n, auto&& emit) {
    int64_t a, b;
    indices(n, a, b);
    if (st > 0)
      for (int64_t i = a; i < b; i += st) emit(i);
    else
      for (int64_t i = a; i > b; i += st) emit(i);
  };
  if (obj.is_sequence()) {
    const List& items = obj.items();
    List out;
    pick(int64_t(items.size()), [&](int64_t i) { out.push_back(items[size_t(i)]); });
    return obj.kind() == Kind::Tuple ? Value::tuple(std::move(out)) : Value::list(std::move(out));
  }
  if (obj.is_string()) {
    std::u32string u = utf8_decode(obj.str());
    std::u32string out;
    pick(int64_t(u.size()), [&](int64_t i) { out += u[size_t(i)]; });
    return Value(utf8_encode(out));
  }
  if (obj.is_dict()) fail("unhashable type: 'slice'");
  fail(cat("'", obj.type_name(), "' object is not subscriptable"));
}

bool Interpreter::contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Kind::Undefined: return false;
    case Kind::String:
      if (!item.is_string())
        fail(cat("'in <string>' requires string as left operand, not ", item.type_name()));
      return container.str().find(item.str()) != std::string::npos;
    case Kind::List:
    case Kind::Tuple:
      for (const auto& x : container.items())
        if (py_equal(x, item)) return true;
      return false;
    case Kind::Dict: return container.dict_ref().find(item) != nullptr;
    default: fail(cat("argument of type '", container.type_name(), "' is not iterable"));
  }
}

bool Interpreter::compare(const std::string& op, const Value& a, const Value& b) {
  if (op == "==") return py_equal(a, b);
  if (op == "!=") return !py_equal(a, b);
  if (op == "in") return contains(b, a);
  if (op == "not in") return !contains(b, a);
  if (a.is_undefined()) fail_undefined(a);
  if (b.is_undefined()) fail_undefined(b);
  std::string err;
  bool r;
  if (op == "<") r = py_less(a, b, &err);
  else if (op == ">") r = py_less(b, a, &err);
  else if (op == "<=") r = !py_less(b, a, &err);
  else r = !py_less(a, b, &err);
  if (!err.empty()) {
    size_t p = err.find("'<'");
    if (p != std::string::npos) err.replace(p, 3, "'" + op + "'");
    if (op == ">" || op == "<=") {
      // py_less was called with swapped operands; name them in source order
      err = cat("'", op, "' not supported between instances of '", a.type_name(), "' and '", b.type_name(), "'");
    }
    fail(err);
  }
  return r;
}

static bool mul_overflows(int64_t a, int64_t b, int64_t* r) { return __builtin_mul_overflow(a, b, r); }

Value Interpreter::binary(const std::string& op, const Value& a, const Value& b) {
  if (a.is_undefined()) fail_undefined(a);
  if (b.is_undefined()) fail_undefined(b);
  auto unsupported = [&]() {
    fail(cat("unsupported operand type(s) for ", op, ": '", a.type_name(), "' and '", b.type_name(), "'"));
  };
  const bool nums = a.is_number() && b.is_number();
  const bool ints = nums && !a.is_float() && !b.is_float();
  if (op == "+") {
    if (ints) {
      int64_t r;
      if (__builtin_add_overflow(a.as_int(), b.as_int(), &r)) fail("integer overflow");
      return Value(r);
    }
    if (nums) return Value(a.as_double() + b.as_double());
    if (a.is_string() && b.is_string()) {
      check_size(a.str().size() + b.str().size());
      return Value(a.str() + b.str());
    }
    if ((a.kind() == Kind::List && b.kind() == Kind::List) || (a.kind() == Kind::Tuple && b.kind() == Kind::Tuple)) {
      List r = a.items();
      r.insert(r.end(), b.items().begin(), b.items().end());
      tick(int64_t(r.size()));
      return a.kind() == Kind::Tuple ? Value::tuple(std::move(r)) : Value::list(std::move(r));
    }
    if (a.is_string()) fail(cat("can only concatenate str (not \"", b.type_name(), "\") to str"));
    if (a.is_sequence()) fail(cat("can only concatenate ", a.type_name(), " (not \"", b.type_name(), "\") to ", a.type_name()));
    unsupported();
  }
  if (op == "-") {
    if (ints) {
      int64_t r;
      if (__builtin_sub_overflow(a.as_int(), b.as_int(), &r)) fail("integer overflow");
      return Value(r);
    }
    if (nums) return Value(a.as_double() - b.as_double());
    unsupported();
  }
  if (op == "*") {
    if (ints) {
      int64_t r;
      if (mul_overflows(a.as_int(), b.as_int(), &r)) fail("integer overflow");
      return Value(r);
    }
    if (nums) return Value(a.as_double() * b.as_double());
    const Value* seq = nullptr;
    const Value* count = nullptr;
    if ((a.is_string() || a.is_sequence()) && (b.is_int() || b.is_bool())) seq = &a, count = &b;
    else if ((b.is_string() || b.is_sequence()) && (a.is_int() || a.is_bool())) seq = &b, count = &a;
    if (!seq) {
      if (a.is_string() || b.is_string() || a.is_sequence() || b.is_sequence())
        fail(cat("can't multiply sequence by non-int of type '", (a.is_string() || a.is_sequence() ? b : a).type_name(), "'"));
      unsupported();
    }
    int64_t n = std::max<int64_t>(0, count->as_int());
    if (seq->is_string()) {
      const std::string& s = seq->str();
      if (n > 0 && s.size() > limits_.max_output_bytes / size_t(n)) check_size(limits_.max_output_bytes + 1);
      std::string r;
      r.reserve(s.size() * size_t(n));
      for (int64_t i = 0; i < n; ++i) r += s;
      return Value(std::move(r));
    }
    const List& items = seq->items();
    if (n > 0 && items.size() > size_t(limits_.max_steps) / size_t(n)) tick(limits_.max_steps + 1);
    tick(int64_t(items.size()) * n);
    List r;
    for (int64_t i = 0; i < n; ++i) r.insert(r.end(), items.begin(), items.end());
    return seq->kind() == Kind::Tuple ? Value::tuple(std::move(r)) : Value::list(std::move(r));
  }
  if (op == "/") {
    if (!nums) unsupported();
    if (b.as_double() == 0.0) fail("division by zero");
    return Value(a.as_double() / b.as_double());
  }
  if (op == "//") {
    if (!nums) unsupported();
    if (ints) {
      int64_t x = a.as_int(), y = b.as_int();
      if (y == 0) fail("integer division or modulo by zero");
      if (x == INT64_MIN && y == -1) fail("integer overflow");
      int64_t q = x / y;
      if ((x % y != 0) && ((x < 0) != (y < 0))) --q;
      return Value(q);
    }
    double x = a.as_double(), y = b.as_double();
    if (y == 0.0) fail("float floor division by zero");
    double mod = std::fmod(x, y);
    double div = (x - mod) / y;
    if (mod != 0.0 && ((y < 0) != (mod < 0))) div -= 1.0;
    double fl;
    if (div != 0.0) {
      fl = std::floor(div);
      if (div - fl > 0.5) fl += 1.0;
    } else {
      fl = std::copysign(0.0, x / y);
    }
    return Value(fl);
  }
  if (op == "%") {
    if (a.is_string()) return Value(percent_format(*this, a.str(), b));
    if (!nums) unsupported();
    if (ints) {
      int64_t x = a.as_int(), y = b.as_int();
      if (y == 0) fail("integer modulo by zero");
      if (y == -1) return Value(int64_t(0));
      int64_t r = x % y;
      if (r != 0 && ((r < 0) != (y < 0))) r += y;
      return Value(r);
    }
    double x = a.as_double(), y = b.as_double();
    if (y == 0.0) fail("float modulo by zero");
    double m = std::fmod(x, y);
    if (m != 0.0) {
      if ((y < 0) != (m < 0)) m += y;
    } else {
      m = std::copysign(0.0, y);
    }
    return Value(m);
  }
  if (op == "**") {
    if (!nums) unsupported();
    if (ints && b.as_int() >= 0) {
      int64_t base = a.as_int(), e = b.as_int(), r = 1;
      while (e > 0) {
        if (e & 1)
          if (mul_overflows(r, base, &r)) fail("integer overflow");
        e >>= 1;
        if (e > 0 && mul_overflows(base, base, &base)) fail("integer overflow");
      }
      return Value(r);
    }
    double x = a.as_double(), y = b.as_double();
    if (x == 0.0 && y < 0) fail("0.0 cannot be raised to a negative power");
    return Value(std::pow(x, y));
  }
  fail(cat("unknown operator '", op, "'"));
}

Value Interpreter::eval(const Expr& e, const ScopePtr& scope) {
  switch (e.kind) {
    case ExprKind::Const: return e.value;
    case ExprKind::Name: return lookup(e.name, scope);
    case ExprKind::List:
    case ExprKind::Tuple: {
      List items;
      items.reserve(e.args.size());
      for (const auto& a : e.args) items.push_back(eval(*a, scope));
      return e.kind == ExprKind::List ? Value::list(std::move(items)) : Value::tuple(std::move(items));
    }
    case ExprKind::Dict: {
      Dict d;
      for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
        Value k = eval(*e.args[i], scope);
        if (k.is_sequence() && k.kind() == Kind::List) {
          loc_ = e.args[i]->loc;
          fail("unhashable type: 'list'");
        }
        if (k.is_dict()) {
          loc_ = e.args[i]->loc;
          fail("unhashable type: 'dict'");
        }
        d.set(k, eval(*e.args[i + 1], scope));
      }
      return Value::dict(std::move(d));
    }
    case ExprKind::GetAttr: {
      Value obj = eval(*e.args[0], scope);
      loc_ = e.loc;
      return getattr(obj, e.name);
    }
    case ExprKind::GetItem: {
      Value obj = eval(*e.args[0], scope);
      Value key = eval(*e.args[1], scope);
      loc_ = e.loc;
      return getitem(obj, key);
    }
    case ExprKind::Slice: {
      Value obj = eval(*e.args[0], scope);
      Value parts[3];
      for (int i = 0; i < 3; ++i) parts[i] = e.args[size_t(i) + 1] ? eval(*e.args[size_t(i) + 1], scope) : Value(nullptr);
      loc_ = e.loc;
      return slice(obj, parts[0], parts[1], parts[2]);
    }
    case ExprKind::Call: return eval_call(e, scope);
    case ExprKind::Filter: {
      Value subject = eval(*e.args[0], scope);
      Args args;
      eval_args(e, 1, args, scope);
      loc_ = e.loc;
      return apply_filter(*this, e.name, subject, args);
    }
    case ExprKind::Test: {
      Value subject = eval(*e.args[0], scope);
      Args args;
      eval_args(e, 1, args, scope);
      loc_ = e.loc;
      bool r = apply_test(*this, e.name, subject, args);
      return Value(e.negated ? !r : r);
    }
    case ExprKind::Neg:
    case ExprKind::Pos: {
      Value v = eval(*e.args[0], scope);
      loc_ = e.loc;
      if (v.is_undefined()) fail_undefined(v);
      if (!v.is_number()) fail(cat("bad operand type for unary ", e.kind == ExprKind::Neg ? "-" : "+", ": '", v.type_name(), "'"));
      if (e.kind == ExprKind::Pos) return v.is_bool() ? Value(v.as_int()) : v;
      if (v.is_float()) return Value(-v.as_double());
      if (v.as_int() == INT64_MIN) fail("integer overflow");
      return Value(-v.as_int());
    }
    case ExprKind::Not: return Value(!eval(*e.args[0], scope).truthy());
    case ExprKind::And: {
      Value a = eval(*e.args[0], scope);
      if (!a.truthy()) return a;
      return eval(*e.args[1], scope);
    }
    case ExprKind::Or: {
      Value a = eval(*e.args[0], scope);
      if (a.truthy()) return a;
      return eval(*e.args[1], scope);
    }
    case ExprKind::Binary: {
      Value a = eval(*e.args[0], scope);
      Value b = eval(*e.args[1], scope);
      loc_ = e.loc;
      return binary(e.name, a, b);
    }
    case ExprKind::Compare: {
      Value left = eval(*e.args[0], scope);
      for (size_t i = 0; i < e.ops.size(); ++i) {
        Value right = eval(*e.args[i + 1], scope);
        loc_ = e.loc;
        if (!compare(e.ops[i], left, right)) return Value(false);
        left = std::move(right);
      }
      return Value(true);
    }
    case ExprKind::Concat: {
      std::string s;
      for (const auto& a : e.args) {
        s += eval(*a, scope).to_str();
        check_size(s.size());
      }
      return Value(std::move(s));
    }
    case ExprKind::CondExpr: {
      if (eval(*e.args[0], scope).truthy()) return eval(*e.args[1], scope);
      if (e.args[2]) return eval(*e.args[2], scope);
      return Value::undefined(cat("the inline if-expression on line ", e.loc.line,
                                  " evaluated to false and no else section was defined."));
    }
  }
  return Value();
}

}  // namespace kestrel::jinja
