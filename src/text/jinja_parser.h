// Parses a Jinja template into statements and expressions with jinja2's grammar and precedence.
#pragma once
#include <memory>
#include <string>
#include <string_view>

#include "text/jinja_ast.h"
#include "text/jinja_lexer.h"

namespace kestrel::jinja {

struct ParsedTemplate {
  std::string name;
  Body body;
};

// Throws kestrel::Error naming the template, line and column on a syntax error, an unknown tag,
// filter or test, or nesting deeper than the parser allows.
std::shared_ptr<ParsedTemplate> parse_template(std::string_view source, const std::string& name, const LexOptions& opt);

}  // namespace kestrel::jinja
