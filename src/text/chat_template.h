// Chat templates: turning a conversation (OpenAI-style messages as JSON) into the prompt text a
// model was trained on, exactly as transformers' apply_chat_template(tokenize=False) does, and
// finding a model folder's template the way transformers does.
#pragma once
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "text/jinja.h"

namespace kestrel {

// A parsed chat template, reusable across requests.
//
// `messages` is a JSON array of message objects. `options` is a JSON object of the keyword
// arguments transformers passes: add_generation_prompt (default false), tools (default null),
// documents (default null), bos_token, eos_token and the other special tokens, enable_thinking,
// continue_final_message (true or a field name), and any other variable the template reads.
// As in transformers, keys whose value is null are dropped from each message, and a message's
// reasoning (reasoning_content, thinking or reasoning) is also offered under the other names.
//
// Key order matters to templates that print JSON (tool schemas, tool-call arguments): the
// ordered_json overload keeps the caller's order; the json overload sees keys sorted.
class ChatTemplate {
 public:
  explicit ChatTemplate(const std::string& source, std::string name = "chat template");
  std::string render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& options) const;
  std::string render(const nlohmann::json& messages, const nlohmann::json& options) const;
  const std::string& source() const { return source_; }

 private:
  std::string source_;
  jinja::Template tmpl_;
};

std::string render_chat(const std::string& template_source, const nlohmann::ordered_json& messages,
                        const nlohmann::ordered_json& options);
std::string render_chat(const std::string& template_source, const nlohmann::json& messages,
                        const nlohmann::json& options);

// All chat templates of a model folder by name, in transformers' precedence: chat_template.jinja
// ("default") and additional_chat_templates/*.jinja; otherwise tokenizer_config.json's
// "chat_template" (a string, or a list of {"name", "template"}); otherwise the legacy processor
// file chat_template.json. Throws kestrel::Error naming the folder when there is none.
std::map<std::string, std::string> load_chat_templates(const std::string& model_dir);

// The template transformers would use: the only one, else "tool_use" when the request has tools
// and the model has one, else "default".
std::string load_chat_template(const std::string& model_dir, bool with_tools = false);

}  // namespace kestrel
