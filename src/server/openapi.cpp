#include "server/openapi.h"

namespace kestrel::server {
namespace {

json error_response(const char* what) {
  return {{"description", what},
          {"content", {{"application/json", {{"schema", {{"$ref", "#/components/schemas/Error"}}}}}}}};
}

// Fields both generation endpoints take.
json common_properties(const std::string& model, int64_t context, int max_n) {
  return {
      {"model", {{"type", "string"}, {"enum", json::array({model})}}},
      {"max_tokens", {{"type", "integer"}, {"minimum", 0}, {"maximum", context}}},
      {"temperature", {{"type", "number"}, {"minimum", 0}, {"maximum", 2}}},
      {"top_p", {{"type", "number"}, {"minimum", 0}, {"exclusiveMinimum", true}, {"maximum", 1}}},
      {"top_k", {{"type", "integer"}, {"minimum", -1}}},
      {"min_p", {{"type", "number"}, {"minimum", 0}, {"maximum", 1}}},
      {"presence_penalty", {{"type", "number"}, {"minimum", -2}, {"maximum", 2}}},
      {"frequency_penalty", {{"type", "number"}, {"minimum", -2}, {"maximum", 2}}},
      {"seed", {{"type", "integer"}}},
      {"stop", {{"oneOf", json::array({{{"type", "string"}, {"minLength", 1}},
                                       {{"type", "array"}, {"maxItems", 4}, {"items", {{"type", "string"}, {"minLength", 1}}}}})}}},
      {"stream", {{"type", "boolean"}}},
      {"response_format",
       {{"type", "object"},
        {"required", json::array({"type"})},
        {"properties",
         {{"type", {{"type", "string"}, {"enum", json::array({"text", "json_object", "json_schema"})}}},
          {"json_schema",
           {{"type", "object"},
            {"required", json::array({"name", "schema"})},
            {"properties", {{"name", {{"type", "string"}}}, {"schema", {{"type", "object"}}}, {"strict", {{"type", "boolean"}}}}}}}}},
        {"description", "json_object: the reply is a JSON object; json_schema: JSON valid against json_schema.schema "
                        "(constrained decoding: tokens that cannot continue it are masked). A schema that is invalid, "
                        "unsupported, or not strict-able with strict: true is refused (400)"}}},
      {"n", {{"type", "integer"},
             {"minimum", 1},
             {"maximum", max_n},
             {"description", "choices, each its own sequence of the same prompt, run side by side; with a seed, "
                             "choice i samples with a seed derived from it and i. Also refused (400) when n "
                             "sequences of prompt + max_tokens do not fit the KV cache at once"}}},
  };
}

json generation_path(const char* summary, const json& schema) {
  return {{"post",
           {{"summary", summary},
            {"requestBody", {{"required", true}, {"content", {{"application/json", {{"schema", schema}}}}}}},
            {"responses",
             {{"200", {{"description", "the completion (JSON), or server-sent events with \"stream\": true"},
                       {"content", {{"application/json", {{"schema", {{"type", "object"}}}}},
                                    {"text/event-stream", {{"schema", {{"type", "string"}}}}}}}}},
              {"400", error_response("invalid request: the message names the field")},
              {"401", error_response("missing or wrong API key")},
              {"404", error_response("unknown model")},
              {"413", error_response("the body exceeds --max-body")},
              {"431", error_response("the headers exceed --max-headers or --max-header-bytes")},
              {"503", error_response("the server is shutting down, or too many connections are open")}}}}}};
}

}  // namespace

json openapi_spec(const std::string& model, int64_t context, int max_n) {
  json completion = {{"type", "object"}, {"required", json::array({"model", "prompt"})}, {"properties", common_properties(model, context, max_n)}};
  completion["properties"]["prompt"] = {
      {"oneOf", json::array({{{"type", "string"}, {"minLength", 1}},
                             {{"type", "array"}, {"minItems", 1}, {"items", {{"type", "integer"}, {"minimum", 0}}}}})}};
  completion["properties"]["logprobs"] = {{"type", "integer"}, {"minimum", 0}, {"maximum", 20}};
  json chat = {{"type", "object"}, {"required", json::array({"model", "messages"})}, {"properties", common_properties(model, context, max_n)}};
  chat["properties"]["messages"] = {
      {"type", "array"},
      {"minItems", 1},
      {"items",
       {{"type", "object"},
        {"required", json::array({"role", "content"})},
        {"properties", {{"role", {{"type", "string"}, {"enum", json::array({"system", "user", "assistant"})}}},
                        {"content", {{"type", "string"}}}}}}}};
  chat["properties"]["logprobs"] = {{"type", "boolean"}};
  chat["properties"]["tools"] = {
      {"type", "array"},
      {"items", {{"type", "object"}, {"required", json::array({"type", "function"})}}},
      {"description", "functions ({type: function, function: {name, description, parameters}}) the model may call"}};
  chat["properties"]["tool_choice"] = {
      {"oneOf", json::array({{{"type", "string"}, {"enum", json::array({"none", "auto", "required"})}},
                             {{"type", "object"}, {"required", json::array({"type", "function"})}}})},
      {"description", "required or a named function: the reply is constrained to tool calls"}};
  chat["properties"]["parallel_tool_calls"] = {{"type", "boolean"}};
  chat["properties"]["max_completion_tokens"] = {{"type", "integer"}, {"minimum", 0}, {"maximum", context}};
  chat["properties"]["stream_options"] = {{"type", "object"}, {"properties", {{"include_usage", {{"type", "boolean"}}}}}};
  json ok_json = {{"description", "ok"}, {"content", {{"application/json", {{"schema", {{"type", "object"}}}}}}}};
  return {
      {"openapi", "3.0.3"},
      {"info", {{"title", "kestrel"}, {"version", "0.1.0"}, {"description", "OpenAI-compatible API of kestrel serve"}}},
      {"paths",
       {{"/health", {{"get", {{"summary", "liveness"}, {"responses", {{"200", ok_json}}}}}}},
        {"/v1/models",
         {{"get", {{"summary", "the served model"}, {"responses", {{"200", ok_json}, {"401", error_response("missing or wrong API key")}}}}}}},
        {"/v1/completions", generation_path("text completion", completion)},
        {"/v1/chat/completions", generation_path("chat completion", chat)},
        {"/metrics",
         {{"get", {{"summary", "Prometheus metrics"},
                   {"responses", {{"200", {{"description", "ok"}, {"content", {{"text/plain", {{"schema", {{"type", "string"}}}}}}}}}}}}}}}}},
      {"components",
       {{"schemas",
         {{"Error",
           {{"type", "object"},
            {"required", json::array({"error"})},
            {"properties", {{"error", {{"type", "object"}, {"required", json::array({"message", "type"})}}}}}}}}}}}};
}

}  // namespace kestrel::server
