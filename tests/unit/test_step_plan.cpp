// The persistent step's plan (plan/step_plan.h): tile rules, the proof of safety on the real
// shapes and on broken plans, the bytes against the floor, and the plan run tile by tile on the
// CPU against the reference forward pass on every fixture family (GQA, MLA, GLM-5's indexer).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <map>
#include <numeric>
#include <set>

#include "backend/cpu/forward.h"
#include "backend/cpu/step_run.h"
#include "common/error.h"
#include "fixture.h"
#include "formats/json_file.h"
#include "model/weights.h"
#include "plan/decode_cost.h"
#include "plan/step_plan.h"
#include "plan/step_plan_check.h"
#include "run_cli.h"

namespace kestrel {
namespace {

ModelConfig config(const std::string& name) {
  const std::string path = std::string(KESTREL_FIXTURES) + "/../../configs/" + name;
  return parse_model_config_and_quant(read_json_file(path), path);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(StepPlan, TileRows) {
  // Whole quanta, no tile across a group boundary, everything covered once.
  for (auto [rows, group, quantum, target] : std::vector<std::array<int64_t, 4>>{
           {5120, 128, 16, 132}, {2048, 2048, 16, 132}, {768, 768, 16, 16}, {128, 128, 1, 132}, {151936, 151936, 16, 132},
           {40, 8, 4, 3}, {100, 100, 16, 7}, {7, 7, 16, 132}}) {
    const auto t = tile_rows(rows, group, quantum, target);
    ASSERT_FALSE(t.empty());
    int64_t at = 0;
    for (const auto& [b, e] : t) {
      EXPECT_EQ(b, at) << rows;
      EXPECT_GT(e, b);
      // Within one group, or whole groups.
      const bool whole = b % group == 0 && (e % group == 0 || e == rows);
      EXPECT_TRUE(b / group == (e - 1) / group || whole) << "a tile across a group boundary: [" << b << ", " << e << ")";
      if (e % group != 0 && e != rows) {
        EXPECT_EQ((e - b) % quantum, 0) << "[" << b << ", " << e << ")";
      }
      at = e;
    }
    EXPECT_EQ(at, rows);
  }
  EXPECT_EQ(tile_rows(5120, 128, 16, 132).size(), 120u);  // 40 heads x 3
  EXPECT_EQ(tile_rows(2048, 2048, 16, 132).size(), 128u); // quanta run out first
  EXPECT_EQ(tile_rows(40, 8, 4, 3).size(), 3u);           // 5 groups in 3 tiles of whole groups
}

TEST(StepPlan, RealShapesAreSafeAndStreamTheirFloor) {
  for (const char* name : {"qwen3-30b-a3b-nvfp4.json", "glm-4.5-air-nvfp4.json", "deepseek-v3-nvfp4.json", "glm-5-nvfp4.json"}) {
    const ModelConfig c = config(name);
    for (int batch : {1, 8}) {
      StepPlanOptions o;
      o.batch = batch;
      const StepPlan p = make_step_plan(c, o);
      SCOPED_TRACE(std::string(name) + " batch " + std::to_string(batch));
      EXPECT_NO_THROW(check_step_plan(p));
      EXPECT_EQ(simulate_step_plan(p, 7).size(), p.instrs.size());
      const DecodeCost floor = decode_cost(c, batch, o.context, o.kv_value_bytes);
      EXPECT_NEAR(p.cache_bytes(), floor.kv_cache, 1e-6 * floor.kv_cache);
      if (batch == 1) {
        // One token: its experts are the plan's positions, so every weight byte is the floor's.
        EXPECT_NEAR(p.weight_bytes(), floor.total() - floor.kv_cache, 1e-6 * floor.total());
      } else {
        EXPECT_GT(p.weight_bytes(), floor.total() - floor.kv_cache);  // positions for every possible expert
      }
      // Every wait is needed: the instruction's other waits and its queue do not imply it (the
      // builder drops those), and none waits on more than a few ops.
      size_t most = 0;
      for (const StepInstr& in : p.instrs) most = std::max(most, in.waits.size());
      EXPECT_LE(most, 3u);
      // Each op instance of a layer is one wave over the SMs, so no SM runs much more than the others.
      std::vector<double> load(size_t(o.sms), 0);
      for (const StepInstr& in : p.instrs)
        if (!in.tail) load[size_t(in.sm)] += in.weight_bytes + in.cache_bytes;
      const double mean = std::accumulate(load.begin(), load.end(), 0.0) / double(load.size());
      EXPECT_LT(*std::max_element(load.begin(), load.end()), 1.05 * mean);
    }
  }
}

TEST(StepPlan, CountersFollowTheData) {
  // Qwen3-30B-A3B at one token: q/k/v tiles never straddle heads, so each KV head's splits wait
  // only on its own group's tiles; o_proj reads every head's output, so the combines share one
  // counter; each expert_down tile waits on one counter of all the expert tiles.
  const StepPlan p = make_step_plan(config("qwen3-30b-a3b-nvfp4.json"), {});
  std::map<StepOp, std::set<int32_t>> advanced;
  for (const StepInstr& in : p.instrs)
    if (in.layer == 1) advanced[in.op].insert(in.signal);
  EXPECT_EQ(advanced[StepOp::AttnNormQkv].size(), 4u);  // one per KV head group
  EXPECT_EQ(advanced[StepOp::AttnCombine].size(), 1u);
  EXPECT_EQ(advanced[StepOp::ExpertGateUp].size(), 1u);
  for (const StepInstr& in : p.instrs) {
    if (in.layer != 1) continue;
    if (in.op == StepOp::AttnSplit && !in.waits.empty()) {  // none where its queue ran one that waited
      ASSERT_EQ(in.waits.size(), 1u);
      EXPECT_EQ(p.counters[size_t(in.waits[0])].producers, 30);  // 10 head blocks x 3 tiles
      EXPECT_EQ(p.instrs[size_t(p.counters[size_t(in.waits[0])].first)].op, StepOp::AttnNormQkv);
    }
    if (in.op == StepOp::AttnNormQkv) {
      ASSERT_EQ(in.waits.size(), 1u);  // the previous layer's expert_down, all of it
      EXPECT_EQ(p.instrs[size_t(p.counters[size_t(in.waits[0])].first)].op, StepOp::ExpertDown);
    }
  }
}

TEST(StepPlan, TailsRunWhereTheirOneWaitCompletes) {
  // Qwen3-30B-A3B: per layer each KV head's combine (after its splits) and the route (after the
  // router) are tails, in no queue, each on a counter of its own producers; the simulated queues
  // run each tail right after the tile that completes its counter.
  const StepPlan p = make_step_plan(config("qwen3-30b-a3b-nvfp4.json"), {.batch = 3});
  ASSERT_EQ(p.tails.size(), size_t(p.layers * (p.kv_heads + 1)));
  for (int32_t t : p.tails) {
    const StepInstr& in = p.instrs[size_t(t)];
    EXPECT_TRUE(in.tail);
    EXPECT_TRUE(in.op == StepOp::AttnCombine || in.op == StepOp::Route) << describe_instr(p, t);
    EXPECT_EQ(in.sm, -1);
    ASSERT_EQ(in.waits.size(), 1u);
    EXPECT_EQ(p.counters[size_t(in.waits[0])].producers, in.op == StepOp::AttnCombine ? p.splits : 128);
  }
  const std::vector<int32_t> order = simulate_step_plan(p, 7);
  for (size_t k = 0; k < order.size(); ++k) {
    const StepInstr& in = p.instrs[size_t(order[k])];
    if (!in.tail) continue;
    ASSERT_GT(k, 0u);
    EXPECT_EQ(p.instrs[size_t(order[k - 1])].signal, in.waits[0]) << describe_instr(p, order[k]);
  }
  // A tail given a second wait is refused.
  StepPlan bad = p;
  StepInstr& t = bad.instrs[size_t(bad.tails[1])];
  t.waits.insert(t.waits.begin(), bad.instrs[size_t(bad.tails[0])].signal);
  EXPECT_NE(error_of([&] { check_step_plan(bad); }).find("waits on 2 counters, not one"), std::string::npos);
}

TEST(StepPlan, BrokenPlansFailNamingTheInstruction) {
  const StepPlanOptions o{.batch = 2, .sms = 8};
  const StepPlan good = make_step_plan(config("qwen3-30b-a3b-nvfp4.json"), o);
  ASSERT_NO_THROW(check_step_plan(good));
  // A dropped wait: the reader may run before its writer.
  {
    StepPlan p = good;
    for (StepInstr& in : p.instrs)
      if (in.op == StepOp::OProj && in.layer == 2) in.waits.clear();
    const std::string e = error_of([&] { check_step_plan(p); });
    EXPECT_NE(e.find("layer 2 o_proj"), std::string::npos) << e;
    EXPECT_NE(e.find("no wait orders them"), std::string::npos) << e;
  }
  // A counter that never fills: the queues stop, naming who waits on what.
  {
    StepPlan p = good;
    const int32_t k = p.instrs.back().waits.at(0);
    ++p.counters[size_t(k)].producers;
    EXPECT_NE(error_of([&] { check_step_plan(p); }).find("producers"), std::string::npos);
    const std::string e = error_of([&] { simulate_step_plan(p, 1); });
    EXPECT_NE(e.find("the queues stop"), std::string::npos) << e;
    EXPECT_NE(e.find("norm_lm_head"), std::string::npos) << e;
  }
  // Queues out of program order.
  {
    StepPlan p = good;
    std::swap(p.queues[0][1], p.queues[0][2]);
    std::swap(p.instrs[size_t(p.queues[0][1])].slot, p.instrs[size_t(p.queues[0][2])].slot);
    EXPECT_NE(error_of([&] { check_step_plan(p); }).find("out of program order"), std::string::npos);
  }
  // A wait on a later instruction's counter (the queues could deadlock).
  {
    StepPlan p = good;
    p.instrs[1].waits = {p.instrs.back().signal};
    EXPECT_NE(error_of([&] { check_step_plan(p); }).find("later in program order"), std::string::npos);
  }
  // A tile that reads past its buffer.
  {
    StepPlan p = good;
    p.instrs[3].reads[0].end += 1;
    EXPECT_NE(error_of([&] { check_step_plan(p); }).find("reads hidden"), std::string::npos);
  }
}

// The plan run tile by tile on the CPU gives the reference forward pass's logits and cache.
class StepPlanRun : public ::testing::TestWithParam<std::string> {};

TEST_P(StepPlanRun, MatchesTheForwardPass) {
  auto model = load_model(test::fixture_dir(GetParam()));
  const ModelConfig& c = model->config;
  ThreadPool pool(2);
  cpu::Forward fwd(*model, pool);
  for (int batch : {1, 3}) {
    StepPlanOptions o;
    o.batch = batch;
    o.sms = 5;
    o.row_quantum = 4;
    o.context = 200;  // several splits of the positions, some empty
    const StepPlan p = make_step_plan(c, o);
    ASSERT_NO_THROW(check_step_plan(p));
    // Sequences of different lengths; the plan's step and the reference decode one token each.
    std::vector<KvCache> mine, ref;
    std::vector<int32_t> next;
    for (int b = 0; b < batch; ++b) {
      std::vector<int32_t> prompt;
      for (int t = 0; t < 3 + 4 * b; ++t) prompt.push_back(int32_t((7 + 31 * t + 17 * b) % c.vocab_size));
      for (auto* set : {&mine, &ref}) {
        set->push_back(fwd.make_cache(32));
        fwd.run(prompt, set->back(), nullptr);
      }
      next.push_back(int32_t((5 + 11 * b) % c.vocab_size));
    }
    const int64_t V = c.vocab_size;
    std::vector<float> got(size_t(batch * V), NAN), want(size_t(batch * V), NAN);
    std::vector<KvCache*> caches;
    for (KvCache& k : mine) caches.push_back(&k);
    cpu::run_step_plan(p, *model, next, caches, got.data());
    for (int b = 0; b < batch; ++b) fwd.run({&next[size_t(b)], 1}, ref[size_t(b)], want.data() + b * V);
    for (int b = 0; b < batch; ++b) {
      const double err = test::rel_l2(got.data() + b * V, want.data() + b * V, V);
      EXPECT_LT(err, 1e-5) << "batch " << batch << " sequence " << b;
      const int64_t at = mine[size_t(b)].length() - 1;
      ASSERT_EQ(at, ref[size_t(b)].length() - 1);
      // The first layer's cached rows are the reference's bit for bit (the same products in the
      // same order); later layers see attention split over positions, rounded differently. (MLA
      // caches one latent row and no values.)
      const int64_t nk = mine[size_t(b)].layout().k_row, nv = mine[size_t(b)].layout().v_row;
      for (int64_t d = 0; d < nk; ++d) ASSERT_EQ(mine[size_t(b)].k(0, at)[d], ref[size_t(b)].k(0, at)[d]);
      for (int64_t d = 0; d < nv; ++d) ASSERT_EQ(mine[size_t(b)].v(0, at)[d], ref[size_t(b)].v(0, at)[d]);
      for (int64_t l = 1; l < c.num_layers; ++l) {
        EXPECT_LT(test::rel_l2(mine[size_t(b)].k(l, at), ref[size_t(b)].k(l, at), nk), 1e-5) << "layer " << l;
        if (nv > 0) {
          EXPECT_LT(test::rel_l2(mine[size_t(b)].v(l, at), ref[size_t(b)].v(l, at), nv), 1e-5) << "layer " << l;
        }
      }
    }
  }
}

TEST(StepPlan, Command) {
  const std::string configs = std::string(KESTREL_FIXTURES) + "/../../configs/";
  auto r = test::run_kestrel("plan --model " + configs + "qwen3-30b-a3b-nvfp4.json --batch 2 --op attn_combine --layer 3 --queues --check");
  EXPECT_EQ(r.status, 0) << r.output;
  for (const char* want : {"batch 2 on 132 SMs", "norm_qkv", "expert_down", "layer 3 attn_combine kv head 3", "queues:", "checked:"})
    EXPECT_NE(r.output.find(want), std::string::npos) << want << "\n" << r.output;
  r = test::run_kestrel("plan --model " + configs + "glm-5-nvfp4.json --op index_topk");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("layer 0 index_topk"), std::string::npos) << r.output;
  r = test::run_kestrel("plan --model " + configs + "qwen3-30b-a3b-nvfp4.json --op nosuch");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--op nosuch"), std::string::npos) << r.output;
  r = test::run_kestrel("plan --model " + configs + "qwen3-30b-a3b-nvfp4.json --batch 65");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("batch must be 1..64"), std::string::npos) << r.output;
}

INSTANTIATE_TEST_SUITE_P(Families, StepPlanRun, ::testing::ValuesIn(test::fixture_names()), test::fixture_test_name);

}  // namespace
}  // namespace kestrel
