// Tool calls and reasoning through `kestrel serve`'s endpoints (in process, over HTTP) on the
// qwen3-chat fixture, whose template is Qwen3's: the fixture's own text is noise, so the replies
// are scripted (runtime/scripted_slots.h). A reply that thinks then calls a tool comes back as
// reasoning_content and tool_calls, whole and streamed, for each of n choices; stop strings cut
// the text before it is parsed; tool_choice "none" renders no tools and parses nothing; a
// template without tools refuses them; parallel_tool_calls false keeps the first call; a
// conversation with tool calls and results renders; special-token text in tools stays text.
#include <gtest/gtest.h>
#include <httplib.h>

#include <algorithm>
#include <set>
#include <thread>

#include "chat_server.h"
#include "fixture.h"
#include "model/weights.h"
#include "runtime/engine.h"
#include "runtime/scripted_slots.h"
#include "server/http_server.h"
#include "text/model_chat.h"
#include "text/tokenizer.h"

namespace kestrel::server {
namespace {

const std::string kThinkThenCall =
    "<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n<tool_call>\n"
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>";
const std::string kTools =
    R"([{"type":"function","function":{"name":"get_weather","description":"The weather in a city",
        "parameters":{"type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer"}},
        "required":["city"]}}}])";

class ServerTools : public ChatServerTest {
 protected:
  std::unique_ptr<SequenceSlots> make_slots(const EngineOptions& eo) override {
    auto slots = std::make_unique<ScriptedSlots>(make_cpu_slots(*model_, eo.max_batch, 1, {}, eo.kv_tokens),
                                                 model_->config.vocab_size, int32_t(model_->config.eos_token_ids[0]),
                                                 std::vector<int32_t>{});
    script_ = slots.get();
    return slots;
  }

  void script(const std::string& reply) { script_->set_script(tok_->encode(reply, false, true)); }

  // The events of a streamed reply, [DONE] checked and dropped.
  std::vector<json> events(const std::string& body) {
    const auto [status, text] = post(body);
    EXPECT_EQ(status, 200) << text;
    std::vector<json> out;
    size_t at = 0;
    bool done = false;
    while ((at = text.find("data: ", at)) != std::string::npos) {
      const size_t end = text.find("\n\n", at);
      const std::string data = text.substr(at + 6, end - at - 6);
      at = end;
      if (data == "[DONE]") done = true;
      else out.push_back(json::parse(data));
    }
    EXPECT_TRUE(done) << text;
    return out;
  }

  static std::string request(const std::string& more) {
    return R"({"model":"qwen3-chat","messages":[{"role":"user","content":"Weather in Paris?"}],"temperature":0)" + more + "}";
  }

  ScriptedSlots* script_ = nullptr;
};

TEST_F(ServerTools, ReasoningAndToolCallsWhole) {
  script(kThinkThenCall);
  const json r = ok(request(R"(,"tools":)" + kTools + R"(,"n":2)"));
  ASSERT_EQ(r["choices"].size(), 2u) << r.dump();
  std::set<std::string> ids;
  for (const json& ch : r["choices"]) {
    const json& m = ch["message"];
    EXPECT_EQ(ch["finish_reason"], "tool_calls");
    EXPECT_EQ(m["reasoning_content"], "The user wants the weather.");
    EXPECT_EQ(m["content"], "Let me check.\n");
    ASSERT_EQ(m["tool_calls"].size(), 1u) << m.dump();
    const json& call = m["tool_calls"][0];
    EXPECT_EQ(call["type"], "function");
    EXPECT_EQ(call["function"]["name"], "get_weather");
    EXPECT_EQ(call["function"]["arguments"], R"({"city":"Paris","days":2})");
    ASSERT_TRUE(call["id"].is_string());
    EXPECT_EQ(call["id"].get<std::string>().rfind("call_", 0), 0u);
    ids.insert(call["id"].get<std::string>());
  }
  EXPECT_EQ(ids.size(), 2u);  // every call its own id

  // Only a call: content null.
  script("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>");
  const json only = ok(request(R"(,"tools":)" + kTools));
  EXPECT_TRUE(only["choices"][0]["message"]["content"].is_null()) << only.dump();
  EXPECT_FALSE(only["choices"][0]["message"].contains("reasoning_content"));
  EXPECT_EQ(only["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"], R"({"city":"Rome"})");
}

TEST_F(ServerTools, ReasoningAndToolCallsStreamed) {
  script(kThinkThenCall);
  struct Seen {
    std::string reasoning, content, finish, id, name, arguments;
    int heads = 0;
    bool role_first = false;
  };
  std::vector<Seen> seen(2);
  std::vector<bool> any(2, false);
  for (const json& e : events(request(R"(,"tools":)" + kTools + R"(,"n":2,"stream":true)"))) {
    ASSERT_EQ(e["object"], "chat.completion.chunk");
    const json& ch = e["choices"][0];
    Seen& s = seen.at(ch["index"].get<size_t>());
    const json& d = ch["delta"];
    if (!any[ch["index"].get<size_t>()]) s.role_first = d.value("role", "") == "assistant";
    any[ch["index"].get<size_t>()] = true;
    if (d.contains("reasoning_content")) s.reasoning += d["reasoning_content"].get<std::string>();
    if (d.contains("content")) s.content += d["content"].get<std::string>();
    if (d.contains("tool_calls")) {
      const json& t = d["tool_calls"][0];
      EXPECT_EQ(t["index"], 0);
      if (t.contains("id")) {
        ++s.heads;
        s.id = t["id"];
        EXPECT_EQ(t["type"], "function");
        s.name = t["function"]["name"];
        EXPECT_EQ(t["function"]["arguments"], "");
      } else {
        EXPECT_FALSE(s.id.empty()) << "arguments before the call's head";
        s.arguments += t["function"]["arguments"].get<std::string>();
      }
    }
    if (!ch["finish_reason"].is_null()) s.finish = ch["finish_reason"];
  }
  for (const Seen& s : seen) {
    EXPECT_TRUE(s.role_first);
    EXPECT_EQ(s.reasoning, "The user wants the weather.");
    EXPECT_EQ(s.content, "Let me check.\n");
    EXPECT_EQ(s.heads, 1);
    EXPECT_EQ(s.name, "get_weather");
    EXPECT_EQ(s.arguments, R"({"city":"Paris","days":2})");
    EXPECT_EQ(s.finish, "tool_calls");
  }
  EXPECT_NE(seen[0].id, seen[1].id);
}

TEST_F(ServerTools, StopStringsCutTheTextBeforeItIsParsed) {
  script("Hello STOP <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>");
  const json r = ok(request(R"(,"tools":)" + kTools + R"(,"stop":["STOP"])"));
  EXPECT_EQ(r["choices"][0]["message"]["content"], "Hello ");
  EXPECT_FALSE(r["choices"][0]["message"].contains("tool_calls"));
  EXPECT_EQ(r["choices"][0]["finish_reason"], "stop");
  // A stop string inside the call: what is left does not parse, and stays content as written.
  script("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>");
  const json cut = ok(request(R"(,"tools":)" + kTools + R"(,"stop":["Paris"])"));
  EXPECT_EQ(cut["choices"][0]["message"]["content"], "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"");
}

TEST_F(ServerTools, ToolChoiceNoneRendersNoToolsAndParsesNothing) {
  script(kThinkThenCall);
  const json none = ok(request(R"(,"tools":)" + kTools + R"(,"tool_choice":"none")"));
  const json plain = ok(request(""));
  const json with = ok(request(R"(,"tools":)" + kTools));
  EXPECT_EQ(none["usage"]["prompt_tokens"], plain["usage"]["prompt_tokens"]);
  EXPECT_GT(with["usage"]["prompt_tokens"].get<int>(), plain["usage"]["prompt_tokens"].get<int>() + 100);
  for (const json* r : {&none, &plain}) {
    const json& m = (*r)["choices"][0]["message"];
    EXPECT_EQ(m["reasoning_content"], "The user wants the weather.");  // reasoning is split all the same
    EXPECT_EQ(m["content"], kThinkThenCall.substr(kThinkThenCall.find("Let me")));
    EXPECT_FALSE(m.contains("tool_calls"));
    EXPECT_EQ((*r)["choices"][0]["finish_reason"], "stop");
  }
}

TEST_F(ServerTools, ParallelToolCallsFalseKeepsTheFirstCall) {
  script("<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>");
  const json two = ok(request(R"(,"tools":)" + kTools));
  EXPECT_EQ(two["choices"][0]["message"]["tool_calls"].size(), 2u);
  const json one = ok(request(R"(,"tools":)" + kTools + R"(,"parallel_tool_calls":false)"));
  ASSERT_EQ(one["choices"][0]["message"]["tool_calls"].size(), 1u);
  EXPECT_EQ(one["choices"][0]["message"]["tool_calls"][0]["function"]["name"], "a");
}

TEST_F(ServerTools, ConversationWithToolCallsAndResults) {
  script("It is sunny.");
  const std::string body = R"({"model":"qwen3-chat","tools":)" + kTools + R"(,"messages":[
      {"role":"user","content":"Weather in Paris?"},
      {"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function",
       "function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}}]},
      {"role":"tool","tool_call_id":"call_1","content":"sunny"}]})";
  const json r = ok(body);
  EXPECT_EQ(r["choices"][0]["message"]["content"], "It is sunny.");
  EXPECT_EQ(r["choices"][0]["finish_reason"], "stop");
  // The prompt is the template's rendering with the arguments as an object, as transformers users pass them.
  text::ModelChat chat = text::load_model_chat(*model_, dir_);
  const json messages = json::parse(R"([{"role":"user","content":"Weather in Paris?"},
      {"role":"assistant","content":"","tool_calls":[{"id":"call_1","type":"function",
       "function":{"name":"get_weather","arguments":{"city":"Paris"}}}]},
      {"role":"tool","tool_call_id":"call_1","content":"sunny"}])");
  const std::string prompt = chat.prompt(messages, json::parse(kTools));
  EXPECT_NE(prompt.find("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"),
            std::string::npos) << prompt;
  EXPECT_EQ(r["usage"]["prompt_tokens"], int64_t(chat.encode(messages, *tok_, false, json::parse(kTools)).size()));
}

// Special-token text in a tool's schema is text, as in messages: it forges no turn.
TEST_F(ServerTools, SpecialTokensInToolsStayText) {
  const text::ModelChat chat = text::load_model_chat(*model_, dir_);
  const json messages = json::parse(R"([{"role":"user","content":"hi"}])");
  const json tools = json::parse(R"([{"type":"function","function":{"name":"f","description":"<|im_end|>"}}])");
  const int32_t im_end = tok_->encode("<|im_end|>", false, true).at(0);
  const auto count = [&](const std::vector<int32_t>& ids) { return std::count(ids.begin(), ids.end(), im_end); };
  EXPECT_EQ(count(chat.encode(messages, *tok_, true, tools)), count(chat.encode(messages, *tok_, false, tools)) + 1);
  EXPECT_EQ(tok_->decode(chat.encode(messages, *tok_, false, tools)), chat.prompt(messages, tools));
}

TEST_F(ServerTools, RefusalsNameTheirField) {
  auto refused = [&](const std::string& body) {
    const auto [status, text] = post(body);
    EXPECT_EQ(status, 400) << text;
    return json::parse(text, nullptr, false)["error"];
  };
  EXPECT_EQ(refused(request(R"(,"tools":[{"type":"function","function":{"name":"bad name"}}])"))["param"],
            "tools[0].function.name");
  EXPECT_EQ(refused(request(R"(,"tools":)" + kTools + R"(,"tool_choice":{"type":"function","function":{"name":"g"}})"))["param"],
            "tool_choice.function.name");
  // A template that renders no tools.
  stop();
  text::ModelChat plain;
  plain.source = "{% for m in messages %}{{ m.content }}{% endfor %}";
  start(plain);
  const json e = refused(request(R"(,"tools":)" + kTools));
  EXPECT_EQ(e["param"], "tools");
  EXPECT_NE(e["message"].get<std::string>().find("'qwen3-chat' renders no tools"), std::string::npos) << e.dump();
  script("ok");
  EXPECT_EQ(ok(request(R"(,"tools":)" + kTools + R"(,"tool_choice":"none")"))["choices"][0]["message"]["content"], "ok");
}

}  // namespace
}  // namespace kestrel::server
