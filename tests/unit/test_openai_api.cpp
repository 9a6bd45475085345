// The OpenAI request parser and response builders: valid requests map onto the engine's
// settings, every invalid one is a 400 naming its field, responses have the documented shape.
#include <gtest/gtest.h>

#include "server/openai_api.h"

namespace kestrel::server {
namespace {

ApiRequest chat(const std::string& body) { return parse_request(Endpoint::Chat, body); }
ApiRequest completion(const std::string& body) { return parse_request(Endpoint::Completions, body); }

// The parameter an invalid body is blamed on ("" when the whole body is wrong).
std::string blamed(Endpoint e, const std::string& body) {
  try {
    parse_request(e, body);
  } catch (const ApiError& err) {
    EXPECT_EQ(err.status, 400) << body;
    return err.param;
  }
  ADD_FAILURE() << "accepted: " << body;
  return "<accepted>";
}

TEST(OpenAiApi, ParsesCompletions) {
  const ApiRequest r = completion(R"({"model":"m","prompt":"hi","max_tokens":7,"temperature":0,"top_p":0.9,
      "top_k":40,"seed":3,"stop":["\n","END"],"stream":true,"stream_options":{"include_usage":true},"logprobs":2,
      "presence_penalty":0.5,"frequency_penalty":-0.5})");
  EXPECT_EQ(r.model, "m");
  EXPECT_EQ(r.prompt, "hi");
  EXPECT_EQ(*r.max_tokens, 7);
  EXPECT_EQ(r.sampling.temperature, 0.0f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 0.9f);
  EXPECT_EQ(r.sampling.top_k, 40);
  EXPECT_EQ(r.sampling.seed, 3u);
  EXPECT_EQ(r.stop, (std::vector<std::string>{"\n", "END"}));
  EXPECT_TRUE(r.stream && r.include_usage);
  EXPECT_EQ(r.top_logprobs, 2);
  EXPECT_FLOAT_EQ(r.sampling.presence_penalty, 0.5f);
  EXPECT_FLOAT_EQ(r.sampling.frequency_penalty, -0.5f);
  EXPECT_EQ(completion(R"({"model":"m","prompt":"x"})").n, 1);
  EXPECT_EQ(completion(R"({"model":"m","prompt":"x","n":3})").n, 3);
  EXPECT_EQ(completion(R"({"model":"m","prompt":"x","n":16,"best_of":16})").n, 16);
  EXPECT_EQ(chat(R"({"model":"m","messages":[{"role":"user","content":"x"}],"n":2})").n, 2);
  EXPECT_EQ(completion(R"({"model":"m","prompt":[1,2,3]})").prompt_tokens, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(completion(R"({"model":"m","prompt":[[4,5]]})").prompt_tokens, (std::vector<int32_t>{4, 5}));
  EXPECT_EQ(completion(R"({"model":"m","prompt":["x"]})").prompt, "x");
  const ApiRequest d = completion(R"({"model":"m","prompt":"x"})");
  EXPECT_FALSE(d.max_tokens.has_value());
  EXPECT_EQ(d.sampling.temperature, 1.0f);  // the API's default
  EXPECT_EQ(d.top_logprobs, -1);
}

TEST(OpenAiApi, ParsesChat) {
  const ApiRequest r = chat(R"({"model":"m","messages":[{"role":"developer","content":"be brief"},
      {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
      {"role":"assistant","content":null}],"max_completion_tokens":5,"max_tokens":9,"logprobs":true,"top_logprobs":3})");
  ASSERT_EQ(r.messages.size(), 3u);
  EXPECT_EQ(r.messages[0]["role"], "system");
  EXPECT_EQ(r.messages[1]["content"], "ab");
  EXPECT_EQ(r.messages[2]["content"], "");
  EXPECT_EQ(*r.max_tokens, 5);  // max_completion_tokens wins
  EXPECT_EQ(r.top_logprobs, 3);
  EXPECT_EQ(chat(R"({"model":"m","messages":[{"role":"user","content":"x"}],"logprobs":true})").top_logprobs, 0);
}

TEST(OpenAiApi, RejectsInvalidRequests) {
  const Endpoint C = Endpoint::Completions, H = Endpoint::Chat;
  EXPECT_EQ(blamed(C, "{bad"), "");
  EXPECT_EQ(blamed(C, "[1,2]"), "");
  EXPECT_EQ(blamed(C, R"({"prompt":"x"})"), "model");
  EXPECT_EQ(blamed(C, R"({"model":3,"prompt":"x"})"), "model");
  EXPECT_EQ(blamed(C, R"({"model":"m"})"), "prompt");
  EXPECT_EQ(blamed(C, R"({"model":"m","prompt":{}})"), "prompt");
  EXPECT_EQ(blamed(C, R"({"model":"m","prompt":["a","b"]})"), "prompt");
  EXPECT_EQ(blamed(C, R"({"model":"m","prompt":[1,-2]})"), "prompt");
  EXPECT_EQ(blamed(C, R"({"model":"m","prompt":[]})"), "prompt");
  EXPECT_EQ(blamed(C, R"({"model":"m","prompt":"x","max_tokens":-1})"), "max_tokens");
  EXPECT_EQ(blamed(C, R"({"model":"m","prompt":"x","max_tokens":"5"})"), "max_tokens");
  EXPECT_EQ(blamed(C, R"({"model":"m","prompt":"x","max_tokens":1e300})"), "max_tokens");
  EXPECT_EQ(blamed(C, R"({"model":"m","prompt":"x","max_tokens":2.5})"), "max_tokens");
  EXPECT_EQ(blamed(C, R"({"model":"m","prompt":"x","temperature":3})"), "temperature");
  EXPECT_EQ(blamed(C, R"({"model":"m","prompt":"x","temperature":"hot"})"), "temperature");
  EXPECT_EQ(blamed(C, R"({"model":"m","prompt":"x","top_p":0})"), "top_p");
  EXPECT_EQ(blamed(C, R"({"model":"m","prompt":"x","n":0})"), "n");
  EXPECT_EQ(blamed(C, R"({"model":"m","prompt":"x","n":17})"), "n");
  EXPECT_EQ(blamed(C, R"({"model":"m","prompt":"x","n":1.5})"), "n");
  EXPECT_EQ(blamed(C, R"({"model":"m","prompt":"x","n":"2"})"), "n");
  EXPECT_EQ(blamed(C, R"({"model":"m","prompt":"x","n":2,"best_of":3})"), "best_of");
  EXPECT_EQ(blamed(C, R"({"model":"m","prompt":"x","best_of":2})"), "best_of");
  EXPECT_EQ(blamed(H, R"({"model":"m","messages":[{"role":"user","content":"x"}],"n":17})"), "n");
  EXPECT_EQ(blamed(C, R"({"model":"m","prompt":"x","stream":"yes"})"), "stream");
  EXPECT_EQ(blamed(C, R"({"model":"m","prompt":"x","stream_options":{"include_usage":true}})"), "stream_options");
  EXPECT_EQ(blamed(C, R"({"model":"m","prompt":"x","stop":["a","b","c","d","e"]})"), "stop");
  EXPECT_EQ(blamed(C, R"({"model":"m","prompt":"x","stop":[1]})"), "stop");
  EXPECT_EQ(blamed(C, R"({"model":"m","prompt":"x","stop":""})"), "stop");
  EXPECT_EQ(blamed(C, R"({"model":"m","prompt":"x","logprobs":21})"), "logprobs");
  EXPECT_EQ(blamed(C, R"({"model":"m","prompt":"x","suffix":"y"})"), "suffix");
  EXPECT_EQ(blamed(C, R"({"model":"m","prompt":"x","echo":true})"), "echo");
  EXPECT_EQ(blamed(C, R"({"model":"m","prompt":"x","presence_penalty":5})"), "presence_penalty");
  EXPECT_EQ(blamed(H, R"({"model":"m"})"), "messages");
  EXPECT_EQ(blamed(H, R"({"model":"m","messages":[]})"), "messages");
  EXPECT_EQ(blamed(H, R"({"model":"m","messages":["hi"]})"), "messages[0]");
  EXPECT_EQ(blamed(H, R"({"model":"m","messages":[{"content":"hi"}]})"), "messages[0].role");
  EXPECT_EQ(blamed(H, R"({"model":"m","messages":[{"role":"robot","content":"hi"}]})"), "messages[0].role");
  EXPECT_EQ(blamed(H, R"({"model":"m","messages":[{"role":"user","content":5}]})"), "messages[0].content");
  EXPECT_EQ(blamed(H, R"({"model":"m","messages":[{"role":"user","content":[{"type":"image_url"}]}]})"),
            "messages[0].content");
  EXPECT_EQ(blamed(H, R"({"model":"m","messages":[{"role":"user","content":"x"}],"top_logprobs":2})"), "top_logprobs");
  EXPECT_EQ(blamed(H, R"({"model":"m","messages":[{"role":"user","content":"x"}],"tools":[]})"), "tools");
}

// Tools: accepted as written, tool_choice "auto" by default with tools, "none" without; assistant
// tool calls and tool results in the conversation.
TEST(OpenAiApi, ParsesTools) {
  const std::string tool = R"({"type":"function","function":{"name":"get_weather","description":"d",
      "parameters":{"type":"object","properties":{"city":{"type":"string"}}},"strict":false}})";
  const ApiRequest r = chat(R"({"model":"m","messages":[{"role":"user","content":"x"},
      {"role":"assistant","content":null,"reasoning_content":"hm","tool_calls":[{"id":"call_1","type":"function",
       "function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}}]},
      {"role":"tool","tool_call_id":"call_1","content":"sunny"}],"tools":[)" + tool + R"(],"parallel_tool_calls":false})");
  ASSERT_EQ(r.tools.size(), 1u);
  EXPECT_EQ(r.tools[0], json::parse(tool));
  EXPECT_EQ(r.tool_choice, ToolChoice::Auto);
  EXPECT_FALSE(r.parallel_tool_calls);
  EXPECT_EQ(r.messages[1]["content"], "");
  EXPECT_EQ(r.messages[1]["reasoning_content"], "hm");
  EXPECT_EQ(r.messages[1]["tool_calls"][0]["function"]["arguments"], "{\"city\": \"Paris\"}");
  EXPECT_EQ(r.messages[2]["tool_call_id"], "call_1");
  const std::string base = R"({"model":"m","messages":[{"role":"user","content":"x"}],"tools":[)" + tool + "]";
  EXPECT_EQ(chat(base + R"(,"tool_choice":"none"})").tool_choice, ToolChoice::None);
  EXPECT_EQ(chat(base + R"(,"tool_choice":"auto"})").tool_choice, ToolChoice::Auto);
  EXPECT_EQ(chat(R"({"model":"m","messages":[{"role":"user","content":"x"}],"tool_choice":"none"})").tool_choice,
            ToolChoice::None);
  EXPECT_EQ(chat(R"({"model":"m","messages":[{"role":"user","content":"x"}]})").tool_choice, ToolChoice::None);
  EXPECT_TRUE(chat(R"({"model":"m","messages":[{"role":"user","content":"x"}],"response_format":{"type":"text"}})").tools.empty());

  // Arguments as objects for the templates that print or iterate them, as strings for DeepSeek's.
  const json objects = template_messages(r.messages, true), strings = template_messages(r.messages, false);
  EXPECT_EQ(objects[1]["tool_calls"][0]["function"]["arguments"], json({{"city", "Paris"}}));
  EXPECT_EQ(strings[1]["tool_calls"][0]["function"]["arguments"], "{\"city\": \"Paris\"}");
  const ApiRequest odd = chat(R"({"model":"m","messages":[{"role":"assistant","content":"","tool_calls":[
      {"id":"a","type":"function","function":{"name":"f","arguments":"not json"}},
      {"id":"b","type":"function","function":{"name":"f","arguments":"[1]"}}]}]})");
  const json kept = template_messages(odd.messages, true);
  EXPECT_EQ(kept[0]["tool_calls"][0]["function"]["arguments"], "not json");  // not an object: kept as written
  EXPECT_EQ(kept[0]["tool_calls"][1]["function"]["arguments"], "[1]");
}

// Each invalid tool field is a 400 naming it; "required" and a named function are taken.
TEST(OpenAiApi, RejectsInvalidTools) {
  const Endpoint H = Endpoint::Chat;
  const std::string head = R"({"model":"m","messages":[{"role":"user","content":"x"}],)";
  const std::string ok = R"({"type":"function","function":{"name":"f"}})";
  auto tools = [&](const std::string& t, const std::string& more = "") { return head + R"("tools":[)" + t + "]" + more + "}"; };
  EXPECT_EQ(blamed(H, head + R"("tools":{}})"), "tools");
  EXPECT_EQ(blamed(H, tools("3")), "tools[0]");
  EXPECT_EQ(blamed(H, tools(R"({"function":{"name":"f"}})")), "tools[0].type");
  EXPECT_EQ(blamed(H, tools(R"({"type":"code","function":{"name":"f"}})")), "tools[0].type");
  EXPECT_EQ(blamed(H, tools(R"({"type":"function"})")), "tools[0].function");
  EXPECT_EQ(blamed(H, tools(ok + R"(,{"type":"function","function":{"name":"g"}},{"type":"function","function":{}})")),
            "tools[2].function.name");
  EXPECT_EQ(blamed(H, tools(R"({"type":"function","function":{"name":7}})")), "tools[0].function.name");
  EXPECT_EQ(blamed(H, tools(R"({"type":"function","function":{"name":"a b"}})")), "tools[0].function.name");
  EXPECT_EQ(blamed(H, tools(R"({"type":"function","function":{"name":")" + std::string(65, 'a') + R"("}})")),
            "tools[0].function.name");
  EXPECT_EQ(blamed(H, tools(ok + "," + ok)), "tools[1].function.name");  // two tools of one name
  EXPECT_EQ(blamed(H, tools(R"({"type":"function","function":{"name":"f","description":1}})")), "tools[0].function.description");
  EXPECT_EQ(blamed(H, tools(R"({"type":"function","function":{"name":"f","parameters":"{}"}})")), "tools[0].function.parameters");
  EXPECT_EQ(blamed(H, tools(R"({"type":"function","function":{"name":"f","strict":"yes"}})")), "tools[0].function.strict");
  EXPECT_EQ(blamed(H, tools(ok, R"(,"tool_choice":"sometimes")")), "tool_choice");
  EXPECT_EQ(blamed(H, tools(ok, R"(,"tool_choice":3)")), "tool_choice");
  EXPECT_EQ(blamed(H, tools(ok, R"(,"tool_choice":{"type":"function","function":{"name":"g"}})")), "tool_choice.function.name");
  EXPECT_EQ(blamed(H, tools(ok, R"(,"tool_choice":{"type":"function","function":{}})")), "tool_choice.function.name");
  EXPECT_EQ(blamed(H, tools(ok, R"(,"tool_choice":{"type":"other","function":{"name":"f"}})")), "tool_choice.type");
  EXPECT_EQ(blamed(H, head + R"("tool_choice":"auto"})"), "tool_choice");  // no tools to choose from
  EXPECT_EQ(blamed(H, tools(ok, R"(,"parallel_tool_calls":1)")), "parallel_tool_calls");
  EXPECT_EQ(chat(tools(ok, R"(,"tool_choice":"required")")).tool_choice, ToolChoice::Required);
  const ApiRequest named = chat(tools(ok, R"(,"tool_choice":{"type":"function","function":{"name":"f"}})"));
  EXPECT_EQ(named.tool_choice, ToolChoice::Named);
  EXPECT_EQ(named.tool_name, "f");
  EXPECT_EQ(blamed(H, tools(ok, R"(,"tool_choice":"required","response_format":{"type":"json_object"})")), "response_format");
  EXPECT_EQ(blamed(H, head + R"("functions":[{"name":"f"}]})"), "functions");
  EXPECT_EQ(blamed(H, head + R"("function_call":"auto"})"), "function_call");
  // Messages: tool calls only from the assistant, each field checked; tool results name their call.
  const std::string call = R"({"id":"c","type":"function","function":{"name":"f","arguments":"{}"}})";
  auto msgs = [](const std::string& m) { return R"({"model":"m","messages":[)" + m + "]}"; };
  EXPECT_EQ(blamed(H, msgs(R"({"role":"user","content":"x","tool_calls":[)" + call + "]}")), "messages[0].tool_calls");
  EXPECT_EQ(blamed(H, msgs(R"({"role":"assistant","tool_calls":{}})")), "messages[0].tool_calls");
  EXPECT_EQ(blamed(H, msgs(R"({"role":"assistant","tool_calls":[)" + call + R"(,{"type":"function","function":{"name":"f","arguments":"{}"}}]})")),
            "messages[0].tool_calls[1].id");
  EXPECT_EQ(blamed(H, msgs(R"({"role":"assistant","tool_calls":[{"id":"c","type":"x","function":{"name":"f","arguments":"{}"}}]})")),
            "messages[0].tool_calls[0].type");
  EXPECT_EQ(blamed(H, msgs(R"({"role":"assistant","tool_calls":[{"id":"c","type":"function"}]})")),
            "messages[0].tool_calls[0].function");
  EXPECT_EQ(blamed(H, msgs(R"({"role":"assistant","tool_calls":[{"id":"c","type":"function","function":{"arguments":"{}"}}]})")),
            "messages[0].tool_calls[0].function.name");
  EXPECT_EQ(blamed(H, msgs(R"({"role":"assistant","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":{}}}]})")),
            "messages[0].tool_calls[0].function.arguments");
  EXPECT_EQ(blamed(H, msgs(R"({"role":"assistant","content":"x","reasoning_content":5})")), "messages[0].reasoning_content");
  EXPECT_EQ(blamed(H, msgs(R"({"role":"tool","content":"x"})")), "messages[0].tool_call_id");
  EXPECT_EQ(blamed(H, msgs(R"({"role":"tool","content":"x","tool_call_id":1})")), "messages[0].tool_call_id");
}

TEST(OpenAiApi, RefusesDeepNesting) {
  EXPECT_EQ(json_nesting(R"({"a":[1,{"b":[]}]})"), 4u);
  EXPECT_EQ(json_nesting(R"({"a":"[[[[{{{{\"[["})"), 1u);  // brackets in strings, escaped quotes
  EXPECT_EQ(json_nesting("]]]}}}"), 0u);
  const std::string deep = std::string(kMaxJsonNesting + 1, '[') + std::string(kMaxJsonNesting + 1, ']');
  try {
    parse_request(Endpoint::Completions, deep);
    FAIL() << "accepted " << kMaxJsonNesting + 1 << " levels";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_NE(std::string(e.what()).find("deeper than 64"), std::string::npos) << e.what();
  }
  // At the limit the body is parsed (and refused for what it is: an array, not an object).
  const std::string ok = std::string(kMaxJsonNesting, '[') + std::string(kMaxJsonNesting, ']');
  try {
    parse_request(Endpoint::Completions, ok);
  } catch (const ApiError& e) {
    EXPECT_NE(std::string(e.what()).find("must be a JSON object"), std::string::npos) << e.what();
  }
}

TEST(OpenAiApi, BuildsResponsesAndChunks) {
  Completion c;
  c.id = "chatcmpl-1";
  c.model = "m";
  c.created = 5;
  c.choices.resize(1);
  c.choices[0].text = "hello";
  c.choices[0].finish_reason = "stop";
  c.usage = {3, 2, 1};
  c.choices[0].tokens = {{"hel", -0.5f, {{"hel", -0.5f}, {"he", -1.5f}}}, {"lo", -0.25f, {}}};
  const json r = response_json(Endpoint::Chat, c, true);
  EXPECT_EQ(r["object"], "chat.completion");
  EXPECT_EQ(r["choices"][0]["index"], 0);
  EXPECT_EQ(r["choices"][0]["message"]["content"], "hello");
  EXPECT_EQ(r["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(r["usage"]["total_tokens"], 5);
  EXPECT_EQ(r["usage"]["prompt_tokens_details"]["cached_tokens"], 1);
  EXPECT_EQ(r["choices"][0]["logprobs"]["content"][0]["top_logprobs"][1]["token"], "he");
  const json t = response_json(Endpoint::Completions, c, true);
  EXPECT_EQ(t["object"], "text_completion");
  EXPECT_EQ(t["choices"][0]["text"], "hello");
  EXPECT_EQ(t["choices"][0]["logprobs"]["text_offset"][1], 3);
  const json first = chunk_json(Endpoint::Chat, c, 0, "he", {}, false, "", true);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["index"], 0);
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(first["choices"][0]["delta"]["content"], "he");
  EXPECT_TRUE(first["choices"][0]["finish_reason"].is_null());
  const json last = chunk_json(Endpoint::Chat, c, 0, "", {}, false, "length", false);
  EXPECT_TRUE(last["choices"][0]["delta"].empty());
  EXPECT_EQ(last["choices"][0]["finish_reason"], "length");
  const json u = usage_chunk_json(Endpoint::Chat, c);
  EXPECT_TRUE(u["choices"].empty());
  EXPECT_EQ(u["usage"]["prompt_tokens"], 3);
  EXPECT_EQ(sse(json{{"a", std::string("\xff")}}), "data: {\"a\":\"\xef\xbf\xbd\"}\n\n");  // invalid UTF-8 replaced
  const json err = json::parse(error_body(ApiError(404, "no such model", "model")));
  EXPECT_EQ(err["error"]["type"], "not_found_error");
  EXPECT_EQ(err["error"]["param"], "model");
  EXPECT_EQ(err["error"]["code"], "model_not_found");
}

// Tool calls and reasoning in a response (content null when there are only calls) and in chunks:
// a call's head (index, id, type, name, empty arguments), then its arguments.
TEST(OpenAiApi, BuildsToolCallsAndReasoning) {
  Completion c;
  c.id = "chatcmpl-1";
  c.model = "m";
  c.choices.resize(2);
  c.choices[0].reasoning = "think";
  c.choices[0].tool_calls = {{"get_weather", R"({"city":"Paris"})", "call_1"}, {"now", "{}", "call_2"}};
  c.choices[0].finish_reason = "tool_calls";
  c.choices[1].text = "hi";
  c.choices[1].finish_reason = "stop";
  const json r = response_json(Endpoint::Chat, c, false);
  const json& m = r["choices"][0]["message"];
  EXPECT_TRUE(m["content"].is_null());
  EXPECT_EQ(m["reasoning_content"], "think");
  ASSERT_EQ(m["tool_calls"].size(), 2u);
  EXPECT_EQ(m["tool_calls"][0], json::parse(R"({"id":"call_1","type":"function","function":{"name":"get_weather",
      "arguments":"{\"city\":\"Paris\"}"}})"));
  EXPECT_EQ(m["tool_calls"][1]["function"]["name"], "now");
  EXPECT_EQ(r["choices"][0]["finish_reason"], "tool_calls");
  EXPECT_EQ(r["choices"][1]["message"], json::parse(R"({"role":"assistant","content":"hi"})"));  // nothing else

  const json head = tool_call_chunk_json(c, 0, 1, c.choices[0].tool_calls[1], true);
  EXPECT_EQ(head["object"], "chat.completion.chunk");
  EXPECT_EQ(head["choices"][0]["index"], 0);
  EXPECT_EQ(head["choices"][0]["delta"], json::parse(R"({"tool_calls":[{"index":1,"id":"call_2","type":"function",
      "function":{"name":"now","arguments":""}}]})"));
  EXPECT_TRUE(head["choices"][0]["finish_reason"].is_null());
  const json args = tool_call_chunk_json(c, 1, 0, c.choices[0].tool_calls[0], false);
  EXPECT_EQ(args["choices"][0]["index"], 1);
  EXPECT_EQ(args["choices"][0]["delta"], json::parse(R"({"tool_calls":[{"index":0,"function":{"arguments":"{\"city\":\"Paris\"}"}}]})"));
  const json thinking = chunk_json(Endpoint::Chat, c, 0, "", {}, false, "", false, "hmm");
  EXPECT_EQ(thinking["choices"][0]["delta"], json::parse(R"({"reasoning_content":"hmm"})"));
  const json first = chunk_json(Endpoint::Chat, c, 0, "", {}, false, "", true, "hmm");
  EXPECT_EQ(first["choices"][0]["delta"], json::parse(R"({"role":"assistant","reasoning_content":"hmm","content":""})"));
}

// n choices: indices 0..n-1 in order, each with its own text, log-probabilities and finish;
// chunks carry the index of their choice.
TEST(OpenAiApi, BuildsSeveralChoices) {
  Completion c;
  c.id = "cmpl-1";
  c.model = "m";
  c.choices = {{"a", {{"a", -0.1f, {}}}, "length"}, {"bc", {{"b", -1.0f, {}}, {"c", -2.0f, {}}}, "stop"}};
  c.usage = {4, 3};
  for (Endpoint e : {Endpoint::Completions, Endpoint::Chat}) {
    const json r = response_json(e, c, true);
    ASSERT_EQ(r["choices"].size(), 2u);
    EXPECT_EQ(r["choices"][1]["index"], 1);
    EXPECT_EQ(r["choices"][1]["finish_reason"], "stop");
    EXPECT_EQ(r["usage"]["completion_tokens"], 3);
    EXPECT_EQ(r["usage"]["total_tokens"], 7);
  }
  const json t = response_json(Endpoint::Completions, c, true);
  EXPECT_EQ(t["choices"][0]["text"], "a");
  EXPECT_EQ(t["choices"][1]["text"], "bc");
  EXPECT_EQ(t["choices"][1]["logprobs"]["tokens"], json({"b", "c"}));
  EXPECT_EQ(t["choices"][1]["logprobs"]["text_offset"], json({0, 1}));
  const json h = response_json(Endpoint::Chat, c, false);
  EXPECT_EQ(h["choices"][1]["message"]["content"], "bc");
  EXPECT_TRUE(h["choices"][1]["logprobs"].is_null());
  const json k = chunk_json(Endpoint::Completions, c, 1, "x", {{"x", -0.5f, {}}}, true, "", false);
  ASSERT_EQ(k["choices"].size(), 1u);
  EXPECT_EQ(k["choices"][0]["index"], 1);
  EXPECT_EQ(k["choices"][0]["text"], "x");
  EXPECT_EQ(k["choices"][0]["logprobs"]["tokens"], json({"x"}));
  EXPECT_EQ(chunk_json(Endpoint::Chat, c, 1, "", {}, false, "stop", false)["choices"][0]["index"], 1);
}

}  // namespace
}  // namespace kestrel::server

namespace kestrel::server {
namespace {

// response_format: text, json_object and json_schema taken on both endpoints; each malformed field
// a 400 naming it (the schema itself is checked when it is compiled: test_structured_outputs.cpp).
TEST(OpenAiApi, ResponseFormat) {
  const std::string head = R"({"model":"m","messages":[{"role":"user","content":"x"}],"response_format":)";
  auto with = [&](const std::string& f) { return head + f + "}"; };
  EXPECT_EQ(chat(with(R"({"type":"text"})")).response_format, ResponseFormat::Text);
  EXPECT_EQ(chat(with(R"({"type":"json_object"})")).response_format, ResponseFormat::JsonObject);
  const ApiRequest s = chat(with(R"({"type":"json_schema","json_schema":{"name":"p","schema":{"type":"object"},"strict":true}})"));
  EXPECT_EQ(s.response_format, ResponseFormat::JsonSchema);
  EXPECT_EQ(s.response_schema, json({{"type", "object"}}));
  EXPECT_TRUE(s.schema_strict);
  const ApiRequest c = parse_request(Endpoint::Completions, R"({"model":"m","prompt":"x","response_format":{"type":"json_object"}})");
  EXPECT_EQ(c.response_format, ResponseFormat::JsonObject);
  const Endpoint H = Endpoint::Chat;
  EXPECT_EQ(blamed(H, with("3")), "response_format");
  EXPECT_EQ(blamed(H, with("{}")), "response_format.type");
  EXPECT_EQ(blamed(H, with(R"({"type":"yaml"})")), "response_format.type");
  EXPECT_EQ(blamed(H, with(R"({"type":"json_schema"})")), "response_format.json_schema");
  EXPECT_EQ(blamed(H, with(R"({"type":"json_schema","json_schema":{"schema":{}}})")), "response_format.json_schema.name");
  EXPECT_EQ(blamed(H, with(R"({"type":"json_schema","json_schema":{"name":"a b","schema":{}}})")),
            "response_format.json_schema.name");
  EXPECT_EQ(blamed(H, with(R"({"type":"json_schema","json_schema":{"name":"p"}})")), "response_format.json_schema.schema");
  EXPECT_EQ(blamed(H, with(R"({"type":"json_schema","json_schema":{"name":"p","schema":[]}})")),
            "response_format.json_schema.schema");
  EXPECT_EQ(blamed(H, with(R"({"type":"json_schema","json_schema":{"name":"p","schema":{},"strict":1}})")),
            "response_format.json_schema.strict");
}

}  // namespace
}  // namespace kestrel::server
