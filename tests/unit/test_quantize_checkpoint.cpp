// Checkpoints written by `kestrel quantize`: they load in kestrel with logits equal to
// transformers' on their dequantized weights (references from scripts/make_quant_fixtures.py),
// hold exactly the tensors of the ModelOpt layout, agree byte for byte with the Python quantizer
// and with `--quant nvfp4` at load, and GGUF sources come out under Hugging Face names in Hugging
// Face row order. Bad input fails with one line naming what is wrong.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <set>

#include "backend/cpu/forward.h"
#include "common/mapped_file.h"
#include "common/numeric.h"
#include "fixture.h"
#include "formats/checkpoint.h"
#include "formats/json_file.h"
#include "formats/safetensors.h"
#include "model/weights.h"
#include "quant/calibrate.h"
#include "quant/nvfp4_quantize.h"
#include "quant/requantize.h"
#include "quant/targets.h"
#include "run_cli.h"
#include "st_writer.h"
#include "same_nvfp4.h"

namespace kestrel {
namespace {

namespace fs = std::filesystem;
using test::run_kestrel;

const std::string kQuantFixtures = std::string(KESTREL_FIXTURES) + "/quant";

std::string join(const std::vector<int32_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

std::string fnv1a64(const uint8_t* p, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", (unsigned long long)h);
  return buf;
}

std::vector<float> logits_of(const Model& m, const std::vector<int32_t>& tokens, bool decode) {
  ThreadPool pool(2);
  cpu::Forward fwd(m, pool);
  const int64_t T = int64_t(tokens.size()), V = m.config.vocab_size;
  std::vector<float> out(size_t(T * V), NAN);
  KvCache cache = fwd.make_cache(T);
  if (!decode) {
    fwd.run(tokens, cache, out.data());
  } else {
    for (int64_t t = 0; t < T; ++t) fwd.run({tokens.data() + t, 1}, cache, out.data() + t * V);
  }
  return out;
}

struct QuantRef {
  nlohmann::json j;
  std::vector<int32_t> tokens, calib;
  std::vector<float> logits;
  int64_t vocab = 0;
};

QuantRef load_quant_ref(const std::string& name) {
  QuantRef r;
  r.j = read_json_file(kQuantFixtures + "/" + name + ".json");
  r.tokens = r.j.at("tokens").get<std::vector<int32_t>>();
  r.calib = r.j.at("calib_tokens").get<std::vector<int32_t>>();
  r.vocab = r.j.at("shape").at(1).get<int64_t>();
  std::ifstream f(kQuantFixtures + "/" + r.j.at("logits").get<std::string>(), std::ios::binary);
  r.logits.resize(r.tokens.size() * size_t(r.vocab));
  f.read(reinterpret_cast<char*>(r.logits.data()), std::streamsize(r.logits.size() * 4));
  EXPECT_TRUE(bool(f)) << name << ": short logits file";
  return r;
}

// `kestrel quantize` of a fixture, as the reference script ran it.
test::CliResult quantize(const std::string& fixture, const fs::path& out, const QuantRef& r) {
  return run_kestrel("quantize --model " + test::fixture_dir(fixture) + " --out " + out.string() + " --calib-tokens " +
                     join(r.calib) + " --shard-size " + r.j.at("shard_size").get<std::string>());
}

float scalar(const TensorView& t) {
  float v;
  std::memcpy(&v, t.data, 4);
  return v;
}

class QuantizedFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(QuantizedFixture, MatchesTransformersOnItsDequantizedWeights) {
  const QuantRef ref = load_quant_ref(GetParam());
  test::TempDir tmp;
  const fs::path out = tmp.path() / "q";
  auto r = quantize(GetParam(), out, ref);
  ASSERT_EQ(r.status, 0) << r.output;
  auto m = load_model(out.string());
  ASSERT_EQ(m->config.vocab_size, ref.vocab);
  const int64_t V = ref.vocab;
  for (bool decode : {false, true}) {
    const std::vector<float> got = logits_of(*m, ref.tokens, decode);
    double worst = 0;
    for (size_t t = 0; t < ref.tokens.size(); ++t) {
      const double e = test::rel_l2(got.data() + t * V, ref.logits.data() + t * V, V);
      EXPECT_LE(e, 1e-3) << (decode ? "decode" : "prefill") << " position " << t;
      worst = std::max(worst, e);
    }
    std::printf("  %s %s: worst relative L2 error %.2e\n", GetParam().c_str(), decode ? "decode" : "prefill", worst);
  }
  // Byte for byte what the reference script read back and ran (every tensor, nothing more),
  // except the input scales: they come from activations of the CPU forward, whose last bits
  // depend on how the compiler vectorized it for the machine (-march=native, e.g. AVX-512 or
  // not); neither forward reads them, and QuantizeCheckpoint.LayoutOfTheWrittenFolder checks each
  // one against the calibration on this machine.
  const auto& want = ref.j.at("tensor_fnv1a64");
  std::set<std::string> names;
  for (const auto& [name, view] : m->checkpoint->tensors()) {
    names.insert(name);
    ASSERT_TRUE(want.contains(name)) << name << " is not in the reference";
    if (name.ends_with(".input_scale")) {
      EXPECT_GT(scalar(*view), 0.0f) << name;
      continue;
    }
    EXPECT_EQ(fnv1a64(view->data, view->nbytes), want.at(name).get<std::string>()) << name;
  }
  EXPECT_EQ(names.size(), want.size());
  EXPECT_EQ(int(m->checkpoint->file_count()), ref.j.at("shards").get<int>());
}

INSTANTIATE_TEST_SUITE_P(Families, QuantizedFixture,
                         ::testing::Values("llama-bf16", "mixtral-bf16", "qwen3moe-bf16", "glm4moe-bf16"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n)
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           return n;
                         });

// The ModelOpt layout, checked against the source model: which modules, which tensors, their
// dtypes and shapes, the scales, the settings files, the index, and the dense tensors as stored.
TEST(QuantizeCheckpoint, LayoutOfTheWrittenFolder) {
  for (const std::string name : {"glm4moe-bf16", "qwen3moe-bf16"}) {
    SCOPED_TRACE(name);
    const QuantRef ref = load_quant_ref(name);
    test::TempDir tmp;
    const fs::path out = tmp.path() / "q";
    ASSERT_EQ(quantize(name, out, ref).status, 0);
    const Checkpoint ck(out.string());
    auto src = load_model(test::fixture_dir(name));
    const Checkpoint& sck = *src->checkpoint;

    // Settings: in config.json and hf_quant_config.json, the same exclusions.
    const nlohmann::json cfg = read_json_file((out / "config.json").string());
    const nlohmann::json& qc = cfg.at("quantization_config");
    EXPECT_EQ(qc.at("quant_method"), "modelopt");
    EXPECT_EQ(qc.at("quant_algo"), "NVFP4");
    EXPECT_EQ(qc.at("group_size"), 16);
    EXPECT_TRUE(qc.at("kv_cache_quant_algo").is_null());
    const auto exclude = qc.at("exclude_modules").get<std::vector<std::string>>();
    EXPECT_EQ(exclude, (std::vector<std::string>{"lm_head", "model.layers.*.mlp.gate", "model.embed_tokens"}));
    const nlohmann::json hq = read_json_file((out / "hf_quant_config.json").string());
    EXPECT_EQ(hq.at("quantization").at("exclude_modules"), qc.at("exclude_modules"));
    EXPECT_EQ(hq.at("quantization").at("quant_algo"), "NVFP4");
    EXPECT_EQ(hq.at("producer").at("name"), "kestrel");
    // Everything else in config.json is the source's.
    nlohmann::json rest = cfg;
    rest.erase("quantization_config");
    EXPECT_EQ(rest, read_json_file(test::fixture_dir(name) + "/config.json"));
    EXPECT_TRUE(fs::exists(out / "generation_config.json"));
    EXPECT_FALSE(fs::exists(out / "reference.json")) << "only tokenizer, generation and license files are copied";

    // Index: every tensor, the total size, shards named model-NNNNN-of-NNNNN.
    const nlohmann::json index = read_json_file((out / "model.safetensors.index.json").string());
    uint64_t total = 0;
    for (const auto& [n, v] : ck.tensors()) total += v->nbytes;
    EXPECT_EQ(index.at("metadata").at("total_size").get<uint64_t>(), total);
    EXPECT_EQ(index.at("weight_map").size(), ck.tensors().size());
    const std::string count = cat(std::setw(5), std::setfill('0'), ck.file_count());
    for (const auto& [n, file] : index.at("weight_map").items())
      EXPECT_TRUE(file.get<std::string>().ends_with("-of-" + count + ".safetensors")) << file;

    // Quantized modules: four tensors in one shard, ModelOpt dtypes and shapes, shared scale_2
    // within q/k/v and gate/up, input_scale = calibrated amax / (6 x 448).
    ThreadPool pool(2);
    const auto amax = calibrate_input_amax(*src, ref.calib, 512, pool);
    const std::vector<QuantTarget> targets = quant_targets(*src);
    std::map<int, float> group_scale;
    std::set<std::string> quantized_tensors;
    for (const QuantTarget& t : targets) {
      SCOPED_TRACE(t.module);
      const int64_t n = t.linear->out, k = t.linear->in;
      const TensorView& w = ck.get(t.module + ".weight");
      const TensorView& s = ck.get(t.module + ".weight_scale");
      const TensorView& s2 = ck.get(t.module + ".weight_scale_2");
      const TensorView& is = ck.get(t.module + ".input_scale");
      EXPECT_EQ(w.dtype, DType::U8);
      EXPECT_EQ(w.shape, (std::vector<int64_t>{n, k / 2}));
      EXPECT_EQ(s.dtype, DType::F8_E4M3);
      EXPECT_EQ(s.shape, (std::vector<int64_t>{n, k / 16}));
      EXPECT_EQ(s2.dtype, DType::F32);
      EXPECT_TRUE(s2.shape.empty());
      EXPECT_EQ(is.dtype, DType::F32);
      EXPECT_TRUE(is.shape.empty());
      EXPECT_EQ(w.file, s.file);
      EXPECT_EQ(w.file, s2.file);
      EXPECT_EQ(w.file, is.file);
      ASSERT_TRUE(amax.count(t.linear));
      EXPECT_EQ(scalar(is), nvfp4_scale2(amax.at(t.linear)));
      EXPECT_GT(scalar(s2), 0.0f);
      auto [it, fresh] = group_scale.emplace(t.group, scalar(s2));
      if (!fresh) {
        EXPECT_EQ(it->second, scalar(s2)) << "fusion group members differ in weight_scale_2";
      }
      for (const char* suffix : {".weight", ".weight_scale", ".weight_scale_2", ".input_scale"})
        quantized_tensors.insert(t.module + suffix);
    }
    // The rest as stored in the source (fused experts are gone: split into the quantized ones).
    for (const auto& [n, v] : ck.tensors()) {
      if (quantized_tensors.count(n)) continue;
      SCOPED_TRACE(n);
      const TensorView* s = sck.find(n);
      ASSERT_NE(s, nullptr) << "a dense tensor the source does not have";
      EXPECT_EQ(v->dtype, s->dtype);
      EXPECT_EQ(v->shape, s->shape);
      EXPECT_EQ(v->nbytes, s->nbytes);
      EXPECT_EQ(std::memcmp(v->data, s->data, v->nbytes), 0);
    }
    for (const auto& [n, v] : sck.tensors()) {
      if (!ck.has(n)) {
        EXPECT_TRUE(n.ends_with("experts.gate_up_proj") || n.ends_with("experts.down_proj")) << n;
      }
    }
  }
}

// The quantizer agrees byte for byte with the Python one that made the NVFP4 fixtures (ModelOpt
// algorithm), ties and E4M3 underflow included.
TEST(QuantizeCheckpoint, AgreesWithThePythonQuantizer) {
  const SafetensorsFile f(kQuantFixtures + "/python_nvfp4.safetensors");
  ThreadPool pool(2);
  int checked = 0;
  for (const auto& [name, t] : f.tensors()) {
    if (!name.ends_with(".input")) continue;
    const std::string base = name.substr(0, name.size() - 6);
    SCOPED_TRACE(base);
    ASSERT_EQ(t.dtype, DType::F32);
    Linear l;
    l.name = base;
    l.out = t.shape[0];
    l.in = t.shape[1];
    l.format = WeightFormat::F32;
    l.data = t.data;
    const Nvfp4Matrix q = quantize_linear(l, weight_amax(l, pool), pool);
    const TensorView& w = f.tensors().at(base + ".weight");
    const TensorView& s = f.tensors().at(base + ".weight_scale");
    ASSERT_EQ(q.packed.size(), w.nbytes);
    ASSERT_EQ(q.scales.size(), s.nbytes);
    EXPECT_EQ(std::memcmp(q.packed.data(), w.data, w.nbytes), 0);
    EXPECT_EQ(std::memcmp(q.scales.data(), s.data, s.nbytes), 0);
    EXPECT_EQ(q.scale2, scalar(f.tensors().at(base + ".weight_scale_2")));
    ++checked;
  }
  EXPECT_EQ(checked, 4);
}

// --quant nvfp4 at load and the checkpoint `kestrel quantize` writes hold the same weights, so
// their logits are identical.
TEST(QuantizeCheckpoint, QuantOptionEqualsTheWrittenCheckpoint) {
  for (const std::string name : {"llama-bf16", "glm4moe-bf16"}) {
    const QuantRef ref = load_quant_ref(name);
    test::TempDir tmp;
    ASSERT_EQ(quantize(name, tmp.path() / "q", ref).status, 0);
    auto written = load_model((tmp.path() / "q").string());
    auto m = load_model(test::fixture_dir(name));
    ThreadPool pool(2);
    requantize_nvfp4(*m, nvfp4_settings(m->config, {}, "test"), pool);
    EXPECT_EQ(logits_of(*m, ref.tokens, false), logits_of(*written, ref.tokens, false)) << name;
  }
  // And through the CLI.
  const QuantRef ref = load_quant_ref("qwen3moe-bf16");
  test::TempDir tmp;
  ASSERT_EQ(quantize("qwen3moe-bf16", tmp.path() / "q", ref).status, 0);
  const std::string a = (tmp.path() / "a.f32").string(), b = (tmp.path() / "b.f32").string();
  ASSERT_EQ(run_kestrel("logits --model " + test::fixture_dir("qwen3moe-bf16") + " --quant nvfp4 --tokens " +
                        join(ref.tokens) + " --out " + a).status, 0);
  ASSERT_EQ(run_kestrel("logits --model " + (tmp.path() / "q").string() + " --tokens " + join(ref.tokens) + " --out " + b)
                .status, 0);
  EXPECT_EQ(read_text_file(a), read_text_file(b));
}

struct GgufCase {
  std::string file, json;
  double tolerance;  // BF16 rounding of the dequantized weights, against the GGUF's reference logits
};

// A GGUF written as a Hugging Face folder: every matrix is the GGUF's dequantized weights rounded
// to BF16, under its Hugging Face name, in Hugging Face row order (llama Q/K unpermuted); vectors
// exactly; the logits stay close to transformers' on the GGUF.
TEST(QuantizeGguf, Bf16ExportHoldsTheGgufWeights) {
  for (const GgufCase& c : {GgufCase{"llama.gguf", "llama.json", 2e-2}, GgufCase{"qwen2.gguf", "qwen2.json", 2e-2},
                            GgufCase{"qwen3moe.gguf", "qwen3moe.json", 2e-2}}) {
    SCOPED_TRACE(c.file);
    const std::string gguf = std::string(KESTREL_FIXTURES) + "/gguf/" + c.file;
    test::TempDir tmp;
    const fs::path out = tmp.path() / "bf16";
    auto r = run_kestrel("quantize --model " + gguf + " --out " + out.string() + " --format bf16");
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_FALSE(fs::exists(out / "hf_quant_config.json"));
    auto g = load_model(gguf);
    auto h = load_model(out.string());
    EXPECT_EQ(h->config.architecture + " (GGUF)", g->config.architecture);
    auto same_rows = [&](const Linear& a, const Linear& b) {
      ASSERT_EQ(b.format, WeightFormat::BF16) << b.name;
      ASSERT_EQ(a.out, b.out);
      ASSERT_EQ(a.in, b.in);
      std::vector<float> ra(size_t(a.in)), rb(size_t(b.in));
      for (int64_t i = 0; i < a.out; ++i) {
        a.dequant_row(i, ra.data());
        b.dequant_row(i, rb.data());
        for (int64_t j = 0; j < a.in; ++j)
          ASSERT_EQ(f32_to_bf16(ra[size_t(j)]), f32_to_bf16(rb[size_t(j)])) << b.name << " row " << i << " col " << j;
      }
    };
    same_rows(g->weights.embed, h->weights.embed);
    same_rows(g->weights.lm_head, h->weights.lm_head);
    EXPECT_EQ(g->weights.final_norm, h->weights.final_norm);
    for (size_t l = 0; l < g->weights.layers.size(); ++l) {
      const LayerWeights &a = g->weights.layers[l], &b = h->weights.layers[l];
      for (auto [x, y] : {std::pair{&a.q, &b.q}, {&a.k, &b.k}, {&a.v, &b.v}, {&a.o, &b.o}}) {
        same_rows(*x, *y);
        EXPECT_EQ(x->bias, y->bias);
      }
      EXPECT_EQ(a.attn_norm, b.attn_norm);
      EXPECT_EQ(a.q_norm, b.q_norm);
      ASSERT_EQ(a.is_moe, b.is_moe);
      if (!a.is_moe) {
        same_rows(a.mlp.gate, b.mlp.gate);
        same_rows(a.mlp.down, b.mlp.down);
      } else {
        same_rows(a.moe.router, b.moe.router);
        for (size_t e = 0; e < a.moe.experts.size(); ++e) {
          same_rows(a.moe.experts[e].up, b.moe.experts[e].up);
          same_rows(a.moe.experts[e].down, b.moe.experts[e].down);
        }
      }
    }
    const nlohmann::json j = read_json_file(std::string(KESTREL_FIXTURES) + "/gguf/" + c.json);
    const auto tokens = j.at("tokens").get<std::vector<int32_t>>();
    const int64_t V = j.at("shape").at(1).get<int64_t>();
    std::vector<float> want(tokens.size() * size_t(V));
    std::ifstream f(std::string(KESTREL_FIXTURES) + "/gguf/" + j.at("logits").get<std::string>(), std::ios::binary);
    f.read(reinterpret_cast<char*>(want.data()), std::streamsize(want.size() * 4));
    const std::vector<float> got = logits_of(*h, tokens, false);
    double worst = 0;
    for (size_t t = 0; t < tokens.size(); ++t) worst = std::max(worst, test::rel_l2(got.data() + t * V, want.data() + t * V, V));
    EXPECT_LE(worst, c.tolerance);
    std::printf("  %s as BF16: worst relative L2 error %.2e against transformers on the GGUF\n", c.file.c_str(), worst);
  }
}

// An NVFP4 checkpoint written from a GGUF holds what --quant nvfp4 makes of the GGUF at load.
TEST(QuantizeGguf, Nvfp4ExportEqualsQuantOption) {
  const std::string gguf = std::string(KESTREL_FIXTURES) + "/gguf/llama.gguf";
  test::TempDir tmp;
  const fs::path out = tmp.path() / "q";
  auto r = run_kestrel("quantize --model " + gguf + " --out " + out.string() + " --calib-tokens 1,2,3,4,5");
  ASSERT_EQ(r.status, 0) << r.output;
  auto g = load_model(gguf);
  ThreadPool pool(2);
  requantize_nvfp4(*g, nvfp4_settings(g->config, {}, "test"), pool);
  auto h = load_model(out.string());
  test::expect_same_nvfp4(*g, *h);
}

struct Case {
  std::string args, expect;
};

void expect_one_line_errors(const std::vector<Case>& cases) {
  for (const auto& c : cases) {
    auto r = run_kestrel(c.args);
    EXPECT_NE(r.status, 0) << c.args;
    EXPECT_LT(r.status, 128) << "crashed: " << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.expect), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find("kestrel: error: "), std::string::npos) << c.args << "\n" << r.output;
  }
}

TEST(QuantizeCli, BadInputGivesOneClearLine) {
  test::TempDir tmp;
  const std::string fx = test::fixture_dir("llama-bf16");
  const std::string out = (tmp.path() / "out").string();
  fs::create_directories(tmp.path() / "full");
  std::ofstream(tmp.path() / "full" / "x") << "x";
  std::ofstream(tmp.path() / "empty.txt") << "  \n";
  expect_one_line_errors({
      {"quantize --model /nonexistent --out " + out, "/nonexistent: no such file or folder"},
      {"quantize --model " + fx + " --out " + (tmp.path() / "full").string() + " --calib-tokens 1",
       "exists and is not an empty folder"},
      {"quantize --model " + fx + " --out " + fx, "the model's own folder"},
      {"quantize --model " + test::fixture_dir("llama-nvfp4") + " --out " + out + " --calib-tokens 1",
       "already quantized"},
      {"quantize --model " + fx + " --out " + out + " --format int4", "--format: expected nvfp4, fp8 or bf16"},
      {"quantize --model " + fx + " --out " + out + " --shard-size 5XB --calib-tokens 1", "--shard-size: unknown unit"},
      {"quantize --model " + fx + " --out " + out + " --calib /no/such.txt", "--calib: /no/such.txt: no such file"},
      {"quantize --model " + fx + " --out " + out + " --calib " + (tmp.path() / "empty.txt").string(),
       "the text is empty"},
      {"quantize --model " + fx + " --out " + out + " --calib x --calib-tokens 1", "give one of them"},
      {"quantize --model " + fx + " --out " + out, "give token ids with --calib-tokens"},
      {"quantize --model " + fx + " --out " + out + " --calib-tokens 1,999", "token id 999 is outside"},
      {"quantize --model " + fx + " --out " + out + " --calib-tokens 1,x", "--calib-tokens: 'x' is not a token id"},
      {"quantize --model " + fx + " --out " + out + " --format bf16 --exclude lm_head", "--format bf16 quantizes nothing"},
  });
  EXPECT_FALSE(fs::exists(out)) << "nothing is written when the input is bad";
}

// A weight that NVFP4 cannot hold, or a shape it cannot take, is named.
TEST(QuantizeCli, BadWeightsAreNamed) {
  test::TempDir tmp;
  // llama-bf16 with a NaN in layer 0's k_proj ([32, 64]: element 70 is in row 1).
  const fs::path bad = tmp.path() / "nan";
  fs::copy(test::fixture_dir("llama-bf16"), bad);
  {
    const std::string file = (bad / "model.safetensors").string();
    const std::string bytes = read_text_file(file);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; --i) hlen = (hlen << 8) | uint8_t(bytes[size_t(i)]);
    const nlohmann::json h = nlohmann::json::parse(bytes.substr(8, hlen));
    const size_t pos = 8 + hlen + h.at("model.layers.0.self_attn.k_proj.weight").at("data_offsets").at(0).get<size_t>() + 2 * 70;
    const uint16_t nan = 0x7fc0;
    std::fstream io(file, std::ios::in | std::ios::out | std::ios::binary);
    io.seekp(std::streamoff(pos));
    io.write(reinterpret_cast<const char*>(&nan), 2);
  }
  // A model whose hidden size (24) is not a multiple of 16.
  const fs::path odd = tmp.path() / "odd";
  fs::create_directories(odd);
  {
    std::vector<test::StTensor> ts;
    auto bf16 = [&](const std::string& n, std::vector<int64_t> shape) {
      int64_t numel = 1;
      for (auto d : shape) numel *= d;
      ts.push_back({n, "BF16", shape, std::vector<uint8_t>(size_t(numel) * 2, 0x3f)});
    };
    bf16("model.embed_tokens.weight", {16, 24});
    bf16("model.norm.weight", {24});
    bf16("lm_head.weight", {16, 24});
    bf16("model.layers.0.input_layernorm.weight", {24});
    bf16("model.layers.0.post_attention_layernorm.weight", {24});
    for (const char* n : {"q_proj", "k_proj", "v_proj", "o_proj"}) bf16(std::string("model.layers.0.self_attn.") + n + ".weight", {24, 24});
    bf16("model.layers.0.mlp.gate_proj.weight", {32, 24});
    bf16("model.layers.0.mlp.up_proj.weight", {32, 24});
    bf16("model.layers.0.mlp.down_proj.weight", {24, 32});
    test::write_file(odd / "model.safetensors", test::safetensors_image(ts));
    std::ofstream(odd / "config.json") << nlohmann::json{{"architectures", {"LlamaForCausalLM"}}, {"vocab_size", 16},
                                                         {"hidden_size", 24}, {"num_hidden_layers", 1},
                                                         {"num_attention_heads", 2}, {"intermediate_size", 32},
                                                         {"max_position_embeddings", 64}}
                                                             .dump();
  }
  expect_one_line_errors({
      {"quantize --model " + bad.string() + " --out " + (tmp.path() / "o1").string() + " --calib-tokens 1,2",
       "model.layers.0.self_attn.k_proj: weight row 1 holds a NaN or infinity"},
      {"quantize --model " + odd.string() + " --out " + (tmp.path() / "o2").string() + " --calib-tokens 1,2",
       "model.layers.0.self_attn.q_proj: input dimension 24 is not a multiple of 16"},
  });
  EXPECT_FALSE(fs::exists(tmp.path() / "o1")) << "a failed write leaves no half-written folder";
  // Excluding the modules whose K is 24 (attention, gate, up) makes it work; down (K = 32) is NVFP4.
  auto r = run_kestrel("quantize --model " + odd.string() + " --out " + (tmp.path() / "o3").string() +
                       " --calib-tokens 1,2 --exclude '*self_attn*' --exclude '*gate_proj' --exclude '*up_proj'");
  EXPECT_EQ(r.status, 0) << r.output;
  auto m = load_model((tmp.path() / "o3").string());
  EXPECT_EQ(m->weights.layers[0].mlp.down.format, WeightFormat::NVFP4);
  EXPECT_EQ(m->weights.layers[0].q.format, WeightFormat::BF16);
}

TEST(PerplexityCli, BadInputGivesOneClearLine) {
  test::TempDir tmp;
  const std::string fx = test::fixture_dir("llama-bf16");
  const std::string text = (tmp.path() / "t.txt").string(), empty = (tmp.path() / "e.txt").string();
  std::ofstream(text) << "Some text.";
  std::ofstream(empty) << "\n\n";
  expect_one_line_errors({
      {"perplexity --model " + fx + " --text /no/such.txt", "--text: /no/such.txt: no such file"},
      {"perplexity --model " + fx + " --text " + empty, "the text is empty"},
      {"perplexity --model " + fx + " --text " + text + " --context 1", "--context: must be at least 2"},
      {"perplexity --model " + fx + " --text " + text + " --stride 0", "--stride: must be at least 1"},
      {"perplexity --model " + fx + " --text " + text + " --context 8 --stride 9", "exceeds the context"},
      {"perplexity --model /nonexistent --text " + text, "/nonexistent: no such file or folder"},
      {"perplexity --model " + fx + " --text " + text + " --reference /nonexistent", "--reference: /nonexistent"},
      {"perplexity --model " + fx + " --text " + text, "no tokenizer"},
      {"perplexity --model " + fx + " --text " + text + " --device gpu", "--device: expected auto, cpu or cuda"},
      {"perplexity --model " + fx + " --text " + text + " --quant int8", "--quant: expected none or nvfp4"},
      {"perplexity --model " + fx + " --text " + text + " --kv-dtype fp8", "--kv-dtype: expected auto, f32 or bf16"},
      // The CPU caches float32: an explicit BF16 cache is refused, not silently ignored.
      {"logits --model " + fx + " --tokens 1,2 --device cpu --kv-dtype bf16 --out " + (tmp.path() / "l.bin").string(),
       "--kv-dtype bf16: the CPU backend caches keys and values as float32"},
  });
}

}  // namespace
}  // namespace kestrel
