// Tool calls in a model's generated text, for each family's format, parsed as the text streams:
//   Hermes (Qwen2.5, Qwen3):   <tool_call>{"name": N, "arguments": {...}}</tool_call>
//   GLM (GLM-4.5/4.6/4.7, GLM-5): <tool_call>N<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>
//                              (newlines between the parts or not); a value is a string unless
//                              the tool's schema gives its parameter another type and it parses
//                              as JSON
//   DeepSeek (V3, R1, V3.1):   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>N
//                              ```json {...} ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜> (V3, R1), or
//                              <｜tool▁call▁begin｜>N<｜tool▁sep｜>{...}<｜tool▁call▁end｜> (V3.1)
//   Llama 3.1+ JSON:           the whole reply {"name": N, "parameters": {...}} (after an optional
//                              <|python_tag|>), calls separated by ';' (outside strings)
// Text outside the calls is content. A call whose text does not parse stays content, as written.
// push() returns the content that is safe to show now (a possible start of a marker is held
// back), so a reply fed split at any byte gives the same content and calls.
#pragma once
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace kestrel {

enum class ToolFormat { None, Hermes, Glm, DeepSeek, LlamaJson };

// The format a chat template renders tools in, from its text (None: it takes no tools).
ToolFormat tool_format_of_template(std::string_view chat_template);
const char* tool_format_name(ToolFormat f);

struct ToolCall {
  std::string name;
  std::string arguments;  // a JSON object, compact
  std::string id;         // the server's id for it in a response ("call_..."); the parser leaves it empty
};

class ToolCallParser {
 public:
  // param_types: per tool, per parameter, the JSON schema type the tool declares ("string",
  // "integer", ...), which the GLM format needs to tell a string "42" from the number 42.
  explicit ToolCallParser(ToolFormat f, std::map<std::string, std::map<std::string, std::string>> param_types = {});

  // The next piece of generated text: returns content to show now; appends finished calls.
  std::string push(std::string_view text, std::vector<ToolCall>& calls);
  // The end of the reply: what was held back, as content or calls.
  std::string finish(std::vector<ToolCall>& calls);

 private:
  std::string flush_content(bool all);  // content_ up to a possible marker start (all: everything)
  bool parse_block(const std::string& block, std::vector<ToolCall>& calls) const;

  ToolFormat f_;
  std::map<std::string, std::map<std::string, std::string>> types_;
  std::string pending_;  // text not yet shown or parsed
  bool in_call_ = false;
  bool whole_reply_ = false;  // Llama JSON: the reply is being held as a possible call
  bool started_ = false;      // Llama JSON: the reply was seen not to start as a call
};

}  // namespace kestrel
