// The OpenAI-compatible request and response formats: parsing and validating the JSON bodies of
// /v1/completions and /v1/chat/completions (every problem becomes an ApiError naming the field),
// and building responses, streamed chunks (server-sent events) and error bodies. Pure functions,
// no I/O, so that they are unit-tested and fuzzed on their own.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/sampler.h"
#include "server/tool_calls.h"

namespace kestrel::server {

using json = nlohmann::ordered_json;

// An error for the client: HTTP status, OpenAI error type, the offending parameter (may be empty).
class ApiError : public std::runtime_error {
 public:
  ApiError(int status, std::string message, std::string param = "", std::string type = "");
  int status;
  std::string param, type;
};

// {"error": {"message", "type", "param", "code"}}
std::string error_body(const ApiError& e);

enum class Endpoint { Completions, Chat };

// tool_choice: "none" (the tools are not rendered and nothing is parsed), "auto" (the model may
// call them), "required" (it must call one or more: the reply is constrained to calls, see
// server/grammar.h) or a named function (it must call that one).
enum class ToolChoice { None, Auto, Required, Named };

// response_format: text, any JSON object, or JSON valid against a schema (constrained decoding).
enum class ResponseFormat { Text, JsonObject, JsonSchema };

struct ApiRequest {
  Endpoint endpoint = Endpoint::Completions;
  std::string model;
  std::string prompt;                     // completions: the text
  std::vector<int32_t> prompt_tokens;     // completions: token ids instead of text
  // chat: [{role, content (a string)}], assistant messages with their tool_calls ([{id, type,
  // function: {name, arguments (a string)}}]) and reasoning_content, tool messages with tool_call_id
  json messages = json::array();
  json tools = json::array();             // chat: the validated tools, as the client wrote them
  ToolChoice tool_choice = ToolChoice::None;  // "auto" when tools come without a tool_choice
  std::string tool_name;                  // ToolChoice::Named: the function
  bool parallel_tool_calls = true;        // false: a reply's first call only
  ResponseFormat response_format = ResponseFormat::Text;
  json response_schema;                   // JsonSchema: response_format.json_schema.schema
  bool schema_strict = false;             // response_format.json_schema.strict
  std::optional<int> max_tokens;          // absent: 16 for completions, the rest of the context for chat
  bool stream = false, include_usage = false;
  SamplerOptions sampling;
  bool seeded = false;                    // the request gave a seed (otherwise the server draws one)
  std::vector<std::string> stop;
  int top_logprobs = -1;                  // -1: no log-probabilities
  bool ignore_eos = false;
  int n = 1;                              // choices, 1..kMaxChoices
};

// The most choices (`n`) one request may ask for; a server also refuses more than it runs at
// once (--max-batch).
constexpr int kMaxChoices = 16;

// The deepest nesting of arrays and objects a request body may have.
constexpr size_t kMaxJsonNesting = 64;
// How deep `text` nests arrays and objects (brackets outside strings; no validation).
size_t json_nesting(std::string_view text);

// Parses a request body. Throws ApiError (400) on invalid JSON, wrong types, missing fields,
// values out of range and options kestrel does not support (best_of other than n, suffix,
// functions). Schemas are checked when they are compiled (server/grammar.h).
ApiRequest parse_request(Endpoint endpoint, const std::string& body);

// The messages as a chat template takes them. Tool-call arguments, a JSON string in the API, become
// the object they encode (as transformers users pass them): the Qwen2.5 and Llama 3 templates print
// them with tojson (a string would come out quoted twice) and GLM's iterates arguments.items()
// (an error on a string); Qwen3's takes either. DeepSeek's templates concatenate them into the
// prompt as strings, so `arguments_as_objects` false keeps them (as does arguments that are not a
// JSON object).
json template_messages(const json& messages, bool arguments_as_objects);

// One generated token's log-probability and its best alternatives, as text.
struct TokenInfo {
  std::string text;
  float logprob = 0;
  std::vector<std::pair<std::string, float>> top;
};

struct Usage {
  int64_t prompt_tokens = 0, completion_tokens = 0;
  int64_t cached_tokens = 0;  // of the prompt's, from the prefix cache (prompt_tokens_details)
  // A vendor field `speculation` where the server speculates: tokens drafted by the checks that
  // made the reply's tokens, and how many of the reply's tokens are accepted drafts.
  bool speculating = false;
  int64_t drafted_tokens = 0, accepted_tokens = 0;
};

// One choice of a response; `finish_reason` "stop", "length" or "tool_calls".
struct Choice {
  std::string text;               // chat: the content
  std::vector<TokenInfo> tokens;  // with log-probabilities requested
  std::string finish_reason;
  std::string reasoning;          // chat: reasoning_content, when the model thought
  std::vector<ToolCall> tool_calls;  // chat: with their ids
};

// The pieces of one response: its choices in index order, usage over all of them (the prompt
// once, the completion tokens of every choice).
struct Completion {
  std::string id, model;
  int64_t created = 0;
  std::vector<Choice> choices;
  Usage usage;
};

json response_json(Endpoint endpoint, const Completion& c, bool logprobs);

// A streamed chunk of choice `index`: text (and tokens) generated since its last chunk, and for chat
// the reasoning; finish_reason empty until its last one. `first` marks the chat chunk that carries
// the assistant role (the first of each choice).
json chunk_json(Endpoint endpoint, const Completion& c, int index, const std::string& delta,
                const std::vector<TokenInfo>& tokens, bool logprobs, const std::string& finish_reason, bool first,
                const std::string& reasoning = "");
// A streamed chat chunk of tool call `call_index` of choice `index`: its head (id, type, name and
// empty arguments) or then its arguments.
json tool_call_chunk_json(const Completion& c, int index, int call_index, const ToolCall& call, bool head);
// The final usage-only chunk (stream_options.include_usage).
json usage_chunk_json(Endpoint endpoint, const Completion& c);

// "data: <json>\n\n" with invalid UTF-8 replaced.
std::string sse(const json& j);
std::string dump(const json& j);

}  // namespace kestrel::server
