// The persistent decode step (backend/cuda/persistent) against the launched step and the CPU:
// every GQA fixture family at 1, 3 and 8 sequences, the first layers of real shapes with random
// weights (the tensor-core tiles), a plan with fewer queues than SMs, steps back
// to back (the counters count up across steps), a graph replay, and a broken plan that must time
// out naming its instruction instead of hanging.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "../unit/fixture.h"
#include "step_check.h"
#include "backend/cpu/forward.h"
#include "backend/cuda/check.h"
#include "backend/cuda/decoder.h"
#include "backend/cuda/device_model.h"
#include "backend/cuda/persistent/persistent_step.h"
#include "formats/json_file.h"
#include "model/weights.h"
#include "plan/step_plan.h"

namespace kestrel {
namespace {

using test::copy_back;
using test::set_inputs;

constexpr double kVsCpu = 1e-4;       // the persistent step vs the CPU's decode, per sequence
constexpr double kVsLaunched = 1e-4;  // vs the launched step's logits

int device_sms() {
  int dev = 0, n = 0;
  KESTREL_CUDA_CHECK(cudaGetDevice(&dev));
  KESTREL_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
}

class CudaPersistentTest : public ::testing::TestWithParam<std::string> {};

// Sequences b = 0..batch-1 decode `steps` tokens each with the launched decoder and the CPU; the
// last `persistent` steps also run the persistent step (after the launched one, on the same cache:
// it stores the same key and value again), whose logits must match both.
TEST_P(CudaPersistentTest, MatchesTheLaunchedStepAndTheCpu) {
  auto model = load_model(test::fixture_dir(GetParam()));
  const ModelConfig& c = model->config;
  const int64_t V = c.vocab_size;
  auto dm = cuda::DeviceModel::upload(*model);
  ThreadPool pool(2);
  cpu::Forward fwd(*model, pool);
  for (int batch : {1, 3, 8}) {
    SCOPED_TRACE("batch " + std::to_string(batch));
    const int steps = 12, persistent = 4;
    cuda::Decoder dec(*dm, batch, steps);
    StepPlanOptions o;
    o.batch = batch;
    o.sms = std::min(device_sms(), 40);  // fewer queues than SMs: each runs many instructions
    o.context = 256;  // several splits of the positions, most empty at this length
    o.row_quantum = 4;
    cuda::PersistentStep ps(*dm, dec, make_step_plan(c, o));
    test::check_step("persistent step", fwd, V, dec, batch, steps, persistent, [&] {
      ps.run(nullptr);
      auto got = test::copy_back(ps.logits(), size_t(batch * V));
      ps.check();
      return got;
    }, kVsCpu, kVsLaunched);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, CudaPersistentTest, ::testing::ValuesIn(test::gqa_fixture_names()),
                         test::fixture_test_name);

// The first layers of real shapes with random weights, whose rows are long enough for the
// tensor-core tiles (the fixtures' are not): the persistent step against the launched one at 1,
// 2, 4 and 8 sequences, over a few steps.
TEST(CudaPersistentRandom, RealShapesMatchTheLaunchedStep) {
  for (const char* name : {"qwen3-30b-a3b-nvfp4", "glm-4.5-air-nvfp4"}) {
    SCOPED_TRACE(name);
    const std::string path = std::string(KESTREL_FIXTURES) + "/../../configs/" + name + ".json";
    ModelConfig c = parse_model_config_and_quant(read_json_file(path), path);
    c.num_layers = 3;  // GLM-4.5-Air: one dense layer, then two with routed and shared experts
    c.moe_layer.resize(3);
    const auto dm = cuda::DeviceModel::random(c);
    const int64_t V = c.vocab_size;
    for (int batch : {1, 2, 4, 8}) {
      SCOPED_TRACE("batch " + std::to_string(batch));
      const int steps = 3;
      cuda::Decoder dec(*dm, batch, 8);
      StepPlanOptions o;
      o.batch = batch;
      o.sms = device_sms();
      o.context = 8;
      cuda::PersistentStep ps(*dm, dec, make_step_plan(c, o));
      if (batch <= 2) {
        EXPECT_GT(ps.tensor_core_tiles(), 0);
      }
      double worst = 0;
      for (int t = 0; t < steps; ++t) {
        std::vector<int32_t> tokens, positions;
        for (int b = 0; b < batch; ++b) {
          tokens.push_back(int32_t((int64_t(b) * 7919 + 31 * t + 5) % V));
          positions.push_back(t);
        }
        set_inputs(dec, tokens, positions);
        dec.step(batch, nullptr);
        const auto launched = copy_back(dec.logits(), size_t(batch * V));
        ps.run(nullptr);
        const auto got = copy_back(ps.logits(), size_t(batch * V));
        ps.check();
        for (int b = 0; b < batch; ++b) {
          const double e = test::rel_l2(got.data() + b * V, launched.data() + b * V, V);
          EXPECT_LE(e, kVsLaunched) << "step " << t << " sequence " << b;
          worst = std::max(worst, e);
        }
      }
      std::printf("  random %s, 3 layers, batch %d: %lld of %zu tiles on tensor cores, worst rel L2 %.2e vs launched\n",
                  name, batch, (long long)ps.tensor_core_tiles(), ps.plan().instrs.size(), worst);
    }
  }
}

// Replayed from a CUDA graph the step gives the same logits as launched directly.
TEST(CudaPersistent, GraphReplay) {
  auto model = load_model(test::fixture_dir("qwen3moe-nvfp4"));
  auto dm = cuda::DeviceModel::upload(*model);
  cuda::Decoder dec(*dm, 2, 8);
  StepPlanOptions o;
  o.batch = 2;
  o.sms = std::min(device_sms(), 16);
  o.row_quantum = 4;
  cuda::PersistentStep ps(*dm, dec, make_step_plan(model->config, o));
  set_inputs(dec, {5, 9}, {0, 0});
  ps.run(nullptr);
  const auto direct = copy_back(ps.logits(), size_t(2 * model->config.vocab_size));
  cudaStream_t s;
  KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t g;
  cudaGraphExec_t e;
  KESTREL_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  ps.run(s);
  KESTREL_CUDA_CHECK(cudaStreamEndCapture(s, &g));
  KESTREL_CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
  for (int i = 0; i < 3; ++i) KESTREL_CUDA_CHECK(cudaGraphLaunch(e, s));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
  ps.check();
  EXPECT_EQ(copy_back(ps.logits(), direct.size()), direct);
  cudaGraphExecDestroy(e);
  cudaGraphDestroy(g);
  cudaStreamDestroy(s);
}

// A counter that never fills: the waits time out and name the instruction.
TEST(CudaPersistent, ABrokenPlanFailsNamingTheInstruction) {
  auto model = load_model(test::fixture_dir("llama-bf16"));
  auto dm = cuda::DeviceModel::upload(*model);
  cuda::Decoder dec(*dm, 1, 4);
  StepPlanOptions o;
  o.sms = std::min(device_sms(), 8);
  o.row_quantum = 4;
  StepPlan p = make_step_plan(model->config, o);
  const int32_t k = p.instrs.back().waits.at(0);
  ++p.counters[size_t(k)].producers;
  cuda::PersistentStep ps(*dm, dec, std::move(p));
  set_inputs(dec, {1}, {0});
  ps.run(nullptr);
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  try {
    ps.check();
    FAIL() << "no timeout";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("norm_lm_head"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kestrel
