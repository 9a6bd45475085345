// The roofline against hand-computed cases. Shapes: the qwen3moe-bf16 fixture (3 layers, layer 1
// dense, hidden 64, 4 query heads and 2 KV heads of 16, dense width 128, 8 experts top-2 of width
// 32, vocabulary 256, everything BF16) and GLM-5's published shapes (configs/glm-5-nvfp4.json).
#include <gtest/gtest.h>

#include <cmath>

#include "fixture.h"
#include "formats/json_file.h"
#include "plan/decode_cost.h"
#include "plan/roofline.h"
#include "run_cli.h"

namespace kestrel {
namespace {

StepShapes fixture_shapes() {
  const std::string path = test::fixture_dir("qwen3moe-bf16") + "/config.json";
  return step_shapes(read_json_file(path), path);
}

double part_bytes(const Roofline& r, Part p) {
  for (const RooflinePart& x : r.parts)
    if (x.part == p) return x.bytes;
  return 0;
}

const GpuSpec& h200() { return find_gpu("h200"); }

TEST(Roofline, OneGpuByHand) {
  const Roofline r = roofline(fixture_shapes(), Layout{}, 1, 10, 2.0, 1000.0, h200());
  // Attention per layer: q 64x64 + k 32x64 + v 32x64 + o 64x64 = 12288 weights, 2 bytes, 3 layers.
  EXPECT_EQ(part_bytes(r, Part::Attention), 12288.0 * 2 * 3);
  // The one dense layer: gate, up, down of 128x64.
  EXPECT_EQ(part_bytes(r, Part::DenseFfn), 3 * 128.0 * 64 * 2);
  // Router of the 2 MoE layers: 8x64.
  EXPECT_EQ(part_bytes(r, Part::Router), 2 * 8.0 * 64 * 2);
  // One expert: 3 x 32x64 x 2 bytes = 12288; a token picks 2 of 8 -> 8 * (1 - 6/8) = 2 per layer.
  EXPECT_DOUBLE_EQ(r.expected_experts, 2.0);
  EXPECT_DOUBLE_EQ(part_bytes(r, Part::RoutedExperts), 2 * 2.0 * 12288);
  EXPECT_EQ(part_bytes(r, Part::Embedding), 64.0 * 2);
  EXPECT_EQ(part_bytes(r, Part::LmHead), 256.0 * 64 * 2);
  // KV: 10 positions x 3 layers x (k and v: 2 heads x 16) x 2 bytes.
  EXPECT_EQ(r.kv_bytes, 10.0 * 3 * 2 * 2 * 16 * 2);
  const double total = 73728 + 49152 + 2048 + 49152 + 128 + 32768 + 3840;
  EXPECT_DOUBLE_EQ(r.total_bytes(), total);
  EXPECT_DOUBLE_EQ(r.memory_ms, total / 1e9);  // 1000 GB/s = 1e9 bytes per ms
  EXPECT_EQ(r.allreduces, 0);
  EXPECT_DOUBLE_EQ(r.floor_ms, r.memory_ms);
  // Held: every expert of both MoE layers, the whole embedding table.
  EXPECT_DOUBLE_EQ(r.resident_bytes, 73728 + 49152 + 2048 + 2 * 8 * 12288.0 + 32768 + 32768);
}

TEST(Roofline, BatchSelectsMoreExperts) {
  const Roofline r = roofline(fixture_shapes(), Layout{}, 3, 10, 2.0, 1000.0, h200());
  // 8 * (1 - (6/8)^3) = 4.625 distinct experts per layer.
  EXPECT_DOUBLE_EQ(r.expected_experts, 4.625);
  EXPECT_DOUBLE_EQ(part_bytes(r, Part::RoutedExperts), 2 * 4.625 * 12288);
  EXPECT_EQ(part_bytes(r, Part::Embedding), 3 * 64.0 * 2);
  EXPECT_EQ(r.kv_bytes, 3 * 3840.0);
}

TEST(Roofline, TensorAndExpertParallel) {
  const Roofline tp2 = roofline(fixture_shapes(), Layout{2, 1}, 1, 10, 2.0, 1000.0, h200());
  EXPECT_EQ(part_bytes(tp2, Part::Attention), 73728.0 / 2);  // q, o by rows/columns; k, v one head each
  EXPECT_EQ(part_bytes(tp2, Part::DenseFfn), 49152.0 / 2);
  EXPECT_EQ(part_bytes(tp2, Part::Router), 2048.0);           // replicated
  EXPECT_DOUBLE_EQ(part_bytes(tp2, Part::RoutedExperts), 49152.0 / 2);
  EXPECT_EQ(part_bytes(tp2, Part::LmHead), 32768.0 / 2);
  EXPECT_EQ(tp2.kv_bytes, 3840.0 / 2);
  // 2 all-reduces per layer + 1 for the sampled token, each 64 BF16 values: latency 5 us +
  // 128 bytes x 2 x (2-1)/2 over 450 GB/s.
  EXPECT_EQ(tp2.allreduces, 7);
  EXPECT_EQ(tp2.allreduce_bytes, 128.0);
  EXPECT_NEAR(tp2.comm_ms, 7 * (5.0 + 128.0 / 450e3) / 1e3, 1e-12);
  EXPECT_NEAR(tp2.floor_ms, tp2.memory_ms + tp2.comm_ms, 1e-15);

  // Whole experts on each of 2 GPUs: 4 experts per GPU, 4 * (1 - 6/8) = 1 touched per layer.
  const Roofline ep2 = roofline(fixture_shapes(), Layout{2, 2}, 1, 10, 2.0, 1000.0, h200());
  EXPECT_DOUBLE_EQ(ep2.expected_experts, 1.0);
  EXPECT_DOUBLE_EQ(part_bytes(ep2, Part::RoutedExperts), 2 * 1.0 * 12288);

  // 4 GPUs, 2 KV heads: k and v split only 2 ways (replicated in pairs), the cache too.
  const Roofline tp4 = roofline(fixture_shapes(), Layout{4, 1}, 1, 10, 2.0, 1000.0, h200());
  EXPECT_EQ(part_bytes(tp4, Part::Attention), 3 * (4096.0 / 4 + 2048.0 / 2 + 2048.0 / 2 + 4096.0 / 4) * 2);
  EXPECT_EQ(tp4.kv_bytes, 3840.0 / 2);
  EXPECT_THROW(roofline(fixture_shapes(), Layout{4, 2}, 1, 10, 2.0, 1000.0, h200()), Error);
  EXPECT_THROW(roofline(fixture_shapes(), Layout{1, 1}, 0, 10, 2.0, 1000.0, h200()), Error);
}

TEST(Roofline, Glm5MlaAndSparseAttention) {
  const std::string path = std::string(KESTREL_FIXTURES) + "/../../configs/glm-5-nvfp4.json";
  const StepShapes s = step_shapes(read_json_file(path), path);
  EXPECT_TRUE(s.mla);
  EXPECT_EQ(s.layers, 78);
  EXPECT_EQ(s.moe_layers, 75);
  const Roofline r = roofline(s, Layout{8, 1}, 1, 4096, 2.0, 1792.0, find_gpu("rtx-pro-6000"));
  // Attention stays BF16 (excluded from NVFP4). Replicated on every GPU: q_a 2048x6144, kv_a
  // (512+64)x6144, indexer wq_b (32*128)x2048, wk 128x6144, weights_proj 32x6144. Split 8 ways:
  // q_b (64*(192+64))x2048, kv_b (64*(192+256))x512, o 6144x(64*256).
  const double replicated = 2048.0 * 6144 + 576.0 * 6144 + 4096.0 * 2048 + 128.0 * 6144 + 32.0 * 6144;
  const double split = 16384.0 * 2048 + 28672.0 * 512 + 6144.0 * 16384;
  EXPECT_NEAR(part_bytes(r, Part::Attention), 78 * (replicated + split / 8) * 2, 1.0);
  // Experts NVFP4 (0.5625 bytes/weight): 3 x 2048x6144 per expert, 8 of 256 per layer, split 8 ways.
  EXPECT_NEAR(r.expected_experts, 256 * (1 - std::pow(1 - 8.0 / 256, 1)), 1e-9);
  EXPECT_NEAR(part_bytes(r, Part::RoutedExperts), 75 * 8.0 * 3 * 2048 * 6144 * 0.5625 / 8, 1.0);
  // KV: the latent (512 + 64) of the top 2048 positions and the indexer key (128) of all 4096.
  EXPECT_NEAR(r.kv_bytes, 78 * (2048.0 * 576 + 4096.0 * 128) * 2, 1e-3);
  EXPECT_EQ(r.allreduces, 2 * 78 + 1);
  EXPECT_NEAR(r.memory_ms, r.total_bytes() / (1792.0 * 1e6), 1e-12);
}

TEST(Roofline, DecodeCostIsTheOneGpuCase) {
  ModelConfig c = load_model_config(test::fixture_dir("qwen3moe-bf16"));
  const DecodeCost d = decode_cost(c, 3, 10, 4.0);
  const Roofline r = roofline(step_shapes(c), Layout{}, 3, 10, 4.0, 1.0, h200());
  EXPECT_DOUBLE_EQ(d.total(), r.total_bytes());
  EXPECT_DOUBLE_EQ(d.routed_experts, part_bytes(r, Part::RoutedExperts));
}

TEST(Roofline, CommandPrintsJson) {
  const std::string cfg = std::string(KESTREL_FIXTURES) + "/../../configs/glm-5-nvfp4.json";
  const test::CliResult res = test::run_kestrel("roofline --model " + cfg + " --gpu rtx-pro-6000 --tp 8 --json");
  ASSERT_EQ(res.status, 0) << res.output;
  const auto j = nlohmann::json::parse(res.output);
  EXPECT_GT(j.at("floor_ms").get<double>(), 0);
  EXPECT_GT(j.at("bytes_per_token").get<double>(), 1e9);
  EXPECT_EQ(j.at("allreduces").get<int>(), 157);
  const test::CliResult bad = test::run_kestrel("roofline --model " + cfg + " --gpu tpu");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.output.find("unknown GPU 'tpu'"), std::string::npos) << bad.output;
}

}  // namespace
}  // namespace kestrel
