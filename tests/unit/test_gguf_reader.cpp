// The GGUF reader: every metadata type round-trips, and every kind of broken file gives one clear
// error naming the file and the key or tensor, never a crash or a read outside the input.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "common/error.h"
#include "formats/gguf.h"
#include "formats/gguf_vocab.h"
#include "st_writer.h"
#include "test_gguf_image.h"

namespace kestrel {
namespace {

using test::GgufImage;

std::vector<uint8_t> q8_block(float d, int8_t q) {
  std::vector<uint8_t> b(34, uint8_t(q));
  const uint16_t h = d == 1.0f ? 0x3c00 : 0x3800;  // 1.0 or 0.5
  b[0] = uint8_t(h);
  b[1] = uint8_t(h >> 8);
  return b;
}

GgufImage small_image() {
  GgufImage g;
  g.str("general.architecture", "llama");
  g.u32("llama.block_count", 2);
  g.tensor("a", {4, 2}, 0, test::f32_bytes({1, 2, 3, 4, 5, 6, 7, 8}));
  g.tensor("b", {32}, 8, q8_block(0.5f, 3));
  return g;
}

// The message of the kestrel::Error that parsing `img` raises ("" if none).
std::string parse_error(const std::vector<uint8_t>& img) {
  try {
    GgufIndex g(img, "m.gguf");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_ERROR(img, ...)                                                        \
  do {                                                                                \
    const std::string msg_ = parse_error(img);                                        \
    EXPECT_FALSE(msg_.empty()) << "no error";                                         \
    EXPECT_EQ(msg_.rfind("m.gguf: ", 0), 0u) << msg_;                                 \
    for (const char* s_ : {__VA_ARGS__}) EXPECT_NE(msg_.find(s_), std::string::npos) << s_ << " | " << msg_; \
  } while (0)

TEST(GgufReader, RoundTripsEveryMetadataType) {
  GgufImage g;
  g.u32("u32", 7);
  g.i32("i32", -5);
  g.u64("u64", 1ull << 40);
  g.f32("f32", 0.25f);
  g.boolean("bool", true);
  g.str("str", "héllo");
  g.str_array("strs", {"a", "", "ccc"});
  g.i32_array("ints", {1, -2, 3});
  g.raw("u8", 0, {200});
  g.raw("i8", 1, {0xfe});
  g.raw("u16", 2, {0x34, 0x12});
  g.raw("i16", 3, {0xff, 0xff});
  g.raw("i64", 11, {0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff});
  g.raw("f64", 12, {0, 0, 0, 0, 0, 0, 0xf8, 0x3f});  // 1.5
  // An array of two arrays of u8: [[1, 2], [3]].
  g.raw("nested", 9, {9, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0,  // element type ARRAY, count 2
                      0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 3});
  g.u32("general.alignment", 64);
  g.alignment = 64;
  g.tensor("t0", {4, 2}, 0, test::f32_bytes({1, 2, 3, 4, 5, 6, 7, 8}));
  g.tensor("t1", {64, 1, 1}, 8, [] {
    auto b = q8_block(1.0f, -1);
    auto c = q8_block(0.5f, 2);
    b.insert(b.end(), c.begin(), c.end());
    return b;
  }());
  const std::vector<uint8_t> img = g.build();
  GgufIndex x(img, "m.gguf");
  EXPECT_EQ(x.version(), 3u);
  EXPECT_EQ(x.alignment(), 64u);
  EXPECT_EQ(x.data_offset() % 64, 0u);
  EXPECT_EQ(x.get_int("u32"), 7);
  EXPECT_EQ(x.get_int("i32"), -5);
  EXPECT_EQ(x.get_int("u64"), int64_t(1) << 40);
  EXPECT_EQ(x.get_float("f32"), 0.25);
  EXPECT_EQ(x.get_float("u32"), 7.0);  // integers are accepted where a float is wanted
  EXPECT_TRUE(x.get_bool("bool", false));
  EXPECT_EQ(x.get_str("str", ""), "héllo");
  EXPECT_EQ(x.get_str_array("strs"), (std::vector<std::string>{"a", "", "ccc"}));
  EXPECT_EQ(x.get_int_array("ints"), (std::vector<int64_t>{1, -2, 3}));
  EXPECT_EQ(x.get_int_array("u32"), (std::vector<int64_t>{7}));
  EXPECT_EQ(x.get_int("u8"), 200);
  EXPECT_EQ(x.get_int("i8"), -2);
  EXPECT_EQ(x.get_int("u16"), 0x1234);
  EXPECT_EQ(x.get_int("i16"), -1);
  EXPECT_EQ(x.get_int("i64"), -2);
  EXPECT_EQ(x.get_float("f64"), 1.5);
  const GgufValue* n = x.find("nested");
  ASSERT_TRUE(n);
  ASSERT_EQ(n->arrays.size(), 2u);
  EXPECT_EQ(n->arrays[0].count, 2u);
  EXPECT_EQ(n->arrays[0].raw[1], 2);
  EXPECT_EQ(n->arrays[1].raw[0], 3);
  EXPECT_EQ(x.get_int("missing", 42), 42);
  EXPECT_TRUE(x.get_str_array("missing").empty());

  ASSERT_EQ(x.tensors().size(), 2u);
  const GgufTensor& t0 = x.tensor("t0");
  EXPECT_EQ(t0.dims, (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(t0.rows(), 2);
  EXPECT_EQ(t0.nbytes, 32u);
  EXPECT_EQ(t0.data, img.data() + x.data_offset());
  float v;
  std::memcpy(&v, t0.data + 28, 4);
  EXPECT_EQ(v, 8.0f);
  const GgufTensor& t1 = x.tensor("t1");
  EXPECT_EQ(t1.type, GgmlType::Q8_0);
  EXPECT_EQ(t1.nbytes, 68u);
  EXPECT_EQ(t1.offset, 64u);
  EXPECT_EQ(t1.dims_str(), "[64, 1, 1]");
}

TEST(GgufReader, TypedAccessErrorsNameTheKey) {
  const auto img = small_image().build();
  GgufIndex x(img, "m.gguf");
  auto msg = [&](auto fn) {
    try {
      fn();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(msg([&] { x.get_int("general.architecture"); }),
            "m.gguf: metadata 'general.architecture': must be an integer, found string");
  EXPECT_EQ(msg([&] { x.get_str("llama.block_count", ""); }),
            "m.gguf: metadata 'llama.block_count': must be a string, found u32");
  EXPECT_EQ(msg([&] { x.get_int("llama.head_count"); }), "m.gguf: missing metadata 'llama.head_count'");
  EXPECT_EQ(msg([&] { x.tensor("c"); }), "m.gguf: missing tensor 'c'");
  EXPECT_NE(msg([&] { x.get_str_array("llama.block_count"); }).find("array of strings"), std::string::npos);
  EXPECT_NE(msg([&] { x.get_bool("llama.block_count", false); }).find("must be a bool"), std::string::npos);
}

TEST(GgufReader, BadMagicAndVersion) {
  auto img = small_image().build();
  auto bad = img;
  bad[0] = 'X';
  EXPECT_ERROR(bad, "not a GGUF file");
  EXPECT_ERROR(std::vector<uint8_t>{}, "not a GGUF file");
  for (uint32_t v : {0u, 1u, 4u, 0x01000000u}) {
    GgufImage g = small_image();
    g.version = v;
    EXPECT_ERROR(g.build(), "version", "not supported");
  }
  GgufImage be = small_image();
  be.version = 0x03000000u;
  EXPECT_ERROR(be.build(), "big-endian");
}

TEST(GgufReader, EveryTruncationIsAnError) {
  const auto img = small_image().build();
  ASSERT_EQ(parse_error(img), "");
  for (size_t n = 0; n < img.size(); ++n) {
    std::vector<uint8_t> cut(img.begin(), img.begin() + long(n));
    const std::string msg = parse_error(cut);
    EXPECT_FALSE(msg.empty()) << "prefix of " << n << " bytes parsed";
  }
  // Cut inside the data section: the message names the tensor.
  std::vector<uint8_t> cut(img.begin(), img.end() - 1);
  EXPECT_ERROR(cut, "tensor 'b'", "Q8_0", "truncated");
  // Cut inside the header (the second key) and inside the header counts.
  std::vector<uint8_t> head(img.begin(), img.begin() + 84);
  EXPECT_ERROR(head, "truncated GGUF file", "metadata key #1");
  std::vector<uint8_t> counts(img.begin(), img.begin() + 20);
  EXPECT_ERROR(counts, "truncated GGUF file", "metadata count");
}

TEST(GgufReader, AbsurdCountsAndLengths) {
  GgufImage g = small_image();
  g.kv_count = 1ull << 60;
  EXPECT_ERROR(g.build(), "metadata entries");
  g = small_image();
  g.tensor_count = 1ull << 60;
  EXPECT_ERROR(g.build(), "tensors");
  // A string value whose length runs past the end.
  g = small_image();
  g.raw("k", 8, {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0});
  EXPECT_ERROR(g.build(), "metadata 'k'", "runs past the end");
  // A key longer than the limit.
  g = GgufImage();
  g.str(std::string(70000, 'k'), "v");
  EXPECT_ERROR(g.build(), "metadata key #0", "exceeds the limit");
  // An array claiming 2^61 u32 elements.
  g = small_image();
  g.raw("arr", 9, {4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x20});
  EXPECT_ERROR(g.build(), "metadata 'arr'", "cannot fit");
  // Arrays nested beyond the limit.
  std::vector<uint8_t> deep;
  for (int i = 0; i < 20; ++i) deep.insert(deep.end(), {9, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0});
  deep.resize(deep.size() + 64, 0);
  g = GgufImage();
  g.raw("deep", 9, deep);
  EXPECT_ERROR(g.build(), "metadata 'deep", "nested deeper");
  // Unknown value types, for a value and for array elements.
  g = GgufImage();
  g.raw("odd", 13, {0, 0, 0, 0});
  EXPECT_ERROR(g.build(), "metadata 'odd'", "unknown value type 13");
  g = GgufImage();
  g.raw("odd", 9, {77, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0});
  EXPECT_ERROR(g.build(), "metadata 'odd'", "unknown array element type 77");
  g = small_image();
  g.u32("llama.block_count", 3);
  EXPECT_ERROR(g.build(), "metadata 'llama.block_count'", "twice");
}

TEST(GgufReader, BadTensorInfos) {
  GgufImage g = small_image();
  g.tensor("c", {32}, 99, std::vector<uint8_t>(32));
  EXPECT_ERROR(g.build(), "tensor 'c'", "unknown ggml type id 99");

  g = small_image();
  g.tensor({"c", {32}, 0, std::vector<uint8_t>(128), 1ull << 40, false});
  EXPECT_ERROR(g.build(), "tensor 'c'", "F32 [32]", "needs 128 bytes", "truncated");

  g = small_image();
  g.tensor({"c", {4}, 0, std::vector<uint8_t>(16), 100, true});
  EXPECT_ERROR(g.build(), "tensor 'c'", "data offset 100 is not a multiple of the alignment 32");

  g = small_image();
  g.tensor({"c", {8}, 0, std::vector<uint8_t>(32), 0, true});  // on top of 'a'
  EXPECT_ERROR(g.build(), "overlap", "'a'", "'c'");

  g = small_image();
  g.tensor("c", {100}, 12, std::vector<uint8_t>(144));
  EXPECT_ERROR(g.build(), "tensor 'c'", "rows of 100 values are not whole Q4_K blocks of 256");

  g = small_image();
  g.tensor("c", {1, 1, 1, 1, 1}, 0, std::vector<uint8_t>(4));
  EXPECT_ERROR(g.build(), "tensor 'c'", "5 dimensions");

  g = small_image();
  g.tensor("c", {1ull << 39, 1ull << 39}, 0, {});
  EXPECT_ERROR(g.build(), "tensor 'c'", "implausibly large");

  g = small_image();
  g.tensor("a", {1}, 0, std::vector<uint8_t>(4));
  EXPECT_ERROR(g.build(), "tensor 'a'", "twice");

  g = small_image();
  g.u32("general.alignment", 48);
  EXPECT_ERROR(g.build(), "general.alignment", "power of two");
  g = small_image();
  g.u64("general.alignment", 64);
  EXPECT_ERROR(g.build(), "general.alignment", "must be u32");
}

TEST(GgufReader, FileErrorsNameThePath) {
  test::TempDir tmp;
  const auto p = (tmp.path() / "x.gguf").string();
  auto img = small_image().build();
  img.resize(img.size() - 10);
  test::write_file(p, img);
  try {
    GgufFile f(p);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(p + ": tensor 'b'"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(is_gguf_file((tmp.path() / "missing.gguf").string()));
  test::write_file(p, small_image().build());
  EXPECT_TRUE(is_gguf_file(p));
  EXPECT_EQ(GgufFile(p).index().tensors().size(), 2u);
}

TEST(GgufVocab, ReadsAndChecksTheTokenizerMetadata) {
  GgufImage g;
  g.str("tokenizer.ggml.model", "gpt2");
  g.str("tokenizer.ggml.pre", "smollm");
  g.str_array("tokenizer.ggml.tokens", {"<s>", "</s>", "a", "b", "ab"});
  g.i32_array("tokenizer.ggml.token_type", {3, 3, 1, 1, 1});
  g.str_array("tokenizer.ggml.merges", {"a b"});
  g.u32("tokenizer.ggml.bos_token_id", 0);
  g.u32("tokenizer.ggml.eos_token_id", 1);
  g.boolean("tokenizer.ggml.add_bos_token", false);
  g.str("tokenizer.chat_template", "{{ x }}");
  g.str("tokenizer.chat_template.tool_use", "{{ y }}");
  GgufVocab v = read_gguf_vocab(GgufIndex(g.build(), "m.gguf"));
  EXPECT_EQ(v.model, "gpt2");
  EXPECT_EQ(v.pre, "smollm");
  EXPECT_EQ(v.tokens.size(), 5u);
  EXPECT_EQ(v.tokens[4], "ab");
  EXPECT_EQ(v.token_types[0], 3);
  EXPECT_EQ(v.merges, std::vector<std::string>{"a b"});
  EXPECT_EQ(v.bos, 0);
  EXPECT_EQ(v.eos, 1);
  EXPECT_EQ(v.eot, -1);
  EXPECT_TRUE(v.has_add_bos);
  EXPECT_FALSE(v.add_bos);
  EXPECT_EQ(v.chat_template, "{{ x }}");
  EXPECT_EQ(v.named_templates.at("tool_use"), "{{ y }}");

  GgufImage h;
  h.str_array("tokenizer.ggml.tokens", {"a", "b"});
  h.i32_array("tokenizer.ggml.token_type", {1});
  h.u32("tokenizer.ggml.eos_token_id", 7);
  try {
    read_gguf_vocab(GgufIndex(h.build(), "m.gguf"));
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "m.gguf: metadata 'tokenizer.ggml.token_type': 1 entries for 2 tokens");
  }
}

}  // namespace
}  // namespace kestrel
