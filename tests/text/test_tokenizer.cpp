// The tokenizer against the Hugging Face `tokenizers` library: ids, decoded text and streamed text
// for every case that scripts/make_tokenizer_fixtures.py recorded, for each model family's
// configuration.
#include <gtest/gtest.h>

#include <filesystem>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "common/error.h"
#include "formats/json_file.h"
#include "text/pretokenize.h"
#include "text/tokenizer.h"
#include "text/utf8.h"

namespace kestrel::text {
namespace {

std::string data_path(const std::string& file) { return std::string(KESTREL_TEXT_DATA) + "/tokenizers/" + file; }


std::string shown(const std::string& s) { return s.size() > 60 ? s.substr(0, 60) + "..." : s; }

class Family : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    ref_ = read_json_file(data_path(GetParam() + ".ref.json"));
    // "repo:PATH": a real tokenizer that scripts/fetch_tokenizers.sh puts under models/ (not committed).
    const std::string file = ref_["tokenizer"];
    const std::string path =
        file.rfind("repo:", 0) == 0 ? std::string(KESTREL_TEXT_DATA) + "/../../../" + file.substr(5) : data_path(file);
    if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " is absent (scripts/fetch_tokenizers.sh fetches it)";
    tok_ = std::make_unique<Tokenizer>(Tokenizer::from_file(path));
  }
  nlohmann::json ref_;
  std::unique_ptr<Tokenizer> tok_;
};

TEST_P(Family, EncodesEveryCaseLikeTheReference) {
  size_t cases = 0;
  for (const auto& c : ref_["cases"]) {
    const std::string text = c["text"];
    EXPECT_EQ(tok_->encode(text), c["ids"].get<std::vector<int32_t>>()) << "text: " << shown(text);
    EXPECT_EQ(tok_->encode(text, false), c["ids_plain"].get<std::vector<int32_t>>()) << "text: " << shown(text);
    EXPECT_EQ(tok_->encode(text, true, false), c["ids_unparsed"].get<std::vector<int32_t>>()) << "text: " << shown(text);
    ++cases;
  }
  EXPECT_GE(cases, 60u);
}

TEST_P(Family, DecodesEveryCaseLikeTheReference) {
  for (const auto& c : ref_["cases"]) {
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(tok_->decode(ids), c["decoded"].get<std::string>()) << "text: " << shown(c["text"]);
    EXPECT_EQ(tok_->decode(ids, true), c["decoded_skip"].get<std::string>()) << "text: " << shown(c["text"]);
  }
}

TEST_P(Family, StreamedTextIsValidUtf8AndAddsUpToTheDecode) {
  for (const auto& c : ref_["cases"]) {
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    for (bool skip : {false, true}) {
      StreamDecoder sd(*tok_, skip);
      std::string all;
      for (int32_t id : ids) {
        const std::string chunk = sd.push(id);
        ASSERT_TRUE(utf8_valid(chunk)) << "text: " << shown(c["text"]);
        all += chunk;
      }
      all += sd.flush();
      EXPECT_EQ(all, c[skip ? "decoded_skip" : "decoded"].get<std::string>()) << "text: " << shown(c["text"]);
    }
  }
}

// Random ids, byte tokens, special tokens and unknown ids included, stream to exactly what decode
// gives.
TEST_P(Family, StreamsRandomIdsExactly) {
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int32_t> any(-3, static_cast<int32_t>(tok_->vocab_size()) + 3);
  for (int round = 0; round < 200; ++round) {
    std::vector<int32_t> ids(1 + round % 40);
    for (auto& id : ids) id = any(rng);
    for (bool skip : {false, true}) {
      StreamDecoder sd(*tok_, skip);
      std::string all;
      for (int32_t id : ids) {
        const std::string chunk = sd.push(id);
        ASSERT_TRUE(utf8_valid(chunk));
        all += chunk;
      }
      all += sd.flush();
      ASSERT_EQ(all, tok_->decode(ids, skip)) << "round " << round;
    }
  }
}

TEST_P(Family, LooksUpTokensBothWays) {
  EXPECT_EQ(tok_->vocab_size(), ref_["vocab_size"].get<size_t>());
  for (size_t id = 0; id < tok_->vocab_size(); ++id) {
    const std::string_view t = tok_->token(static_cast<int32_t>(id));
    ASSERT_FALSE(t.empty()) << id;
    EXPECT_EQ(tok_->token_id(t), static_cast<int32_t>(id));
  }
  EXPECT_EQ(tok_->token_id("no such token, surely"), -1);
  EXPECT_TRUE(tok_->token(-1).empty());
  EXPECT_TRUE(tok_->token(static_cast<int32_t>(tok_->vocab_size())).empty());
}

TEST_P(Family, EncodesLongInputsQuickly) {
  const std::string corpus = ref_["cases"].back()["text"];
  std::string big;
  while (big.size() < 100 * 1024) big += corpus;
  const std::string letters(100 * 1024, 'x');
  const std::string spaces(100 * 1024, ' ');
  std::string digits;
  while (digits.size() < 100 * 1024) digits += "0123456789";
  for (const std::string* s : std::vector<const std::string*>{&big, &letters, &spaces, &digits}) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto ids = tok_->encode(*s);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_FALSE(ids.empty());
    EXPECT_LT(ms, 5000.0) << "100 KB took " << ms << " ms";
  }
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, Family,
                         ::testing::Values("llama3", "qwen2", "glm45", "mistral_sp", "metaspace_sp", "gpt2_flags",
                                           "deepseek_v3"));

TEST(StreamDecoder, HoldsAnEmojiSplitOverByteLevelTokens) {
  const Tokenizer tok = Tokenizer::from_file(data_path("qwen2.json"));
  const std::string emoji = "\xF0\x9F\x98\x80";  // U+1F600
  std::vector<int32_t> ids = tok.encode("a");
  for (char c : emoji) {
    const int32_t id = tok.token_id(byte_to_unicode(static_cast<unsigned char>(c)));
    ASSERT_GE(id, 0);
    ids.push_back(id);
  }
  ids.push_back(tok.encode("b")[0]);
  StreamDecoder sd(tok);
  std::vector<std::string> chunks;
  for (int32_t id : ids) chunks.push_back(sd.push(id));
  EXPECT_EQ(chunks, (std::vector<std::string>{"a", "", "", "", emoji, "b"}));
  EXPECT_EQ(sd.flush(), "");
}

TEST(StreamDecoder, HoldsARunOfByteFallbackTokensUntilItEnds) {
  const Tokenizer tok = Tokenizer::from_file(data_path("mistral_sp.json"));
  std::vector<int32_t> ids;
  for (const char* b : {"<0xF0>", "<0x9F>", "<0x98>", "<0x80>"}) ids.push_back(tok.token_id(b));
  ids.push_back(tok.token_id("<0xFF>"));  // makes the whole run invalid: one U+FFFD per byte
  StreamDecoder sd(tok);
  for (int32_t id : ids) EXPECT_EQ(sd.push(id), "");
  const std::string tail = sd.flush();
  EXPECT_EQ(tail, tok.decode(ids));
  std::string five;
  for (int i = 0; i < 5; ++i) five += kReplacementChar;
  EXPECT_EQ(tail, five);

  ids.pop_back();
  ids.push_back(tok.token_id("▁a"));
  std::string all;
  for (int32_t id : ids) all += sd.push(id);
  EXPECT_EQ(all, "\xF0\x9F\x98\x80 a");

  // Unknown ids and skipped special tokens inside a run do not end it: decode drops them first.
  ids = {tok.token_id("<0xE6>"), tok.token_id("<0xAC>"), tok.token_id("<0xA3>"), -7, tok.token_id("</s>"),
         tok.token_id("<0xFC>"), tok.token_id("▁a")};
  all.clear();
  for (int32_t id : ids) all += sd.push(id);
  all += sd.flush();
  EXPECT_EQ(all, tok.decode(ids, true));
  EXPECT_EQ(all.find("\xE6\xAC\xA3"), std::string::npos);
}

TEST(StreamDecoder, KeepsGoingAfterFlush) {
  const Tokenizer tok = Tokenizer::from_file(data_path("metaspace_sp.json"));
  StreamDecoder sd(tok);
  std::string out;
  for (int32_t id : tok.encode("Hello world")) out += sd.push(id);
  out += sd.flush();
  EXPECT_EQ(out, "Hello world");
  out.clear();
  for (int32_t id : tok.encode("again")) out += sd.push(id);
  out += sd.flush();
  EXPECT_EQ(out, "again");
}

TEST(Tokenizer, SpecialTokensAreTextWhenNotParsed) {
  const Tokenizer tok = Tokenizer::from_file(data_path("qwen2.json"));
  const int32_t im_start = tok.token_id("<|im_start|>");
  ASSERT_GE(im_start, 0);
  EXPECT_TRUE(tok.is_special(im_start));
  EXPECT_EQ(tok.encode("<|im_start|>"), std::vector<int32_t>{im_start});
  const auto raw = tok.encode("<|im_start|>", true, false);
  EXPECT_GT(raw.size(), 1u);
  EXPECT_EQ(tok.decode(raw), "<|im_start|>");
  const int32_t think = tok.token_id("<think>");
  ASSERT_GE(think, 0);
  EXPECT_FALSE(tok.is_special(think));
  EXPECT_EQ(tok.encode("<think>", true, false), std::vector<int32_t>{think});
}

TEST(Tokenizer, RejectsInvalidUtf8Text) {
  const Tokenizer tok = Tokenizer::from_file(data_path("llama3.json"));
  EXPECT_THROW(tok.encode("ok \xC3\x28 bad"), Error);
  EXPECT_THROW(tok.encode("\xED\xA0\x80"), Error);  // a UTF-16 surrogate
}

}  // namespace
}  // namespace kestrel::text
