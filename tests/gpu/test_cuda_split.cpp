// Split models on the GPUs present: every fixture family at TP and EP over all GPUs (and with a
// single GPU, the split code path with one rank: the decoder with its all-reduce and logits
// gather) against the unsplit CPU reference, prefill and decode, through the Session that
// generate and logits run.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include "../unit/fixture.h"
#include "backend/cpu/forward.h"
#include "backend/cuda/allreduce.h"
#include "backend/cuda/check.h"
#include "backend/cuda/device_model.h"
#include "backend/cuda/gpu_model.h"
#include "backend/cuda/rank_group.h"
#include "backend/cuda/session.h"
#include "formats/json_file.h"
#include "parallel/shard.h"

namespace kestrel {
namespace {

constexpr double kVsCpu = 1e-4;  // as the unsplit GPU decode (test_cuda_model.cpp)

int gpus() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

class CudaSplitTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaSplitTest, TpAndEpOverTheGpusGiveTheCpuLogits) {
  const std::string dir = test::fixture_dir(GetParam());
  auto model = load_model(dir);
  const test::Reference ref = test::load_reference(dir);
  const int64_t T = int64_t(ref.tokens.size()), V = ref.vocab, P = T / 2;
  ThreadPool pool(2);
  cpu::Forward fwd(*model, pool);
  KvCache cache = fwd.make_cache(T);
  std::vector<float> want(static_cast<size_t>(T * V));
  fwd.run(ref.tokens, cache, want.data());

  const int n = std::min(gpus(), 4);
  std::vector<Layout> layouts = {{n, 1}};
  if (n > 1 && model->config.num_experts > 0) layouts.push_back({n, n});
  for (const Layout& layout : layouts) {
    SCOPED_TRACE(layout.str());
    cuda::GpuModel on_gpus(*model, layout);
    cuda::Session session(on_gpus, int(T));
    std::vector<float> got(static_cast<size_t>(P * V)), last(static_cast<size_t>(V), NAN);
    session.run({ref.tokens.data(), size_t(P)}, got.data(), true);
    for (int64_t t = 0; t < P; ++t)
      EXPECT_LE(test::rel_l2(got.data() + t * V, want.data() + t * V, V), kVsCpu) << "prefill position " << t;
    for (int64_t t = P; t < T; ++t) {
      std::fill(last.begin(), last.end(), NAN);
      session.run({ref.tokens.data() + t, 1}, last.data(), false);
      EXPECT_LE(test::rel_l2(last.data(), want.data() + t * V, V), kVsCpu) << "position " << t;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Families, CudaSplitTest, ::testing::ValuesIn(test::fixture_names()), [](const auto& info) {
  std::string n = info.param;
  for (char& ch : n)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return n;
});

// Random weights of Qwen3-30B-A3B's full shapes: each rank generates its block of the same
// matrices (a function of the element's place in the whole matrix), so a split model must give
// the unsplit model's logits, step after step of greedy decoding, and the same tokens.
TEST(CudaSplitRandom, Qwen3MoeFullShapesGiveTheUnsplitLogitsAndTokens) {
  const std::string path = std::string(KESTREL_FIXTURES) + "/../../configs/qwen3-30b-a3b-nvfp4.json";
  const ModelConfig c = parse_model_config_and_quant(read_json_file(path), path);
  const int B = 2, steps = 12, ctx = 64;
  const int64_t V = c.vocab_size;
  const std::vector<int32_t> start_tokens = {17, 9001}, start_pos = {0, 0};
  std::vector<std::vector<float>> want(steps);
  std::vector<std::vector<int32_t>> want_tokens(steps);
  {
    auto dm = cuda::DeviceModel::random(c);
    cuda::Decoder dec(*dm, B, ctx);
    cudaStream_t s;
    KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    KESTREL_CUDA_CHECK(cudaMemcpy(dec.tokens(), start_tokens.data(), B * 4, cudaMemcpyHostToDevice));
    KESTREL_CUDA_CHECK(cudaMemcpy(dec.positions(), start_pos.data(), B * 4, cudaMemcpyHostToDevice));
    for (int i = 0; i < steps; ++i) {
      dec.step_graph(B, true, s);
      KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
      want[size_t(i)].resize(size_t(B * V));
      want_tokens[size_t(i)].resize(B);
      KESTREL_CUDA_CHECK(cudaMemcpy(want[size_t(i)].data(), dec.logits(), size_t(B * V) * 4, cudaMemcpyDeviceToHost));
      KESTREL_CUDA_CHECK(cudaMemcpy(want_tokens[size_t(i)].data(), dec.tokens(), B * 4, cudaMemcpyDeviceToHost));
    }
    cudaStreamDestroy(s);
  }
  const int n = std::min(gpus(), 8);
  for (const Layout& layout : {Layout{n, 1}, Layout{n, n}}) {
    SCOPED_TRACE(layout.str());
    cuda::RankGroup group(layout.ranks());
    std::vector<std::unique_ptr<cuda::DeviceModel>> parts(static_cast<size_t>(n));
    std::vector<std::unique_ptr<cuda::Decoder>> decs(static_cast<size_t>(n));
    group.run([&](int r) {
      parts[size_t(r)] = cuda::DeviceModel::random(c, 1, layout, r);
      decs[size_t(r)] = std::make_unique<cuda::Decoder>(*parts[size_t(r)], B, ctx, false, group.link(r));
      KESTREL_CUDA_CHECK(cudaMemcpy(decs[size_t(r)]->tokens(), start_tokens.data(), B * 4, cudaMemcpyHostToDevice));
      KESTREL_CUDA_CHECK(cudaMemcpy(decs[size_t(r)]->positions(), start_pos.data(), B * 4, cudaMemcpyHostToDevice));
    });
    double worst = 0;
    for (int i = 0; i < steps; ++i) {
      std::vector<float> got(static_cast<size_t>(B * V), NAN);
      std::vector<int32_t> tokens(static_cast<size_t>(B), -1);
      group.run([&](int r) {
        decs[size_t(r)]->step_graph(B, true, group.stream(r));
        KESTREL_CUDA_CHECK(cudaStreamSynchronize(group.stream(r)));
        if (r == 0) {
          KESTREL_CUDA_CHECK(cudaMemcpy(got.data(), decs[0]->logits(), got.size() * 4, cudaMemcpyDeviceToHost));
          KESTREL_CUDA_CHECK(cudaMemcpy(tokens.data(), decs[0]->tokens(), B * 4, cudaMemcpyDeviceToHost));
        }
      });
      for (int b = 0; b < B; ++b)
        worst = std::max(worst, test::rel_l2(&got[size_t(b * V)], &want[size_t(i)][size_t(b * V)], V));
      EXPECT_EQ(tokens, want_tokens[size_t(i)]) << "step " << i;
    }
    EXPECT_LE(worst, kVsCpu);
    std::printf("  random Qwen3-30B-A3B %s vs unsplit, %d greedy steps of 2 sequences: worst rel L2 %.2e\n",
                layout.str().c_str(), steps, worst);
    group.run([&](int r) {
      decs[size_t(r)].reset();
      parts[size_t(r)].reset();
    });
  }
}

// A rank that fails inside a step stops the step on every rank with its error, instead of
// leaving the others waiting in a collective; the group then refuses further work.
TEST(RankGroup, ARankThatFailsStopsTheStepWithItsError) {
  const int n = std::min(gpus(), 4);
  cuda::RankGroup group(n);
  std::vector<float*> bufs(static_cast<size_t>(n));  // per rank: partial, x, xn of 4096 floats
  group.run([&](int r) {
    KESTREL_CUDA_CHECK(cudaMalloc(&bufs[size_t(r)], 3 * 4096 * 4));
    KESTREL_CUDA_CHECK(cudaMemset(bufs[size_t(r)], 0, 3 * 4096 * 4));
  });
  try {
    group.run([&](int r) {
      if (r == n - 1) fail("out of GPU memory (simulated)");
      // The others enter a collective the failed rank never joins.
      float* b = bufs[size_t(r)];
      group.link(r)->reduce->all_reduce_add_norm(b, b + 4096, nullptr, 1e-6f, b + 8192, 1, 4096, group.stream(r));
      KESTREL_CUDA_CHECK(cudaStreamSynchronize(group.stream(r)));
    });
    FAIL() << "the step did not fail";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("out of GPU memory (simulated)"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank " + std::to_string(n - 1)), std::string::npos) << e.what();
  }
  EXPECT_THROW(group.run([](int) {}), Error);
  for (size_t r = 0; r < bufs.size(); ++r) {
    cudaSetDevice(int(r));
    cudaFree(bufs[r]);
  }
  cudaSetDevice(0);
}

}  // namespace
}  // namespace kestrel
