// The parsed form of a Jinja template: expressions and statements, each with the line and column
// it came from so that runtime errors can point at the template source.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "text/jinja_value.h"

namespace kestrel::jinja {

struct Loc {
  int line = 0;
  int col = 0;
};

enum class ExprKind {
  Const,     // value
  Name,      // name
  List,      // args: items
  Tuple,     // args: items
  Dict,      // args: key0, value0, key1, value1, ...
  GetAttr,   // args[0].name
  GetItem,   // args[0][args[1]]
  Slice,     // args[0][args[1]:args[2]:args[3]] (missing parts are null)
  Call,      // args[0](args[1..], kwargs)
  Filter,    // args[0] | name(args[1..], kwargs); args[0] is null in filter blocks
  Test,      // args[0] is name(args[1..]); negated for "is not"
  Neg,       // -args[0]
  Pos,       // +args[0]
  Not,       // not args[0]
  And,       // args[0] and args[1]
  Or,        // args[0] or args[1]
  Binary,    // args[0] op args[1] for + - * / // % **
  Compare,   // args[0] ops[0] args[1] ops[1] args[2] ...
  Concat,    // args joined with ~
  CondExpr,  // args[1] if args[0] else args[2] (args[2] may be null)
};

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  ExprKind kind;
  Loc loc;
  Value value;
  std::string name;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;
  bool negated = false;
  int depth = 1;  // height of the subtree
};

// The left side of an assignment or loop: a name, a tuple of targets, or namespace.attr.
struct Target {
  enum class Kind { Name, Tuple, Attr } kind = Kind::Name;
  std::string name;
  std::string attr;
  std::vector<Target> items;
  Loc loc;
};

enum class StmtKind {
  Output,       // text
  Print,        // {{ expr }}
  If,           // branches (a null condition is the else branch)
  For,          // for target in expr [if cond]: body, else_body
  Set,          // set target = expr
  SetBlock,     // set target [| filters] ... endset
  Macro,        // macro name(params=defaults) body
  CallBlock,    // call(params) expr: body becomes `caller`
  FilterBlock,  // filter f|g ... endfilter
  With,         // with assigns: body
  Break,
  Continue,
  Generation,   // transformers' {% generation %} marker: renders its body
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct Stmt {
  StmtKind kind;
  Loc loc;
  std::string text;
  ExprPtr expr;
  ExprPtr cond;
  Target target;
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body body;
  Body else_body;
  std::string name;
  std::vector<std::string> params;
  std::vector<ExprPtr> defaults;  // one per param; null where the param has no default
  std::vector<ExprPtr> filters;   // Filter expressions with a null subject
  std::vector<std::pair<Target, ExprPtr>> assigns;
  bool uses_varargs = false;
  bool uses_kwargs = false;
  bool uses_caller = false;
  bool uses_loop = false;  // For: the body reads `loop`
};

}  // namespace kestrel::jinja
