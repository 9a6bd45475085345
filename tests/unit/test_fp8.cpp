// FP8 checkpoints: the E4M3 decode of every code, block scales over partial edge blocks, the
// layouts (quant_method "fp8" with weight_scale_inv per block or weight_scale per tensor,
// compressed-tensors float-quantized), the settings and modules_to_not_convert (hostile patterns
// included), bad input named by tensor, the fixtures split over ranks, and `kestrel quantize
// --format fp8` against the Python quantizer and transformers.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include "backend/cpu/forward.h"
#include "common/error.h"
#include "common/numeric.h"
#include "fixture.h"
#include "formats/fp8.h"
#include "formats/json_file.h"
#include "formats/quant_config.h"
#include "model/weights.h"
#include "parallel/shard.h"
#include "quant/fp8_quantize.h"
#include "run_cli.h"
#include "st_writer.h"

namespace kestrel {
namespace {

namespace fs = std::filesystem;
using test::StTensor;

// E4M3 (FN) from its definition: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
// subnormal, S.1111.111 is NaN, there is no infinity.
double e4m3_reference(int code) {
  const int sign = code >> 7, exp = (code >> 3) & 15, man = code & 7;
  if (exp == 15 && man == 7) return NAN;
  const double mag = exp == 0 ? man / 8.0 * std::ldexp(1.0, -6) : (1.0 + man / 8.0) * std::ldexp(1.0, exp - 7);
  return sign ? -mag : mag;
}

TEST(Fp8, DecodesEveryCode) {
  std::vector<uint8_t> codes(256);
  for (int c = 0; c < 256; ++c) codes[size_t(c)] = uint8_t(c);
  const float one = 1.0f;
  std::vector<float> out(256);
  fp8_dequant_row(codes.data(), reinterpret_cast<const uint8_t*>(&one), false, 256, 256, out.data());
  int nans = 0;
  for (int c = 0; c < 256; ++c) {
    const double want = e4m3_reference(c);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(out[size_t(c)])) << c;
      ++nans;
      continue;
    }
    EXPECT_EQ(double(out[size_t(c)]), want) << "code " << c;
    EXPECT_EQ(std::signbit(out[size_t(c)]), c >= 128) << "code " << c;
  }
  EXPECT_EQ(nans, 2);  // 0x7f and 0xff
  EXPECT_EQ(out[0x7e], 448.0f);
  EXPECT_EQ(out[0xfe], -448.0f);
  EXPECT_EQ(out[0x38], 1.0f);
  EXPECT_EQ(out[0x01], std::ldexp(1.0f, -9));  // the smallest subnormal
  EXPECT_EQ(out[0x08], std::ldexp(1.0f, -6));  // the smallest normal
  // The quantizer's rounding maps every finite value back to its own code.
  for (int c = 0; c < 256; ++c) {
    if (!std::isnan(out[size_t(c)])) EXPECT_EQ(f32_to_e4m3(out[size_t(c)]), c) << c;
  }
}

TEST(Fp8, FindsNanCodesAnywhere) {
  for (int64_t n : {1, 7, 8, 9, 64, 100}) {
    std::vector<uint8_t> v(size_t(n), 0x7e);
    EXPECT_EQ(fp8_find_nan(v.data(), n), -1);
    for (int64_t at = 0; at < n; ++at)
      for (uint8_t nan : {uint8_t(0x7f), uint8_t(0xff)}) {
        std::vector<uint8_t> w = v;
        w[size_t(at)] = nan;
        if (at + 1 < n) w[size_t(n - 1)] = nan;
        EXPECT_EQ(fp8_find_nan(w.data(), n), at) << n << " " << at;
      }
  }
}

// A matrix [out, in] of random finite codes with scales in blocks: the views read_fp8_matrix checks.
struct Fp8Case {
  int64_t out, in;
  Fp8Blocks b;
  bool bf16;
  std::vector<uint8_t> codes, scales;
  std::vector<int64_t> scale_shape;
  TensorView w, s;

  Fp8Case(int64_t o, int64_t i, Fp8Blocks blocks, bool bf16_scales, uint32_t seed)
      : out(o), in(i), b(blocks), bf16(bf16_scales) {
    std::mt19937 rng(seed);
    codes.resize(size_t(out * in));
    for (auto& c : codes) {
      c = uint8_t(rng());
      if ((c & 0x7f) == 0x7f) c = 0x7e;
    }
    const int64_t n = b.scale_rows(out) * b.scale_cols(in);
    std::uniform_real_distribution<float> d(0.001f, 2.0f);
    for (int64_t k = 0; k < n; ++k) {
      const float v = d(rng);
      if (bf16) {
        const uint16_t h = f32_to_bf16(v);
        scales.push_back(uint8_t(h));
        scales.push_back(uint8_t(h >> 8));
      } else {
        uint8_t p[4];
        std::memcpy(p, &v, 4);
        scales.insert(scales.end(), p, p + 4);
      }
    }
    scale_shape = {b.scale_rows(out), b.scale_cols(in)};
    w = view("m.weight", DType::F8_E4M3, {out, in}, codes);
    s = view("m.weight_scale_inv", bf16 ? DType::BF16 : DType::F32, scale_shape, scales);
  }

  static TensorView view(const std::string& name, DType dt, std::vector<int64_t> shape, const std::vector<uint8_t>& b) {
    TensorView t;
    t.name = name;
    t.file = "test.safetensors";
    t.dtype = dt;
    t.shape = std::move(shape);
    t.data = b.data();
    t.nbytes = b.size();
    return t;
  }

  float scale(int64_t r, int64_t c) const {
    const int64_t k = (r / b.rows) * b.scale_cols(in) + c / b.cols;
    if (bf16) return bf16_to_f32(uint16_t(scales[size_t(2 * k)] | (scales[size_t(2 * k + 1)] << 8)));
    float v;
    std::memcpy(&v, scales.data() + 4 * k, 4);
    return v;
  }

  Linear linear() const {
    const Fp8Matrix m = read_fp8_matrix(w, s, out, in, b);
    Linear l;
    l.name = "m";
    l.out = out;
    l.in = in;
    l.format = WeightFormat::FP8;
    l.data = m.codes;
    l.scales = m.scales;
    l.fp8 = b;
    l.fp8_bf16_scales = m.bf16_scales;
    return l;
  }
};

// Every weight equals code x its block's scale in float32, the edge blocks partial.
void expect_dequantized(const Fp8Case& c, const Linear& l) {
  std::vector<float> row(size_t(c.in));
  for (int64_t r = 0; r < c.out; ++r) {
    l.dequant_row(r, row.data());
    for (int64_t i = 0; i < c.in; ++i) {
      const float want = e4m3_to_f32(c.codes[size_t(r * c.in + i)]) * c.scale(r, i);
      ASSERT_EQ(row[size_t(i)], want) << "row " << r << " column " << i;
    }
  }
}

TEST(Fp8, BlockScalesCoverPartialEdgeBlocks) {
  // DeepSeek-V3's kv_a_proj_with_mqa is [576, 7168]: 4 full row blocks and one of 64 rows.
  for (bool bf16 : {false, true}) {
    Fp8Case c(576, 300, {128, 128}, bf16, 1);
    ASSERT_EQ(c.scale_shape, (std::vector<int64_t>{5, 3}));
    expect_dequantized(c, c.linear());
    EXPECT_EQ(c.linear().bytes(), size_t(576 * 300) + size_t(15 * (bf16 ? 2 : 4)));
  }
  Fp8Case small(40, 64, {128, 128}, false, 2);  // one partial block
  expect_dequantized(small, small.linear());
  Fp8Case odd(7, 9, {2, 4}, false, 3);  // other block sizes
  expect_dequantized(odd, odd.linear());
}

TEST(Fp8, ChannelAndTensorScalesAreBlocksToo) {
  QuantConfig q;
  q.algo = "FP8";
  q.fp8_scaling = Fp8Scaling::Channel;
  Fp8Case ch(24, 40, q.fp8_blocks(24, 40), true, 4);
  ASSERT_EQ(ch.scale_shape, (std::vector<int64_t>{24, 1}));
  expect_dequantized(ch, ch.linear());
  ch.s.shape = {24};  // a vector of one scale per row reads the same
  expect_dequantized(ch, ch.linear());
  q.fp8_scaling = Fp8Scaling::Tensor;
  Fp8Case t(24, 40, q.fp8_blocks(24, 40), false, 5);
  for (std::vector<int64_t> shape : {std::vector<int64_t>{1, 1}, std::vector<int64_t>{1}, std::vector<int64_t>{}}) {
    t.s.shape = shape;
    expect_dequantized(t, t.linear());
  }
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void expect_parts(const std::string& msg, std::initializer_list<std::string> parts) {
  ASSERT_FALSE(msg.empty()) << "expected an error";
  for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "message: " << msg << "\nmissing: " << p;
}

TEST(Fp8, BadTensorsAreNamed) {
  auto err = [](const std::function<void(Fp8Case&)>& spoil) {
    Fp8Case c(130, 20, {128, 128}, false, 6);
    spoil(c);
    return error_of([&] { read_fp8_matrix(c.w, c.s, c.out, c.in, c.b); });
  };
  expect_parts(err([](Fp8Case& c) { c.codes[size_t(129 * 20 + 3)] = 0xff; }),
               {"'m.weight'", "[129, 3]", "NaN", "0xff"});
  expect_parts(err([](Fp8Case& c) { c.codes[5] = 0x7f; }), {"'m.weight'", "[0, 5]", "NaN"});
  expect_parts(err([](Fp8Case& c) { c.w.dtype = DType::F8_E5M2; }), {"'m.weight'", "F8_E4M3", "F8_E5M2"});
  expect_parts(err([](Fp8Case& c) { c.w.shape = {20, 130}; }), {"'m.weight'", "[20, 130]", "[130, 20]"});
  expect_parts(err([](Fp8Case& c) { c.s.dtype = DType::F16; }), {"'m.weight_scale_inv'", "F32 or BF16", "F16"});
  expect_parts(err([](Fp8Case& c) { c.s.shape = {1, 2}; }),
               {"'m.weight_scale_inv'", "[1, 2]", "expected [2, 1]", "128 x 128"});
  expect_parts(err([](Fp8Case& c) { c.s.shape = {}; }), {"'m.weight_scale_inv'", "expected [2, 1]"});
  expect_parts(err([](Fp8Case& c) {
                 const float inf = INFINITY;
                 std::memcpy(c.scales.data() + 4, &inf, 4);
               }),
               {"'m.weight_scale_inv'", "[1, 0]", "not finite"});
}

// ---- settings ----

QuantConfig settings(const nlohmann::json& q) {
  return load_quant_config("/nonexistent", {{"quantization_config", q}}, "config.json");
}

TEST(Fp8, DeepSeekSettings) {
  const QuantConfig q = settings(
      {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"activation_scheme", "dynamic"}, {"weight_block_size", {128, 128}}});
  EXPECT_EQ(q.method, QuantMethod::Fp8);
  EXPECT_TRUE(q.is_fp8());
  const Fp8Blocks b = q.fp8_blocks(576, 7168);
  EXPECT_EQ(b.rows, 128);
  EXPECT_EQ(b.cols, 128);
  EXPECT_EQ(b.scale_rows(576), 5);
  EXPECT_EQ(b.scale_cols(7168), 56);
  EXPECT_TRUE(q.quantizes("model.layers.0.self_attn.kv_a_proj_with_mqa"));
  EXPECT_NE(q.describe().find("FP8 E4M3 (blocks 128 x 128"), std::string::npos) << q.describe();
}

TEST(Fp8, ModulesToNotConvertAsTransformersMatchesThem) {
  const QuantConfig q = settings({{"quant_method", "fp8"},
                                  {"weight_block_size", {128, 128}},
                                  {"modules_to_not_convert",
                                   {"lm_head", "mlp.gate", "model.layers.1", "model.layers.*.self_attn.o_proj",
                                    "model.layers.3.mlp.experts.0."}}});
  EXPECT_FALSE(q.quantizes("lm_head"));
  EXPECT_FALSE(q.quantizes("model.layers.5.mlp.gate"));         // a suffix
  EXPECT_TRUE(q.quantizes("model.layers.5.mlp.gate_proj"));     // not at a module boundary
  EXPECT_FALSE(q.quantizes("model.layers.1.mlp.down_proj"));    // a module above it
  EXPECT_TRUE(q.quantizes("model.layers.11.mlp.down_proj"));    // "model.layers.1" ends inside "11"
  EXPECT_FALSE(q.quantizes("model.layers.7.self_attn.o_proj"));  // a regular expression
  EXPECT_TRUE(q.quantizes("model.layers.7.self_attn.q_proj"));
  EXPECT_FALSE(q.quantizes("model.layers.3.mlp.experts.0.up_proj"));  // a prefix ending in '.'
  EXPECT_TRUE(q.quantizes("model.layers.3.mlp.experts.10.up_proj"));
  EXPECT_FALSE(q.quantizes("model.layers.3.mlp.experts.01.up_proj"));  // as a pattern, '.' matches any character
  EXPECT_TRUE(not_convert_match("model.layers.0.mlp", "model.layers.0.mlp", "entry"));
  EXPECT_FALSE(not_convert_match("", "model.layers.0.mlp", "entry"));
  // Regular expressions end at a module boundary too: before a '.', at the end, or after a '.'.
  EXPECT_TRUE(not_convert_match("model\\.layers\\.[34]", "model.layers.3.mlp.up_proj", "entry"));
  EXPECT_FALSE(not_convert_match("model\\.layers\\.[34]", "model.layers.33.mlp.up_proj", "entry"));
  EXPECT_TRUE(not_convert_match("model\\.layers\\.[34]\\.", "model.layers.4.mlp.up_proj", "entry"));
  EXPECT_TRUE(not_convert_match("(model|lm_head)$", "lm_head", "entry"));
  EXPECT_FALSE(not_convert_match("(model|lm_head)$", "model.norm", "entry"));  // $ is the end
  // A pattern that does not compile fails as the settings load, naming the file, field and entry.
  expect_parts(error_of([&] {
                 settings({{"quant_method", "fp8"}, {"weight_block_size", {128, 128}},
                           {"modules_to_not_convert", {"lm_head", "model.layers.(1"}}});
               }),
               {"config.json: quantization_config.modules_to_not_convert[1] 'model.layers.(1'",
                "not a valid regular expression", "parenthesis", "offset 15"});
  expect_parts(error_of([&] {
                 settings({{"quant_method", "fp8"},
                           {"weight_block_size", {128, 128}},
                           {"ignored_layers", {"lm_head", "a)|(b"}}});
               }),
               {"config.json: quantization_config.ignored_layers[1] 'a)|(b'", "not a valid regular expression"});
}

// Patterns come from config files: one that backtracks exponentially ("(a+)+$" on a name of a's
// that ends otherwise) stops at PCRE2's match limit and fails, naming the entry, in milliseconds.
TEST(Fp8, CatastrophicPatternsFailQuickly) {
  const std::string name = std::string(64, 'a') + ".mlp";
  auto timed_error = [&](const QuantConfig& q) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string err = error_of([&] { (void)q.quantizes(name); });
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(500));
    return err;
  };
  const QuantConfig fp8 = settings(
      {{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}, {"modules_to_not_convert", {"lm_head", "(a+)+$"}}});
  expect_parts(timed_error(fp8), {"config.json: quantization_config.modules_to_not_convert[1] '(a+)+$'",
                                  "backtracks too much", name, "match limit"});
  const QuantConfig ct = settings({{"quant_method", "compressed-tensors"},
                                   {"format", "float-quantized"},
                                   {"config_groups",
                                    {{"group_0",
                                      {{"targets", {"Linear"}},
                                       {"weights", {{"num_bits", 8}, {"type", "float"}, {"strategy", "tensor"}}}}}}},
                                   {"ignore", {"lm_head", "re:(a|aa)+$"}}});
  expect_parts(timed_error(ct), {"config.json: quantization_config.ignore[1] 're:(a|aa)+$'", "backtracks too much"});
  // Other names the same patterns match, or not, at once.
  EXPECT_FALSE(fp8.quantizes("aaaa"));
  EXPECT_TRUE(fp8.quantizes("model.layers.0.mlp.down_proj"));
  EXPECT_FALSE(ct.quantizes("aaaa"));
  EXPECT_TRUE(ct.quantizes("model.layers.0.mlp.down_proj"));
}

// quant_method "fp8" without weight_block_size (AutoFP8, early llm-compressor): one weight_scale
// per tensor, as compressed-tensors' strategy "tensor"; static and dynamic activation schemes alike.
TEST(Fp8, PerTensorSettings) {
  for (const char* act : {"static", "dynamic"}) {
    const QuantConfig q =
        settings({{"quant_method", "fp8"}, {"activation_scheme", act}, {"ignored_layers", {"lm_head"}}});
    EXPECT_EQ(q.method, QuantMethod::Fp8);
    EXPECT_TRUE(q.is_fp8());
    EXPECT_EQ(q.fp8_scaling, Fp8Scaling::Tensor);
    EXPECT_EQ(q.fp8_blocks(24, 40).rows, 24);
    EXPECT_EQ(q.fp8_blocks(24, 40).cols, 40);
    EXPECT_STREQ(q.fp8_scale_name(), "weight_scale");
    EXPECT_FALSE(q.quantizes("lm_head"));
    EXPECT_TRUE(q.quantizes("model.layers.0.mlp.down_proj"));
    EXPECT_NE(q.describe().find("FP8 E4M3 (per tensor, from config.json), not converted: lm_head"), std::string::npos)
        << q.describe();
  }
  EXPECT_STREQ(settings({{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}}).fp8_scale_name(),
               "weight_scale_inv");
}

TEST(Fp8, CompressedTensorsSettings) {
  auto ct = [](const nlohmann::json& weights) {
    return nlohmann::json{{"quant_method", "compressed-tensors"},
                          {"format", "float-quantized"},
                          {"config_groups", {{"group_0", {{"targets", {"Linear"}}, {"weights", weights}}}}},
                          {"ignore", {"lm_head", "re:.*mlp.gate$"}}};
  };
  nlohmann::json w = {{"num_bits", 8}, {"type", "float"}, {"strategy", "channel"}, {"symmetric", true},
                      {"dynamic", false}};
  QuantConfig q = settings(ct(w));
  EXPECT_EQ(q.method, QuantMethod::CompressedTensors);
  EXPECT_TRUE(q.is_fp8());
  EXPECT_EQ(q.fp8_scaling, Fp8Scaling::Channel);
  EXPECT_EQ(q.fp8_blocks(24, 40).rows, 1);
  EXPECT_EQ(q.fp8_blocks(24, 40).cols, 40);
  EXPECT_FALSE(q.quantizes("model.layers.3.mlp.gate"));
  EXPECT_TRUE(q.quantizes("model.layers.3.mlp.gate_proj"));
  w["strategy"] = "tensor";
  EXPECT_EQ(settings(ct(w)).fp8_scaling, Fp8Scaling::Tensor);
  w["strategy"] = "block";
  w["block_structure"] = {64, 32};
  q = settings(ct(w));
  EXPECT_EQ(q.fp8_blocks(1, 1).rows, 64);
  EXPECT_EQ(q.fp8_blocks(1, 1).cols, 32);
}

TEST(Fp8, BadSettingsNameTheFileAndField) {
  auto expect = [](const nlohmann::json& q, std::initializer_list<std::string> parts) {
    expect_parts(error_of([&] { settings(q); }), parts);
  };
  expect({{"quant_method", "fp8"}, {"weight_block_size", {128}}}, {"weight_block_size", "[128]"});
  expect({{"quant_method", "fp8"}, {"weight_block_size", {0, 128}}}, {"weight_block_size", "positive"});
  expect({{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}, {"fmt", "e5m2"}}, {"fmt", "e5m2"});
  expect({{"quant_method", "fp8"}, {"activation_scheme", "tensor"}}, {"config.json", "activation_scheme 'tensor'"});
  expect({{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}, {"modules_to_not_convert", "lm_head"}},
         {"modules_to_not_convert", "list"});
  auto ct = [](const nlohmann::json& weights) {
    return nlohmann::json{{"quant_method", "compressed-tensors"},
                          {"format", "float-quantized"},
                          {"config_groups", {{"group_0", {{"targets", {"Linear"}}, {"weights", weights}}}}}};
  };
  expect(ct({{"num_bits", 4}, {"type", "float"}, {"strategy", "channel"}}), {"config_groups.group_0.weights", "8-bit"});
  expect(ct({{"num_bits", 8}, {"type", "float"}, {"strategy", "group"}}), {"strategy 'group'"});
  expect(ct({{"num_bits", 8}, {"type", "float"}, {"strategy", "channel"}, {"symmetric", false}}), {"asymmetric"});
  expect(ct({{"num_bits", 8}, {"type", "float"}, {"strategy", "block"}}), {"block_structure"});
}

// ---- checkpoints ----

// A one-layer Llama whose linears are FP8 in one of the layouts.
struct TinyFp8 {
  int64_t hidden = 32, vocab = 16, inter = 160;
  bool ct = false;          // compressed-tensors per-channel, else quant_method fp8 with 128 x 128 blocks
  bool per_tensor = false;  // quant_method fp8 without weight_block_size (AutoFP8), an input_scale beside
  bool bf16_scales = false;
  nlohmann::json not_convert = nlohmann::json::array();

  std::string scale_suffix() const { return ct || per_tensor ? ".weight_scale" : ".weight_scale_inv"; }

  nlohmann::json config() const {
    nlohmann::json c = {{"architectures", {"LlamaForCausalLM"}}, {"vocab_size", vocab}, {"hidden_size", hidden},
                        {"num_hidden_layers", 1}, {"num_attention_heads", 2}, {"num_key_value_heads", 2},
                        {"intermediate_size", inter}, {"max_position_embeddings", 64}};
    if (ct)
      c["quantization_config"] = {
          {"quant_method", "compressed-tensors"},
          {"format", "float-quantized"},
          {"config_groups",
           {{"group_0",
             {{"targets", {"Linear"}},
              {"weights", {{"num_bits", 8}, {"type", "float"}, {"strategy", "channel"}, {"symmetric", true}}}}}}},
          {"ignore", not_convert}};
    else if (per_tensor)
      c["quantization_config"] = {{"quant_method", "fp8"}, {"activation_scheme", "static"},
                                  {"modules_to_not_convert", not_convert}};
    else
      c["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {128, 128}},
                                  {"modules_to_not_convert", not_convert}};
    return c;
  }

  std::vector<StTensor> tensors() const {
    std::vector<StTensor> t;
    auto bf16 = [&](const std::string& n, std::vector<int64_t> shape) {
      int64_t numel = 1;
      for (auto d : shape) numel *= d;
      std::vector<uint8_t> b(size_t(numel) * 2);
      for (size_t i = 0; i < b.size(); i += 2) b[i + 1] = 0x3c;  // 0.0078125
      t.push_back({n, "BF16", shape, b});
    };
    auto lin = [&](const std::string& n, int64_t out, int64_t in) {
      const std::string m = n.substr(0, n.size() - 7);
      if (QuantConfig q = load_quant_config("/nonexistent", config(), "config.json"); !q.quantizes(m))
        return bf16(n, {out, in});
      t.push_back({n, "F8_E4M3", {out, in}, std::vector<uint8_t>(size_t(out * in), 0x30)});
      const std::vector<int64_t> shape = ct           ? std::vector<int64_t>{out, 1}
                                         : per_tensor ? std::vector<int64_t>{}  // a scalar
                                                      : std::vector<int64_t>{(out + 127) / 128, (in + 127) / 128};
      const size_t n_scales = per_tensor ? 1 : size_t(shape[0] * shape[1]);
      if (bf16_scales) {
        std::vector<uint8_t> b;
        for (size_t i = 0; i < n_scales; ++i) b.insert(b.end(), {0x00, 0x3f});  // 0.5
        t.push_back({m + scale_suffix(), "BF16", shape, b});
      } else {
        t.push_back({m + scale_suffix(), "F32", shape, test::f32_bytes(std::vector<float>(n_scales, 0.5f))});
      }
      if (per_tensor) t.push_back({m + ".input_scale", "F32", {}, test::f32_bytes({0.25f})});  // not read
    };
    bf16("model.embed_tokens.weight", {vocab, hidden});
    bf16("model.norm.weight", {hidden});
    bf16("lm_head.weight", {vocab, hidden});
    const std::string p = "model.layers.0.";
    bf16(p + "input_layernorm.weight", {hidden});
    bf16(p + "post_attention_layernorm.weight", {hidden});
    for (const char* n : {"q_proj", "k_proj", "v_proj", "o_proj"}) lin(p + "self_attn." + n + ".weight", hidden, hidden);
    lin(p + "mlp.gate_proj.weight", inter, hidden);
    lin(p + "mlp.up_proj.weight", inter, hidden);
    lin(p + "mlp.down_proj.weight", hidden, inter);
    return t;
  }
};

void write_model(const fs::path& dir, const nlohmann::json& cfg, const std::vector<StTensor>& ts) {
  std::ofstream(dir / "config.json") << cfg.dump();
  test::write_file(dir / "model.safetensors", test::safetensors_image(ts));
}

std::string load_error(const TinyFp8& m, const std::function<void(std::vector<StTensor>&)>& spoil = {}) {
  test::TempDir d;
  auto ts = m.tensors();
  if (spoil) spoil(ts);
  write_model(d.path(), m.config(), ts);
  return error_of([&] { load_model(d.path().string()); });
}

StTensor& find(std::vector<StTensor>& ts, const std::string& name) {
  for (auto& t : ts)
    if (t.name == name) return t;
  throw std::runtime_error("no tensor " + name);
}

TEST(Fp8Checkpoint, EveryLayoutLoadsWithItsScales) {
  for (int layout = 0; layout < 3; ++layout)  // 128 x 128 blocks, per channel, per tensor
    for (bool bf16 : {false, true}) {
      test::TempDir d;
      TinyFp8 m;
      m.ct = layout == 1;
      m.per_tensor = layout == 2;
      m.bf16_scales = bf16;
      m.not_convert = {"model.layers.0.self_attn.o_proj"};
      write_model(d.path(), m.config(), m.tensors());
      auto model = load_model(d.path().string());
      const LayerWeights& L = model->weights.layers[0];
      EXPECT_EQ(L.q.format, WeightFormat::FP8);
      EXPECT_EQ(L.o.format, WeightFormat::BF16);  // not converted
      EXPECT_EQ(L.mlp.down.fp8_bf16_scales, bf16);
      EXPECT_EQ(L.mlp.gate.fp8.rows, m.ct ? 1 : m.per_tensor ? m.inter : 128);
      std::vector<float> row(size_t(L.mlp.down.in));
      L.mlp.down.dequant_row(31, row.data());
      for (float v : row) ASSERT_EQ(v, 0.5f * 0.5f);  // code 0x30 is 0.5, times the scale 0.5
      const StorageStats s = storage_stats(*model);
      EXPECT_EQ(s.linears[size_t(WeightFormat::FP8)], 6u);
      EXPECT_EQ(s.linears[size_t(WeightFormat::BF16)], 3u);  // o_proj, embeddings, lm_head
    }
}

TEST(Fp8Checkpoint, BadInputIsNamedByTensor) {
  const std::string down = "model.layers.0.mlp.down_proj";
  TinyFp8 m;
  expect_parts(load_error(m, [&](auto& ts) { std::erase_if(ts, [&](auto& t) { return t.name == down + ".weight_scale_inv"; }); }),
               {"'" + down + ".weight'", "without its scales", down + ".weight_scale_inv"});
  expect_parts(load_error(m, [&](auto& ts) { std::erase_if(ts, [&](auto& t) { return t.name == down + ".weight"; }); }),
               {"missing tensor '" + down + ".weight'", "FP8", "config.json"});
  expect_parts(load_error(m, [&](auto& ts) {
                 auto& s = find(ts, down + ".weight_scale_inv");
                 s.shape = {1, 1};
                 s.bytes.resize(4);
               }),
               {"'" + down + ".weight_scale_inv'", "[1, 1]", "expected [1, 2]"});
  expect_parts(load_error(m, [&](auto& ts) { find(ts, down + ".weight_scale_inv").dtype = "I32"; }),
               {"'" + down + ".weight_scale_inv'", "F32 or BF16", "I32"});
  expect_parts(load_error(m, [&](auto& ts) { find(ts, down + ".weight").bytes[100] = 0x7f; }),
               {"'" + down + ".weight'", "[0, 100]", "NaN"});
  expect_parts(load_error(m, [&](auto& ts) {
                 auto& w = find(ts, down + ".weight");
                 w.dtype = "BF16";
                 w.shape = {32, 80};
               }),
               {"'" + down + ".weight'", "BF16", "says this module is FP8", "modules_to_not_convert"});
  expect_parts(load_error(m, [&](auto& ts) { find(ts, down + ".weight_scale_inv").bytes.assign(8, 0xff); }),
               {"'" + down + ".weight_scale_inv'", "not finite"});
  // A module that modules_to_not_convert names but that is stored quantized.
  TinyFp8 ex = m;
  const auto spoilt = ex.tensors();
  ex.not_convert = {down};
  test::TempDir d;
  write_model(d.path(), ex.config(), spoilt);
  expect_parts(error_of([&] { load_model(d.path().string()); }),
               {"'" + down + ".weight_scale_inv'", "stored quantized", "does not quantize it"});
  // compressed-tensors: per-channel scales of the wrong shape, named as weight_scale.
  TinyFp8 ct;
  ct.ct = true;
  expect_parts(load_error(ct, [&](auto& ts) { find(ts, down + ".weight_scale").shape = {1, 32}; }),
               {"'" + down + ".weight_scale'", "[1, 32]", "expected [32, 1]"});
  // Per tensor: one F32 or BF16 weight_scale, a scalar or [1] (an input_scale beside it is not read).
  TinyFp8 pt;
  pt.per_tensor = true;
  expect_parts(load_error(pt, [&](auto& ts) {
                 std::erase_if(ts, [&](auto& t) { return t.name == down + ".weight_scale"; });
               }),
               {"'" + down + ".weight'", "without its scales", down + ".weight_scale"});
  expect_parts(load_error(pt, [&](auto& ts) {
                 auto& s = find(ts, down + ".weight_scale");
                 s.shape = {2};
                 s.bytes = test::f32_bytes({0.5f, 0.5f});
               }),
               {"'" + down + ".weight_scale'", "[2]", "expected [1, 1]"});
  expect_parts(load_error(pt, [&](auto& ts) { find(ts, down + ".weight_scale").dtype = "I32"; }),
               {"'" + down + ".weight_scale'", "F32 or BF16", "I32"});
  expect_parts(load_error(pt, [&](auto& ts) { find(ts, down + ".weight_scale").bytes = test::f32_bytes({NAN}); }),
               {"'" + down + ".weight_scale'", "not finite"});
  expect_parts(load_error(pt, [&](auto& ts) {
                 auto& s = find(ts, down + ".weight_scale");
                 s.name = down + ".weight_scale_inv";
               }),
               {"'" + down + ".weight'", "without its scales", down + ".weight_scale'"});
  test::TempDir d1;  // a scale of shape [1] reads as the scalar does
  auto ts = pt.tensors();
  find(ts, down + ".weight_scale").shape = {1};
  write_model(d1.path(), pt.config(), ts);
  EXPECT_EQ(load_model(d1.path().string())->weights.layers[0].mlp.down.format, WeightFormat::FP8);
}

// ---- the fixtures ----

// Rows of a split FP8 matrix: a view where the rank's first row starts a block of rows (or the
// matrix has one), else F32 copies; column slices on block boundaries stay FP8. All exact.
TEST(Fp8Checkpoint, SlicesHoldTheFullModelsValues) {
  auto full = load_model(test::fixture_dir("deepseekv3-fp8"));
  const GatedFfn& f = full->weights.layers[0].mlp;  // intermediate 192: a full and a partial row block
  ASSERT_EQ(f.gate.format, WeightFormat::FP8);
  ASSERT_EQ(f.gate.out, 192);
  for (int tp : {2, 4}) {
    for (int r = 0; r < tp; ++r) {
      auto part = shard_model(*full, Layout{tp, 1}, r);
      const GatedFfn& g = part->weights.layers[0].mlp;
      const int64_t r0 = r * g.gate.out;
      EXPECT_EQ(g.gate.format, r0 % 128 == 0 ? WeightFormat::FP8 : WeightFormat::F32) << tp << " " << r;
      std::vector<float> a(size_t(f.down.in)), b(a.size());
      for (int64_t row = 0; row < g.gate.out; ++row) {
        f.gate.dequant_row(r0 + row, a.data());
        g.gate.dequant_row(row, b.data());
        for (int64_t i = 0; i < g.gate.in; ++i) ASSERT_EQ(b[size_t(i)], a[size_t(i)]) << tp << " " << r << " " << row;
      }
      for (int64_t row = 0; row < g.down.out; ++row) {
        f.down.dequant_row(row, a.data());
        g.down.dequant_row(row, b.data());
        for (int64_t i = 0; i < g.down.in; ++i) ASSERT_EQ(b[size_t(i)], a[size_t(r0 + i)]);
      }
    }
  }
}

TEST(Fp8Checkpoint, InspectReportsTheFormat) {
  auto r = test::run_kestrel("inspect --model " + test::fixture_dir("glm4moe-fp8"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("FP8 E4M3 (blocks 128 x 128, from config.json), not converted: lm_head model.layers.0.mlp"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("in 33 matrices"), std::string::npos) << r.output;  // every linear but layer 0's MLP and o_proj
  r = test::run_kestrel("inspect --model " + test::fixture_dir("qwen3-fp8-ct"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("compressed-tensors FP8 E4M3 (per channel"), std::string::npos) << r.output;
  r = test::run_kestrel("inspect --model " + test::fixture_dir("llama-fp8-tensor"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("FP8 E4M3 (per tensor, from config.json), not converted: lm_head"), std::string::npos)
      << r.output;
}

// ---- kestrel quantize --format fp8 ----

const std::string kQuantFixtures = std::string(KESTREL_FIXTURES) + "/quant";

// Byte for byte the Python quantizer's codes and scales (partial blocks, outliers with
// subnormal codes, a block of zeros).
TEST(Fp8Quantize, AgreesWithThePythonQuantizer) {
  const SafetensorsFile f(kQuantFixtures + "/python_fp8.safetensors");
  ThreadPool pool(2);
  int checked = 0;
  for (const auto& [name, t] : f.tensors()) {
    if (!name.ends_with(".input")) continue;
    const std::string base = name.substr(0, name.size() - 6);
    SCOPED_TRACE(base);
    Linear l;
    l.name = base;
    l.out = t.shape[0];
    l.in = t.shape[1];
    l.format = WeightFormat::BF16;
    l.data = t.data;
    const Fp8Quantized q = fp8_quantize_linear(l, pool);
    const TensorView& w = f.tensors().at(base + ".weight");
    const TensorView& s = f.tensors().at(base + ".weight_scale_inv");
    ASSERT_EQ(q.codes.size(), w.nbytes);
    ASSERT_EQ(q.scales.size() * 4, s.nbytes);
    EXPECT_EQ(std::memcmp(q.codes.data(), w.data, w.nbytes), 0);
    EXPECT_EQ(std::memcmp(q.scales.data(), s.data, s.nbytes), 0);
    ++checked;
  }
  EXPECT_EQ(checked, 3);
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

class Fp8QuantizedFixture : public ::testing::TestWithParam<std::string> {};

// The checkpoint `kestrel quantize --format fp8` writes holds the tensors the reference script read
// back (every one, byte for byte), and its logits are transformers' on its dequantized weights.
TEST_P(Fp8QuantizedFixture, MatchesTransformersOnItsDequantizedWeights) {
  const nlohmann::json ref = read_json_file(kQuantFixtures + "/" + GetParam() + "-fp8.json");
  test::TempDir tmp;
  const fs::path out = tmp.path() / "q";
  auto r = test::run_kestrel("quantize --format fp8 --model " + test::fixture_dir(GetParam()) + " --out " +
                             out.string() + " --shard-size " + ref.at("shard_size").get<std::string>());
  ASSERT_EQ(r.status, 0) << r.output;
  auto m = load_model(out.string());
  const nlohmann::json qc = read_json_file((out / "config.json").string()).at("quantization_config");
  EXPECT_EQ(qc.at("quant_method"), "fp8");
  EXPECT_EQ(qc.at("weight_block_size"), nlohmann::json({128, 128}));
  const auto& want = ref.at("tensor_fnv1a64");
  size_t n = 0;
  for (const auto& [name, view] : m->checkpoint->tensors()) {
    ASSERT_TRUE(want.contains(name)) << name;
    EXPECT_EQ(fnv1a64(view->data, view->nbytes), want.at(name).get<std::string>()) << name;
    ++n;
  }
  EXPECT_EQ(n, want.size());

  const std::vector<int32_t> tokens = ref.at("tokens").get<std::vector<int32_t>>();
  const int64_t V = ref.at("shape").at(1).get<int64_t>(), T = int64_t(tokens.size());
  std::vector<float> logits(size_t(T * V));
  std::ifstream(kQuantFixtures + "/" + ref.at("logits").get<std::string>(), std::ios::binary)
      .read(reinterpret_cast<char*>(logits.data()), std::streamsize(logits.size() * 4));
  ThreadPool pool(2);
  cpu::Forward fwd(*m, pool);
  std::vector<float> got(size_t(T * V));
  KvCache cache = fwd.make_cache(T);
  fwd.run(tokens, cache, got.data());
  for (int64_t t = 0; t < T; ++t) EXPECT_LE(test::rel_l2(&got[size_t(t * V)], &logits[size_t(t * V)], V), 1e-3) << t;
}

INSTANTIATE_TEST_SUITE_P(Families, Fp8QuantizedFixture,
                         ::testing::Values("deepseekv3-bf16", "glm4moe-bf16", "qwen3moe-bf16"), test::fixture_test_name);

}  // namespace
}  // namespace kestrel
