#include "text/jinja.h"

namespace kestrel::jinja {

Template::Template(std::string_view source, std::string name, Options options) : options_(options) {
  LexOptions lex;
  lex.trim_blocks = options.trim_blocks;
  lex.lstrip_blocks = options.lstrip_blocks;
  parsed_ = parse_template(source, name, lex);
}

std::string Template::render(const Dict& context) const {
  Interpreter in(*parsed_, options_.limits);
  return in.render(context);
}

template <typename J>
static Dict context_from_json(const J& j, const std::string& name) {
  if (!j.is_object()) fail(name, ": the render context must be a JSON object");
  Value v = Value::from_json(j);
  return v.dict_ref();
}

std::string Template::render(const nlohmann::ordered_json& context) const {
  return render(context_from_json(context, name()));
}

std::string Template::render(const nlohmann::json& context) const { return render(context_from_json(context, name())); }

}  // namespace kestrel::jinja
