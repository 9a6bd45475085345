#include <gtest/gtest.h>

#include <fstream>

#include "fixture.h"
#include "run_cli.h"
#include "st_writer.h"

namespace kestrel {
namespace {

std::string join(const std::vector<int32_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

std::vector<float> read_f32(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  std::vector<float> v(size_t(f.tellg()) / 4);
  f.seekg(0);
  f.read(reinterpret_cast<char*>(v.data()), std::streamsize(v.size() * 4));
  return v;
}

TEST(Cli, LogitsPrefillAndDecodeMatchReference) {
  test::TempDir tmp;
  const std::string dir = test::fixture_dir("qwen3moe-nvfp4");
  const test::Reference ref = test::load_reference(dir);
  for (const char* mode : {"", "--decode"}) {
    const std::string out = (tmp.path() / "logits.f32").string();
    auto r = test::run_kestrel("logits --model " + dir + " --tokens " + join(ref.tokens) + " " + mode + " --out " + out);
    ASSERT_EQ(r.status, 0) << r.output;
    const std::vector<float> got = read_f32(out);
    ASSERT_EQ(got.size(), ref.logits.size());
    for (size_t t = 0; t < ref.tokens.size(); ++t)
      EXPECT_LE(test::rel_l2(got.data() + t * size_t(ref.vocab), ref.logits.data() + t * size_t(ref.vocab), ref.vocab),
                1e-3)
          << mode << " position " << t;
  }
}

TEST(Cli, InspectDescribesModel) {
  auto r = test::run_kestrel("inspect --model " + test::fixture_dir("glm4moe-nvfp4"));
  ASSERT_EQ(r.status, 0) << r.output;
  for (const char* s : {"Glm4MoeForCausalLM", "NVFP4", "BF16", "sigmoid", "shared", "DMM"})
    EXPECT_NE(r.output.find(s), std::string::npos) << s << "\n" << r.output;
}

TEST(Cli, BadInputGivesOneClearLineAndNonZeroExit) {
  test::TempDir tmp;
  const std::string fx = test::fixture_dir("llama-bf16");
  struct Case {
    std::string args, expect;
  } cases[] = {
      {"logits --model /nonexistent --tokens 1 --out " + (tmp.path() / "o").string(), "/nonexistent"},
      {"logits --model " + fx + " --tokens 1,x --out " + (tmp.path() / "o").string(), "'x' is not a token id"},
      {"logits --model " + fx + " --tokens 1,99999 --out " + (tmp.path() / "o").string(), "99999"},
      {"logits --model " + fx + " --tokens 1 --out /nonexistent/dir/o", "/nonexistent/dir/o"},
      {"inspect --model " + tmp.path().string(), "config.json"},
      {"frobnicate", "frobnicate"},
  };
  for (const auto& c : cases) {
    auto r = test::run_kestrel(c.args);
    EXPECT_NE(r.status, 0) << c.args;
    EXPECT_LT(r.status, 128) << "crashed: " << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.expect), std::string::npos) << c.args << "\n" << r.output;
  }
}

// `kestrel serve --speculative`: values out of range and scripted replies are refused
// before the model loads, each with one line naming the flag; valid flags pass on to the next
// check (here an out-of-range port).
TEST(Cli, ServeSpeculationFlags) {
  const std::string fx = "serve --model " + test::fixture_dir("qwen3-chat") + " ";
  struct Case {
    std::string args, expect;
  } cases[] = {
      {fx + "--speculative eagle", "--speculative: expected none, ngram or mtp"},
      {fx + "--speculative mtp --device cuda", "--speculative mtp: drafting with the MTP layer is not built yet on the GPU"},
      {fx + "--speculative mtp --draft-tokens 17", "--draft-tokens: expected 1..16"},
      {fx + "--speculative mtp --draft-tokens 3 --device cpu --port 70000", "--port: expected 0..65535"},
      {fx + "--speculative ngram --draft-tokens 0", "--draft-tokens: expected 1..16"},
      {fx + "--speculative ngram --draft-tokens 17", "--draft-tokens: expected 1..16"},
      {fx + "--speculative ngram --device cpu --test-scripted-reply hi", "--test-scripted-reply: not with --speculative"},
      {fx + "--speculative ngram --draft-tokens 4 --device cpu --port 70000", "--port: expected 0..65535"},
      {fx + "--speculative none --draft-tokens 4 --device cpu --port 70000", "--port: expected 0..65535"},
  };
  for (const auto& c : cases) {
    auto r = test::run_kestrel(c.args);
    EXPECT_NE(r.status, 0) << c.args;
    EXPECT_LT(r.status, 128) << "crashed: " << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.expect), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_EQ(r.output.find('\n'), r.output.size() - 1) << "more than one line: " << c.args << "\n" << r.output;
  }
}

// --speculative mtp on a model without an MTP layer, once it has loaded: one line naming the
// flag and the model's config.
TEST(Cli, MtpSpeculationNeedsAnMtpLayer) {
  const std::string model = test::fixture_dir("qwen3-chat");
  for (const std::string& args : {"serve --model " + model + " --device cpu --port 0 --speculative mtp",
                                  "generate --model " + model + " --device cpu --prompt hi --speculative mtp"}) {
    auto r = test::run_kestrel(args);
    EXPECT_NE(r.status, 0) << args;
    EXPECT_LT(r.status, 128) << "crashed: " << args << "\n" << r.output;
    EXPECT_NE(r.output.find("--speculative mtp: " + model + "/config.json has no MTP layer"), std::string::npos)
        << args << "\n" << r.output;
  }
}

}  // namespace
}  // namespace kestrel
