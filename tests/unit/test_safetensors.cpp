#include <gtest/gtest.h>

#include "common/error.h"
#include "formats/checkpoint.h"
#include "formats/safetensors.h"
#include "st_writer.h"

namespace kestrel {
namespace {

using test::StTensor;

// Expects parsing to fail with a message that contains every one of `parts`.
void expect_error(const std::vector<uint8_t>& img, std::initializer_list<std::string> parts) {
  try {
    SafetensorsIndex idx(img, "shard.safetensors");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "message: " << msg << "\nmissing: " << p;
  }
}

TEST(Safetensors, ParsesTensorsAndMetadata) {
  auto img = test::safetensors_image({{"a", "F32", {2, 2}, test::f32_bytes({1, 2, 3, 4})},
                                      {"b", "U8", {3}, {7, 8, 9}},
                                      {"s", "F32", {}, test::f32_bytes({0.5f})}},
                                     {{"__metadata__", {{"format", "pt"}}}});
  SafetensorsIndex idx(img, "x.safetensors");
  ASSERT_EQ(idx.tensors().size(), 3u);
  const TensorView& a = idx.tensors().at("a");
  EXPECT_EQ(a.dtype, DType::F32);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 2}));
  float v;
  std::memcpy(&v, a.data + 12, 4);
  EXPECT_EQ(v, 4.0f);
  EXPECT_EQ(idx.tensors().at("b").data[2], 9);
  EXPECT_EQ(idx.tensors().at("s").numel(), 1);
  EXPECT_EQ(idx.metadata().at("format"), "pt");
}

TEST(Safetensors, AllDtypesKnown) {
  for (const char* d : {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "I64", "I32", "I16", "I8", "U8", "BOOL"}) {
    auto t = parse_dtype(d);
    ASSERT_TRUE(t) << d;
    auto img = test::safetensors_image({{"t", d, {3}, std::vector<uint8_t>(3 * dtype_size(*t), 0)}});
    SafetensorsIndex idx(img, "x");
    EXPECT_EQ(idx.tensors().at("t").nbytes, 3 * dtype_size(*t));
  }
}

TEST(Safetensors, Truncated) {
  expect_error({1, 2, 3}, {"shard.safetensors", "truncated"});
  auto img = test::safetensors_image({{"w", "F32", {4}, test::f32_bytes({1, 2, 3, 4})}});
  img.resize(img.size() - 3);
  expect_error(img, {"shard.safetensors", "'w'", "past the end"});
  auto img2 = test::safetensors_image({{"w", "F32", {4}, test::f32_bytes({1, 2, 3, 4})}});
  img2.resize(20);
  expect_error(img2, {"shard.safetensors", "truncated"});
}

TEST(Safetensors, HeaderNotJson) { expect_error(test::raw_image("{not json", 0), {"shard.safetensors", "not valid JSON"}); }

TEST(Safetensors, HeaderNotObject) { expect_error(test::raw_image("[1,2]", 0), {"not a JSON object"}); }

TEST(Safetensors, HeaderTooLarge) {
  std::vector<uint8_t> img(16, 0);
  img[5] = 0x10;  // 2^44 bytes
  expect_error(img, {"shard.safetensors", "larger than the limit"});
}

TEST(Safetensors, UnknownDtype) {
  expect_error(test::raw_image(R"({"w":{"dtype":"Q4_K","shape":[2],"data_offsets":[0,2]}})", 2),
               {"'w'", "unsupported dtype 'Q4_K'"});
}

TEST(Safetensors, ShapeDisagreesWithBytes) {
  expect_error(test::raw_image(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
               {"'w'", "needs 12 bytes", "span 8"});
}

TEST(Safetensors, ReversedAndNegativeOffsets) {
  expect_error(test::raw_image(R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[8,4]}})", 8), {"'w'", "reversed"});
  expect_error(test::raw_image(R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[-4,0]}})", 8), {"'w'", "non-negative"});
  expect_error(test::raw_image(R"({"w":{"dtype":"U8","shape":[-4],"data_offsets":[0,4]}})", 8), {"'w'", "non-negative"});
}

TEST(Safetensors, Overlap) {
  expect_error(test::raw_image(R"({"a":{"dtype":"U8","shape":[6],"data_offsets":[0,6]},)"
                               R"("b":{"dtype":"U8","shape":[6],"data_offsets":[4,10]}})",
                               16),
               {"shard.safetensors", "'a'", "'b'", "overlap"});
}

TEST(Safetensors, HugeShapeRejected) {
  expect_error(test::raw_image(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})", 4),
               {"'w'", "too large"});
}

TEST(Safetensors, MissingFields) {
  expect_error(test::raw_image(R"({"w":{"shape":[1],"data_offsets":[0,1]}})", 1), {"'w'", "dtype"});
  expect_error(test::raw_image(R"({"w":{"dtype":"U8","data_offsets":[0,1]}})", 1), {"'w'", "shape"});
  expect_error(test::raw_image(R"({"w":{"dtype":"U8","shape":[1]}})", 1), {"'w'", "data_offsets"});
  expect_error(test::raw_image(R"({"w":7})", 1), {"'w'", "not an object"});
}

TEST(Checkpoint, ShardsWithIndex) {
  test::TempDir dir;
  test::write_file(dir.path() / "a.safetensors", test::safetensors_image({{"x", "U8", {2}, {1, 2}}}));
  test::write_file(dir.path() / "b.safetensors", test::safetensors_image({{"y", "U8", {1}, {3}}}));
  std::ofstream(dir.path() / "model.safetensors.index.json")
      << R"({"metadata":{},"weight_map":{"x":"a.safetensors","y":"b.safetensors"}})";
  Checkpoint ck(dir.path().string());
  EXPECT_EQ(ck.file_count(), 2u);
  EXPECT_EQ(ck.get("y").data[0], 3);
  try {
    ck.get("z");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing tensor 'z'"), std::string::npos);
  }
}

TEST(Checkpoint, IndexNamesMissingTensor) {
  test::TempDir dir;
  test::write_file(dir.path() / "a.safetensors", test::safetensors_image({{"x", "U8", {2}, {1, 2}}}));
  std::ofstream(dir.path() / "model.safetensors.index.json") << R"({"weight_map":{"x":"a.safetensors","q":"a.safetensors"}})";
  try {
    Checkpoint ck(dir.path().string());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'q' listed in the index is missing"), std::string::npos) << e.what();
  }
}

TEST(Checkpoint, IndexRejectsPathsOutsideFolder) {
  test::TempDir dir;
  std::ofstream(dir.path() / "model.safetensors.index.json") << R"({"weight_map":{"x":"../etc/passwd"}})";
  EXPECT_THROW(Checkpoint ck(dir.path().string()), Error);
}

TEST(Checkpoint, DuplicateTensorAcrossShards) {
  test::TempDir dir;
  test::write_file(dir.path() / "a.safetensors", test::safetensors_image({{"x", "U8", {1}, {1}}}));
  test::write_file(dir.path() / "b.safetensors", test::safetensors_image({{"x", "U8", {1}, {2}}}));
  try {
    Checkpoint ck(dir.path().string());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("stored twice"), std::string::npos) << e.what();
  }
}

TEST(Checkpoint, EmptyFolder) {
  test::TempDir dir;
  EXPECT_THROW(Checkpoint ck(dir.path().string()), Error);
}

}  // namespace
}  // namespace kestrel
