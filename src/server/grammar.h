// Structured outputs: the grammars of response_format ({"type": "json_object"} and
// {"type": "json_schema"}) and of tool_choice "required" or a named function (a tool call in the
// template's format, its arguments valid against the tool's parameters), compiled by XGrammar
// over the tokenizer's vocabulary into the engine's token constraints (runtime/token_constraint.h).
// Compiling happens on the request's thread, so that a bad schema is a 400 before anything runs;
// the vocabulary's index is built once, on the first constrained request.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "runtime/token_constraint.h"
#include "server/tool_calls.h"
#include "text/tokenizer.h"

namespace kestrel::server {

// What a client's schema may hold, checked before it compiles (XGrammar cannot be interrupted,
// and compiles one grammar at a time): beyond each, a 400 naming the field. Each bounds a cost
// measured to grow faster than its size (docs/ARCHITECTURE.md, "Structured outputs"); ordinary
// schemas are far below them.
// JSON values in a schema (those of a request's tools together): anyOf branches, enum values,
// properties, $defs all count.
constexpr int64_t kMaxSchemaValues = 4096;
// Properties of one object (optional ones cost more than linearly: 256 compile in ~0.5 s).
constexpr size_t kMaxSchemaProperties = 256;
// A pattern's characters, and its length spelled out with its counted repetitions expanded
// ("a{1000}" is 1000: XGrammar unrolls them into an automaton), a class that admits most
// characters ([^...], '.', \D, \S, \W) counting 32 ("^.{0,8}$" is 256: ~0.5 s).
constexpr size_t kMaxPatternLength = 1000;
constexpr int64_t kMaxPatternSpelled = 256;

// A compiled grammar: a factory of matchers, one per choice (cheap: they share the compiled tables).
using CompiledConstraint = ConstraintFactory;

class Grammars {
 public:
  // vocab: the model's (ids past the tokenizer's are never allowed); stop: the end-of-sequence ids,
  // allowed only where the grammar may end. The tokenizer must outlive this.
  Grammars(const text::Tokenizer& tok, int64_t vocab, std::vector<int32_t> stop);
  ~Grammars();

  // Any JSON object. `thinking`: the reply starts inside <think> (prompt_opens_thinking), which
  // the grammar lets it close first.
  CompiledConstraint json_object(bool thinking = false);
  // JSON valid against `schema`; `field` names it in errors ("response_format.json_schema.schema").
  // strict: the schema must meet OpenAI's strict rules (check_strict_schema).
  CompiledConstraint json_schema(const nlohmann::ordered_json& schema, bool strict, const std::string& field,
                                 bool thinking = false);
  // Tool calls of `tools` (the request's, validated) in `format` (ToolFormat::None: the Llama JSON
  // form, {"name": N, "parameters": {...}} calls separated by "; ", which that parser reads): of
  // the tool named `name`, or of any when it is empty; one, or with `parallel` one or more.
  CompiledConstraint tool_calls(const nlohmann::ordered_json& tools, ToolFormat format, const std::string& name,
                                bool parallel, bool thinking = false, bool deepseek_fences = true);

  // Milliseconds the vocabulary's index took to build (0 before the first use).
  double setup_ms() const { return setup_ms_; }

 private:
  struct Vocab;
  Vocab& vocab();
  CompiledConstraint structural(const nlohmann::ordered_json& format, const std::string& field);

  const text::Tokenizer& tok_;
  int64_t vocab_size_;
  std::vector<int32_t> stop_;
  std::once_flag once_;
  std::unique_ptr<Vocab> vocab_;
  std::mutex mu_;  // compiling
  double setup_ms_ = 0;
};

// OpenAI's rules for a strict schema: every object lists all its properties in "required" and has
// "additionalProperties": false, down every properties, items, anyOf and $defs. Throws
// RequestError naming the path under `field` and what is missing.
void check_strict_schema(const nlohmann::ordered_json& schema, const std::string& field);

}  // namespace kestrel::server
