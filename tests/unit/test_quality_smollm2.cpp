// The real model (SmolLM2-135M-Instruct, Q4_1 GGUF; skipped when scripts/fetch_model.sh has not
// fetched it) on a short slice of the committed public-domain text: `kestrel perplexity` is in a
// sane band and equals a recomputation from `kestrel logits` window by window; --quant nvfp4 stays
// close to the original; a checkpoint written by `kestrel quantize` loads, tokenizes as the GGUF
// does and holds the NVFP4 weights --quant nvfp4 makes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "common/mapped_file.h"
#include "formats/json_file.h"
#include "model/weights.h"
#include "quant/requantize.h"
#include "quant/targets.h"
#include "run_cli.h"
#include "same_nvfp4.h"
#include "st_writer.h"
#include "text/gguf_tokenizer.h"

namespace kestrel {
namespace {

namespace fs = std::filesystem;
using test::run_kestrel;

const std::string kSmolLM2 =
    std::string(KESTREL_FIXTURES) + "/../../models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf";
const std::string kText = std::string(KESTREL_FIXTURES) + "/../../docs/data/pride_and_prejudice_ch1.txt";
constexpr int kContext = 32, kStride = 16;

class SmolLM2Quality : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(kSmolLM2)) GTEST_SKIP() << kSmolLM2 << " is absent; run scripts/fetch_model.sh to fetch it";
    // The first two paragraphs: 79 tokens, 4 windows.
    const std::string text = read_text_file(kText);
    const std::string end = "of their daughters.\n";
    slice_ = (tmp_.path() / "slice.txt").string();
    std::ofstream(slice_) << text.substr(0, text.find(end) + end.size());
  }
  std::string flags() const {
    return " --text " + slice_ + " --context " + std::to_string(kContext) + " --stride " + std::to_string(kStride);
  }
  test::TempDir tmp_;
  std::string slice_;
};

std::vector<float> read_f32(const std::string& path) {
  const std::string b = read_text_file(path);
  std::vector<float> v(b.size() / 4);
  std::memcpy(v.data(), b.data(), v.size() * 4);
  return v;
}

TEST_F(SmolLM2Quality, PerplexityIsSaneAndEqualsItsRecomputation) {
  const std::string json = (tmp_.path() / "p.json").string();
  auto r = run_kestrel("perplexity --model " + kSmolLM2 + flags() + " --device cpu --json " + json);
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json j = read_json_file(json);
  const double ppl = j.at("perplexity").get<double>();
  EXPECT_GT(ppl, 5.0);
  EXPECT_LT(ppl, 100.0);

  // Recompute: the same tokens, the windows of the Hugging Face guide, each run by `kestrel logits`.
  const std::vector<int32_t> ids = text::load_tokenizer_for_model(kSmolLM2).encode(read_text_file(slice_), true, false);
  ASSERT_EQ(j.at("tokens").get<size_t>(), ids.size());
  const int64_t n = int64_t(ids.size()), V = 49152;
  double nll = 0;
  int64_t scored = 0, prev_end = 0, windows = 0;
  for (int64_t begin = 0;; begin += kStride) {
    const int64_t end = std::min<int64_t>(begin + kContext, n);
    std::string toks;
    for (int64_t t = begin; t < end; ++t) toks += (t > begin ? "," : "") + std::to_string(ids[size_t(t)]);
    const std::string out = (tmp_.path() / "l.f32").string();
    auto lr = run_kestrel("logits --model " + kSmolLM2 + " --device cpu --tokens " + toks + " --out " + out);
    ASSERT_EQ(lr.status, 0) << lr.output;
    const std::vector<float> logits = read_f32(out);
    ASSERT_EQ(int64_t(logits.size()), (end - begin) * V);
    ++windows;
    for (int64_t p = std::max(prev_end, begin + 1); p < end; ++p) {
      const float* row = logits.data() + (p - 1 - begin) * V;
      double m = row[0], s = 0;
      for (int64_t v = 0; v < V; ++v) m = std::max(m, double(row[v]));
      for (int64_t v = 0; v < V; ++v) s += std::exp(double(row[v]) - m);
      nll += m + std::log(s) - row[ids[size_t(p)]];
      ++scored;
    }
    prev_end = end;
    if (end == n) break;
  }
  EXPECT_EQ(j.at("scored").get<int64_t>(), scored);
  EXPECT_EQ(j.at("windows").get<int64_t>(), windows);
  EXPECT_NEAR(ppl, std::exp(nll / double(scored)), 1e-4 * ppl);
  std::printf("  SmolLM2 Q4_1 perplexity %.4f over %lld positions (recomputed %.4f)\n", ppl, (long long)scored,
              std::exp(nll / double(scored)));
}

TEST_F(SmolLM2Quality, Nvfp4AtLoadStaysCloseToTheOriginal) {
  const std::string json = (tmp_.path() / "q.json").string();
  auto r = run_kestrel("perplexity --model " + kSmolLM2 + " --quant nvfp4 --reference " + kSmolLM2 + flags() +
                       " --device cpu --json " + json);
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json j = read_json_file(json);
  const double ppl = j.at("perplexity").get<double>(), ref = j.at("reference_perplexity").get<double>();
  const double kl = j.at("mean_kl").get<double>(), top1 = j.at("top1_agreement").get<double>();
  std::printf("  NVFP4 at load: perplexity %.4f (original %.4f), KL %.4f, top-1 %.3f\n", ppl, ref, kl, top1);
  EXPECT_GT(kl, 0.0);
  EXPECT_LT(kl, 0.5);
  EXPECT_GT(top1, 0.6);
  EXPECT_GT(ppl, 0.8 * ref);
  EXPECT_LT(ppl, 1.5 * ref);
}

TEST_F(SmolLM2Quality, QuantizedCheckpointLoadsAndTokenizesAsTheGguf) {
  const fs::path out = tmp_.path() / "nvfp4";
  auto r = run_kestrel("quantize --model " + kSmolLM2 + " --out " + out.string() + " --calib " + slice_ +
                       " --calib-max-tokens 32");
  ASSERT_EQ(r.status, 0) << r.output;
  for (const char* f : {"config.json", "hf_quant_config.json", "generation_config.json", "tokenizer.json",
                        "tokenizer_config.json", "model.safetensors.index.json"})
    EXPECT_TRUE(fs::exists(out / f)) << f;
  const std::string text = read_text_file(kText);
  EXPECT_EQ(text::load_tokenizer_for_model(out.string()).encode(text), text::load_tokenizer_for_model(kSmolLM2).encode(text));

  auto h = load_model(out.string());
  auto g = load_model(kSmolLM2);
  ThreadPool pool(2);
  requantize_nvfp4(*g, nvfp4_settings(g->config, {}, "test"), pool);
  ASSERT_EQ(quant_targets(*h).size(), 30u * 7);
  test::expect_same_nvfp4(*g, *h);
  // A different vocabulary cannot be a reference.
  auto bad = run_kestrel("perplexity --model " + kSmolLM2 + flags() + " --reference " + KESTREL_FIXTURES "/llama-bf16");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.output.find("has a vocabulary of 256 tokens, the model 49152"), std::string::npos) << bad.output;
  // Too short a text.
  const std::string one = (tmp_.path() / "one.txt").string();
  std::ofstream(one) << "Hello";
  bad = run_kestrel("perplexity --model " + kSmolLM2 + " --text " + one);
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.output.find("encodes to 1 token(s); perplexity needs at least 2"), std::string::npos) << bad.output;
}

}  // namespace
}  // namespace kestrel
