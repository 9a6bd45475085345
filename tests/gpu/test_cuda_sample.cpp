// Sampling on the GPU (backend/cuda/sample.h) against the host's sampler: the kept, renormalized
// distribution equals sampling_distribution() (within 1e-5, and the same support apart from
// tokens at a top-p or min-p cut-off within float rounding), temperature 0 is the host's argmax,
// a draw is reproducible per (seed, counter), stays in the support, is the inverse CDF of its
// Philox number, and 20000 draws pass a chi-square test against the host's distribution; the
// decoder's step and a Session draw inside their graphs. Outputs are poisoned before each run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "../unit/fixture.h"
#include "backend/cuda/decoder.h"
#include "backend/cuda/device_model.h"
#include "backend/cuda/philox.h"
#include "backend/cuda/sample.h"
#include "backend/cuda/session.h"
#include "device_buffer.h"
#include "model/weights.h"
#include "runtime/sampler.h"

namespace kestrel {
namespace {

using test::DeviceBuffer;

constexpr double kTol = 1e-5;  // relative, per probability (plus 1e-8 absolute for tiny ones)

struct Drawn {
  std::vector<int32_t> tokens;
  std::vector<float> dist;  // [rows, vocab] when asked for
};

// launch_sample over rows [params.size(), vocab] of logits, outputs poisoned first.
Drawn sample_on_gpu(const std::vector<float>& logits, int vocab, const std::vector<cuda::SampleParams>& params,
                    bool with_dist) {
  const int rows = int(params.size());
  DeviceBuffer<float> dl(logits), dd(with_dist ? logits.size() : 1);
  DeviceBuffer<cuda::SampleParams> dp(params);
  DeviceBuffer<int32_t> dt(params.size());
  dt.poison();
  dd.poison();
  cuda::launch_sample(dl.get(), rows, vocab, dp.get(), dt.get(), nullptr, with_dist ? dd.get() : nullptr);
  KESTREL_CUDA_CHECK(cudaGetLastError());
  Drawn d;
  d.tokens = dt.download();
  if (with_dist) d.dist = dd.download();
  return d;
}

// Logits of a few kinds: normal; rounded to halves (many exact ties, cut-offs inside tie
// groups); every third id -inf; a tied maximum with zeros of both signs among the rest.
std::vector<float> make_logits(int vocab, int kind, std::mt19937& rng) {
  std::vector<float> l = test::random_floats(size_t(vocab), rng, 3.0f);
  switch (kind) {
    case 1:
      for (float& x : l) x = std::round(x * 2.0f) / 2.0f;
      break;
    case 2:
      for (size_t i = 1; i < l.size(); i += 3) l[i] = -INFINITY;
      break;
    case 3:
      for (size_t i = 0; i < l.size(); ++i) {
        if (i % 5 == 1) l[i] = i % 10 == 1 ? -0.0f : 0.0f;
        if (i % 97 == 3) l[i] = 9.0f;  // the maximum, several times in large rows
      }
      break;
  }
  return l;
}

// Options that exercise each filter alone, all together and at their extremes.
std::vector<SamplerOptions> option_mixes(int vocab) {
  return {
      {.temperature = 1.0f},
      {.temperature = 0.7f, .top_k = 5},
      {.temperature = 1.0f, .top_k = 40},
      {.temperature = 1.0f, .top_p = 0.9f},
      {.temperature = 1.0f, .min_p = 0.1f},
      {.temperature = 0.8f, .top_k = 50, .top_p = 0.95f, .min_p = 0.05f},
      {.temperature = 1.3f, .top_k = 1},
      {.temperature = 1.0f, .top_p = 1e-6f},
      {.temperature = 1.0f, .min_p = 0.9f},
      {.temperature = 1e-3f},
      {.temperature = 1e3f},
      {.temperature = 1e3f, .top_p = 0.5f},
      {.temperature = 1e-3f, .top_k = 5, .top_p = 0.9f},
      {.temperature = 2.0f, .top_k = vocab + 5, .top_p = 0.3f, .min_p = 0.01f},
  };
}

cuda::SampleParams params_of(const SamplerOptions& o, uint64_t counter) { return cuda::sample_params(o, counter); }

// Row r of rows of `vocab` logits.
std::vector<float> row(const std::vector<float>& rows, int vocab, size_t r) {
  const auto begin = rows.begin() + long(r * size_t(vocab));
  return std::vector<float>(begin, begin + vocab);
}

// Why a token may be kept on one side and not the other: it sits at the top-p cut-off (the
// host's probability mass before it, in its order, is within 1e-5 of top_p) or at the min-p
// cut-off (its exp((x - max) / T) within 1e-5 of min_p), where float and double rounding may
// decide differently; or its probability is near float's underflow. Top-k counts are exact.
struct HostCuts {
  std::vector<double> before, e;  // per token: mass before it among the top-k, exp((x - max) / T)
  std::vector<bool> in_top_k;
};

HostCuts host_cuts(const std::vector<float>& l, const SamplerOptions& o) {
  const size_t n = l.size();
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
  const size_t keep = o.top_k > 0 && size_t(o.top_k) < n ? size_t(o.top_k) : n;
  const float inv_t = 1.0f / o.temperature;
  const double top = double(l[size_t(order[0])]) * inv_t;
  HostCuts h;
  h.before.assign(n, 2.0);
  h.e.assign(n, 0.0);
  h.in_top_k.assign(n, false);
  double sum = 0;
  for (size_t i = 0; i < n; ++i) h.e[i] = std::exp(double(l[i]) * inv_t - top);
  for (size_t j = 0; j < keep; ++j) sum += h.e[size_t(order[j])];
  double cum = 0;
  for (size_t j = 0; j < keep; ++j) {
    const size_t i = size_t(order[j]);
    h.in_top_k[i] = true;
    h.before[i] = cum / sum;
    cum += h.e[i];
  }
  return h;
}

bool at_cut_off(const HostCuts& h, size_t i, const SamplerOptions& o) {
  if (!h.in_top_k[i]) return false;
  if (o.top_p < 1.0f && std::abs(h.before[i] - double(o.top_p)) <= 1e-5) return true;
  if (o.min_p > 0.0f && std::abs(h.e[i] - double(o.min_p)) <= 1e-5 * double(o.min_p)) return true;
  return h.e[i] < 1e-30;
}

// The GPU's row against the host's: the same support but for tokens at a cut-off (at most 2),
// and over the common support, each renormalized there, the same probabilities. Returns the
// worst relative difference.
double expect_same_distribution(const float* gpu, const std::vector<float>& logits, const SamplerOptions& o,
                                const std::string& what) {
  const std::vector<float> cpu = sampling_distribution(logits, o);
  const HostCuts h = host_cuts(logits, o);
  int odd = 0;
  double gs = 0, cs = 0, total = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    EXPECT_TRUE(std::isfinite(gpu[i]) && gpu[i] >= 0.0f) << what << ": p[" << i << "] = " << gpu[i];
    total += gpu[i];
    if ((gpu[i] > 0) != (cpu[i] > 0)) {
      EXPECT_TRUE(at_cut_off(h, i, o)) << what << ": token " << i << " kept by the " << (gpu[i] > 0 ? "GPU" : "host")
                                       << " only (" << gpu[i] << " vs " << cpu[i] << ")";
      ++odd;
    } else if (gpu[i] > 0) {
      gs += gpu[i];
      cs += cpu[i];
    }
  }
  EXPECT_LE(odd, 2) << what;
  EXPECT_NEAR(total, 1.0, 1e-5) << what;
  double worst = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    if (!(gpu[i] > 0 && cpu[i] > 0)) continue;
    const double g = gpu[i] / gs, c = cpu[i] / cs, err = std::abs(g - c);
    EXPECT_LE(err, kTol * c + 1e-8) << what << ": token " << i << " p " << g << " vs " << c;
    worst = std::max(worst, err / std::max(c, 1e-3));
  }
  return worst;
}

std::string case_name(int vocab, int kind, const SamplerOptions& o) {
  return cat("vocab ", vocab, ", logits kind ", kind, ", T ", o.temperature, " top_k ", o.top_k, " top_p ", o.top_p,
             " min_p ", o.min_p);
}

// The token the inverse CDF of `p` (in id order) gives for the draw's number u in [0, 1), and
// whether u is within `tol` of the boundary of the GPU's token instead.
bool draw_consistent(const float* p, size_t n, uint64_t bits, int32_t token, double tol) {
  const double u = std::ldexp(double(bits), -64);
  if (token < 0 || size_t(token) >= n || !(p[token] > 0)) return false;
  double before = 0;
  for (int32_t i = 0; i < token; ++i) before += p[i];
  return u >= before - tol && u < before + p[token] + tol;
}

TEST(CudaSample, PhiloxKnownAnswers) {
  // Random123's known-answer vectors for Philox4x32-10.
  const uint32_t c0[4] = {0, 0, 0, 0}, k0[2] = {0, 0};
  const uint32_t c1[4] = {0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, k1[2] = {0xffffffffu, 0xffffffffu};
  const uint32_t c2[4] = {0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, k2[2] = {0xa4093822u, 0x299f31d0u};
  auto philox = [](const uint32_t* c, const uint32_t* k) {
    std::vector<uint32_t> out(4);
    cuda::philox4x32_10(c, k, out.data());
    return out;
  };
  EXPECT_EQ(philox(c0, k0), (std::vector<uint32_t>{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
  EXPECT_EQ(philox(c1, k1), (std::vector<uint32_t>{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}));
  EXPECT_EQ(philox(c2, k2), (std::vector<uint32_t>{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}));
  EXPECT_EQ(cuda::sample_bits(0, 0), 0xe169c58d6627e8d5ull);
  EXPECT_EQ(cuda::scale_bits(~0ull, 10), 9u);
  EXPECT_EQ(cuda::scale_bits(0, 10), 0u);
}

// Every option mix on every kind of logits, one row each, for vocabularies of 1 to 151936.
TEST(CudaSample, DistributionMatchesHost) {
  std::mt19937 rng(2024);
  for (int vocab : {1, 7, 1000, 151936}) {
    const std::vector<SamplerOptions> mixes = option_mixes(vocab);
    std::vector<float> logits;
    std::vector<cuda::SampleParams> params;
    std::vector<std::pair<int, SamplerOptions>> rows;  // (kind, options)
    for (int kind = 0; kind < 4; ++kind)
      for (const SamplerOptions& o : mixes) {
        const std::vector<float> l = make_logits(vocab, kind, rng);
        logits.insert(logits.end(), l.begin(), l.end());
        params.push_back(params_of(o, rows.size()));
        rows.push_back({kind, o});
      }
    const Drawn d = sample_on_gpu(logits, vocab, params, true);
    double worst = 0;
    for (size_t r = 0; r < rows.size(); ++r) {
      const std::string what = case_name(vocab, rows[r].first, rows[r].second);
      const std::vector<float> l = row(logits, vocab, r);
      const float* p = d.dist.data() + r * size_t(vocab);
      worst = std::max(worst, expect_same_distribution(p, l, rows[r].second, what));
      EXPECT_TRUE(d.tokens[r] >= 0 && d.tokens[r] < vocab && p[d.tokens[r]] > 0) << what << ": token " << d.tokens[r];
    }
    std::printf("  vocab %d: %zu rows, worst relative difference %.2e\n", vocab, rows.size(), worst);
  }
}

// Temperature 0 is the host's argmax whatever the other options say: ties (a repeated maximum,
// -0 and +0) go to the lowest id; the distribution output is one-hot there.
TEST(CudaSample, GreedyIsTheHostsArgmax) {
  std::mt19937 rng(7);
  for (int vocab : {1, 7, 1000, 151936}) {
    std::vector<float> logits;
    std::vector<cuda::SampleParams> params;
    for (int kind = 0; kind < 4; ++kind)
      for (const SamplerOptions& mix : option_mixes(vocab)) {
        std::vector<float> l = make_logits(vocab, kind, rng);
        if (kind == 0 && vocab > 5) {  // the maximum at -0 and +0, below it only negatives
          for (float& x : l) x = -std::abs(x) - 1.0f;
          l[size_t(vocab) - 1] = 0.0f;
          l[size_t(vocab) / 2] = -0.0f;
        }
        logits.insert(logits.end(), l.begin(), l.end());
        SamplerOptions o = mix;
        o.temperature = 0.0f;
        o.seed = 99;
        params.push_back(params_of(o, 5));
      }
    const Drawn d = sample_on_gpu(logits, vocab, params, true);
    for (size_t r = 0; r < params.size(); ++r) {
      const std::vector<float> l = row(logits, vocab, r);
      Sampler host({});
      const int32_t want = host.sample(l, {});
      EXPECT_EQ(d.tokens[r], want) << "vocab " << vocab << " row " << r;
      std::vector<float> one_hot(size_t(vocab), 0.0f);
      one_hot[size_t(want)] = 1.0f;
      EXPECT_TRUE(std::equal(one_hot.begin(), one_hot.end(), d.dist.begin() + long(r * size_t(vocab))))
          << "vocab " << vocab << " row " << r;
    }
  }
}

// A draw depends on (logits, options, seed, counter) only: the same in another row, in another
// launch, with or without the distribution output; other counters give other tokens. Each token
// is the inverse CDF, in id order, of the row's distribution at the draw's Philox number.
TEST(CudaSample, DrawsAreReproducibleAndFollowTheirNumbers) {
  std::mt19937 rng(99);
  for (int vocab : {7, 1000, 151936}) {
    const std::vector<SamplerOptions> mixes = option_mixes(vocab);
    std::vector<float> logits;
    std::vector<cuda::SampleParams> params;
    const std::vector<float> l = make_logits(vocab, 0, rng);
    for (size_t m = 0; m < mixes.size(); ++m)
      for (uint64_t counter = 0; counter < 16; ++counter) {
        SamplerOptions o = mixes[m];
        o.seed = 1234 + m;
        logits.insert(logits.end(), l.begin(), l.end());
        params.push_back(params_of(o, counter));
      }
    const Drawn a = sample_on_gpu(logits, vocab, params, true);
    const Drawn b = sample_on_gpu(logits, vocab, params, false);
    EXPECT_EQ(a.tokens, b.tokens) << "vocab " << vocab;
    // The same (seed, counter) in other rows of one launch: every row is row 0's options at counter 3.
    std::vector<cuda::SampleParams> same(params.size(), params[3]);
    const Drawn c = sample_on_gpu(logits, vocab, same, false);
    for (int32_t t : c.tokens) EXPECT_EQ(t, a.tokens[3]) << "vocab " << vocab;
    int inconsistent = 0;
    for (size_t r = 0; r < params.size(); ++r) {
      const float* p = a.dist.data() + r * size_t(vocab);
      const uint64_t bits = cuda::sample_bits(params[r].seed, params[r].counter);
      if (!draw_consistent(p, size_t(vocab), bits, a.tokens[r], 1e-6)) ++inconsistent;
    }
    EXPECT_EQ(inconsistent, 0) << "vocab " << vocab << ": tokens off their inverse CDF";
    // Rows 0..15 (temperature 1, no filter): other counters give other tokens unless one token
    // holds most of the mass.
    const float p_max = *std::max_element(a.dist.begin(), a.dist.begin() + vocab);
    std::vector<int32_t> first(a.tokens.begin(), a.tokens.begin() + 16);
    std::sort(first.begin(), first.end());
    if (p_max < 0.6f) {
      EXPECT_GT(std::unique(first.begin(), first.end()) - first.begin(), 1) << "vocab " << vocab;
    }
  }
}

// The 0.999 quantile of the chi-square distribution with `df` degrees of freedom
// (Wilson-Hilferty).
double chi_square_999(int df) {
  const double z = 3.0902, a = 2.0 / (9.0 * df);
  return df * std::pow(1.0 - a + z * std::sqrt(a), 3.0);
}

// 20000 draws (counters 0..19999, one seed) of a small vocabulary against the host's
// distribution: never outside its support, and a chi-square statistic below the 0.999 quantile.
TEST(CudaSample, TwentyThousandDrawsFitTheHostDistribution) {
  std::mt19937 rng(5);
  const int vocab = 24, draws = 20000;
  const std::vector<float> l = test::random_floats(size_t(vocab), rng, 1.5f);
  const SamplerOptions plain{.temperature = 1.0f, .seed = 77};
  const SamplerOptions filtered{.temperature = 2.0f, .top_k = 12, .top_p = 0.9f, .min_p = 0.05f, .seed = 78};
  for (const SamplerOptions& o : {plain, filtered}) {
    const std::string what = case_name(vocab, 0, o);
    std::vector<float> logits;
    std::vector<cuda::SampleParams> params;
    for (int i = 0; i < draws; ++i) {
      logits.insert(logits.end(), l.begin(), l.end());
      params.push_back(params_of(o, uint64_t(i)));
    }
    const Drawn d = sample_on_gpu(logits, vocab, params, false);
    const std::vector<float> p = sampling_distribution(l, o);
    std::vector<int> count(size_t(vocab), 0);
    for (int32_t t : d.tokens) {
      ASSERT_TRUE(t >= 0 && t < vocab) << what << ": token " << t;
      EXPECT_GT(p[size_t(t)], 0.0f) << what << ": token " << t << " outside the host's support";
      ++count[size_t(t)];
    }
    // Bins of at least 5 expected draws; the rest of the support pooled into one.
    double chi2 = 0, pooled_e = 0, pooled_o = 0;
    int bins = 0;
    for (int t = 0; t < vocab; ++t) {
      const double e = double(p[size_t(t)]) * draws;
      if (e >= 5) {
        chi2 += (count[size_t(t)] - e) * (count[size_t(t)] - e) / e;
        ++bins;
      } else if (e > 0) {
        pooled_e += e;
        pooled_o += count[size_t(t)];
      }
    }
    if (pooled_e >= 5) {
      chi2 += (pooled_o - pooled_e) * (pooled_o - pooled_e) / pooled_e;
      ++bins;
    }
    ASSERT_GE(bins, 3) << what;
    const double limit = chi_square_999(bins - 1);
    std::printf("  %s: chi-square %.1f over %d bins (0.999 quantile %.1f)\n", what.c_str(), chi2, bins, limit);
    EXPECT_LT(chi2, limit) << what;
  }
}

// A non-blocking stream for graph capture (the legacy default stream cannot be captured).
struct Stream {
  cudaStream_t s;
  Stream() { KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(s); }
};

// A decoder step that samples draws inside its graph what launch_sample draws from the step's
// logits, re-reading the parameters at every replay; the greedy step still takes the argmax.
TEST(CudaSample, DecoderStepSamplesInItsGraph) {
  auto model = load_model(test::fixture_dir("qwen3moe-nvfp4"));
  auto dm = cuda::DeviceModel::upload(*model);
  const int B = 3, V = int(model->config.vocab_size);
  cuda::Decoder dec(*dm, B, 8);
  Stream stream;
  const std::vector<int32_t> tokens = {5, 17, 101}, positions = {0, 0, 0};
  for (uint64_t counter : {0, 1, 2}) {
    KESTREL_CUDA_CHECK(cudaMemcpy(dec.tokens(), tokens.data(), B * 4, cudaMemcpyHostToDevice));
    KESTREL_CUDA_CHECK(cudaMemcpy(dec.positions(), positions.data(), B * 4, cudaMemcpyHostToDevice));
    const std::vector<cuda::SampleParams> params = {
        params_of({}, counter),  // greedy
        params_of({.temperature = 1.5f, .seed = 3}, counter),
        params_of({.temperature = 1.0f, .top_k = 20, .top_p = 0.9f, .seed = 4}, counter)};
    KESTREL_CUDA_CHECK(cudaMemcpy(dec.sample_params(), params.data(), B * sizeof(cuda::SampleParams),
                                  cudaMemcpyHostToDevice));
    KESTREL_CUDA_CHECK(cudaMemset(const_cast<int32_t*>(dec.next()), 0xff, B * 4));
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());  // the copies above are on the legacy stream
    dec.step_graph(B, false, stream.s, cuda::Decoder::Logits::All, true);
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream.s));
    std::vector<int32_t> next(B);
    std::vector<float> logits(size_t(B) * size_t(V));
    KESTREL_CUDA_CHECK(cudaMemcpy(next.data(), dec.next(), B * 4, cudaMemcpyDeviceToHost));
    KESTREL_CUDA_CHECK(cudaMemcpy(logits.data(), dec.logits(), logits.size() * 4, cudaMemcpyDeviceToHost));
    EXPECT_EQ(next, sample_on_gpu(logits, V, params, false).tokens) << "counter " << counter;
    Sampler greedy({});
    EXPECT_EQ(next[0], greedy.sample(std::span<const float>(logits.data(), size_t(V)), {}));

    dec.step_graph(B, false, stream.s, cuda::Decoder::Logits::All, false);
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream.s));
    KESTREL_CUDA_CHECK(cudaMemcpy(next.data(), dec.next(), B * 4, cudaMemcpyDeviceToHost));
    for (int b = 0; b < B; ++b)
      EXPECT_EQ(next[size_t(b)], greedy.sample(std::span<const float>(logits.data() + size_t(b) * V, size_t(V)), {}));
  }
}

// Session::run_sample (generate and chat on the GPU) draws what launch_sample draws from the
// logits Session::run hands back for the same tokens, after a prompt of several chunks and
// after single tokens.
TEST(CudaSample, SessionDrawsFromItsLogits) {
  auto model = load_model(test::fixture_dir("qwen3moe-nvfp4"));
  auto dm = cuda::DeviceModel::upload(*model);
  const int V = int(model->config.vocab_size);
  cuda::Session with_logits(*dm, 32), sampling(*dm, 32);
  std::vector<int32_t> run = {3, 9, 27, 81, 243, 7, 21, 63, 189, 55, 11};  // two chunks
  std::vector<float> logits(static_cast<size_t>(V));
  for (int step = 0; step < 4; ++step) {
    const SamplerOptions o = step % 2 ? SamplerOptions{.temperature = 1.2f, .top_p = 0.95f, .seed = 8}
                                      : SamplerOptions{};
    const cuda::SampleParams p = params_of(o, uint64_t(step));
    with_logits.run(run, logits.data());
    const int32_t got = sampling.run_sample(run, p);
    EXPECT_EQ(got, sample_on_gpu(logits, V, {p}, false).tokens[0]) << "step " << step;
    EXPECT_EQ(sampling.position(), with_logits.position());
    run = {got};
  }
}

}  // namespace
}  // namespace kestrel
