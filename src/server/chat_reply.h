// One choice's generated chat text split as it streams: the reasoning of a thinking model
// (reasoning.h), then in what follows the tool calls of the template's format (tool_calls.h) and
// the content around them. Fed split at any byte it gives the same pieces.
#pragma once
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "server/reasoning.h"
#include "server/tool_calls.h"

namespace kestrel::server {

struct ReplyPieces {
  std::string reasoning, content;
  std::vector<ToolCall> calls;  // finished calls, in order
};

// Per tool, per parameter, the JSON schema type of `tools` (the request's): what GLM's parser needs
// to tell the string "42" from the number 42. A list of types gives its first that is not "null".
std::map<std::string, std::map<std::string, std::string>> tool_parameter_types(const nlohmann::ordered_json& tools);

class ChatReply {
 public:
  // reasoning: absent when the model does not think, else whether the reply starts inside its
  // thinking (prompt_opens_thinking). tools: ToolFormat::None leaves every call as content.
  ChatReply(std::optional<bool> reasoning, ToolFormat tools,
            std::map<std::string, std::map<std::string, std::string>> parameter_types = {});
  ReplyPieces push(std::string_view text);
  ReplyPieces finish();

 private:
  std::optional<ReasoningSplitter> reasoning_;
  ToolCallParser tools_;
};

}  // namespace kestrel::server
