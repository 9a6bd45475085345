// Splits a Jinja template into text and the tokens inside {{ }} and {% %} tags, applying the
// whitespace rules of jinja2: `-` and `+` modifiers, trim_blocks, lstrip_blocks, newline
// normalization and the dropped final newline.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "text/jinja_ast.h"

namespace kestrel::jinja {

enum class TokKind { Data, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, Eof };

struct Token {
  TokKind kind;
  std::string text;  // data, name, operator, or the unescaped string literal
  int64_t ival = 0;
  double fval = 0;
  Loc loc;
};

struct LexOptions {
  bool trim_blocks = true;
  bool lstrip_blocks = true;
};

// Throws kestrel::Error naming `name`, the line and the column on malformed input.
std::vector<Token> tokenize(std::string_view source, const std::string& name, const LexOptions& opt);

}  // namespace kestrel::jinja
