// The GEMM prefill (backend/cuda/prefill_gemm.h): its own kernels against the CPU, whole fixture
// models against the CPU reference (in chunks, across chunk boundaries, and decoding on after it
// from the cache it filled), and real MoE shapes with random weights against the decode step's
// chunks of 64.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

#include "../unit/fixture.h"
#include "backend/cpu/forward.h"
#include "backend/cuda/decoder.h"
#include "backend/cuda/device_model.h"
#include "backend/cuda/expert_sort.h"
#include "backend/cuda/prefill_gemm.h"
#include "backend/cuda/session.h"
#include "backend/cuda/weights_bf16.h"
#include "common/numeric.h"
#include "device_buffer.h"
#include "formats/json_file.h"
#include "model/weights.h"

namespace kestrel {
namespace {

using test::DeviceBuffer;

// The GEMM prefill rounds every product's input activations to BF16 (8 significant bits; the
// weights stay exact: NVFP4 and BF16 are exact in BF16), where the CPU and the decode step keep
// float32: relative L2 error of the logits, per position. The BF16 KV cache test allows 1e-2 for
// its keys and values alone; this one rounds the inputs of every product. The tests print the
// worst they saw: record it in docs/PERF.md and tighten this once measured.
constexpr double kGemmVsCpu = 2e-2;
constexpr double kVsCpu = 1e-4;  // what falls back to the decode step (MLA models) keeps its tolerance

struct Stream {
  cudaStream_t s;
  Stream() { KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(s); }
};

std::vector<float> download(const float* p, size_t n) {
  std::vector<float> v(n);
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  KESTREL_CUDA_CHECK(cudaMemcpy(v.data(), p, n * 4, cudaMemcpyDeviceToHost));
  return v;
}

// Every format's conversion to BF16 against the CPU's dequantization: NVFP4 (times the GEMM's
// alpha, scale2) and BF16 exactly, float32 to BF16's rounding; the batched launch as the single one.
TEST(CudaPrefillOps, ToBf16MatchesCpuDequant) {
  std::mt19937 rng(7);
  const int out = 37, in = 96;
  for (const WeightFormat f : {WeightFormat::NVFP4, WeightFormat::BF16, WeightFormat::F32}) {
    SCOPED_TRACE(int(f));
    std::vector<uint8_t> data, scales;
    std::uniform_int_distribution<int> byte(0, 255), sc(0x20, 0x38);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    Linear host;
    host.out = out, host.in = in, host.format = f;
    if (f == WeightFormat::NVFP4) {
      data.resize(size_t(out) * in / 2);
      scales.resize(size_t(out) * in / 16);
      for (auto& b : data) b = uint8_t(byte(rng));
      for (auto& s : scales) s = uint8_t(sc(rng));
      host.scale2 = 0.37f;
    } else {
      const size_t width = f == WeightFormat::BF16 ? 2 : 4;
      data.resize(size_t(out) * in * width);
      for (size_t i = 0; i < size_t(out) * in; ++i) {
        const float v = nd(rng);
        if (width == 2) {
          const uint16_t h = f32_to_bf16(v);
          std::memcpy(&data[2 * i], &h, 2);
        } else {
          std::memcpy(&data[4 * i], &v, 4);
        }
      }
    }
    host.data = data.data();
    host.scales = scales.empty() ? nullptr : scales.data();
    DeviceBuffer<uint8_t> d_data(data), d_scales(scales.empty() ? std::vector<uint8_t>(1) : scales);
    cuda::DLinear dev;
    dev.out = out, dev.in = in, dev.format = cuda::DFormat(uint8_t(f)), dev.data = d_data.get();
    dev.scales = scales.empty() ? nullptr : d_scales.get();
    dev.scale2 = host.scale2;
    std::vector<float> want(static_cast<size_t>(out) * in);
    for (int r = 0; r < out; ++r) host.dequant_row(r, want.data() + size_t(r) * in);
    DeviceBuffer<uint16_t> one(size_t(out) * in), two(2 * size_t(out) * in);
    one.poison(), two.poison();
    cuda::launch_to_bf16(cuda::Bf16Job{dev, reinterpret_cast<__nv_bfloat16*>(one.get())}, nullptr);
    const cuda::Bf16Job jobs[2] = {{dev, reinterpret_cast<__nv_bfloat16*>(two.get())},
                                   {dev, reinterpret_cast<__nv_bfloat16*>(two.get()) + size_t(out) * in}};
    DeviceBuffer<cuda::Bf16Job> d_jobs(std::vector<cuda::Bf16Job>(jobs, jobs + 2));
    cuda::launch_to_bf16(d_jobs.get(), 2, int64_t(out) * in, nullptr);
    const std::vector<uint16_t> a = one.download(), b = two.download();
    const float alpha = cuda::bf16_alpha(dev);
    std::vector<float> got(want.size());
    for (size_t i = 0; i < got.size(); ++i) got[i] = bf16_to_f32(a[i]) * alpha;
    EXPECT_LE(test::rel_err(got, want), f == WeightFormat::F32 ? 4e-3 : 1e-7);
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(a[i], b[i]) << "batched, first job, element " << i;
      ASSERT_EQ(a[i], b[got.size() + i]) << "batched, second job, element " << i;
    }
    DeviceBuffer<float> f32(size_t(out) * in);
    f32.poison();
    cuda::launch_to_f32(dev, f32.get(), nullptr);
    EXPECT_LE(test::rel_err(f32.download(), want), 1e-7) << "to float32";
  }
}

// The sort by expert is stable (each expert's pairs in pair order), the gather copies each row's
// token, and the combination adds the weighted rows in slot order.
TEST(CudaPrefillOps, ExpertSortGatherCombine) {
  std::mt19937 rng(11);
  const int tokens = 301, K = 8, E = 64, W = 40, P = tokens * K;
  std::vector<int32_t> experts(static_cast<size_t>(P));
  std::vector<int32_t> ids(E);
  std::iota(ids.begin(), ids.end(), 0);
  for (int t = 0; t < tokens; ++t) {  // distinct experts per token, some experts left without any
    std::shuffle(ids.begin(), ids.end() - 3, rng);
    std::copy(ids.begin(), ids.begin() + K, experts.begin() + t * K);
  }
  DeviceBuffer<int32_t> d_experts(experts), counts(E), row_pair(P), pair_row(P);
  row_pair.poison(), pair_row.poison();
  cuda::ExpertSort sort{counts.get(), row_pair.get(), pair_row.get()};
  cuda::launch_expert_sort(d_experts.get(), P, E, sort, nullptr);
  std::vector<int32_t> want_counts(E, 0), want_rows;
  for (int e = 0; e < E; ++e)
    for (int p = 0; p < P; ++p)
      if (experts[size_t(p)] == e) ++want_counts[size_t(e)], want_rows.push_back(p);
  EXPECT_EQ(counts.download(), want_counts);
  const std::vector<int32_t> rows = row_pair.download(), inverse = pair_row.download();
  EXPECT_EQ(rows, want_rows);
  for (int r = 0; r < P; ++r) EXPECT_EQ(inverse[size_t(rows[size_t(r)])], r) << "row " << r;

  std::vector<uint16_t> x(static_cast<size_t>(tokens) * W);
  for (auto& v : x) v = f32_to_bf16(std::normal_distribution<float>(0.0f, 1.0f)(rng));
  DeviceBuffer<uint16_t> d_x(x), xs(static_cast<size_t>(P) * W);
  xs.poison();
  cuda::launch_gather_rows(reinterpret_cast<const __nv_bfloat16*>(d_x.get()), W, row_pair.get(), P, K,
                           reinterpret_cast<__nv_bfloat16*>(xs.get()), nullptr);
  const std::vector<uint16_t> gathered = xs.download();
  for (int r = 0; r < P; ++r)
    ASSERT_EQ(0, std::memcmp(&gathered[size_t(r) * W], &x[size_t(rows[size_t(r)] / K) * W], W * 2)) << "row " << r;

  const std::vector<float> ys = test::random_floats(size_t(P) * W, rng), w = test::random_floats(size_t(P), rng),
                           res = test::random_floats(size_t(tokens) * W, rng);
  DeviceBuffer<float> d_ys(ys), d_w(w), d_res(res);
  cuda::launch_combine_experts(d_ys.get(), W, pair_row.get(), d_w.get(), tokens, K, d_res.get(), nullptr);
  std::vector<float> want = res;
  for (int t = 0; t < tokens; ++t)
    for (int c = 0; c < W; ++c) {
      float sum = 0.0f;
      for (int j = 0; j < K; ++j) {
        const int p = t * K + j;
        sum += w[size_t(p)] * ys[size_t(inverse[size_t(p)]) * W + c];
      }
      want[size_t(t) * W + c] += sum;
    }
  EXPECT_LE(test::rel_err(d_res.download(), want), 1e-6);
}

class CudaPrefillTest : public ::testing::TestWithParam<std::string> {};

// The GEMM prefill directly over the fixture's prompt but its last token, in chunks of 3
// (several chunks and a shorter last one where the length allows): the last position's logits against the CPU
// reference; then the last token through the decode step on the cache the chunks filled.
// Chunks of 3: the fixtures' prompts are short.
TEST_P(CudaPrefillTest, ChunksMatchCpuAndDecodingGoesOn) {
  const std::string dir = test::fixture_dir(GetParam());
  auto model = load_model(dir);
  const test::Reference ref = test::load_reference(dir);
  const int64_t T = int64_t(ref.tokens.size()), V = ref.vocab;
  ASSERT_GE(T, 5);
  auto dm = cuda::DeviceModel::upload(*model);
  const std::string why = cuda::GemmPrefill::unsupported(*dm);
  if (!why.empty()) {
    EXPECT_TRUE(dm->config().is_mla()) << why;
    GTEST_SKIP() << "the GEMM prefill does not take " << why << " (Session falls back: next test)";
  }
  ThreadPool pool(2);
  cpu::Forward fwd(*model, pool);
  KvCache cache = fwd.make_cache(T);
  std::vector<float> want(static_cast<size_t>(T * V));
  fwd.run(ref.tokens, cache, want.data());

  cuda::Decoder dec(*dm, 1, int(T), true);
  cuda::GemmPrefill pre(*dm, dec, 3);
  Stream st;
  for (int64_t i = 0; i < T - 1; i += 3) {
    const int n = int(std::min<int64_t>(3, T - 1 - i));
    pre.run(ref.tokens.data() + i, n, int(i), st.s, i + n == T - 1);
  }
  const std::vector<float> got = download(pre.logits(), size_t(V));
  const double e_pre = test::rel_l2(got.data(), want.data() + (T - 2) * V, V);
  EXPECT_LE(e_pre, kGemmVsCpu) << "last prefilled position";
  KESTREL_CUDA_CHECK(cudaMemcpy(dec.tokens(), &ref.tokens[size_t(T - 1)], 4, cudaMemcpyHostToDevice));
  const int32_t p = int32_t(T - 1);
  KESTREL_CUDA_CHECK(cudaMemcpy(dec.positions(), &p, 4, cudaMemcpyHostToDevice));
  dec.step(1, st.s);
  const std::vector<float> next = download(dec.logits(), size_t(V));
  const double e_next = test::rel_l2(next.data(), want.data() + (T - 1) * V, V);
  EXPECT_LE(e_next, kGemmVsCpu) << "the next token, decoded from the prefilled cache";
  std::printf("  GEMM prefill vs CPU: rel L2 %.2e (last prefilled), %.2e (decoded after)\n", e_pre, e_next);
}

// A Session with the GEMM prefill on (chunks of 512) over a 700-token prompt made by repeating
// the fixture's tokens, so that it crosses a chunk boundary; its last logits and the next
// token's against the CPU. Models the path does not take (MLA) fall back to the decode step.
TEST_P(CudaPrefillTest, SessionAcrossChunkBoundaries) {
  const std::string dir = test::fixture_dir(GetParam());
  auto model = load_model(dir);
  const test::Reference ref = test::load_reference(dir);
  const int64_t V = ref.vocab, T = 700;
  std::vector<int32_t> prompt(static_cast<size_t>(T));
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = ref.tokens[i % ref.tokens.size()];
  auto dm = cuda::DeviceModel::upload(*model);
  const bool gemm = cuda::GemmPrefill::unsupported(*dm).empty();
  const double tol = gemm ? kGemmVsCpu : kVsCpu;
  ThreadPool pool(2);
  cpu::Forward fwd(*model, pool);
  KvCache cache = fwd.make_cache(T);
  std::vector<float> want(static_cast<size_t>((T - 1) * V)), want_next(static_cast<size_t>(V));
  fwd.run({prompt.data(), size_t(T - 1)}, cache, want.data());
  fwd.run({prompt.data() + T - 1, 1}, cache, want_next.data());

  cuda::Session s(*dm, int(T), cuda::Session::kDefaultChunk, cuda::KvType::F32, 512);
  std::vector<float> got(static_cast<size_t>(V), std::nanf(""));
  s.run({prompt.data(), size_t(T - 1)}, got.data(), false);
  const double e_pre = test::rel_l2(got.data(), want.data() + (T - 2) * V, V);
  EXPECT_LE(e_pre, tol) << "last prompt position";
  std::fill(got.begin(), got.end(), std::nanf(""));
  s.run({prompt.data() + T - 1, 1}, got.data(), false);
  const double e_next = test::rel_l2(got.data(), want_next.data(), V);
  EXPECT_LE(e_next, tol) << "the token after the prompt";
  std::printf("  %s, 699 + 1 tokens: rel L2 %.2e (prompt), %.2e (next)\n", gemm ? "GEMM prefill" : "decode step",
              e_pre, e_next);
}

INSTANTIATE_TEST_SUITE_P(Families, CudaPrefillTest, ::testing::ValuesIn(test::fixture_names()), [](const auto& info) {
  std::string n = info.param;
  for (char& ch : n)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return n;
});

// Real MoE shapes (3 layers, random weights; GLM-4.5-Air: one dense layer, then routed and shared
// experts) with the experts' GEMMs over many rows, against the decode step's chunks of 64: a prompt
// crossing a 512 boundary and an 8k prompt in chunks of 4096, the prompt's last logits and those of
// 8 tokens decoded after it from the cache each path filled.
// A row whose router input moves by the BF16 rounding can choose another expert where two are
// nearly tied (random routers at these widths: measured once in 18 rows, rel L2 0.41 on the
// prompt's last row of Qwen3-30B-A3B at 8192), so the median row must be within kGemmVsCpu and
// every row below 1 (unrelated logits of equal norm: ~1.4; NaN: infinity).
TEST(CudaRandomPrefill, GemmPrefillMatchesDecodeStepChunks) {
  constexpr int kDecoded = 8;
  for (const char* name : {"qwen3-30b-a3b-nvfp4", "glm-4.5-air-nvfp4"}) {
    SCOPED_TRACE(name);
    const std::string path = std::string(KESTREL_FIXTURES) + "/../../configs/" + name + ".json";
    ModelConfig c = parse_model_config_and_quant(read_json_file(path), path);
    c.num_layers = 3;
    c.moe_layer.resize(3);
    const auto dm = cuda::DeviceModel::random(c);
    ASSERT_EQ(cuda::GemmPrefill::unsupported(*dm), "");
    const int64_t V = c.vocab_size;
    for (const auto& [T, chunk] : {std::pair{700, 512}, std::pair{8192, 4096}}) {
      SCOPED_TRACE(T);
      std::vector<int32_t> prompt(static_cast<size_t>(T) + kDecoded);
      for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = int32_t((int64_t(i) * 7919 + 13) % V);
      cuda::Session old(*dm, T + kDecoded, cuda::Session::kDefaultChunk, cuda::KvType::F32, 0);
      cuda::Session gemm(*dm, T + kDecoded, cuda::Session::kDefaultChunk, cuda::KvType::F32, chunk);
      std::vector<float> a(static_cast<size_t>(V)), b(static_cast<size_t>(V));
      old.run({prompt.data(), size_t(T)}, a.data(), false);
      gemm.run({prompt.data(), size_t(T)}, b.data(), false);
      std::vector<double> err = {test::rel_l2(b.data(), a.data(), V)};
      for (int i = 0; i < kDecoded; ++i) {
        old.run({prompt.data() + T + i, 1}, a.data(), false);
        gemm.run({prompt.data() + T + i, 1}, b.data(), false);
        err.push_back(test::rel_l2(b.data(), a.data(), V));
      }
      std::vector<double> sorted = err;
      std::sort(sorted.begin(), sorted.end());
      EXPECT_LE(sorted[sorted.size() / 2], kGemmVsCpu) << "median row";
      EXPECT_LE(sorted.back(), 1.0) << "worst row";
      std::printf("  random %s, 3 layers, %d tokens in chunks of %d vs chunks of 64: rel L2 %.2e (prompt's last), "
                  "median %.2e, worst %.2e (with %d decoded after)\n",
                  name, T, chunk, err[0], sorted[sorted.size() / 2], sorted.back(), kDecoded);
    }
  }
}

}  // namespace
}  // namespace kestrel
