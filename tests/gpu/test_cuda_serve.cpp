// The server's engine on the GPU: requests decoding side by side in one batched step per token
// and prefilling prompt chunks in their own KV blocks (backend/cuda/gpu_slots.h; long chunks
// through the GEMM prefill), unsplit and split over every GPU, give the tokens the CPU engine
// gives each of them (greedy ones drawn on the GPU, sampled ones on the host): with a pool of a
// whole context per sequence, with a pool so small that requests wait for blocks and take the
// ones others gave back, and sixteen sequences at once. With a BF16 KV cache, each greedy
// sequence gets the tokens a BF16 Session gives it alone. Tokens sampled on the GPU are the
// draws their seeds and counters give from the CPU's distribution.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>

#include "../unit/fixture.h"
#include "backend/cpu/forward.h"
#include "backend/cuda/gpu_model.h"
#include "backend/cuda/gpu_slots.h"
#include "backend/cuda/philox.h"
#include "backend/cuda/session.h"
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

// `count` requests of 3 to 47 prompt tokens and 6 to 15 new ones (at most 63 positions).
std::vector<GenerationRequest> requests(int count) {
  std::vector<GenerationRequest> rs;
  for (int i = 0; i < count; ++i) {
    GenerationRequest r;
    for (int t = 0; t < 3 + (5 * i) % 45; ++t) r.prompt.push_back(int32_t((17 * i + 5 * t + 1) % 256));
    r.max_tokens = 6 + i % 10;
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

std::vector<std::vector<int32_t>> serve(Engine& e, int count) {
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const auto& r : requests(count)) streams.push_back(e.submit(r));
  std::vector<std::vector<int32_t>> out;
  for (auto& s : streams) {
    Finish f = Finish::None;
    out.push_back(drain(*s, &f));
    EXPECT_EQ(f, Finish::Length);
  }
  return out;
}

// The engine on GpuSlots with a pool of kv_positions (0: sized by GpuSlots), admitting what the
// pool holds, as kestrel serve sets it up.
std::unique_ptr<Engine> gpu_engine(const Model& model, EngineOptions o, const cuda::GpuModel& gpus, int64_t kv_positions,
                                   cuda::KvType kv = cuda::KvType::F32) {
  auto slots = std::make_unique<cuda::GpuSlots>(gpus, o.max_batch, int(o.context), kv_positions, kv);
  o.kv_tokens = slots->kv_positions();
  return std::make_unique<Engine>(model, o, std::move(slots));
}

// Each fixture and layout: the CPU engine's tokens for `count` requests, then the GPU's.
void expect_cpu_tokens(const EngineOptions& o, int count, int64_t kv_positions, int64_t want_capacity) {
  int gpus = 0;
  ASSERT_EQ(cudaGetDeviceCount(&gpus), cudaSuccess);
  for (const std::string name : {"qwen3moe-nvfp4", "glm5-nvfp4"}) {
    SCOPED_TRACE(name);
    auto model = load_model(test::fixture_dir(name));
    std::vector<std::vector<int32_t>> want;
    {
      Engine cpu(*model, o);
      want = serve(cpu, count);
    }
    for (const Layout& layout : {Layout{1, 1}, Layout{std::min(gpus, 4), 1}}) {
      SCOPED_TRACE(layout.str());
      cuda::GpuModel on_gpus(*model, layout);
      auto gpu = gpu_engine(*model, o, on_gpus, kv_positions);
      EXPECT_EQ(gpu->stats().kv_capacity, want_capacity);
      EXPECT_NE(gpu->describe().find(std::to_string(want_capacity) + " KV positions"), std::string::npos)
          << gpu->describe();
      EXPECT_EQ(serve(*gpu, count), want);
      gpu->shutdown(1.0);
    }
  }
}

TEST(CudaServe, BatchedGpuStepsGiveTheCpuEnginesTokens) {
  EngineOptions o;
  o.max_batch = 4;  // 6 requests: two wait for a slot
  o.context = 64;
  o.threads = 2;
  expect_cpu_tokens(o, 6, 0, 4 * 64);  // by default a whole context per sequence
}

// 5 blocks of 16 positions for 10 requests of 1 to 4 blocks each: requests wait for blocks
// (not slots) and reuse the ones others gave back, in another order.
TEST(CudaServe, RequestsWaitForKvBlocksAndReuseThem) {
  EngineOptions o;
  o.max_batch = 4;
  o.context = 64;
  o.threads = 2;
  o.kv_tokens = 80;
  expect_cpu_tokens(o, 10, o.kv_tokens, 80);
}

TEST(CudaServe, SixteenSequencesAtOnce) {
  EngineOptions o;
  o.max_batch = 16;  // 20 requests: four wait for a slot
  o.context = 64;
  o.threads = 2;
  expect_cpu_tokens(o, 20, 0, 16 * 64);
}

// Requests that share a 40-token beginning, one after another: each after the first takes the
// 2 full blocks the first computed from the prefix cache and gives the tokens the CPU engine
// gives without a cache (greedy, drawn on the GPU, and sampled on the host).
TEST(CudaServe, PrefixCacheHitsGiveTheCpuEnginesTokens) {
  auto model = load_model(test::fixture_dir("qwen3moe-nvfp4"));
  EngineOptions o;
  o.max_batch = 4;
  o.context = 64;
  o.threads = 2;
  std::vector<GenerationRequest> rs = requests(6);
  for (size_t i = 0; i < rs.size(); ++i) {
    std::vector<int32_t> p;
    for (int t = 0; t < 40; ++t) p.push_back(int32_t((7 * t + 3) % 256));
    for (int t = 0; t < 3 + int(i); ++t) p.push_back(int32_t((11 * i + 13 * t + 2) % 256));
    rs[i].prompt = p;
    rs[i].max_tokens = 8;
  }
  auto run = [&](Engine& e) {
    std::vector<std::vector<int32_t>> out;
    std::vector<int64_t> cached;
    for (const auto& r : rs) {
      auto s = e.submit(r);
      Finish f = Finish::None;
      out.push_back(drain(*s, &f));
      EXPECT_EQ(f, Finish::Length);
      cached.push_back(s->cached_tokens());
    }
    return std::make_pair(out, cached);
  };
  EngineOptions cpu_o = o;
  cpu_o.prefix_cache = false;
  Engine cpu(*model, cpu_o);
  const auto want = run(cpu).first;
  cuda::GpuModel on_gpu(*model, Layout{1, 1});
  auto gpu = gpu_engine(*model, o, on_gpu, 0);
  const auto [got, cached] = run(*gpu);
  EXPECT_EQ(got, want);
  EXPECT_EQ(cached, (std::vector<int64_t>{0, 32, 32, 32, 32, 32}));
  gpu->shutdown(1.0);
}

// With a BF16 KV cache (serve's default for GQA models), batched steps give each greedy
// sequence the tokens a BF16 Session gives it alone: the same rounding of the same keys and
// values, where the CPU's float32 cache would round differently.
TEST(CudaServe, Bf16CacheGivesEachSequenceItsOwnTokens) {
  auto model = load_model(test::fixture_dir("qwen3moe-nvfp4"));
  const size_t V = size_t(model->config.vocab_size);
  EngineOptions o;
  o.max_batch = 4;  // 6 requests: two wait for a slot
  o.context = 64;
  o.threads = 2;
  std::vector<GenerationRequest> rs = requests(6);
  for (auto& r : rs) r.sampling = SamplerOptions{}, r.top_logprobs = -1;  // greedy, drawn on the GPU
  cuda::GpuModel on_gpu(*model, Layout{1, 1});
  std::vector<std::vector<int32_t>> got(rs.size());
  {
    auto gpu = gpu_engine(*model, o, on_gpu, 0, cuda::KvType::BF16);
    EXPECT_NE(gpu->describe().find("KV positions (bf16)"), std::string::npos) << gpu->describe();
    std::vector<std::shared_ptr<RequestStream>> streams;
    for (const auto& r : rs) streams.push_back(gpu->submit(r));
    for (size_t q = 0; q < rs.size(); ++q) {
      Finish f = Finish::None;
      got[q] = drain(*streams[q], &f);
      EXPECT_EQ(f, Finish::Length) << "request " << q;
    }
    gpu->shutdown(1.0);
  }  // the engine is gone before the sessions run on its GPU model (they share its streams)
  for (size_t q = 0; q < rs.size(); ++q) {
    cuda::Session alone(on_gpu, int(o.context), cuda::Session::kDefaultChunk, cuda::KvType::BF16);
    std::vector<float> logits(V);
    std::vector<int32_t> want;
    alone.run(rs[q].prompt, logits.data());
    while (want.size() < size_t(rs[q].max_tokens)) {
      want.push_back(int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin()));
      alone.run({&want.back(), 1}, logits.data());
    }
    EXPECT_EQ(got[q], want) << "request " << q;
  }
}

// Prompt-lookup speculation on the GPU (a check's rows through the prefill decoder, every row's
// logits, then a rewind): greedy requests whose prompts repeat, alone and four at once, give the
// CPU engine's plain tokens, drafts are accepted (else nothing here checks a kept draft), the
// GPU makes the CPU's speculating engine's checks, and no KV block stays held after the replies.
TEST(CudaServe, SpeculationGivesTheCpuEnginesGreedyTokens) {
  auto model = load_model(test::fixture_dir("qwen3moe-nvfp4"));
  EngineOptions o;
  o.max_batch = 4;
  o.context = 160;
  o.threads = 2;
  std::vector<GenerationRequest> rs;
  for (int i = 0; i < 6; ++i) {
    GenerationRequest r;
    for (int t = 0; t < 18 + 5 * i; ++t) r.prompt.push_back(int32_t(40 + i + (t * 7) % 5));
    r.max_tokens = 40 + 13 * i;
    r.ignore_eos = true;
    rs.push_back(r);
  }
  auto run = [&](Engine& e, bool together) {
    std::vector<std::vector<int32_t>> out;
    std::vector<std::shared_ptr<RequestStream>> streams;
    for (const auto& r : rs) {
      streams.push_back(e.submit(r));
      if (!together) {
        Finish f = Finish::None;
        out.push_back(drain(*streams.back(), &f));
        EXPECT_EQ(f, Finish::Length);
      }
    }
    if (together)
      for (auto& st : streams) {
        Finish f = Finish::None;
        out.push_back(drain(*st, &f));
        EXPECT_EQ(f, Finish::Length);
      }
    return out;
  };
  std::vector<std::vector<int32_t>> want;
  {
    Engine cpu(*model, o);
    want = run(cpu, false);
  }
  EngineOptions so = o;
  so.speculation.method = "ngram";
  so.speculation.draft_tokens = 4;
  SpeculationStats cpu_checks;
  {
    Engine cpu(*model, so);
    EXPECT_EQ(run(cpu, false), want);
    cpu_checks = cpu.stats().speculation;
  }
  ASSERT_GT(cpu_checks.accepted, 0) << "the fixture's outputs never repeat: nothing here checks a kept draft";
  cuda::GpuModel on_gpu(*model, Layout{1, 1});
  for (bool together : {false, true}) {
    SCOPED_TRACE(together ? "together" : "alone");
    auto slots = std::make_unique<cuda::GpuSlots>(on_gpu, so.max_batch, int(so.context), 0, cuda::KvType::F32);
    cuda::GpuSlots* backend = slots.get();
    EngineOptions go = so;
    go.kv_tokens = slots->kv_positions();
    Engine gpu(*model, go, std::move(slots));
    EXPECT_EQ(run(gpu, together), want);
    const EngineStats st = gpu.stats();
    EXPECT_TRUE(st.speculating);
    // A sequence's drafts and checks follow from its own tokens alone, batched or not.
    EXPECT_EQ(st.speculation.verifications, cpu_checks.verifications);
    EXPECT_EQ(st.speculation.drafted, cpu_checks.drafted);
    EXPECT_EQ(st.speculation.accepted, cpu_checks.accepted);
    for (int i = 0; i < 100 && gpu.stats().running > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    EXPECT_EQ(gpu.stats().kv_used, 0);
    EXPECT_EQ(backend->kv_blocks_held(), 0) << "a finished sequence kept KV blocks";
    gpu.shutdown(1.0);
  }
}

// Prompts of GpuSlots::kGemmMinPrompt tokens and more run through the GEMM prefill in the slots'
// own KV blocks, every chunk of them (a short first chunk too), beside a short prompt on the
// decoder and, in the same run, tokens drawn on the GPU and decoding sequences. Each long
// prompt's logits match the CPU's within the GEMM prefill's tolerance (test_cuda_prefill.cpp)
// and equal a Session's GEMM prefill of the same prompt (so the path was taken: the decoder's
// rounding differs), the short one's the CPU's to float32 precision, and decoding goes on from
// the cache the chunks filled.
TEST(CudaServe, LongPromptChunksRunThroughTheGemmPrefill) {
  constexpr double kGemmVsCpu = 2e-2;
  auto model = load_model(test::fixture_dir("qwen3moe-nvfp4"));
  const int64_t V = model->config.vocab_size;
  const int context = 640;
  cuda::GpuModel on_gpu(*model, Layout{1, 1});
  cuda::GpuSlots slots(on_gpu, 4, context, 0);
  ASSERT_TRUE(slots.gemm_prefill());
  EXPECT_EQ(slots.max_chunk(), std::min(cuda::GpuSlots::kGemmChunk, context));
  auto prompt = [&](int n, int salt) {
    std::vector<int32_t> p(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) p[size_t(i)] = int32_t((31 * salt + 7 * i + i * i / 5) % V);
    return p;
  };
  const std::vector<int32_t> a = prompt(300, 1), b = prompt(420, 2), c = prompt(290, 3), d = prompt(200, 4);
  ThreadPool pool(2);
  cpu::Forward fwd(*model, pool);
  // The CPU's logits after `p` and then after each of `more`.
  auto cpu_logits = [&](const std::vector<int32_t>& p, std::vector<int32_t> more) {
    KvCache cache = fwd.make_cache(context);
    std::vector<std::vector<float>> out(1 + more.size(), std::vector<float>(size_t(V)));
    std::vector<float> all(p.size() * size_t(V));
    fwd.run(p, cache, all.data());
    std::copy(all.end() - V, all.end(), out[0].begin());
    for (size_t i = 0; i < more.size(); ++i) fwd.run({&more[i], 1}, cache, out[i + 1].data());
    return out;
  };

  // Run 1: a's whole prompt (the GEMM prefill, logits to the host), b's first 40 tokens (the
  // GEMM prefill: b is long; no logits), c's whole prompt with a greedy draw offered (the GEMM
  // prefill for 289 tokens, the decoder's step draws after the last), d's whole prompt (shorter
  // than kGemmMinPrompt: the decoder, 64 tokens a step).
  const int sa = slots.open(context, a).slot, sb = slots.open(context, b).slot, sc = slots.open(context, c).slot;
  const int sd = slots.open(context, d).slot;
  std::vector<float> la(size_t(V), std::nanf("")), lb(size_t(V), std::nanf("")), lc(size_t(V), std::nanf(""));
  std::vector<float> ld(size_t(V), std::nanf(""));
  int32_t drawn = -1;
  SequenceSlots::Sample greedy;
  greedy.options.temperature = 0.0f;
  greedy.token = &drawn;
  std::vector<SequenceSlots::Job> jobs(4);
  jobs[0].slot = sa, jobs[0].tokens = a, jobs[0].logits = la.data();
  jobs[1].slot = sb, jobs[1].tokens = {b.data(), 40};
  jobs[2].slot = sc, jobs[2].tokens = c, jobs[2].logits = lc.data(), jobs[2].sample = &greedy;
  jobs[3].slot = sd, jobs[3].tokens = d, jobs[3].logits = ld.data();
  slots.run(jobs);
  jobs.pop_back();
  const auto want_a = cpu_logits(a, {5}), want_c = cpu_logits(c, {}), want_d = cpu_logits(d, {});
  const double e_a = test::rel_l2(la.data(), want_a[0].data(), V);
  EXPECT_LE(e_a, kGemmVsCpu) << "a's last prompt position";
  const double e_d = test::rel_l2(ld.data(), want_d[0].data(), V);
  EXPECT_LE(e_d, 1e-4) << "d's last prompt position (the decoder: its float32 precision)";
  ASSERT_GE(drawn, 0);
  ASSERT_LT(drawn, V);
  const float best = *std::max_element(want_c[0].begin(), want_c[0].end());
  EXPECT_GE(want_c[0][size_t(drawn)], best - 0.05f * std::fabs(best)) << "c's greedy draw " << drawn;
  {
    cuda::Session alone(on_gpu, context);
    std::vector<float> ref(static_cast<size_t>(V));
    alone.run(a, ref.data());
    const double e_same = test::rel_l2(la.data(), ref.data(), V);
    EXPECT_LE(e_same, 1e-5) << "a's logits against a Session's GEMM prefill of the same prompt";
    std::printf("  a: GEMM prefill in the slots vs CPU %.2e, vs a Session's %.2e; d (200 tokens, the decoder) %.2e\n",
                e_a, e_same, e_d);
  }

  // Run 2: b's other 380 tokens (the GEMM prefill from position 40), a and c decode a token each
  // in the batched step.
  const int32_t next_a = 5, next_c = drawn;
  std::vector<float> la2(size_t(V), std::nanf("")), lc2(size_t(V), std::nanf(""));
  jobs[0].tokens = {&next_a, 1}, jobs[0].logits = la2.data();
  jobs[1].tokens = {b.data() + 40, b.size() - 40}, jobs[1].logits = lb.data();
  jobs[2].tokens = {&next_c, 1}, jobs[2].logits = lc2.data(), jobs[2].sample = nullptr;
  slots.run(jobs);
  const auto want_b = cpu_logits(b, {}), want_c2 = cpu_logits(c, {drawn});
  const double e_a2 = test::rel_l2(la2.data(), want_a[1].data(), V), e_b = test::rel_l2(lb.data(), want_b[0].data(), V),
               e_c2 = test::rel_l2(lc2.data(), want_c2[1].data(), V);
  EXPECT_LE(e_a2, kGemmVsCpu) << "a's token decoded after the GEMM prefill";
  EXPECT_LE(e_b, kGemmVsCpu) << "b's last prompt position (chunks of 40 and 380)";
  EXPECT_LE(e_c2, kGemmVsCpu) << "c's token decoded after the GEMM prefill and the draw";
  std::printf("  decoded after: a %.2e, c %.2e; b (40 + 380) %.2e\n", e_a2, e_c2, e_b);
}

// GpuSlots refuses what it cannot run, naming the numbers.
TEST(CudaServe, SlotsAndPoolLimitsAreNamed) {
  auto model = load_model(test::fixture_dir("qwen3moe-nvfp4"));
  cuda::GpuModel on_gpu(*model, Layout{1, 1});
  EXPECT_THROW(cuda::GpuSlots(on_gpu, cuda::GpuSlots::kMaxSlots + 1, 64, 0), Error);
  cuda::GpuSlots slots(on_gpu, 2, 64, 40);  // two blocks
  EXPECT_EQ(slots.kv_positions(), 32);
  const std::vector<int32_t> prompt{1, 2, 3};
  EXPECT_EQ(slots.open(20, prompt).slot, 0);
  try {
    slots.open(20, prompt);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("0 of its 2 blocks"), std::string::npos) << e.what();
  }
  slots.close(0);
  EXPECT_EQ(slots.open(32, prompt).slot, 0);
  EXPECT_THROW(slots.open(65, prompt), Error);  // longer than the context
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
  auto gpu = gpu_engine(*model, o, on_gpu, 0);
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const auto& r : rs) streams.push_back(gpu->submit(r));
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
  gpu->shutdown(1.0);
}

}  // namespace
}  // namespace kestrel
