// Tokenizers built from GGUF tokenizer.* metadata: a vocabulary made here (runs everywhere), a
// SentencePiece vocabulary (gguf_spm.gguf) against transformers' tokenizer of the same file, and
// SmolLM2-135M-Instruct's against Hugging Face's ids (when the model has been fetched).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "formats/gguf.h"
#include "text/detokenize.h"
#include "text/gguf_tokenizer.h"
#include "text/spm_merges.h"
#include "text/utf8.h"

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
  v.model = "t5";
  EXPECT_NE(error_of(v).find("tiny.gguf: metadata 'tokenizer.ggml.model'"), std::string::npos) << error_of(v);
  EXPECT_NE(error_of(v).find("'t5' is not supported"), std::string::npos) << error_of(v);
  v = tiny_vocab();
  v.pre = "no-such-pre";
  EXPECT_NE(error_of(v).find("'tokenizer.ggml.pre'"), std::string::npos) << error_of(v);
  EXPECT_NE(error_of(v).find("no-such-pre"), std::string::npos);
  v = tiny_vocab();
  v.merges.clear();
  EXPECT_NE(error_of(v).find("'tokenizer.ggml.merges'"), std::string::npos) << error_of(v);
}

// ---------------------------------------------------------------------------------------------
// SentencePiece ("llama") vocabularies: scripts/make_gguf_tokenizer_fixture.py trained one with
// byte fallback and wrote it as llama.cpp's converter does (scores, no merges).

const std::string kSpm = std::string(KESTREL_TEXT_DATA) + "/gguf_spm.gguf";

nlohmann::json spm_reference() {
  std::ifstream in(std::string(KESTREL_TEXT_DATA) + "/gguf_spm.ref.json");
  EXPECT_TRUE(in) << "missing tests/text/data/gguf_spm.ref.json";
  return nlohmann::json::parse(in);
}

GgufVocab spm_vocab() {
  GgufFile f(kSpm);
  return read_gguf_vocab(f.index());
}

TEST(GgufTokenizer, SentencePieceMatchesTransformers) {
  const Tokenizer tok = load_tokenizer_for_model(kSpm);
  const auto ref = spm_reference();
  ASSERT_GE(ref["cases"].size(), 70u);
  EXPECT_EQ(tok.vocab_size(), ref["vocab_size"].get<size_t>());
  size_t checked = 0;
  for (const auto& c : ref["cases"]) {
    const std::string text = c["text"];
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(tok.encode(text), ids) << text;
    EXPECT_EQ(tok.encode(text, false), c["ids_plain"].get<std::vector<int32_t>>()) << text;
    EXPECT_EQ(tok.decode(ids), c["decoded"].get<std::string>()) << text;
    EXPECT_EQ(tok.decode(ids, true), c["decoded_skip"].get<std::string>()) << text;
    ++checked;
  }
  EXPECT_EQ(checked, ref["cases"].size());
}

TEST(GgufTokenizer, SentencePieceVariants) {
  const auto ref = spm_reference();
  GgufVocab phi3 = spm_vocab();
  phi3.architecture = "phi3";  // transformers prefixes with a normalizer here
  GgufVocab no_prefix = spm_vocab();
  no_prefix.add_space_prefix = false;
  const Tokenizer a = tokenizer_from_gguf(phi3), b = tokenizer_from_gguf(no_prefix);
  for (const auto& c : ref["cases"]) {
    const std::string text = c["text"];
    EXPECT_EQ(a.encode(text), c["ids_phi3"].get<std::vector<int32_t>>()) << "phi3: " << text;
    const auto ids = c["ids_no_prefix"].get<std::vector<int32_t>>();
    EXPECT_EQ(b.encode(text), ids) << "no prefix: " << text;
    EXPECT_EQ(b.decode(ids), c["decoded_no_prefix"].get<std::string>()) << "no prefix: " << text;
  }
}

TEST(GgufTokenizer, SentencePieceBosAndEosFollowTheFile) {
  GgufVocab v = spm_vocab();
  const std::vector<int32_t> plain = tokenizer_from_gguf(v).encode("hi", false);
  v.add_bos = false;
  v.has_add_bos = false;  // no key: BOS, as llama.cpp and transformers add it to these vocabularies
  EXPECT_EQ(tokenizer_from_gguf(v).encode("hi").front(), 1);
  v.has_add_bos = true;  // add_bos_token = false
  EXPECT_EQ(tokenizer_from_gguf(v).encode("hi"), plain);
  v.add_eos = true;
  std::vector<int32_t> want = plain;
  want.push_back(2);
  EXPECT_EQ(tokenizer_from_gguf(v).encode("hi"), want);
  v.add_bos = true;
  want.insert(want.begin(), 1);
  EXPECT_EQ(tokenizer_from_gguf(v).encode("hi"), want);
}

TEST(GgufTokenizer, SentencePieceStreamsByteFallbackWhole) {
  const Tokenizer tok = load_tokenizer_for_model(kSpm);
  const std::string text = "中文 and 🙂";
  const std::vector<int32_t> ids = tok.encode(text, false);
  EXPECT_TRUE(std::any_of(ids.begin(), ids.end(), [&](int32_t id) { return tok.is_byte_fallback_token(id); }));
  StreamDecoder dec(tok);
  std::string out;
  for (int32_t id : ids) {
    const std::string piece = dec.push(id);
    EXPECT_TRUE(utf8_valid(piece)) << id;
    out += piece;
  }
  out += dec.flush();
  EXPECT_EQ(out, text);
}

TEST(GgufTokenizer, MergesFromScoresFollowScoreThenLengthThenOrder) {
  // "abc" (score -1) splits as a|bc and ab|c: longer left half first; "ab" (score -2) after it.
  const std::vector<std::string> tokens = {"a", "b", "c", "ab", "bc", "abc", "\xE2\x96\x81", "\xE2\x96\x81" "a"};
  const std::vector<float> scores = {0, 0, 0, -2, -3, -1, 0, -2};
  const auto m = merges_from_scores(tokens, scores);
  const std::vector<std::pair<std::string, std::string>> want = {
      {"ab", "c"}, {"a", "bc"}, {"a", "b"}, {"\xE2\x96\x81", "a"}, {"b", "c"}};
  EXPECT_EQ(m, want);
}

TEST(GgufTokenizer, SentencePieceInputThatCannotBeBuiltIsRefused) {
  GgufVocab v = spm_vocab();
  v.pre = "qwen2";
  EXPECT_NE(error_of(v).find("metadata 'tokenizer.ggml.pre'"), std::string::npos) << error_of(v);
  v = spm_vocab();
  v.scores.clear();
  EXPECT_NE(error_of(v).find("metadata 'tokenizer.ggml.scores'"), std::string::npos) << error_of(v);
  v = spm_vocab();
  v.architecture = "gemma3";
  EXPECT_NE(error_of(v).find("gemma3"), std::string::npos) << error_of(v);
  v = spm_vocab();
  v.tokens[700] = "\xC3";
  EXPECT_NE(error_of(v).find("token 700 is not valid UTF-8"), std::string::npos) << error_of(v);
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
