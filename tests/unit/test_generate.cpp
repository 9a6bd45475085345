// kestrel generate end to end: bad input fails with one line; SmolLM2 (when fetched) continues
// "The capital of France is" with " Paris" under greedy decoding, as transformers does.
#include <gtest/gtest.h>

#include <filesystem>

#include "run_cli.h"

namespace kestrel {
namespace {

using test::run_kestrel;

const std::string kSmolLM2 =
    std::string(KESTREL_FIXTURES) + "/../../models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf";

int lines(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

// stdout of a generate run, without the statistics line on stderr.
std::string text_of(const std::string& output) { return output.substr(0, output.find("prompt tokens: ")); }

TEST(Generate, MissingModelFailsWithOneLine) {
  const auto r = run_kestrel("generate --model /no/such/model --prompt hi");
  EXPECT_NE(r.status, 0);
  EXPECT_EQ(lines(r.output), 1) << r.output;
  EXPECT_NE(r.output.find("/no/such/model: no such file or folder"), std::string::npos) << r.output;
}

TEST(Generate, ModelWithoutTokenizerFailsWithOneLine) {
  const auto r = run_kestrel("generate --model " KESTREL_FIXTURES "/llama-bf16 --prompt hi");
  EXPECT_NE(r.status, 0);
  EXPECT_EQ(lines(r.output), 1) << r.output;
  EXPECT_NE(r.output.find("no tokenizer"), std::string::npos) << r.output;
}

TEST(Generate, BadSamplingOptionFailsWithOneLine) {
  const auto r = run_kestrel("generate --model " KESTREL_FIXTURES "/llama-bf16 --prompt hi --top-p 0");
  EXPECT_NE(r.status, 0);
  EXPECT_EQ(lines(r.output), 1) << r.output;
  EXPECT_NE(r.output.find("--top-p"), std::string::npos) << r.output;
}

class GenerateSmolLM2 : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(kSmolLM2))
      GTEST_SKIP() << kSmolLM2 << " is absent; run scripts/fetch_model.sh to fetch it";
  }
};

TEST_F(GenerateSmolLM2, GreedyContinuesWithParis) {
  const auto r = run_kestrel("generate --model " + kSmolLM2 + " --prompt 'The capital of France is' --max-tokens 4");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(text_of(r.output).rfind(" Paris", 0), 0u) << r.output;
  EXPECT_NE(r.output.find("prompt tokens: 5, generated tokens: 4"), std::string::npos) << r.output;
}

TEST_F(GenerateSmolLM2, StopStringEndsTheText) {
  const auto r =
      run_kestrel("generate --model " + kSmolLM2 + " --prompt 'The capital of France is' --max-tokens 8 --stop .");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(text_of(r.output), " Paris\n") << r.output;
}

TEST_F(GenerateSmolLM2, SeedMakesSamplingReproducible) {
  const std::string cmd = "generate --model " + kSmolLM2 +
                          " --prompt 'Once upon a time' --max-tokens 12 --temperature 0.9 --top-k 40 --top-p 0.95"
                          " --min-p 0.02 --repetition-penalty 1.1 --seed 1234";
  const auto a = run_kestrel(cmd), b = run_kestrel(cmd);
  ASSERT_EQ(a.status, 0) << a.output;
  ASSERT_EQ(b.status, 0) << b.output;
  EXPECT_EQ(text_of(a.output), text_of(b.output));
}

TEST_F(GenerateSmolLM2, ChatTemplateMatchesTransformers) {
  const auto r = run_kestrel("generate --model " + kSmolLM2 +
                             " --chat --system 'You are brief.' --prompt 'What is the capital of France?' --max-tokens 16");
  ASSERT_EQ(r.status, 0) << r.output;
  // transformers' apply_chat_template + greedy generate on the same weights gives these 25 prompt
  // tokens and this text (the Q4_1 weights of a 135M model are not a reliable geographer).
  EXPECT_EQ(text_of(r.output), "La femme de France, la femme de France, la femme de\n") << r.output;
  EXPECT_NE(r.output.find("prompt tokens: 25, generated tokens: 16"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace kestrel
