// A Jinja template engine for chat templates: the subset of Jinja that model chat templates use,
// rendered exactly as Python's jinja2 renders it in transformers' sandboxed environment
// (trim_blocks and lstrip_blocks on, loop controls, namespace(), raise_exception, strftime_now
// and a tojson that does not HTML-escape).
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "text/jinja_interp.h"

namespace kestrel::jinja {

struct Options {
  bool trim_blocks = true;
  bool lstrip_blocks = true;
  Limits limits;
};

class Template {
 public:
  // Parses once; throws kestrel::Error naming `name`, line and column on a malformed template.
  explicit Template(std::string_view source, std::string name = "template", Options options = {});

  // Renders with the given top-level variables. Errors (undefined use, type errors, limits) throw
  // kestrel::Error; raise_exception() throws TemplateRaise (a kestrel::Error).
  std::string render(const Dict& context) const;
  std::string render(const nlohmann::ordered_json& context) const;
  std::string render(const nlohmann::json& context) const;

  const std::string& name() const { return parsed_->name; }

 private:
  std::shared_ptr<const ParsedTemplate> parsed_;
  Options options_;
};

}  // namespace kestrel::jinja
