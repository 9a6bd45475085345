// Tokenizers built from GGUF tokenizer.* metadata: a vocabulary made here (runs everywhere), and
// SmolLM2-135M-Instruct's against Hugging Face's ids (when the model has been fetched).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "formats/gguf.h"
#include "text/gguf_tokenizer.h"

namespace kestrel::text {
namespace {

const std::string kSmolLM2 =
    std::string(KESTREL_TEXT_DATA) + "/../../../models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf";

// A byte-level BPE vocabulary small enough to follow by hand.
GgufVocab tiny_vocab() {
  GgufVocab v;
  v.model = "gpt2";
  v.pre = "smollm";
  v.tokens = {"<|end|>", "h", "e", "l", "o", "w", "r", "d", "\xC4\xA0", "4", "2",   // 0..10 (Ġ is U+0120)
              "he", "ll", "hell", "hello", "\xC4\xA0w", "or", "\xC4\xA0wor", "42", "<tag>"};
  v.token_types.assign(v.tokens.size(), 1);
  v.token_types[0] = 3;   // CONTROL
  v.token_types[19] = 4;  // USER_DEFINED
  v.merges = {"h e", "l l", "he ll", "hell o", "\xC4\xA0 w", "o r", "\xC4\xA0w or", "4 2"};
  v.eos = 0;
  return v;
}

std::string error_of(const GgufVocab& v) {
  try {
    tokenizer_from_gguf(v, "tiny.gguf");
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(GgufTokenizer, TinyVocabularyEncodesAndDecodes) {
  const Tokenizer tok = tokenizer_from_gguf(tiny_vocab(), "tiny.gguf");
  EXPECT_EQ(tok.encode("hello"), (std::vector<int32_t>{14}));
  EXPECT_EQ(tok.encode("hello wor"), (std::vector<int32_t>{14, 17}));
  EXPECT_EQ(tok.encode("hello<|end|>"), (std::vector<int32_t>{14, 0}));
  EXPECT_EQ(tok.encode("<tag>he"), (std::vector<int32_t>{19, 11}));
  EXPECT_TRUE(tok.is_special(0));
  EXPECT_FALSE(tok.is_special(19));
  EXPECT_EQ(tok.decode(std::vector<int32_t>{14, 17, 0}), "hello wor<|end|>");
  EXPECT_EQ(tok.decode(std::vector<int32_t>{14, 17, 0}, true), "hello wor");
}

TEST(GgufTokenizer, SmollmSplitsDigitsOthersDoNot) {
  GgufVocab v = tiny_vocab();
  EXPECT_EQ(tokenizer_from_gguf(v).encode("42"), (std::vector<int32_t>{9, 10}));
  v.pre = "default";
  EXPECT_EQ(tokenizer_from_gguf(v).encode("42"), (std::vector<int32_t>{18}));
  v.pre = "llama-bpe";
  EXPECT_EQ(tokenizer_from_gguf(v).encode("42"), (std::vector<int32_t>{18}));
  v.pre = "qwen2";  // \p{N} alone
  EXPECT_EQ(tokenizer_from_gguf(v).encode("42"), (std::vector<int32_t>{9, 10}));
}

TEST(GgufTokenizer, AddsBosWhenTheFileSaysSo) {
  GgufVocab v = tiny_vocab();
  v.bos = 0;
  v.add_bos = true;
  EXPECT_EQ(tokenizer_from_gguf(v).encode("hello"), (std::vector<int32_t>{0, 14}));
  EXPECT_EQ(tokenizer_from_gguf(v).encode("hello", false), (std::vector<int32_t>{14}));
}

TEST(GgufTokenizer, UnsupportedInputIsRefusedNamingTheField) {
  GgufVocab v = tiny_vocab();
  v.model = "llama";
  EXPECT_NE(error_of(v).find("tiny.gguf: metadata 'tokenizer.ggml.model'"), std::string::npos) << error_of(v);
  v = tiny_vocab();
  v.pre = "no-such-pre";
  EXPECT_NE(error_of(v).find("'tokenizer.ggml.pre'"), std::string::npos) << error_of(v);
  EXPECT_NE(error_of(v).find("no-such-pre"), std::string::npos);
  v = tiny_vocab();
  v.merges.clear();
  EXPECT_NE(error_of(v).find("'tokenizer.ggml.merges'"), std::string::npos) << error_of(v);
}

TEST(GgufTokenizer, LoaderErrorsNameThePath) {
  auto error = [](const std::string& path) {
    try {
      load_tokenizer_for_model(path);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error("/no/such/model").find("/no/such/model: no such file"), std::string::npos);
  const auto dir = std::filesystem::temp_directory_path() / "kestrel_empty_model_dir";
  std::filesystem::create_directories(dir);
  EXPECT_NE(error(dir.string()).find("no tokenizer"), std::string::npos) << error(dir.string());
  std::filesystem::remove_all(dir);
}

TEST(GgufTokenizer, SmolLM2MatchesHuggingFace) {
  if (!std::filesystem::exists(kSmolLM2))
    GTEST_SKIP() << kSmolLM2 << " is absent; run scripts/fetch_model.sh to fetch it";
  const Tokenizer tok = load_tokenizer_for_model(kSmolLM2);
  std::ifstream in(std::string(KESTREL_TEXT_DATA) + "/gguf_smollm2.ref.json");
  ASSERT_TRUE(in) << "missing tests/text/data/gguf_smollm2.ref.json";
  const auto ref = nlohmann::json::parse(in);
  ASSERT_GE(ref["cases"].size(), 12u);
  for (const auto& c : ref["cases"]) {
    const std::string text = c["text"];
    EXPECT_EQ(tok.encode(text), c["ids"].get<std::vector<int32_t>>()) << text;
    EXPECT_EQ(tok.decode(c["ids"].get<std::vector<int32_t>>()), text);
  }
  EXPECT_EQ(tok.vocab_size(), 49152u);
}

}  // namespace
}  // namespace kestrel::text
