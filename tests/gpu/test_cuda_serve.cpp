// The server's engine on the GPU: requests decoding side by side in one batched step per token
// and prefilling 8 prompt tokens per step in their own slots
// (backend/cuda/gpu_slots.h), unsplit and split over every GPU, give the tokens the CPU engine
// gives each of them (greedy ones drawn on the GPU, sampled ones on the host); tokens sampled on
// the GPU are the draws their seeds and counters give from the CPU's distribution.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cmath>

#include "../unit/fixture.h"
#include "backend/cpu/forward.h"
#include "backend/cuda/gpu_model.h"
#include "backend/cuda/gpu_slots.h"
#include "backend/cuda/philox.h"
#include "runtime/engine.h"

namespace kestrel {
namespace {

std::vector<int32_t> drain(RequestStream& s, Finish* finish) {
  std::vector<int32_t> out;
  TokenEvent e;
  while (s.next(e))
    if (e.finish == Finish::None) out.push_back(e.token);
    else *finish = e.finish;
  return out;
}

std::vector<GenerationRequest> requests() {
  std::vector<GenerationRequest> rs;
  for (int i = 0; i < 6; ++i) {
    GenerationRequest r;
    for (int t = 0; t < 3 + 5 * i; ++t) r.prompt.push_back(int32_t((17 * i + 5 * t + 1) % 256));
    r.max_tokens = 6 + i;
    r.ignore_eos = true;
    // Odd: seeded sampling on the host, from the GPU's logits (a penalty or log-probabilities
    // keep it there); even: greedy, the argmax drawn on the GPU.
    if (i % 2) {
      r.sampling.temperature = 0.8f;
      r.sampling.seed = uint64_t(100 + i);
      if (i % 4 == 1) r.sampling.repetition_penalty = 1.1f;
      else r.top_logprobs = 1;
    }
    rs.push_back(r);
  }
  return rs;
}

std::vector<std::vector<int32_t>> serve(Engine& e) {
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const auto& r : requests()) streams.push_back(e.submit(r));
  std::vector<std::vector<int32_t>> out;
  for (auto& s : streams) {
    Finish f = Finish::None;
    out.push_back(drain(*s, &f));
    EXPECT_EQ(f, Finish::Length);
  }
  return out;
}

TEST(CudaServe, BatchedGpuStepsGiveTheCpuEnginesTokens) {
  int gpus = 0;
  ASSERT_EQ(cudaGetDeviceCount(&gpus), cudaSuccess);
  for (const std::string name : {"qwen3moe-nvfp4", "glm5-nvfp4"}) {
    SCOPED_TRACE(name);
    auto model = load_model(test::fixture_dir(name));
    EngineOptions o;
    o.max_batch = 4;  // 6 requests: two wait for a slot
    o.context = 64;
    o.threads = 2;
    std::vector<std::vector<int32_t>> want;
    {
      Engine cpu(*model, o);
      want = serve(cpu);
    }
    for (const Layout& layout : {Layout{1, 1}, Layout{std::min(gpus, 4), 1}}) {
      SCOPED_TRACE(layout.str());
      cuda::GpuModel on_gpus(*model, layout);
      Engine gpu(*model, o, std::make_unique<cuda::GpuSlots>(on_gpus, o.max_batch, int(o.context)));
      EXPECT_EQ(serve(gpu), want);
      gpu.shutdown(1.0);
    }
  }
}

// Requests sampled on the GPU (no penalty, no log-probabilities), through the prefill decoder
// (prompts of 12 and 3 tokens) and the batched step (a prompt of 1 token, every later token):
// replayed token by token on the CPU reference, each token is the inverse CDF, in id order, of
// the host's distribution at the draw's Philox number (seed of its choice, counter = tokens
// generated before it), unless that number lies within 1e-3 of the token's interval (the GPU's
// logits differ from the CPU's by rounding).
TEST(CudaServe, GpuSampledTokensAreTheirDraws) {
  auto model = load_model(test::fixture_dir("qwen3moe-nvfp4"));
  const size_t V = size_t(model->config.vocab_size);
  EngineOptions o;
  o.max_batch = 4;
  o.context = 64;
  o.threads = 2;
  std::vector<GenerationRequest> rs(3);
  rs[0].prompt = {3, 9, 27, 81, 243, 7, 21, 63, 189, 55, 11, 33};
  rs[0].sampling = {.temperature = 3.0f, .seed = 11};
  rs[0].n = 2;
  rs[1].prompt = {5, 25, 125};
  rs[1].sampling = {.temperature = 2.5f, .top_k = 30, .top_p = 0.95f, .min_p = 0.02f, .seed = 12};
  rs[2].prompt = {77};
  rs[2].sampling = {.temperature = 4.0f, .seed = 13};
  for (auto& r : rs) {
    r.max_tokens = 8;
    r.ignore_eos = true;
  }
  cuda::GpuModel on_gpu(*model, Layout{1, 1});
  Engine gpu(*model, o, std::make_unique<cuda::GpuSlots>(on_gpu, o.max_batch, int(o.context)));
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const auto& r : rs) streams.push_back(gpu.submit(r));
  ThreadPool pool(2);
  cpu::Forward fwd(*model, pool);
  int exact = 0, near = 0;
  for (size_t q = 0; q < rs.size(); ++q) {
    std::vector<std::vector<int32_t>> choices(size_t(rs[q].n));
    TokenEvent e;
    while (streams[q]->next(e))
      if (e.finish == Finish::None) choices.at(size_t(e.index)).push_back(e.token);
    for (int c = 0; c < rs[q].n; ++c) {
      SCOPED_TRACE(cat("request ", q, " choice ", c));
      const std::vector<int32_t>& got = choices[size_t(c)];
      ASSERT_EQ(got.size(), 8u);
      SamplerOptions so = rs[q].sampling;
      so.seed = choice_seed(rs[q].sampling.seed, c);
      KvCache cache = fwd.make_cache(o.context);
      std::vector<float> logits(V);
      for (int32_t t : rs[q].prompt) fwd.run({&t, 1}, cache, logits.data());
      for (size_t k = 0; k < got.size(); ++k) {
        const std::vector<float> p = sampling_distribution(logits, so);
        const double u = std::ldexp(double(cuda::sample_bits(so.seed, k)), -64);
        double before = 0;
        for (int32_t i = 0; i < got[k]; ++i) before += p[size_t(i)];
        const double through = before + p[size_t(got[k])];
        if (before <= u && u < through) ++exact;
        else if (u >= before - 1e-3 && u < through + 1e-3) ++near;
        else ADD_FAILURE() << "token " << k << " is " << got[k] << " (host mass " << before << " .. " << through
                           << "), its draw's number " << u;
        fwd.run({&got[k], 1}, cache, logits.data());
      }
    }
  }
  std::printf("  %d GPU-sampled tokens the host's inverse CDF at their numbers, %d within 1e-3 of it\n", exact, near);
  EXPECT_GE(exact, 24);
  gpu.shutdown(1.0);
}

}  // namespace
}  // namespace kestrel
