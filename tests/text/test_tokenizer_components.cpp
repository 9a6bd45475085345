// Normalizers and pre-tokenizers on their own against the Hugging Face `tokenizers` library, for
// the behaviours no family file uses (Removed, MergedWith*, Contiguous, invert, Digits, ...).
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/error.h"
#include "formats/json_file.h"
#include "text/normalize.h"
#include "text/pretokenize.h"
#include "text/utf8.h"

namespace kestrel::text {
namespace {

nlohmann::json components() { return read_json_file(std::string(KESTREL_TEXT_DATA) + "/tokenizers/components.ref.json"); }

TEST(TokenizerComponents, MatchTheReference) {
  const auto ref = components();
  const auto inputs = ref["inputs"].get<std::vector<std::string>>();
  size_t checked = 0;
  for (const auto& c : ref["components"]) {
    const std::string kind = c["kind"];
    SCOPED_TRACE(kind + " " + c["config"].dump());
    const auto& outs = c["outputs"];
    ASSERT_EQ(outs.size(), inputs.size());
    if (kind == "normalizer") {
      const auto n = Normalizer::from_json(c["config"], "components");
      for (size_t i = 0; i < inputs.size(); ++i) {
        std::string s = inputs[i];
        n->normalize(s);
        EXPECT_EQ(s, outs[i].get<std::string>()) << "input: " << inputs[i];
        ++checked;
      }
    } else {
      const auto p = PreTokenizer::from_json(c["config"], "components");
      for (size_t i = 0; i < inputs.size(); ++i) {
        EXPECT_EQ(pre_tokenize(*p, inputs[i]), outs[i].get<std::vector<std::string>>()) << "input: " << inputs[i];
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 1000u);
}

TEST(TokenizerComponents, ByteLevelMapIsAPermutation) {
  std::vector<bool> seen(512, false);
  for (int b = 0; b < 256; ++b) {
    const std::string& s = byte_to_unicode(static_cast<unsigned char>(b));
    char32_t c = 0;
    ASSERT_EQ(utf8_decode(s, 0, c), s.size());
    ASSERT_LT(c, 512u);
    EXPECT_FALSE(seen[c]);
    seen[c] = true;
    EXPECT_EQ(unicode_to_byte(c), b);
  }
  EXPECT_EQ(byte_to_unicode(' '), "\xC4\xA0");  // Ġ
  EXPECT_EQ(byte_to_unicode('\n'), "\xC4\x8A");  // Ċ
}

TEST(TokenizerComponents, LossyUtf8ReplacesMaximalInvalidSubparts) {
  const std::string r(kReplacementChar);
  EXPECT_EQ(utf8_lossy("a\xE2\x82"), "a" + r);
  EXPECT_EQ(utf8_lossy("\xE2\x82\xAC"), "\xE2\x82\xAC");
  EXPECT_EQ(utf8_lossy("\xF0\x9F\x98"), r);
  EXPECT_EQ(utf8_lossy("\x80\x80"), r + r);
  EXPECT_EQ(utf8_lossy("\xED\xA0\x80"), r + r + r);  // surrogates are not valid UTF-8
  EXPECT_EQ(utf8_lossy("\xF4\x90\x80\x80"), r + r + r + r);
  EXPECT_EQ(utf8_lossy("\xE0\x80"), r + r);
  EXPECT_EQ(utf8_lossy("\xC3\x28"), r + "(");
}

TEST(TokenizerComponents, RejectUnknownTypes) {
  EXPECT_THROW(Normalizer::from_json({{"type", "BertNormalizer"}}, "t.json: normalizer"), Error);
  EXPECT_THROW(PreTokenizer::from_json({{"type", "Whitespace"}}, "t.json: pre_tokenizer"), Error);
  EXPECT_THROW(PreTokenizer::from_json({{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}},
                                       "t.json: pre_tokenizer"),
               Error);
  EXPECT_THROW(PreTokenizer::from_json({{"type", "Split"}, {"pattern", {{"Regex", "a"}}}, {"behavior", "Sideways"}},
                                       "t.json: pre_tokenizer"),
               Error);
  EXPECT_THROW(PreTokenizer::from_json({{"type", "Metaspace"}, {"replacement", "ab"}}, "t.json: pre_tokenizer"), Error);
}

}  // namespace
}  // namespace kestrel::text
