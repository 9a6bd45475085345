#include "text/jinja_parser.h"

#include <algorithm>
#include <initializer_list>

#include "common/error.h"
#include "text/jinja_builtins.h"

namespace kestrel::jinja {
namespace {

constexpr int kMaxNesting = 200;
constexpr int kMaxExprDepth = 400;

std::string describe(const Token& t) {
  switch (t.kind) {
    case TokKind::Data: return "template data";
    case TokKind::VarBegin: return "'{{'";
    case TokKind::VarEnd: return "end of print statement";
    case TokKind::BlockBegin: return "'{%'";
    case TokKind::BlockEnd: return "end of statement block";
    case TokKind::Name: return "'" + t.text + "'";
    case TokKind::String: return "string";
    case TokKind::Int: return "integer";
    case TokKind::Float: return "float";
    case TokKind::Op: return "'" + t.text + "'";
    case TokKind::Eof: return "end of template";
  }
  return "token";
}

class Parser {
 public:
  Parser(std::vector<Token> toks, const std::string& name) : toks_(std::move(toks)), name_(name) {}

  Body parse_all() {
    Body body = subparse({});
    if (cur().kind != TokKind::Eof) error(cur().loc, "unexpected " + describe(cur()));
    return body;
  }

 private:
  // ---- token stream ----
  const Token& cur() const { return toks_[pos_]; }
  const Token& peek(size_t k = 1) const { return toks_[std::min(pos_ + k, toks_.size() - 1)]; }
  const Token& next() {
    const Token& t = toks_[pos_];
    if (pos_ + 1 < toks_.size()) ++pos_;
    return t;
  }
  bool is_op(std::string_view op) const { return cur().kind == TokKind::Op && cur().text == op; }
  bool is_name(std::string_view n) const { return cur().kind == TokKind::Name && cur().text == n; }
  bool skip_op(std::string_view op) {
    if (!is_op(op)) return false;
    next();
    return true;
  }
  bool skip_name(std::string_view n) {
    if (!is_name(n)) return false;
    next();
    return true;
  }
  void expect_op(std::string_view op) {
    if (!is_op(op)) error(cur().loc, cat("expected '", op, "', got ", describe(cur())));
    next();
  }
  void expect_block_end() {
    if (cur().kind != TokKind::BlockEnd) error(cur().loc, cat("expected end of statement block, got ", describe(cur())));
    next();
  }
  std::string expect_name() {
    if (cur().kind != TokKind::Name) error(cur().loc, cat("expected a name, got ", describe(cur())));
    return next().text;
  }

  [[noreturn]] void error(Loc l, const std::string& msg) const { fail(name_, ":", l.line, ":", l.col, ": ", msg); }

  struct DepthGuard {
    Parser& p;
    DepthGuard(Parser& parser, Loc l) : p(parser) {
      if (++p.depth_ > kMaxNesting) p.error(l, "template nesting too deep");
    }
    ~DepthGuard() { --p.depth_; }
  };

  // Records the depth of a node built over existing ones; left-deep chains (a + b + c ..., a.b.c ...)
  // are bounded here so that evaluating and freeing them cannot exhaust the stack.
  ExprPtr sized(ExprPtr e) {
    int d = 0;
    for (const auto& a : e->args)
      if (a) d = std::max(d, a->depth);
    for (const auto& [k, a] : e->kwargs)
      if (a) d = std::max(d, a->depth);
    e->depth = d + 1;
    if (e->depth > kMaxExprDepth) error(e->loc, "expression nesting too deep");
    return e;
  }

  static ExprPtr make(ExprKind k, Loc l) {
    auto e = std::make_unique<Expr>();
    e->kind = k;
    e->loc = l;
    return e;
  }

  // ---- statements ----

  // Statements until a block tag whose name is in `end`; leaves the stream on that name.
  Body subparse(std::initializer_list<std::string_view> end) {
    Body body;
    for (;;) {
      const Token& t = cur();
      if (t.kind == TokKind::Eof) {
        if (end.size() == 0) return body;
        eof_error(end);
      }
      if (t.kind == TokKind::Data) {
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::Output;
        s->loc = t.loc;
        s->text = t.text;
        body.push_back(std::move(s));
        next();
      } else if (t.kind == TokKind::VarBegin) {
        next();
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::Print;
        s->loc = cur().loc;
        s->expr = parse_tuple(true, {}, false);
        if (cur().kind != TokKind::VarEnd) error(cur().loc, cat("expected end of print statement, got ", describe(cur())));
        next();
        body.push_back(std::move(s));
      } else if (t.kind == TokKind::BlockBegin) {
        next();
        if (cur().kind == TokKind::Name)
          for (std::string_view e : end)
            if (cur().text == e) return body;
        body.push_back(parse_statement(end));
      } else {
        error(t.loc, "unexpected " + describe(t));
      }
    }
  }

  std::string end_list(std::initializer_list<std::string_view> end) const {
    std::string s;
    size_t i = 0;
    for (std::string_view e : end) {
      if (i++) s += i == end.size() ? " or " : ", ";
      s += cat("'", e, "'");
    }
    return s;
  }

  [[noreturn]] void eof_error(std::initializer_list<std::string_view> end) const {
    std::string msg = "Unexpected end of template. Jinja was looking for the following tags: " + end_list(end) + ".";
    if (!open_blocks_.empty()) {
      msg += cat(" The innermost block that needs to be closed is '", open_blocks_.back().first, "' (opened at line ",
                 open_blocks_.back().second.line, ").");
    }
    error(cur().loc, msg);
  }

  // After a statement's head: `%}` then the body up to one of `end`; the stream is left on the end name.
  Body parse_body(std::initializer_list<std::string_view> end) {
    expect_block_end();
    return subparse(end);
  }

  StmtPtr parse_statement(std::initializer_list<std::string_view> end) {
    const Token& t = cur();
    if (t.kind != TokKind::Name) error(t.loc, "tag name expected");
    DepthGuard guard(*this, t.loc);
    const std::string tag = t.text;
    static const std::initializer_list<std::string_view> known_end = {
        "endfor", "endif", "elif", "else", "endset", "endmacro", "endcall", "endfilter", "endwith", "endgeneration", "endraw"};
    if (tag == "for") return parse_for();
    if (tag == "if") return parse_if();
    if (tag == "set") return parse_set();
    if (tag == "macro") return parse_macro();
    if (tag == "call") return parse_call_block();
    if (tag == "filter") return parse_filter_block();
    if (tag == "with") return parse_with();
    if (tag == "generation") return parse_generation();
    if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) error(t.loc, cat("'", tag, "' outside of a loop"));
      auto s = std::make_unique<Stmt>();
      s->kind = tag == "break" ? StmtKind::Break : StmtKind::Continue;
      s->loc = t.loc;
      next();
      expect_block_end();
      return s;
    }
    if (tag == "include" || tag == "import" || tag == "from" || tag == "extends" || tag == "block" || tag == "do" ||
        tag == "autoescape" || tag == "trans")
      error(t.loc, cat("the '", tag, "' tag is not supported in chat templates"));
    for (std::string_view e : known_end) {
      if (tag == e) {
        std::string msg = cat("Encountered unknown tag '", tag, "'.");
        if (end.size())
          msg += " You probably made a nesting mistake. Jinja is expecting this tag, but currently looking for " +
                 end_list(end) + ".";
        if (!open_blocks_.empty()) msg += cat(" The innermost block that needs to be closed is '", open_blocks_.back().first, "'.");
        error(t.loc, msg);
      }
    }
    error(t.loc, cat("Encountered unknown tag '", tag, "'."));
  }

  struct BlockScope {
    Parser& p;
    BlockScope(Parser& parser, std::string tag, Loc l) : p(parser) { p.open_blocks_.emplace_back(std::move(tag), l); }
    ~BlockScope() { p.open_blocks_.pop_back(); }
  };

  StmtPtr parse_for() {
    auto s = std::make_unique<Stmt>();
    s->kind = StmtKind::For;
    s->loc = next().loc;
    BlockScope scope(*this, "for", s->loc);
    s->target = parse_assign_target(true, false, {"in"});
    if (!skip_name("in")) error(cur().loc, cat("expected 'in', got ", describe(cur())));
    s->expr = parse_tuple(false, {"recursive"}, false);
    if (skip_name("if")) s->cond = parse_expression(true);
    if (is_name("recursive")) error(cur().loc, "recursive loops are not supported");
    ++loop_depth_;
    loop_uses_.push_back(false);
    s->body = parse_body({"endfor", "else"});
    s->uses_loop = loop_uses_.back();
    loop_uses_.pop_back();
    --loop_depth_;
    if (next().text == "else") {
      s->else_body = parse_body({"endfor"});
      next();
    }
    expect_block_end();
    return s;
  }

  StmtPtr parse_if() {
    auto s = std::make_unique<Stmt>();
    s->kind = StmtKind::If;
    s->loc = next().loc;
    BlockScope scope(*this, "if", s->loc);
    for (;;) {
      ExprPtr cond = parse_tuple(false, {}, false);
      Body body = parse_body({"elif", "else", "endif"});
      s->branches.emplace_back(std::move(cond), std::move(body));
      const std::string tag = next().text;
      if (tag == "elif") continue;
      if (tag == "else") {
        Body else_body = parse_body({"endif"});
        next();
        s->branches.emplace_back(nullptr, std::move(else_body));
      }
      break;
    }
    expect_block_end();
    return s;
  }

  StmtPtr parse_set() {
    auto s = std::make_unique<Stmt>();
    s->loc = next().loc;
    s->target = parse_assign_target(true, true, {});
    if (skip_op("=")) {
      s->kind = StmtKind::Set;
      s->expr = parse_tuple(true, {}, false);
      expect_block_end();
      return s;
    }
    s->kind = StmtKind::SetBlock;
    if (s->target.kind != Target::Kind::Name) error(s->loc, "a block 'set' assigns to a single name");
    while (skip_op("|")) s->filters.push_back(parse_filter(nullptr));
    BlockScope scope(*this, "set", s->loc);
    s->body = parse_body({"endset"});
    next();
    expect_block_end();
    return s;
  }

  void parse_signature(Stmt& s) {
    expect_op("(");
    bool first = true;
    while (!is_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (is_op(")")) break;
      Loc l = cur().loc;
      std::string p = expect_name();
      if (p == "varargs" || p == "kwargs" || p == "caller" || p == "loop") error(l, cat("'", p, "' cannot be a parameter name"));
      s.params.push_back(p);
      if (skip_op("=")) s.defaults.push_back(parse_expression(true));
      else if (!s.defaults.empty() && s.defaults.back()) error(l, "non-default argument follows default argument");
      else s.defaults.push_back(nullptr);
    }
    next();
  }

  StmtPtr parse_macro() {
    auto s = std::make_unique<Stmt>();
    s->kind = StmtKind::Macro;
    s->loc = next().loc;
    s->name = expect_name();
    parse_signature(*s);
    BlockScope scope(*this, "macro", s->loc);
    macro_uses_.emplace_back();
    int saved_loops = loop_depth_;
    loop_depth_ = 0;
    s->body = parse_body({"endmacro"});
    loop_depth_ = saved_loops;
    next();
    if (cur().kind == TokKind::Name && cur().text == s->name) next();
    expect_block_end();
    s->uses_varargs = macro_uses_.back().varargs;
    s->uses_kwargs = macro_uses_.back().kwargs;
    s->uses_caller = macro_uses_.back().caller;
    macro_uses_.pop_back();
    return s;
  }

  StmtPtr parse_call_block() {
    auto s = std::make_unique<Stmt>();
    s->kind = StmtKind::CallBlock;
    s->loc = next().loc;
    if (is_op("(")) parse_signature(*s);
    s->expr = parse_expression(true);
    if (s->expr->kind != ExprKind::Call) error(s->loc, "expected a call expression after 'call'");
    BlockScope scope(*this, "call", s->loc);
    macro_uses_.emplace_back();
    int saved_loops = loop_depth_;
    loop_depth_ = 0;
    s->body = parse_body({"endcall"});
    loop_depth_ = saved_loops;
    s->uses_varargs = macro_uses_.back().varargs;
    s->uses_kwargs = macro_uses_.back().kwargs;
    macro_uses_.pop_back();
    next();
    expect_block_end();
    return s;
  }

  StmtPtr parse_filter_block() {
    auto s = std::make_unique<Stmt>();
    s->kind = StmtKind::FilterBlock;
    s->loc = next().loc;
    s->filters.push_back(parse_filter(nullptr));
    while (skip_op("|")) s->filters.push_back(parse_filter(nullptr));
    BlockScope scope(*this, "filter", s->loc);
    s->body = parse_body({"endfilter"});
    next();
    expect_block_end();
    return s;
  }

  StmtPtr parse_with() {
    auto s = std::make_unique<Stmt>();
    s->kind = StmtKind::With;
    s->loc = next().loc;
    while (cur().kind != TokKind::BlockEnd) {
      if (!s->assigns.empty()) expect_op(",");
      Target t = parse_assign_target(false, false, {});
      expect_op("=");
      s->assigns.emplace_back(std::move(t), parse_expression(true));
    }
    BlockScope scope(*this, "with", s->loc);
    s->body = parse_body({"endwith"});
    next();
    expect_block_end();
    return s;
  }

  StmtPtr parse_generation() {
    auto s = std::make_unique<Stmt>();
    s->kind = StmtKind::Generation;
    s->loc = next().loc;
    BlockScope scope(*this, "generation", s->loc);
    s->body = parse_body({"endgeneration"});
    next();
    expect_block_end();
    return s;
  }

  Target parse_assign_target(bool with_tuple, bool with_namespace, std::initializer_list<std::string_view> extra_end) {
    Target t;
    t.loc = cur().loc;
    if (with_namespace && cur().kind == TokKind::Name && peek().kind == TokKind::Op && peek().text == ".") {
      t.kind = Target::Kind::Attr;
      t.name = next().text;
      next();
      t.attr = expect_name();
      return t;
    }
    auto one = [&]() -> Target {
      Target x;
      x.loc = cur().loc;
      if (skip_op("(")) {
        x.kind = Target::Kind::Tuple;
        while (!is_op(")")) {
          if (!x.items.empty()) expect_op(",");
          if (is_op(")")) break;
          Target inner;
          inner.loc = cur().loc;
          inner.name = expect_name();
          x.items.push_back(std::move(inner));
        }
        next();
        return x;
      }
      x.name = expect_name();
      if (x.name == "true" || x.name == "false" || x.name == "none" || x.name == "True" || x.name == "False" ||
          x.name == "None")
        error(x.loc, cat("can't assign to '", x.name, "'"));
      return x;
    };
    t = one();
    if (!with_tuple || !is_op(",")) return t;
    Target tuple;
    tuple.kind = Target::Kind::Tuple;
    tuple.loc = t.loc;
    tuple.items.push_back(std::move(t));
    while (skip_op(",")) {
      if (cur().kind != TokKind::Name && !is_op("(")) break;
      bool stop = false;
      for (std::string_view e : extra_end)
        if (is_name(e)) stop = true;
      if (stop) break;
      tuple.items.push_back(one());
    }
    return tuple;
  }

  // ---- expressions ----

  ExprPtr parse_expression(bool with_condexpr) {
    DepthGuard guard(*this, cur().loc);
    return with_condexpr ? parse_condexpr() : parse_or();
  }

  ExprPtr parse_condexpr() {
    Loc l = cur().loc;
    ExprPtr expr1 = parse_or();
    while (skip_name("if")) {
      ExprPtr test = parse_or();
      ExprPtr expr3;
      if (skip_name("else")) expr3 = parse_condexpr();
      auto e = make(ExprKind::CondExpr, l);
      e->args.push_back(std::move(test));
      e->args.push_back(std::move(expr1));
      e->args.push_back(std::move(expr3));
      expr1 = sized(std::move(e));
    }
    return expr1;
  }

  ExprPtr binary(ExprKind k, ExprPtr a, ExprPtr b, Loc l, std::string op = {}) {
    auto e = make(k, l);
    e->name = std::move(op);
    e->args.push_back(std::move(a));
    e->args.push_back(std::move(b));
    return sized(std::move(e));
  }

  ExprPtr parse_or() {
    Loc l = cur().loc;
    ExprPtr left = parse_and();
    while (skip_name("or")) left = binary(ExprKind::Or, std::move(left), parse_and(), l);
    return left;
  }

  ExprPtr parse_and() {
    Loc l = cur().loc;
    ExprPtr left = parse_not();
    while (skip_name("and")) left = binary(ExprKind::And, std::move(left), parse_not(), l);
    return left;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      DepthGuard guard(*this, cur().loc);
      auto e = make(ExprKind::Not, next().loc);
      e->args.push_back(parse_not());
      return sized(std::move(e));
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    Loc l = cur().loc;
    ExprPtr first = parse_math1();
    std::unique_ptr<Expr> cmp;
    for (;;) {
      std::string op;
      if (cur().kind == TokKind::Op &&
          (is_op("==") || is_op("!=") || is_op("<") || is_op("<=") || is_op(">") || is_op(">="))) {
        op = next().text;
      } else if (is_name("in")) {
        next();
        op = "in";
      } else if (is_name("not") && peek().kind == TokKind::Name && peek().text == "in") {
        next();
        next();
        op = "not in";
      } else {
        break;
      }
      if (!cmp) {
        cmp = make(ExprKind::Compare, l);
        cmp->args.push_back(std::move(first));
      }
      cmp->ops.push_back(op);
      cmp->args.push_back(parse_math1());
    }
    return cmp ? sized(std::move(cmp)) : std::move(first);
  }

  ExprPtr parse_math1() {
    Loc l = cur().loc;
    ExprPtr left = parse_concat();
    while (is_op("+") || is_op("-")) {
      std::string op = next().text;
      left = binary(ExprKind::Binary, std::move(left), parse_concat(), l, op);
    }
    return left;
  }

  ExprPtr parse_concat() {
    Loc l = cur().loc;
    ExprPtr first = parse_math2();
    if (!is_op("~")) return first;
    auto e = make(ExprKind::Concat, l);
    e->args.push_back(std::move(first));
    while (skip_op("~")) e->args.push_back(parse_math2());
    return sized(std::move(e));
  }

  ExprPtr parse_math2() {
    Loc l = cur().loc;
    ExprPtr left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      std::string op = next().text;
      left = binary(ExprKind::Binary, std::move(left), parse_pow(), l, op);
    }
    return left;
  }

  ExprPtr parse_pow() {
    Loc l = cur().loc;
    ExprPtr left = parse_unary(true);
    while (skip_op("**")) left = binary(ExprKind::Binary, std::move(left), parse_unary(true), l, "**");
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    DepthGuard guard(*this, cur().loc);
    ExprPtr node;
    if (is_op("-") || is_op("+")) {
      auto e = make(is_op("-") ? ExprKind::Neg : ExprKind::Pos, cur().loc);
      next();
      e->args.push_back(parse_unary(false));
      node = sized(std::move(e));
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprPtr parse_primary() {
    const Token& t = cur();
    Loc l = t.loc;
    if (t.kind == TokKind::Name) {
      next();
      auto e = make(ExprKind::Const, l);
      if (t.text == "true" || t.text == "True") e->value = Value(true);
      else if (t.text == "false" || t.text == "False") e->value = Value(false);
      else if (t.text == "none" || t.text == "None") e->value = Value(nullptr);
      else {
        e->kind = ExprKind::Name;
        e->name = t.text;
        if (t.text == "loop" && !loop_uses_.empty()) loop_uses_.back() = true;
        if (!macro_uses_.empty()) {
          if (t.text == "varargs") macro_uses_.back().varargs = true;
          if (t.text == "kwargs") macro_uses_.back().kwargs = true;
          if (t.text == "caller") macro_uses_.back().caller = true;
        }
      }
      return e;
    }
    if (t.kind == TokKind::String) {
      std::string s;
      while (cur().kind == TokKind::String) s += next().text;  // adjacent literals concatenate
      auto e = make(ExprKind::Const, l);
      e->value = Value(std::move(s));
      return e;
    }
    if (t.kind == TokKind::Int || t.kind == TokKind::Float) {
      auto e = make(ExprKind::Const, l);
      e->value = t.kind == TokKind::Int ? Value(t.ival) : Value(t.fval);
      next();
      return e;
    }
    if (is_op("(")) {
      next();
      ExprPtr e = parse_tuple(true, {}, true);
      expect_op(")");
      return e;
    }
    if (is_op("[")) {
      next();
      auto e = make(ExprKind::List, l);
      while (!is_op("]")) {
        if (!e->args.empty()) expect_op(",");
        if (is_op("]")) break;
        e->args.push_back(parse_expression(true));
      }
      next();
      return e;
    }
    if (is_op("{")) {
      next();
      auto e = make(ExprKind::Dict, l);
      while (!is_op("}")) {
        if (!e->args.empty()) expect_op(",");
        if (is_op("}")) break;
        e->args.push_back(parse_expression(true));
        expect_op(":");
        e->args.push_back(parse_expression(true));
      }
      next();
      return e;
    }
    error(l, "unexpected " + describe(t));
  }

  // Comma-separated expressions: a tuple when there is a comma, else the single expression.
  ExprPtr parse_tuple(bool with_condexpr, std::initializer_list<std::string_view> extra_end, bool explicit_parens) {
    Loc l = cur().loc;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    auto at_end = [&]() {
      if (cur().kind == TokKind::VarEnd || cur().kind == TokKind::BlockEnd || cur().kind == TokKind::Eof) return true;
      if (is_op(")")) return true;
      for (std::string_view e : extra_end)
        if (is_name(e)) return true;
      return false;
    };
    for (;;) {
      if (!items.empty()) {
        if (!skip_op(",")) break;
        is_tuple = true;
      }
      if (at_end()) break;
      items.push_back(parse_expression(with_condexpr));
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parens) error(cur().loc, "Expected an expression, got " + describe(cur()));
    }
    auto e = make(ExprKind::Tuple, l);
    e->args = std::move(items);
    return e;
  }

  ExprPtr parse_postfix(ExprPtr node) {
    for (;;) {
      if (is_op(".")) {
        Loc l = next().loc;
        if (cur().kind == TokKind::Name) {
          auto e = make(ExprKind::GetAttr, l);
          e->name = next().text;
          e->args.push_back(std::move(node));
          node = sized(std::move(e));
        } else if (cur().kind == TokKind::Int) {
          auto e = make(ExprKind::GetItem, l);
          auto idx = make(ExprKind::Const, cur().loc);
          idx->value = Value(next().ival);
          e->args.push_back(std::move(node));
          e->args.push_back(std::move(idx));
          node = sized(std::move(e));
        } else {
          error(cur().loc, "expected name or number after '.'");
        }
      } else if (is_op("[")) {
        node = parse_subscript(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr node) {
    Loc l = next().loc;  // '['
    DepthGuard guard(*this, l);
    auto slice_part = [&]() -> ExprPtr {
      if (is_op(":") || is_op("]")) return nullptr;
      return parse_expression(true);
    };
    std::vector<ExprPtr> indices;
    for (;;) {
      ExprPtr start = slice_part();
      if (is_op(":")) {
        next();
        auto s = make(ExprKind::Slice, l);
        s->args.push_back(nullptr);  // the object, filled below
        s->args.push_back(std::move(start));
        s->args.push_back(slice_part());
        if (skip_op(":")) s->args.push_back(slice_part());
        else s->args.push_back(nullptr);
        indices.push_back(std::move(s));
      } else {
        if (!start) error(cur().loc, "expected an index");
        indices.push_back(std::move(start));
      }
      if (!skip_op(",")) break;
    }
    expect_op("]");
    if (indices.size() != 1) error(l, "tuple indices are not supported");
    ExprPtr idx = std::move(indices[0]);
    if (idx->kind == ExprKind::Slice && !idx->args[0]) {
      idx->args[0] = std::move(node);
      return sized(std::move(idx));
    }
    auto e = make(ExprKind::GetItem, l);
    e->args.push_back(std::move(node));
    e->args.push_back(std::move(idx));
    return sized(std::move(e));
  }

  void parse_call_args(Expr& e) {
    expect_op("(");
    bool first = true;
    while (!is_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (is_op(")")) break;
      if (is_op("*") || is_op("**")) error(cur().loc, "*args and **kwargs in calls are not supported");
      if (cur().kind == TokKind::Name && peek().kind == TokKind::Op && peek().text == "=") {
        std::string key = next().text;
        next();
        e.kwargs.emplace_back(key, parse_expression(true));
      } else {
        if (!e.kwargs.empty()) error(cur().loc, "positional argument after keyword argument");
        e.args.push_back(parse_expression(true));
      }
    }
    next();
  }

  ExprPtr parse_call(ExprPtr node) {
    DepthGuard guard(*this, cur().loc);
    auto e = make(ExprKind::Call, cur().loc);
    e->args.push_back(std::move(node));
    parse_call_args(*e);
    return sized(std::move(e));
  }

  std::string dotted_name() {
    std::string n = expect_name();
    while (is_op(".") && peek().kind == TokKind::Name) {
      next();
      n += "." + next().text;
    }
    return n;
  }

  ExprPtr parse_filter(ExprPtr subject) {
    Loc l = cur().loc;
    std::string n = dotted_name();
    if (!is_filter(n)) error(l, cat("No filter named '", n, "'."));
    auto e = make(ExprKind::Filter, l);
    e->name = n;
    e->args.push_back(std::move(subject));
    if (is_op("(")) parse_call_args(*e);
    return sized(std::move(e));
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    for (;;) {
      if (is_op("|")) {
        next();
        node = parse_filter(std::move(node));
      } else if (is_name("is")) {
        node = parse_test(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_test(ExprPtr node) {
    Loc l = next().loc;  // 'is'
    bool negated = skip_name("not");
    Loc nl = cur().loc;
    std::string n = dotted_name();
    if (!is_test(n)) error(nl, cat("No test named '", n, "'."));
    auto e = make(ExprKind::Test, l);
    e->name = n;
    e->negated = negated;
    e->args.push_back(std::move(node));
    const Token& t = cur();
    if (is_op("(")) {
      parse_call_args(*e);
    } else if ((t.kind == TokKind::Name || t.kind == TokKind::String || t.kind == TokKind::Int ||
                t.kind == TokKind::Float || is_op("[") || is_op("{")) &&
               !(is_name("else") || is_name("or") || is_name("and"))) {
      if (is_name("is")) error(t.loc, "You cannot chain multiple tests with is");
      e->args.push_back(parse_postfix(parse_primary()));
    }
    return sized(std::move(e));
  }

  struct MacroUses {
    bool varargs = false, kwargs = false, caller = false;
  };

  std::vector<Token> toks_;
  const std::string& name_;
  size_t pos_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;
  std::vector<std::pair<std::string, Loc>> open_blocks_;
  std::vector<MacroUses> macro_uses_;
  std::vector<bool> loop_uses_;
};

}  // namespace

std::shared_ptr<ParsedTemplate> parse_template(std::string_view source, const std::string& name, const LexOptions& opt) {
  auto t = std::make_shared<ParsedTemplate>();
  t->name = name;
  Parser p(tokenize(source, name, opt), t->name);
  t->body = p.parse_all();
  return t;
}

}  // namespace kestrel::jinja
