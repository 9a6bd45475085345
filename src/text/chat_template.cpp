#include "text/chat_template.h"

#include <filesystem>

#include "common/error.h"
#include "common/mapped_file.h"
#include "formats/json_file.h"

namespace kestrel {
namespace fs = std::filesystem;
namespace {

using jinja::Dict;
using jinja::Kind;
using jinja::List;
using jinja::Value;

const char* const kReasoningFields[] = {"reasoning_content", "thinking", "reasoning"};
const char* const kContinueTag = "CONTINUE_FINAL_MESSAGE_TAG ";

std::string py_strip_ws(const std::string& s, bool left, bool right) {
  std::u32string u = jinja::utf8_decode(s);
  size_t a = 0, b = u.size();
  if (left)
    while (a < b && jinja::py_isspace(u[a])) ++a;
  if (right)
    while (b > a && jinja::py_isspace(u[b - 1])) --b;
  return jinja::utf8_encode(u.substr(a, b - a));
}

// transformers' message preparation: drop null-valued keys, then alias the reasoning fields
// ({"thinking": r, **message, "reasoning_content": r}).
Value prepare_message(const Value& m, const std::string& name, size_t index) {
  if (!m.is_dict()) fail(name, ": message ", index, " must be a JSON object, got ", m.type_name());
  Dict d;
  for (const auto& [k, v] : m.dict_ref().entries)
    if (!v.is_none()) d.entries.emplace_back(k, v);
  const Value* reasoning = nullptr;
  for (const char* f : kReasoningFields) {
    if (const Value* v = d.find(std::string_view(f))) {
      reasoning = v;
      break;
    }
  }
  if (!reasoning) return Value::dict(std::move(d));
  Value r = *reasoning;
  Dict out;
  out.set(Value("thinking"), r);
  for (const auto& [k, v] : d.entries) out.set(k, v);
  out.set(Value("reasoning_content"), r);
  return Value::dict(std::move(out));
}

std::string render_impl(const jinja::Template& tmpl, const std::string& source, const Value& messages,
                        const Value& options) {
  const std::string& name = tmpl.name();
  if (!messages.is_sequence()) fail(name, ": messages must be a JSON array");
  if (messages.items().empty()) fail(name, ": cannot apply a chat template to an empty conversation");
  if (!options.is_dict() && !options.is_none()) fail(name, ": chat template options must be a JSON object");
  Dict opts = options.is_dict() ? options.dict_ref() : Dict{};

  List chat;
  for (size_t i = 0; i < messages.items().size(); ++i) chat.push_back(prepare_message(messages.items()[i], name, i));

  // continue_final_message: mark the final message so the rendering can be cut right after it.
  Value cont = opts.find(std::string_view("continue_final_message")) ? *opts.find(std::string_view("continue_final_message"))
                                                                      : Value(false);
  opts.erase(Value("continue_final_message"));
  const bool add_gen = opts.find(std::string_view("add_generation_prompt")) &&
                       opts.find(std::string_view("add_generation_prompt"))->truthy();
  std::string final_message;
  if (cont.truthy()) {
    if (add_gen)
      fail(name, ": continue_final_message and add_generation_prompt are not compatible");
    std::string field = cont.is_string() ? cont.str() : "content";
    Dict& last = chat.back().dict_mut();
    const Value* fm = last.find(std::string_view(field));
    if (!fm) fail(name, ": continue_final_message is set but the final message has no \"", field, "\" to continue");
    std::vector<std::string> fields = {field};
    bool is_reasoning = false;
    for (const char* f : kReasoningFields) is_reasoning |= field == f;
    if (is_reasoning) {
      fields.clear();
      Value target = *fm;
      for (const char* f : kReasoningFields)
        if (const Value* v = last.find(std::string_view(f)); v && jinja::py_equal(*v, target)) fields.push_back(f);
    }
    bool mentioned = false;
    for (const auto& f : fields) mentioned |= source.find(f) != std::string::npos;
    if (!mentioned)
      fail(name, ": continue_final_message is set to \"", field, "\" but this is not an accepted field in the chat_template");
    if (fm->is_sequence()) {
      bool found = false;
      List blocks = fm->items();
      for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
        if (!it->is_dict()) continue;
        const Value* text = it->dict_ref().find(std::string_view("text"));
        if (!text) continue;
        final_message = text->to_str();
        Dict b = it->dict_ref();
        b.set(Value("text"), Value(final_message + kContinueTag));
        *it = Value::dict(std::move(b));
        found = true;
        break;
      }
      if (!found) fail(name, ": continue_final_message is set but there is no text to continue in the final message");
      last.set(Value(field), fm->kind() == Kind::Tuple ? Value::tuple(std::move(blocks)) : Value::list(std::move(blocks)));
    } else {
      if (!fm->is_string()) fail(name, ": continue_final_message needs the final message's \"", field, "\" to be text");
      final_message = fm->str();
      for (const auto& f : fields) {
        const Value* v = last.find(std::string_view(f));
        last.set(Value(f), Value(v->to_str() + kContinueTag));
      }
    }
  }

  Dict ctx;
  if (opts.find(std::string_view("messages"))) fail(name, ": 'messages' cannot also be passed as an option");
  ctx.set(Value("messages"), Value::list(std::move(chat)));
  ctx.set(Value("tools"), Value(nullptr));
  ctx.set(Value("documents"), Value(nullptr));
  ctx.set(Value("add_generation_prompt"), Value(false));
  for (const auto& [k, v] : opts.entries) ctx.set(k, v);
  std::string rendered = tmpl.render(ctx);

  if (cont.truthy()) {
    const std::string tag = kContinueTag;
    const std::string tag_stripped = py_strip_ws(tag, true, true);
    if (rendered.find(py_strip_ws(final_message, true, true)) == std::string::npos ||
        rendered.find(tag_stripped) == std::string::npos)
      fail(name, ": continue_final_message is set but the final message does not appear in the chat after applying "
                 "the chat template");
    size_t loc = rendered.rfind(tag_stripped);
    if (rendered.compare(loc, tag.size(), tag) == 0) rendered.resize(loc);
    else rendered = py_strip_ws(rendered.substr(0, loc), false, true);
  }
  return rendered;
}

}  // namespace

ChatTemplate::ChatTemplate(const std::string& source, std::string name)
    : source_(source), tmpl_(source, std::move(name)) {}

std::string ChatTemplate::render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& options) const {
  return render_impl(tmpl_, source_, Value::from_json(messages), Value::from_json(options));
}

std::string ChatTemplate::render(const nlohmann::json& messages, const nlohmann::json& options) const {
  return render_impl(tmpl_, source_, Value::from_json(messages), Value::from_json(options));
}

std::string render_chat(const std::string& template_source, const nlohmann::ordered_json& messages,
                        const nlohmann::ordered_json& options) {
  return ChatTemplate(template_source).render(messages, options);
}

std::string render_chat(const std::string& template_source, const nlohmann::json& messages,
                        const nlohmann::json& options) {
  return ChatTemplate(template_source).render(messages, options);
}

std::map<std::string, std::string> load_chat_templates(const std::string& model_dir) {
  std::map<std::string, std::string> out;
  const fs::path dir(model_dir);
  if (!fs::is_directory(dir)) fail(model_dir, ": not a directory");
  const fs::path jinja_file = dir / "chat_template.jinja";
  if (fs::is_regular_file(jinja_file)) out["default"] = read_text_file(jinja_file.string());
  const fs::path extra = dir / "additional_chat_templates";
  if (fs::is_directory(extra)) {
    for (const auto& e : fs::directory_iterator(extra)) {
      if (e.is_regular_file() && e.path().extension() == ".jinja")
        out[e.path().stem().string()] = read_text_file(e.path().string());
    }
  }
  if (!out.empty()) return out;

  const fs::path config = dir / "tokenizer_config.json";
  if (fs::is_regular_file(config)) {
    nlohmann::json j = read_json_file(config.string());
    if (j.is_object() && j.contains("chat_template") && !j["chat_template"].is_null()) {
      const auto& t = j["chat_template"];
      if (t.is_string()) {
        out["default"] = t.get<std::string>();
      } else if (t.is_array()) {
        for (const auto& item : t) {
          if (!item.is_object() || !item.contains("name") || !item.contains("template") || !item["name"].is_string() ||
              !item["template"].is_string())
            fail(config.string(), ": field 'chat_template' must be a string or a list of {\"name\", \"template\"} strings");
          out[item["name"].get<std::string>()] = item["template"].get<std::string>();
        }
      } else {
        fail(config.string(), ": field 'chat_template' must be a string or a list of {\"name\", \"template\"}, got ",
             t.type_name());
      }
      if (!out.empty()) return out;
    }
  }

  const fs::path legacy = dir / "chat_template.json";
  if (fs::is_regular_file(legacy)) {
    nlohmann::json j = read_json_file(legacy.string());
    if (j.is_object() && j.contains("chat_template") && j["chat_template"].is_string()) {
      out["default"] = j["chat_template"].get<std::string>();
      return out;
    }
    fail(legacy.string(), ": field 'chat_template' must be a string");
  }
  fail(model_dir, ": no chat template: looked for chat_template.jinja, additional_chat_templates/*.jinja, "
                  "the 'chat_template' field of tokenizer_config.json and chat_template.json");
}

std::string load_chat_template(const std::string& model_dir, bool with_tools) {
  std::map<std::string, std::string> all = load_chat_templates(model_dir);
  if (all.size() == 1 && all.count("default")) return all["default"];
  if (with_tools && all.count("tool_use")) return all["tool_use"];
  if (all.count("default")) return all["default"];
  std::string names;
  for (const auto& [k, v] : all) names += (names.empty() ? "" : ", ") + k;
  fail(model_dir, ": the model has several chat templates and none is named 'default' (templates: ", names, ")");
}

}  // namespace kestrel
