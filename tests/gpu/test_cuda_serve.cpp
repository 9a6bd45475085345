// The server's engine on the GPU: requests decoding side by side in one batched step per token
// and prefilling 8 prompt tokens per step in their own slots
// (backend/cuda/gpu_slots.h), unsplit and split over every GPU, give the tokens the CPU engine
// gives each of them.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include "../unit/fixture.h"
#include "backend/cuda/gpu_model.h"
#include "backend/cuda/gpu_slots.h"
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
    if (i % 2) {  // seeded sampling on the host, from the GPU's logits
      r.sampling.temperature = 0.8f;
      r.sampling.seed = uint64_t(100 + i);
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

}  // namespace
}  // namespace kestrel
