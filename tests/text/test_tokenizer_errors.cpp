// A bad tokenizer.json gives one kestrel::Error that names the file and the field at fault.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "text/tokenizer.h"

namespace kestrel::text {
namespace {

nlohmann::json minimal() {
  return {{"model",
           {{"type", "BPE"},
            {"vocab", {{"a", 0}, {"b", 1}, {"ab", 2}, {"c", 3}}},
            {"merges", {"a b"}}}},
          {"added_tokens", nlohmann::json::array()}};
}

std::string error_text(const std::string& text) {
  const auto path = std::filesystem::temp_directory_path() / "kestrel_bad_tokenizer.json";
  std::ofstream(path, std::ios::binary) << text;
  try {
    Tokenizer::from_file(path.string());
  } catch (const Error& e) {
    std::filesystem::remove(path);
    return e.what();
  }
  std::filesystem::remove(path);
  return "no error";
}

std::string error_of(const nlohmann::json& j) { return error_text(j.dump()); }

TEST(TokenizerErrors, MinimalFileLoads) {
  const Tokenizer tok = Tokenizer::from_json_text(minimal().dump());
  EXPECT_EQ(tok.encode("abc"), (std::vector<int32_t>{2, 3}));
  EXPECT_EQ(tok.decode(std::vector<int32_t>{2, 3}), "ab c");  // no decoder: tokens joined by spaces
}

TEST(TokenizerErrors, MissingFile) {
  EXPECT_THROW(Tokenizer::from_file("/nonexistent/tokenizer.json"), Error);
}

TEST(TokenizerErrors, TruncatedJson) {
  const std::string text = minimal().dump();
  const std::string e = error_text(text.substr(0, text.size() / 2));
  EXPECT_NE(e.find("kestrel_bad_tokenizer.json"), std::string::npos) << e;
  EXPECT_NE(e.find("not valid JSON"), std::string::npos) << e;
  EXPECT_NE(error_text("").find("not valid JSON"), std::string::npos);
  EXPECT_NE(error_text("[1, 2]").find("must be an object"), std::string::npos);
}

TEST(TokenizerErrors, UnknownModelType) {
  auto j = minimal();
  j["model"]["type"] = "WordPiece";
  const std::string e = error_of(j);
  EXPECT_NE(e.find("model type 'WordPiece' is not supported"), std::string::npos) << e;
  j.erase("model");
  EXPECT_NE(error_of(j).find("missing field 'model'"), std::string::npos);
}

TEST(TokenizerErrors, BadVocabulary) {
  auto j = minimal();
  j["model"]["vocab"]["d"] = "four";
  EXPECT_NE(error_of(j).find("id of 'd' must be an integer"), std::string::npos);
  j["model"]["vocab"]["d"] = -4;
  EXPECT_NE(error_of(j).find("out of range"), std::string::npos);
  j["model"]["vocab"]["d"] = 2000000000;
  EXPECT_NE(error_of(j).find("too sparse"), std::string::npos);
  j["model"]["vocab"] = {1, 2};
  EXPECT_NE(error_of(j).find("model.vocab: must be an object"), std::string::npos);
}

TEST(TokenizerErrors, BadMerges) {
  auto j = minimal();
  j["model"]["merges"] = {"a b c"};
  std::string e = error_of(j);
  EXPECT_NE(e.find("model.merges[0]"), std::string::npos) << e;
  EXPECT_NE(e.find("two tokens separated by one space"), std::string::npos) << e;
  j["model"]["merges"] = {"a x"};
  e = error_of(j);
  EXPECT_NE(e.find("token 'x' is not in the vocabulary"), std::string::npos) << e;
  j["model"]["merges"] = nlohmann::json::array({nlohmann::json::array({"b", "c"})});
  e = error_of(j);
  EXPECT_NE(e.find("merged token 'bc' is not in the vocabulary"), std::string::npos) << e;
  j["model"]["merges"] = nlohmann::json::array({nlohmann::json::array({"a"})});
  EXPECT_NE(error_of(j).find("must be \"a b\" or [\"a\", \"b\"]"), std::string::npos);
  j["model"]["merges"] = "a b";
  EXPECT_NE(error_of(j).find("model.merges: must be a list"), std::string::npos);
}

TEST(TokenizerErrors, UnsupportedComponents) {
  auto j = minimal();
  j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", {{{"type", "BertPreTokenizer"}}}}};
  std::string e = error_of(j);
  EXPECT_NE(e.find("pre_tokenizer.pretokenizers[0]: pre-tokenizer type 'BertPreTokenizer' is not supported"),
            std::string::npos)
      << e;
  j = minimal();
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "[a-"}}}, {"behavior", "Isolated"}};
  e = error_of(j);
  EXPECT_NE(e.find("pre_tokenizer.pattern: bad regex"), std::string::npos) << e;
  j = minimal();
  j["decoder"] = {{"type", "WordPiece"}};
  EXPECT_NE(error_of(j).find("decoder type 'WordPiece' is not supported"), std::string::npos);
  j = minimal();
  j["normalizer"] = {{"type", "Precompiled"}};
  EXPECT_NE(error_of(j).find("normalizer type 'Precompiled' is not supported"), std::string::npos);
  j = minimal();
  j["post_processor"] = {{"type", "TemplateProcessing"},
                         {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}}}}}},
                         {"special_tokens", nlohmann::json::object()}};
  EXPECT_NE(error_of(j).find("special token '<s>' is not in special_tokens"), std::string::npos);
  j = minimal();
  j["added_tokens"] = {{{"id", 4}, {"special", true}}};
  EXPECT_NE(error_of(j).find("added_tokens[0]: missing field 'content'"), std::string::npos);
}

TEST(TokenizerErrors, MissingUnknownTokenFailsAtEncode) {
  auto j = minimal();
  j["model"]["unk_token"] = "<unk>";
  const Tokenizer tok = Tokenizer::from_json_text(j.dump());
  EXPECT_EQ(tok.encode("ab"), std::vector<int32_t>{2});
  EXPECT_THROW(tok.encode("z"), Error);
}

}  // namespace
}  // namespace kestrel::text
