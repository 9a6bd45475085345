// The multi-token-prediction (NextN) layer of DeepSeek-V3 and GLM-5 against transformers' modules holding the
// same weights (scripts/make_fixtures.py), through prefill and one position at a time; loading
// checkpoints without MTP weights and with one MTP tensor missing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>

#include "backend/cpu/forward.h"
#include "fixture.h"
#include "mtp_checkpoint.h"
#include "formats/checkpoint.h"
#include "model/weights.h"
#include "run_cli.h"
#include "st_writer.h"

namespace kestrel {
namespace {

constexpr double kTolerance = 1e-3;  // relative L2 error per position, as for the main logits
const char* kFixture = "deepseekv3-bf16";

std::vector<float> mtp_reference(const std::string& dir, int64_t rows, int64_t vocab) {
  const nlohmann::json j = read_json_file(dir + "/reference.json");
  EXPECT_EQ(j.at("mtp_shape").at(0).get<int64_t>(), rows);
  EXPECT_EQ(j.at("mtp_shape").at(1).get<int64_t>(), vocab);
  const std::string path = dir + "/" + j.at("mtp_logits").get<std::string>();
  std::vector<float> r(size_t(rows * vocab));
  std::ifstream f(path, std::ios::binary);
  f.read(reinterpret_cast<char*>(r.data()), std::streamsize(r.size() * 4));
  if (!f) fail(path, ": short read");
  return r;
}

// MTP logits for positions 0 .. T-2: the main model's hidden states, then the MTP layer.
std::vector<float> mtp_logits(const Model& model, const std::vector<int32_t>& tokens, bool decode) {
  const int64_t T = int64_t(tokens.size()), H = model.config.hidden_size, V = model.config.vocab_size;
  ThreadPool pool(2);
  cpu::Forward fwd(model, pool);
  KvCache cache = fwd.make_cache(T), mtp = fwd.make_mtp_cache(T - 1);
  std::vector<float> hidden(size_t(T * H)), out(size_t((T - 1) * V), NAN);
  if (decode) {
    for (int64_t t = 0; t < T; ++t) fwd.run({tokens.data() + t, 1}, cache, nullptr, hidden.data() + t * H);
    for (int64_t t = 0; t + 1 < T; ++t) fwd.run_mtp({tokens.data() + t + 1, 1}, hidden.data() + t * H, mtp, out.data() + t * V);
  } else {
    fwd.run(tokens, cache, nullptr, hidden.data());
    fwd.run_mtp({tokens.data() + 1, size_t(T - 1)}, hidden.data(), mtp, out.data());
  }
  return out;
}

double worst_error(const std::vector<float>& got, const std::vector<float>& ref, int64_t rows, int64_t V) {
  double worst = 0;
  for (int64_t t = 0; t < rows; ++t) worst = std::max(worst, test::rel_l2(got.data() + t * V, ref.data() + t * V, V));
  return worst;
}

class MtpFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(MtpFixture, PrefillAndDecodeMatchTransformers) {
  const std::string dir = test::fixture_dir(GetParam());
  auto model = load_model(dir);
  ASSERT_EQ(model->weights.mtp.size(), 1u);
  const MtpLayer& m = model->weights.mtp[0];
  EXPECT_EQ(m.index, model->config.num_layers);
  EXPECT_TRUE(m.layer.is_moe);
  EXPECT_NE(m.head.data, model->weights.lm_head.data);  // its own shared_head.head
  EXPECT_EQ(m.embed.data, model->weights.embed.data);   // no embed_tokens of its own
  EXPECT_EQ(m.layer.mla.has_indexer, model->config.indexer.enabled());
  const test::Reference ref = test::load_reference(dir);
  const int64_t T = int64_t(ref.tokens.size()), V = ref.vocab;
  const std::vector<float> want = mtp_reference(dir, T - 1, V);

  const std::vector<float> prefill = mtp_logits(*model, ref.tokens, false);
  const std::vector<float> decode = mtp_logits(*model, ref.tokens, true);
  for (int64_t t = 0; t + 1 < T; ++t) {
    EXPECT_LE(test::rel_l2(prefill.data() + t * V, want.data() + t * V, V), kTolerance) << "prefill, position " << t;
    EXPECT_LE(test::rel_l2(decode.data() + t * V, want.data() + t * V, V), kTolerance) << "decode, position " << t;
  }
  const double e_prefill = worst_error(prefill, want, T - 1, V), e_decode = worst_error(decode, want, T - 1, V),
               e_paths = worst_error(decode, prefill, T - 1, V);
  EXPECT_LE(e_paths, 1e-5) << "decode against prefill";
  std::printf("  MTP worst relative L2 error: prefill %.2e, decode %.2e, decode vs prefill %.2e\n", e_prefill, e_decode,
              e_paths);
}

INSTANTIATE_TEST_SUITE_P(Families, MtpFixture, ::testing::Values("deepseekv3-bf16", "glm5-bf16"),
                         test::fixture_test_name);

// Each detail of the semantics moves the logits far past the tolerance.
TEST(Mtp, MutationsAreCaught) {
  const std::string dir = test::fixture_dir(kFixture);
  const test::Reference ref = test::load_reference(dir);
  const int64_t T = int64_t(ref.tokens.size()), V = ref.vocab;
  const std::vector<float> want = mtp_reference(dir, T - 1, V);
  auto error_after = [&](const std::function<void(Model&)>& mutate) {
    auto model = load_model(dir);
    mutate(*model);
    return worst_error(mtp_logits(*model, ref.tokens, false), want, T - 1, V);
  };
  const double tol = kTolerance * 10;
  // the two halves of eh_proj's input swapped (hidden state first)
  EXPECT_GT(error_after([](Model& m) { std::swap(m.weights.mtp[0].enorm, m.weights.mtp[0].hnorm); }), tol);
  // the main LM head instead of shared_head.head
  EXPECT_GT(error_after([](Model& m) { m.weights.mtp[0].head = m.weights.lm_head; }), tol);
}

TEST(Mtp, Glm5IndexerSelects) {
  // The MTP layer's attention over its own top-4 selection differs from dense attention: the main
  // model runs as it is, then the MTP layer with a top-k that selects every position.
  const std::string dir = test::fixture_dir("glm5-bf16");
  const test::Reference ref = test::load_reference(dir);
  const int64_t T = int64_t(ref.tokens.size()), V = ref.vocab;
  const std::vector<float> want = mtp_reference(dir, T - 1, V);
  auto model = load_model(dir);
  ASSERT_EQ(model->weights.mtp.size(), 1u);
  const int64_t H = model->config.hidden_size;
  ThreadPool pool(2);
  cpu::Forward fwd(*model, pool);
  KvCache cache = fwd.make_cache(T), mtp = fwd.make_mtp_cache(T - 1);
  std::vector<float> hidden(size_t(T * H)), got(size_t((T - 1) * V));
  fwd.run(ref.tokens, cache, nullptr, hidden.data());
  model->config.indexer.topk = 1000;
  fwd.run_mtp({ref.tokens.data() + 1, size_t(T - 1)}, hidden.data(), mtp, got.data());
  EXPECT_GT(worst_error(got, want, T - 1, V), kTolerance * 10);
}

// Position 0 reads a zero embedding: its MTP logits do not depend on the token after it, while
// position 1's do.
TEST(Mtp, PositionZeroIgnoresTheNextToken) {
  auto model = load_model(test::fixture_dir(kFixture));
  const test::Reference ref = test::load_reference(test::fixture_dir(kFixture));
  std::vector<int32_t> other = ref.tokens;
  other[1] = (other[1] + 1) % int32_t(ref.vocab);
  const int64_t V = ref.vocab, H = model->config.hidden_size;
  ThreadPool pool(2);
  cpu::Forward fwd(*model, pool);
  KvCache cache = fwd.make_cache(2);
  std::vector<float> hidden(size_t(2 * H)), a(size_t(2 * V)), b(size_t(2 * V));
  fwd.run({ref.tokens.data(), 2}, cache, nullptr, hidden.data());  // the same hidden states for both
  KvCache m1 = fwd.make_mtp_cache(2), m2 = fwd.make_mtp_cache(2);
  const int32_t next_a[2] = {ref.tokens[1], ref.tokens[2]}, next_b[2] = {other[1], ref.tokens[2]};
  fwd.run_mtp(next_a, hidden.data(), m1, a.data());
  fwd.run_mtp(next_b, hidden.data(), m2, b.data());
  EXPECT_EQ(test::rel_l2(a.data(), b.data(), V), 0.0);
  // position 1 attends to position 0's entry, which is the same; its own input is too: equal
  EXPECT_EQ(test::rel_l2(a.data() + V, b.data() + V, V), 0.0);
  KvCache m3 = fwd.make_mtp_cache(2);
  const int32_t next_c[2] = {ref.tokens[1], other[1]};
  fwd.run_mtp(next_c, hidden.data(), m3, b.data());
  EXPECT_GT(test::rel_l2(a.data() + V, b.data() + V, V), 1e-2);
}

TEST(Mtp, CheckpointsWithoutMtpWeightsLoad) {
  // Both announce num_nextn_predict_layers 1 and hold no MTP tensors.
  for (const char* name : {"deepseekv3-nvfp4", "glm4moe-nvfp4"}) {
    auto model = load_model(test::fixture_dir(name));
    EXPECT_EQ(model->config.num_nextn_predict_layers, 1) << name;
    EXPECT_TRUE(model->weights.mtp.empty()) << name;
    ThreadPool pool(1);
    cpu::Forward fwd(*model, pool);
    try {
      fwd.make_mtp_cache(4);
      ADD_FAILURE() << name << ": expected an error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("no MTP layer"), std::string::npos) << e.what();
    }
  }
  auto model = load_model(test::fixture_dir("glm4moe-bf16"));
  EXPECT_EQ(model->config.num_nextn_predict_layers, 0);
}

// The fixture rewritten without one tensor.
std::string load_error_without(const std::string& fixture, const std::string& dropped) {
  const std::string dir = test::fixture_dir(fixture);
  Checkpoint ck(dir);
  EXPECT_TRUE(ck.has(dropped)) << dropped;
  std::vector<test::StTensor> ts;
  for (const auto& [name, t] : ck.tensors())
    if (name != dropped)
      ts.push_back({name, std::string(dtype_name(t->dtype)), t->shape, std::vector<uint8_t>(t->data, t->data + t->nbytes)});
  test::TempDir tmp;
  std::filesystem::copy_file(dir + "/config.json", tmp.path() / "config.json");
  test::write_file(tmp.path() / "model.safetensors", test::safetensors_image(ts));
  try {
    load_model(tmp.path().string());
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Mtp, MissingTensorIsNamed) {
  for (const char* t : {"model.layers.3.hnorm.weight", "model.layers.3.eh_proj.weight",
                        "model.layers.3.mlp.experts.5.up_proj.weight", "model.layers.3.self_attn.kv_b_proj.weight",
                        "model.layers.3.shared_head.norm.weight"}) {
    const std::string msg = load_error_without(kFixture, t);
    EXPECT_NE(msg.find(std::string("missing tensor '") + t + "'"), std::string::npos) << t << ": " << msg;
  }
  // two MTP layers announced, one present
  {
    const std::string dir = test::fixture_dir(kFixture);
    nlohmann::json cfg = read_json_file(dir + "/config.json");
    cfg["num_nextn_predict_layers"] = 2;
    test::TempDir tmp;
    std::ofstream(tmp.path() / "config.json") << cfg.dump();
    std::filesystem::copy_file(dir + "/model.safetensors", tmp.path() / "model.safetensors");
    std::string msg;
    try {
      load_model(tmp.path().string());
    } catch (const Error& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find("missing tensor 'model.layers.4.eh_proj.weight' (1 of 2 MTP layers present"), std::string::npos)
        << msg;
  }
  const char* t = "model.layers.3.self_attn.indexer.wk.weight";
  const std::string msg = load_error_without("glm5-bf16", t);
  EXPECT_NE(msg.find(std::string("missing tensor '") + t + "'"), std::string::npos) << msg;
}

// A quantized checkpoint's MTP layer (mtp_checkpoint.h) loads, and the two paths agree.
void quantized_mtp_layer_loads_and_runs(const std::string& fixture) {
  SCOPED_TRACE(fixture);
  const std::string dir = test::fixture_dir(fixture);
  test::TempDir tmp;
  test::write_quantized_mtp_checkpoint(fixture, tmp.path());
  auto model = load_model(tmp.path().string());
  ASSERT_EQ(model->weights.mtp.size(), 1u);
  const MtpLayer& m = model->weights.mtp[0];
  const LayerWeights& last = model->weights.layers.back();
  EXPECT_EQ(m.eh_proj.format, WeightFormat::NVFP4);
  EXPECT_NEAR(m.eh_proj.scale2, 0.05f, 1e-7f);
  EXPECT_EQ(m.layer.is_moe, last.is_moe);
  const Linear& down = m.layer.is_moe ? m.layer.moe.experts[0].down : m.layer.mlp.down;
  EXPECT_EQ(down.format, WeightFormat::NVFP4);
  EXPECT_EQ(down.scale2, (last.is_moe ? last.moe.experts[0].down : last.mlp.down).scale2);
  EXPECT_EQ(m.head.data, model->weights.lm_head.data);
  EXPECT_EQ(m.embed.data, model->weights.embed.data);
  const test::Reference ref = test::load_reference(dir);
  const int64_t T = int64_t(ref.tokens.size()), V = ref.vocab;
  const std::vector<float> prefill = mtp_logits(*model, ref.tokens, false), decode = mtp_logits(*model, ref.tokens, true);
  double sq = 0;
  for (float v : prefill) {
    ASSERT_TRUE(std::isfinite(v));
    sq += double(v) * v;
  }
  EXPECT_GT(sq, 0.0);
  EXPECT_LE(worst_error(decode, prefill, T - 1, V), 1e-5);
}

TEST(Mtp, QuantizedMtpLayersLoadAndRun) {
  quantized_mtp_layer_loads_and_runs("deepseekv3-nvfp4");  // ModelOpt, MLA, NVFP4 experts
  quantized_mtp_layer_loads_and_runs("qwen3-nvfp4-ct");    // compressed-tensors (a GQA layer)
}

TEST(Mtp, CliWritesMtpLogits) {
  const std::string dir = test::fixture_dir(kFixture);
  const test::Reference ref = test::load_reference(dir);
  const int64_t T = int64_t(ref.tokens.size()), V = ref.vocab;
  const std::vector<float> want = mtp_reference(dir, T - 1, V);
  std::string list;
  for (int32_t t : ref.tokens) {
    if (!list.empty()) list += ',';
    list += std::to_string(t);
  }
  test::TempDir tmp;
  for (const char* mode : {"", "--decode"}) {
    const std::string out = (tmp.path() / "mtp.f32").string();
    auto r = test::run_kestrel("logits --mtp --device cpu --model " + dir + " --tokens " + list + " " + mode + " --out " + out);
    ASSERT_EQ(r.status, 0) << r.output;
    std::ifstream f(out, std::ios::binary | std::ios::ate);
    ASSERT_EQ(int64_t(f.tellg()), (T - 1) * V * 4) << mode;
    std::vector<float> got(size_t((T - 1) * V));
    f.seekg(0);
    f.read(reinterpret_cast<char*>(got.data()), std::streamsize(got.size() * 4));
    EXPECT_LE(worst_error(got, want, T - 1, V), kTolerance) << mode;
  }
  auto r = test::run_kestrel("logits --mtp --model " + test::fixture_dir("deepseekv3-nvfp4") + " --tokens 1,2 --out " +
                             (tmp.path() / "o").string());
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("holds none"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace kestrel
