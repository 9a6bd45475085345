// Chat templates of the supported model families against transformers' apply_chat_template
// (renderings recorded by scripts/make_chat_fixtures.py), and the loading of a model folder's
// template in transformers' order of precedence.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unistd.h>

#include "common/error.h"
#include "common/mapped_file.h"
#include "text/chat_template.h"

namespace kestrel {
namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

std::string chat_data(const std::string& file) { return std::string(KESTREL_TEXT_DATA) + "/chat/" + file; }


struct RenderCase {
  std::string template_file;
  std::string name;
  ojson messages;
  ojson options;
  bool is_error = false;
  std::string expected;  // the rendering, or the error message
};

std::vector<RenderCase> load_cases() {
  std::vector<RenderCase> out;
  ojson j = ojson::parse(read_text_file(chat_data("renderings.json")));
  for (const auto& c : j.at("cases")) {
    RenderCase r;
    r.template_file = c.at("template").get<std::string>();
    r.name = c.at("case").get<std::string>();
    r.messages = c.at("messages");
    r.options = c.at("options");
    r.is_error = c.contains("error");
    r.expected = r.is_error ? c.at("error").get<std::string>() : c.at("expected").get<std::string>();
    out.push_back(std::move(r));
  }
  return out;
}

const ChatTemplate& template_for(const std::string& file) {
  static std::map<std::string, std::unique_ptr<ChatTemplate>> cache;
  auto& slot = cache[file];
  if (!slot) slot = std::make_unique<ChatTemplate>(read_text_file(chat_data("templates/" + file)), file);
  return *slot;
}

void PrintTo(const RenderCase& c, std::ostream* os) { *os << c.template_file << " / " << c.name; }

class Rendering : public ::testing::TestWithParam<RenderCase> {};

TEST_P(Rendering, MatchesTransformers) {
  const RenderCase& c = GetParam();
  const ChatTemplate& t = template_for(c.template_file);
  if (!c.is_error) {
    EXPECT_EQ(t.render(c.messages, c.options), c.expected);
    return;
  }
  try {
    std::string got = t.render(c.messages, c.options);
    FAIL() << "expected the error \"" << c.expected << "\", got a rendering:\n" << got;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(c.expected), std::string::npos)
        << "error \"" << e.what() << "\" does not contain \"" << c.expected << "\"";
    EXPECT_NE(std::string(e.what()).find(c.template_file), std::string::npos) << e.what();
  }
}

std::string case_name(const ::testing::TestParamInfo<RenderCase>& info) {
  std::string n = info.param.template_file.substr(0, info.param.template_file.size() - 6) + "_" + info.param.name;
  for (char& ch : n)
    if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return n;
}

INSTANTIATE_TEST_SUITE_P(Transformers, Rendering, ::testing::ValuesIn(load_cases()), case_name);

TEST(ChatTemplate, EveryFamilyIsCovered) {
  std::map<std::string, int> rendered, errors;
  for (const auto& c : load_cases()) (c.is_error ? errors : rendered)[c.template_file]++;
  for (const char* f : {"qwen3.jinja", "qwen2.5.jinja", "llama3.1.jinja", "llama3.2.jinja", "mixtral.jinja",
                        "glm-4.5.jinja", "deepseek-v3.jinja", "deepseek-r1.jinja", "deepseek-v3.1.jinja"})
    EXPECT_GE(rendered[f], 8) << f;
  EXPECT_GE(errors["mixtral.jinja"], 3);
}

TEST(ChatTemplate, RaiseExceptionCarriesTheTemplateMessage) {
  ChatTemplate t(read_text_file(chat_data("templates/mixtral.jinja")), "mixtral");
  ojson messages = ojson::parse(R"([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])");
  try {
    t.render(messages, ojson::object());
    FAIL() << "no error";
  } catch (const jinja::TemplateRaise& e) {
    EXPECT_EQ(e.message(), "After the optional system message, conversation roles must alternate user/assistant/user/assistant/...");
    EXPECT_EQ(std::string(e.what()).rfind("mixtral:", 0), 0u) << e.what();
  }
}

TEST(ChatTemplate, JsonOverloadSortsKeysOrderedKeepsThem) {
  const std::string src = "{{ tools[0] | tojson }}";
  nlohmann::json sorted = nlohmann::json::parse(R"({"tools": [{"b": 1, "a": 2}]})");
  ojson ordered = ojson::parse(R"({"tools": [{"b": 1, "a": 2}]})");
  ojson msgs = ojson::parse(R"([{"role": "user", "content": "x"}])");
  EXPECT_EQ(render_chat(src, nlohmann::json(msgs), sorted), "{\"a\": 2, \"b\": 1}");
  EXPECT_EQ(render_chat(src, msgs, ordered), "{\"b\": 1, \"a\": 2}");
}

TEST(ChatTemplate, DefaultsAndPassThroughOptions) {
  const std::string src =
      "{{ tools }}|{{ documents }}|{{ add_generation_prompt }}|{{ enable_thinking }}|{{ custom }}|{{ messages|length }}";
  ojson msgs = ojson::parse(R"([{"role": "user", "content": "x"}])");
  EXPECT_EQ(render_chat(src, msgs, ojson::object()), "None|None|False|||1");
  EXPECT_EQ(render_chat(src, msgs, ojson::parse(R"({"enable_thinking": false, "custom": [1], "add_generation_prompt": true})")),
            "None|None|True|False|[1]|1");
}

TEST(ChatTemplate, RejectsBadInput) {
  EXPECT_THROW(render_chat("x", ojson::array(), ojson::object()), Error);
  EXPECT_THROW(render_chat("x", ojson::object(), ojson::object()), Error);
  EXPECT_THROW(render_chat("x", ojson::parse("[1]"), ojson::object()), Error);
  EXPECT_THROW(render_chat("{% if %}", ojson::parse(R"([{"role":"user","content":"x"}])"), ojson::object()), Error);
  ojson msgs = ojson::parse(R"([{"role": "user", "content": "x"}])");
  EXPECT_THROW(render_chat("{{ messages[0].content }}", msgs, ojson::parse(R"({"continue_final_message": true, "add_generation_prompt": true})")),
               Error);
}

// ---- loading -----------------------------------------------------------------------------

class TempModelDir {
 public:
  TempModelDir() {
    static int counter = 0;
    path_ = fs::temp_directory_path() / ("kestrel_chat_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::create_directories(path_);
  }
  ~TempModelDir() { fs::remove_all(path_); }
  void write(const std::string& rel, const std::string& text) const {
    fs::create_directories((path_ / rel).parent_path());
    std::ofstream(path_ / rel, std::ios::binary) << text;
  }
  std::string str() const { return path_.string(); }

 private:
  fs::path path_;
};

TEST(LoadChatTemplate, JinjaFileWinsOverTokenizerConfig) {
  TempModelDir d;
  d.write("tokenizer_config.json", R"({"chat_template": "from config"})");
  d.write("chat_template.jinja", "from jinja");
  EXPECT_EQ(load_chat_template(d.str()), "from jinja");
}

TEST(LoadChatTemplate, TokenizerConfigString) {
  TempModelDir d;
  d.write("tokenizer_config.json", R"({"eos_token": "</s>", "chat_template": "{{ messages }}"})");
  EXPECT_EQ(load_chat_template(d.str()), "{{ messages }}");
}

TEST(LoadChatTemplate, TokenizerConfigListUsesDefaultOrToolUse) {
  TempModelDir d;
  d.write("tokenizer_config.json",
          R"({"chat_template": [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}, {"name": "rag", "template": "R"}]})");
  EXPECT_EQ(load_chat_template(d.str()), "D");
  EXPECT_EQ(load_chat_template(d.str(), true), "T");
  auto all = load_chat_templates(d.str());
  EXPECT_EQ(all.size(), 3u);
  EXPECT_EQ(all["rag"], "R");
}

TEST(LoadChatTemplate, AdditionalTemplatesFolder) {
  TempModelDir d;
  d.write("chat_template.jinja", "D");
  d.write("additional_chat_templates/tool_use.jinja", "T");
  d.write("tokenizer_config.json", R"({"chat_template": "ignored"})");
  EXPECT_EQ(load_chat_template(d.str()), "D");
  EXPECT_EQ(load_chat_template(d.str(), true), "T");
}

TEST(LoadChatTemplate, LegacyProcessorFile) {
  TempModelDir d;
  d.write("tokenizer_config.json", R"({"eos_token": "</s>"})");
  d.write("chat_template.json", R"({"chat_template": "P"})");
  EXPECT_EQ(load_chat_template(d.str()), "P");
}

TEST(LoadChatTemplate, ClearErrors) {
  TempModelDir d;
  try {
    load_chat_template(d.str());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no chat template"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(d.str()), std::string::npos) << e.what();
  }
  d.write("tokenizer_config.json", R"({"chat_template": 5})");
  EXPECT_THROW(load_chat_template(d.str()), Error);
  d.write("tokenizer_config.json", R"({"chat_template": [{"name": "rag", "template": "R"}, {"name": "x", "template": "X"}]})");
  try {
    load_chat_template(d.str());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rag"), std::string::npos) << e.what();
  }
  d.write("tokenizer_config.json", "{not json");
  EXPECT_THROW(load_chat_template(d.str()), Error);
  EXPECT_THROW(load_chat_template(d.str() + "/missing"), Error);
}

TEST(LoadChatTemplate, RendersAFixtureTemplateFromAFolder) {
  TempModelDir d;
  nlohmann::json cfg = {{"chat_template", read_text_file(chat_data("templates/qwen3.jinja"))}};
  d.write("tokenizer_config.json", cfg.dump());
  ojson msgs = ojson::parse(R"([{"role": "user", "content": "Hi"}])");
  EXPECT_EQ(render_chat(load_chat_template(d.str()), msgs, ojson::parse(R"({"add_generation_prompt": true})")),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

}  // namespace
}  // namespace kestrel
