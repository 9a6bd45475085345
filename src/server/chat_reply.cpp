#include "server/chat_reply.h"

namespace kestrel::server {

std::map<std::string, std::map<std::string, std::string>> tool_parameter_types(const nlohmann::ordered_json& tools) {
  std::map<std::string, std::map<std::string, std::string>> out;
  if (!tools.is_array()) return out;
  for (const auto& t : tools) {
    if (!t.is_object() || !t.contains("function") || !t["function"].is_object()) continue;
    const auto& f = t["function"];
    if (!f.contains("name") || !f["name"].is_string()) continue;
    auto& params = out[f["name"].get<std::string>()];
    if (!f.contains("parameters") || !f["parameters"].is_object()) continue;
    const auto& p = f["parameters"];
    if (!p.contains("properties") || !p["properties"].is_object()) continue;
    for (const auto& [name, schema] : p["properties"].items()) {
      if (!schema.is_object() || !schema.contains("type")) continue;
      const auto& type = schema["type"];
      if (type.is_string()) params[name] = type.get<std::string>();
      else if (type.is_array())
        for (const auto& x : type)
          if (x.is_string() && x != "null") {
            params[name] = x.get<std::string>();
            break;
          }
    }
  }
  return out;
}

ChatReply::ChatReply(std::optional<bool> reasoning, ToolFormat tools,
                     std::map<std::string, std::map<std::string, std::string>> parameter_types)
    : tools_(tools, std::move(parameter_types)) {
  if (reasoning) reasoning_.emplace(*reasoning);
}

ReplyPieces ChatReply::push(std::string_view text) {
  ReplyPieces r;
  std::string content;
  if (reasoning_) reasoning_->push(text, r.reasoning, content);
  else content = text;
  r.content = tools_.push(content, r.calls);
  return r;
}

ReplyPieces ChatReply::finish() {
  ReplyPieces r;
  std::string content;
  if (reasoning_) reasoning_->finish(r.reasoning, content);
  r.content = tools_.push(content, r.calls);
  r.content += tools_.finish(r.calls);
  return r;
}

}  // namespace kestrel::server
