// Every CUDA op against the CPU reference on fresh random inputs. Outputs are poisoned with NaN
// before each run so an element a kernel does not write fails the check.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <numeric>
#include <random>
#include <string>

#include "backend/cpu/attention.h"
#include "backend/cpu/mla.h"
#include "backend/cpu/linear.h"
#include "backend/cpu/moe.h"
#include "backend/cpu/ops.h"
#include "backend/cuda/attention.h"
#include "backend/cuda/gemv.h"
#include "backend/cuda/misc.h"
#include "backend/cuda/mla.h"
#include "backend/cuda/moe.h"
#include "backend/cuda/norm_rope.h"
#include "backend/cuda/read_chain.h"
#include "common/env.h"
#include "common/numeric.h"
#include "../unit/fixture.h"
#include "device_buffer.h"
#include "paged_kv.h"

namespace kestrel {
namespace {

using test::DeviceBuffer;

constexpr double kTol = 1e-5;  // float32 with a different summation order

// A random weight matrix held on the host (CPU view) and on the device.
struct RandomLinear {
  std::vector<uint8_t> data, scales;
  std::vector<float> bias;
  Linear host;
  std::unique_ptr<DeviceBuffer<uint8_t>> d_data, d_scales;
  std::unique_ptr<DeviceBuffer<float>> d_bias;
  cuda::DLinear dev;

  RandomLinear(int out, int in, WeightFormat f, std::mt19937& rng, bool with_bias = false) {
    host.out = out;
    host.in = in;
    host.format = f;
    std::uniform_int_distribution<int> byte(0, 255);
    std::normal_distribution<float> nd(0.0f, 1.0f / std::sqrt(float(in)));
    if (f == WeightFormat::NVFP4) {
      data.resize(size_t(out) * in / 2);
      scales.resize(size_t(out) * in / 16);
      for (auto& b : data) b = uint8_t(byte(rng));
      std::uniform_int_distribution<int> sc(0x20, 0x38);  // E4M3 0.0156 .. 1.0
      for (auto& s : scales) s = uint8_t(sc(rng));
      host.scale2 = 0.37f;
    } else if (f == WeightFormat::BF16) {
      data.resize(size_t(out) * in * 2);
      for (size_t i = 0; i < size_t(out) * in; ++i) {
        const uint16_t h = f32_to_bf16(nd(rng));
        std::memcpy(&data[2 * i], &h, 2);
      }
    } else {
      data.resize(size_t(out) * in * 4);
      for (size_t i = 0; i < size_t(out) * in; ++i) {
        const float v = nd(rng);
        std::memcpy(&data[4 * i], &v, 4);
      }
    }
    host.data = data.data();
    host.scales = scales.empty() ? nullptr : scales.data();
    if (with_bias) host.bias = test::random_floats(size_t(out), rng, 0.1f);
    d_data = std::make_unique<DeviceBuffer<uint8_t>>(data);
    dev.out = out;
    dev.in = in;
    dev.format = cuda::DFormat(uint8_t(f));
    dev.data = d_data->get();
    dev.scale2 = host.scale2;
    if (!scales.empty()) {
      d_scales = std::make_unique<DeviceBuffer<uint8_t>>(scales);
      dev.scales = d_scales->get();
    }
    if (with_bias) {
      d_bias = std::make_unique<DeviceBuffer<float>>(host.bias);
      dev.bias = d_bias->get();
    }
  }
};

struct LinearCase {
  WeightFormat format;
  int out, in, batch;
};

class LinearTest : public ::testing::TestWithParam<LinearCase> {};

TEST_P(LinearTest, MatchesCpu) {
  const auto p = GetParam();
  std::mt19937 rng(1234 + p.out + p.in + p.batch);
  RandomLinear W(p.out, p.in, p.format, rng, true);
  const auto x = test::random_floats(size_t(p.batch) * p.in, rng);
  std::vector<float> ref(size_t(p.batch) * p.out);
  ThreadPool pool(1);
  cpu::linear(W.host, x.data(), p.batch, ref.data(), pool);

  DeviceBuffer<float> dx(x), dy(ref.size());
  dy.poison();
  const cuda::LinearJob job{W.dev, dy.get()};
  cuda::launch_linear(&job, 1, dx.get(), p.batch, false, nullptr);
  const double err = test::rel_err(dy.download(), ref);
  EXPECT_LE(err, kTol);
  std::printf("  linear %d x %d, %d tokens: rel err %.2e vs cpu\n", p.out, p.in, p.batch, err);

  // Accumulate mode adds onto what is there.
  const auto base = test::random_floats(ref.size(), rng);
  dy.upload(base);
  cuda::launch_linear(&job, 1, dx.get(), p.batch, true, nullptr);
  std::vector<float> ref2(ref.size());
  for (size_t i = 0; i < ref.size(); ++i) ref2[i] = base[i] + ref[i];
  EXPECT_LE(test::rel_err(dy.download(), ref2), kTol);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, LinearTest,
    ::testing::Values(LinearCase{WeightFormat::NVFP4, 64, 16, 1}, LinearCase{WeightFormat::NVFP4, 300, 2048, 1},
                      LinearCase{WeightFormat::NVFP4, 129, 784, 3}, LinearCase{WeightFormat::NVFP4, 512, 1536, 8},
                      LinearCase{WeightFormat::NVFP4, 77, 4096, 11}, LinearCase{WeightFormat::BF16, 300, 2048, 1},
                      // Tensor-core path (NVFP4 from 2 tokens, BF16 from 1, K % 64 == 0), tiles of 16 rows
                      // cut by the matrix end.
                      LinearCase{WeightFormat::NVFP4, 200, 2048, 4}, LinearCase{WeightFormat::NVFP4, 45, 192, 7},
                      LinearCase{WeightFormat::NVFP4, 16, 64, 2}, LinearCase{WeightFormat::NVFP4, 1000, 4096, 8},
                      LinearCase{WeightFormat::BF16, 200, 2048, 4}, LinearCase{WeightFormat::BF16, 45, 192, 8},
                      LinearCase{WeightFormat::BF16, 129, 776, 5}, LinearCase{WeightFormat::BF16, 33, 20, 2},
                      LinearCase{WeightFormat::F32, 65, 96, 4},
                      // Tall enough for the several-rows-per-group path (short ones take one row).
                      LinearCase{WeightFormat::NVFP4, 9000, 256, 2}, LinearCase{WeightFormat::NVFP4, 17000, 256, 3},
                      LinearCase{WeightFormat::BF16, 9000, 64, 1},
                      // 9..64 tokens per pass (the wide tensor-core kernel: 2, 4 or 8 groups of 8, the
                      // last one partial), and passes of 64 followed by a shorter one.
                      LinearCase{WeightFormat::NVFP4, 200, 2048, 9}, LinearCase{WeightFormat::NVFP4, 45, 192, 16},
                      LinearCase{WeightFormat::NVFP4, 129, 4096, 27}, LinearCase{WeightFormat::NVFP4, 300, 1024, 64},
                      LinearCase{WeightFormat::NVFP4, 77, 256, 70}, LinearCase{WeightFormat::BF16, 129, 776, 40},
                      LinearCase{WeightFormat::BF16, 33, 128, 129},
                      // Tall enough for the tiled kernel (a block of 128 rows per SM), 8, 2 and 4 groups
                      // in one block row (small matrices spread them over more).
                      LinearCase{WeightFormat::NVFP4, 20000, 128, 64}, LinearCase{WeightFormat::BF16, 17000, 64, 40},
                      LinearCase{WeightFormat::NVFP4, 17000, 128, 16}, LinearCase{WeightFormat::BF16, 17000, 192, 27},
                      // Too few 128-row blocks for the SMs (132 on an H200): the tiled kernel with K split
                      // over a cluster: q/k/v- and o-shaped, one group of 8 tokens, 21 chunks in uneven
                      // parts with a row block cut by the matrix end.
                      LinearCase{WeightFormat::NVFP4, 5120, 2048, 64}, LinearCase{WeightFormat::NVFP4, 2048, 4096, 32},
                      LinearCase{WeightFormat::BF16, 1000, 1024, 16}, LinearCase{WeightFormat::NVFP4, 700, 1344, 40},
                      LinearCase{WeightFormat::NVFP4, 4096, 2048, 8},
                      // 16 warps a block (few tiles, K split over 16 warps; uneven at 65 chunks)
                      LinearCase{WeightFormat::NVFP4, 2048, 4096, 2}, LinearCase{WeightFormat::NVFP4, 77, 4160, 3},
                      LinearCase{WeightFormat::BF16, 200, 8192, 5}));

// The 16-bit half of an n-wide fragment row that holds element e's hi part (slot_mma.cuh's
// frag_word layout: hi + lo FP16 parts of value / 16; the lo part 4 halves on).
size_t frag_half(int e) {
  const int c = e >> 7, j = (e >> 5) & 3, i = (e >> 3) & 3, k = e & 7;
  return 2 * size_t(((c * 8 + 2 * i + (k >> 2)) * 4 + j) * 4 + (k & 1)) + ((k >> 1) & 1);
}

// Fragment rows read back on the host.
std::vector<float> unfrag(const std::vector<uint32_t>& f, int rows, int n) {
  std::vector<float> v(size_t(rows) * size_t(n));
  const auto* h = reinterpret_cast<const uint16_t*>(f.data());
  for (int r = 0; r < rows; ++r)
    for (int e = 0; e < n; ++e) {
      const size_t at = 2 * size_t(r) * n + frag_half(e);
      v[size_t(r) * n + e] = 16.0f * (f16_to_f32(h[at]) + f16_to_f32(h[at + 4]));
    }
  return v;
}

// Rows of n values (n % 128 == 0) as fragment rows, made on the host.
std::vector<uint32_t> to_frag(const std::vector<float>& x, int rows, int n) {
  std::vector<uint32_t> f(size_t(rows) * size_t(n));
  auto* h = reinterpret_cast<uint16_t*>(f.data());
  auto bits = [](_Float16 v) {
    uint16_t u;
    std::memcpy(&u, &v, 2);
    return u;
  };
  for (int r = 0; r < rows; ++r)
    for (int e = 0; e < n; ++e) {
      const float v = x[size_t(r) * n + e] / 16.0f;
      const _Float16 hi = _Float16(v), lo = _Float16(v - float(hi));
      const size_t at = 2 * size_t(r) * n + frag_half(e);
      h[at] = bits(hi), h[at + 4] = bits(lo);
    }
  return f;
}

// An RMSNorm of the input inside the product (one token on CUDA cores) or, where the kernel
// cannot take it, launched first into norm.out, with and without room for fragment rows (which
// 2-7 tokens of NVFP4 rows of whole 128-weight chunks then take, K in uneven shares at 640, and
// one token of a product of 12 M weights and up): against the CPU's norm then product.
TEST(CudaOps, LinearWithNormMatchesCpu) {
  std::mt19937 rng(21);
  for (const LinearCase& p : {LinearCase{WeightFormat::NVFP4, 300, 2048, 1}, LinearCase{WeightFormat::NVFP4, 64, 784, 1},
                              LinearCase{WeightFormat::NVFP4, 129, 784, 3}, LinearCase{WeightFormat::BF16, 300, 2048, 1},
                              LinearCase{WeightFormat::NVFP4, 300, 2048, 2}, LinearCase{WeightFormat::NVFP4, 2048, 4096, 5},
                              LinearCase{WeightFormat::NVFP4, 77, 640, 7}, LinearCase{WeightFormat::BF16, 200, 2048, 3},
                              LinearCase{WeightFormat::NVFP4, 4096, 4096, 1}}) {
    RandomLinear W(p.out, p.in, p.format, rng, true);
    const auto x = test::random_floats(size_t(p.batch) * p.in, rng, 3.0f);
    const auto g = test::random_floats(size_t(p.in), rng);
    std::vector<float> xn(x.size()), ref(size_t(p.batch) * p.out);
    cpu::rms_norm(x.data(), g.data(), p.batch, p.in, 1e-5f, xn.data());
    ThreadPool pool(1);
    cpu::linear(W.host, xn.data(), p.batch, ref.data(), pool);
    for (const bool frag : {false, true}) {
      DeviceBuffer<float> dx(x), dg(g), dy(ref.size()), dxn(x.size());
      DeviceBuffer<uint32_t> dxf(x.size());
      dy.poison(), dxn.poison(), dxf.poison();
      const cuda::LinearJob job{W.dev, dy.get()};
      const bool fused = cuda::linear_fuses_norm(&job, 1, p.batch, frag);
      // One token fuses on CUDA cores, except a large product (12 M weights) given room for
      // fragment rows, which takes tensor cores.
      const bool large = frag && env_switch("KESTREL_LINEAR_FRAG") && double(p.out) * p.in >= 12e6 && p.in % 128 == 0;
      if (!std::getenv("KESTREL_LINEAR_FRAG_MIN_MWEIGHTS") && !std::getenv("KESTREL_LINEAR_FRAG_MIN_BATCH")) {
        EXPECT_EQ(fused, p.format == WeightFormat::NVFP4 && p.batch == 1 && !large)
            << p.out << " x " << p.in << ", batch " << p.batch << (frag ? ", fragment rows" : "");
      }
      cuda::launch_linear(&job, 1, dx.get(), p.batch, false, nullptr,
                          cuda::RowNorm{dg.get(), 1e-5f, dxn.get(), frag ? dxf.get() : nullptr});
      EXPECT_LE(test::rel_err(dy.download(), ref), kTol)
          << p.out << " x " << p.in << ", batch " << p.batch << (frag ? ", fragment rows" : "");
      if (!fused) {
        EXPECT_LE(test::rel_err(dxn.download(), xn), kTol) << "the normalized rows, batch " << p.batch;
      }
      // The fragment rows are made (and so read) exactly where they should be.
      const bool takes = frag && env_switch("KESTREL_LINEAR_FRAG") && p.format == WeightFormat::NVFP4 &&
                         (p.batch >= 2 || !fused) && p.in % 128 == 0;
      if (takes) EXPECT_LE(test::rel_err(unfrag(dxf.download(), p.batch, p.in), xn), 1e-6) << "fragment rows";
      else EXPECT_EQ(dxf.download(), std::vector<uint32_t>(x.size(), 0xffffffffu)) << "fragment rows written";
    }
  }
}

// Products that read their input as fragment rows made by the kernel before (attention's output
// before o): 1-7 tokens of NVFP4 rows of whole 128-weight chunks (o-shaped on 16-warp blocks at 1
// and 2, uneven K shares at 640), where the float input is poison so that only the fragment rows
// can give the result; elsewhere (8 tokens, BF16, K not a multiple of 128) the floats.
TEST(CudaOps, LinearFromFragmentRowsMatchesCpu) {
  std::mt19937 rng(31);
  const bool env = std::getenv("KESTREL_LINEAR_FRAG") || std::getenv("KESTREL_LINEAR_FRAG_MIN_BATCH");
  for (const LinearCase& p : {LinearCase{WeightFormat::NVFP4, 2048, 4096, 2}, LinearCase{WeightFormat::NVFP4, 2048, 4096, 1},
                              LinearCase{WeightFormat::NVFP4, 300, 2048, 5}, LinearCase{WeightFormat::NVFP4, 77, 640, 7},
                              LinearCase{WeightFormat::NVFP4, 200, 2048, 8}, LinearCase{WeightFormat::NVFP4, 64, 784, 3},
                              LinearCase{WeightFormat::BF16, 200, 2048, 3}}) {
    RandomLinear W(p.out, p.in, p.format, rng, true);
    const auto x = test::random_floats(size_t(p.batch) * p.in, rng, 3.0f);
    std::vector<float> ref(size_t(p.batch) * p.out);
    ThreadPool pool(1);
    cpu::linear(W.host, x.data(), p.batch, ref.data(), pool);
    DeviceBuffer<float> dx(x), dy(ref.size());
    DeviceBuffer<uint32_t> dxf(p.in % 128 == 0 ? to_frag(x, p.batch, p.in) : std::vector<uint32_t>(x.size(), 0u));
    const cuda::LinearJob job{W.dev, dy.get()};
    const bool takes = cuda::linear_takes_fragment_rows(&job, 1, p.batch);
    const std::string what = std::to_string(p.out) + " x " + std::to_string(p.in) + ", batch " + std::to_string(p.batch);
    if (!env) {
      EXPECT_EQ(takes, p.format == WeightFormat::NVFP4 && p.in % 128 == 0 && p.batch <= 7) << what;
    }
    if (takes) dx.poison();
    dy.poison();
    cuda::launch_linear(&job, 1, dx.get(), p.batch, false, nullptr, cuda::RowNorm{}, dxf.get());
    EXPECT_LE(test::rel_err(dy.download(), ref), kTol) << what << (takes ? ", from fragment rows" : "");
  }
}

// Three matrices over the same input in one launch_linear of B tokens (q, k and v), each against the CPU.
void check_three_jobs(RandomLinear& a, RandomLinear& b, RandomLinear& c, int B, std::mt19937& rng) {
  const int in = a.host.in;
  const auto x = test::random_floats(size_t(B) * in, rng);
  DeviceBuffer<float> dx(x), ya(size_t(B) * a.host.out), yb(size_t(B) * b.host.out), yc(size_t(B) * c.host.out);
  ya.poison(), yb.poison(), yc.poison();
  const cuda::LinearJob jobs[3] = {{a.dev, ya.get()}, {b.dev, yb.get()}, {c.dev, yc.get()}};
  cuda::launch_linear(jobs, 3, dx.get(), B, false, nullptr);
  ThreadPool pool(1);
  for (auto [w, y] : {std::pair{&a, &ya}, std::pair{&b, &yb}, std::pair{&c, &yc}}) {
    std::vector<float> ref(size_t(B) * w->host.out);
    cpu::linear(w->host, x.data(), B, ref.data(), pool);
    EXPECT_LE(test::rel_err(y->download(), ref), kTol) << w->host.out << " rows";
  }
}

TEST(CudaOps, ThreeJobsInOneLaunch) {
  std::mt19937 rng(7);
  RandomLinear a(128, 256, WeightFormat::NVFP4, rng, true), b(32, 256, WeightFormat::NVFP4, rng, true),
      c(32, 256, WeightFormat::BF16, rng, true);
  check_three_jobs(a, b, c, 2, rng);
}

// q, k and v of 3 tokens from fragment rows made by their RMSNorm: each job's rows from one x.
TEST(CudaOps, ThreeJobsFromFragmentRows) {
  std::mt19937 rng(9);
  const int B = 3, in = 2048;
  RandomLinear a(512, in, WeightFormat::NVFP4, rng, true), b(64, in, WeightFormat::NVFP4, rng, true),
      c(64, in, WeightFormat::NVFP4, rng, true);
  const auto x = test::random_floats(size_t(B) * in, rng, 3.0f);
  const auto g = test::random_floats(size_t(in), rng);
  std::vector<float> xn(x.size());
  cpu::rms_norm(x.data(), g.data(), B, in, 1e-5f, xn.data());
  DeviceBuffer<float> dx(x), dg(g), dxn(x.size()), ya(size_t(B) * a.host.out), yb(size_t(B) * b.host.out),
      yc(size_t(B) * c.host.out);
  DeviceBuffer<uint32_t> dxf(x.size());
  ya.poison(), yb.poison(), yc.poison(), dxf.poison();
  const cuda::LinearJob jobs[3] = {{a.dev, ya.get()}, {b.dev, yb.get()}, {c.dev, yc.get()}};
  cuda::launch_linear(jobs, 3, dx.get(), B, false, nullptr, cuda::RowNorm{dg.get(), 1e-5f, dxn.get(), dxf.get()});
  ThreadPool pool(1);
  for (auto [w, y] : {std::pair{&a, &ya}, std::pair{&b, &yb}, std::pair{&c, &yc}}) {
    std::vector<float> ref(size_t(B) * w->host.out);
    cpu::linear(w->host, xn.data(), B, ref.data(), pool);
    EXPECT_LE(test::rel_err(y->download(), ref), kTol) << w->host.out << " rows";
  }
}

// q, k and v in one launch of the split tiled kernel: the parts of a row block belong to one job.
TEST(CudaOps, ThreeJobsSplitOverClusters) {
  std::mt19937 rng(8);
  RandomLinear a(4096, 2048, WeightFormat::NVFP4, rng, true), b(512, 2048, WeightFormat::NVFP4, rng, true),
      c(448, 2048, WeightFormat::NVFP4, rng, true);
  check_three_jobs(a, b, c, 24, rng);
}

// CUDA cores (1 token, K % 64 != 0) and tensor cores (2..32 tokens per pass: 1, 2 or 4 groups
// of 8, passes of 32 followed by a shorter one), NVFP4 and BF16.
TEST(CudaOps, GatedMatchesCpu) {
  std::mt19937 rng(11);
  struct Case {
    WeightFormat f;
    int out, in, B;
  };
  for (const Case k : {Case{WeightFormat::NVFP4, 96, 512, 1}, Case{WeightFormat::NVFP4, 96, 512, 4},
                       Case{WeightFormat::NVFP4, 96, 512, 9}, Case{WeightFormat::NVFP4, 200, 2048, 27},
                       Case{WeightFormat::NVFP4, 77, 4096, 40}, Case{WeightFormat::NVFP4, 64, 784, 5},
                       Case{WeightFormat::BF16, 130, 1024, 8}, Case{WeightFormat::BF16, 45, 192, 33}}) {
    const int B = k.B;
    RandomLinear g(k.out, k.in, k.f, rng), u(k.out, k.in, k.f, rng);
    const auto x = test::random_floats(size_t(B) * k.in, rng);
    ThreadPool pool(1);
    std::vector<float> gr(size_t(B) * k.out), ur(gr.size()), ref(gr.size());
    cpu::linear(g.host, x.data(), B, gr.data(), pool);
    cpu::linear(u.host, x.data(), B, ur.data(), pool);
    cpu::silu_mul(gr.data(), ur.data(), int64_t(gr.size()), ref.data());
    DeviceBuffer<float> dx(x), out(ref.size());
    out.poison();
    cuda::launch_gated(g.dev, u.dev, dx.get(), B, out.get(), nullptr);
    EXPECT_LE(test::rel_err(out.download(), ref), kTol) << "batch " << B << ", " << k.out << " x " << k.in;
  }
}

TEST(CudaOps, RmsNorm) {
  std::mt19937 rng(3);
  const int rows = 5;
  // Rows held in registers (multiples of 4 up to 8192) and rows that take the looping path.
  for (int n : {1000, 2048, 8192, 1001, 9000}) {
    const auto x = test::random_floats(size_t(rows) * n, rng, 3.0f), w = test::random_floats(n, rng);
    std::vector<float> ref(x.size());
    cpu::rms_norm(x.data(), w.data(), rows, n, 1e-6f, ref.data());
    DeviceBuffer<float> dx(x), dw(w), out(x.size());
    out.poison();
    cuda::launch_rms_norm(dx.get(), dw.get(), rows, n, 1e-6f, out.get(), nullptr);
    EXPECT_LE(test::rel_err(out.download(), ref), kTol) << "n " << n;
  }
}

// Builds a ModelConfig for router tests.
ModelConfig router_config(bool sigmoid, int E, int K, int groups, int topk_groups, bool norm) {
  ModelConfig c;
  c.num_experts = E;
  c.experts_per_token = K;
  c.router = sigmoid ? RouterKind::SigmoidBias : RouterKind::Softmax;
  c.n_group = groups;
  c.topk_group = topk_groups;
  c.norm_topk_prob = norm;
  c.routed_scaling_factor = sigmoid ? 2.5f : 1.0f;
  return c;
}

// A diverged hidden state (NaN) must still route to experts that exist: garbage out, no crash.
TEST(CudaOps, RoutingOfNanStaysInRange) {
  std::mt19937 rng(6);
  const int H = 128, B = 3;
  for (const ModelConfig& c : {router_config(false, 128, 8, 1, 1, true), router_config(true, 64, 6, 8, 3, true)}) {
    RandomLinear w(int(c.num_experts), H, WeightFormat::BF16, rng);
    const auto bias = test::random_floats(size_t(c.num_experts), rng, 0.1f);
    const std::vector<float> x(size_t(B) * H, std::nanf(""));
    DeviceBuffer<float> dx(x), dbias(bias), dw(size_t(B) * c.experts_per_token), dl(size_t(B) * c.num_experts);
    DeviceBuffer<int32_t> de(size_t(B) * c.experts_per_token);
    DeviceBuffer<uint32_t> done(std::vector<uint32_t>(size_t(cuda::route_chunks(B)), 0));
    cuda::launch_route(cuda::make_router(c, w.dev, dbias.get()), dx.get(), B, dl.get(), done.get(), de.get(), dw.get(),
                       nullptr);
    for (int32_t e : de.download()) {
      EXPECT_GE(e, 0);
      EXPECT_LT(e, c.num_experts);
    }
  }
}

// A router test case: the routing rules, the router weights' format and the hidden size.
struct RouterCase {
  ModelConfig c;
  WeightFormat f;
  int H;
  int cluster = 0;  // batches up to this take the one-cluster kernel (BF16 or F32, rows a multiple of 8, small)

  std::string name(int B) const {
    return std::string(format_name(f)) + " " + std::to_string(c.num_experts) + " experts x " + std::to_string(H) +
           ", batch " + std::to_string(B);
  }
};

// The experts and weights the device chose for each token (de, dw: [B, top_k]) against the CPU's.
void expect_routing(DeviceBuffer<int32_t>& de, DeviceBuffer<float>& dw, const cpu::Routing& ref, int K,
                    const std::string& what) {
  const auto ge = de.download();
  const auto gw = dw.download();
  for (size_t i = 0; i < ge.size(); ++i) {
    const std::string at = what + ", token " + std::to_string(i / size_t(K)) + " slot " + std::to_string(i % size_t(K));
    EXPECT_EQ(ge[i], ref.experts[i]) << at;
    EXPECT_NEAR(gw[i], ref.weights[i], 1e-5f) << at;
  }
}

// Whether each batch takes the one-cluster kernel as the case expects (unless switched off for an
// A/B run): small BF16 and F32 routers up to 4 tokens.
void expect_cluster(const cuda::DRouter& r, const RouterCase& rc) {
  const char* e = std::getenv("KESTREL_ROUTE_CLUSTER");
  const bool on = !(e && std::string(e) == "0");
  for (int B = 1; B <= 9; ++B) EXPECT_EQ(cuda::route_in_cluster(r, B), on && B <= rc.cluster) << rc.name(B);
}

// Routing is one launch over chunks of up to 8 tokens: every batch size (partial last chunks
// included), each launched twice on the same buffers (the chunk counters must be back at 0), in
// every router weight format; rows 2048 wide split K over the warps of a block, 132 wide (BF16,
// not a multiple of 8) take the element-wise path. Up to 4 tokens of a small BF16 or F32 router
// take the one-cluster kernel (60 experts: the last block holds fewer rows; 64: 4 rows a block).
TEST(CudaOps, RoutingMatchesCpu) {
  std::mt19937 rng(5);
  for (const RouterCase& rc : {RouterCase{router_config(false, 128, 8, 1, 1, true), WeightFormat::BF16, 2048, 4},
                               RouterCase{router_config(false, 60, 4, 1, 1, false), WeightFormat::BF16, 132},
                               RouterCase{router_config(false, 60, 4, 1, 1, false), WeightFormat::BF16, 256, 4},
                               RouterCase{router_config(true, 64, 6, 8, 3, true), WeightFormat::BF16, 128, 4},
                               RouterCase{router_config(true, 16, 2, 1, 1, true), WeightFormat::F32, 96, 4},
                               RouterCase{router_config(false, 128, 8, 1, 1, true), WeightFormat::NVFP4, 2048},
                               RouterCase{router_config(true, 256, 8, 8, 4, true), WeightFormat::NVFP4, 176}}) {
    const ModelConfig& c = rc.c;
    const int H = rc.H, E = int(c.num_experts), K = int(c.experts_per_token);
    RandomLinear w(E, H, rc.f, rng);
    const auto bias = test::random_floats(size_t(E), rng, 0.1f);
    DeviceBuffer<float> dbias(bias);
    const cuda::DRouter router = cuda::make_router(c, w.dev, dbias.get());
    expect_cluster(router, rc);
    for (int B : {1, 2, 7, 8, 9, 33, 64}) {
      const auto x = test::random_floats(size_t(B) * H, rng);
      std::vector<float> logits(size_t(B) * E);
      ThreadPool pool(1);
      cpu::linear(w.host, x.data(), B, logits.data(), pool);
      const cpu::Routing ref = cpu::route(c, logits.data(), B, bias);
      DeviceBuffer<float> dx(x), dw(size_t(B) * K), dl(size_t(B) * E);
      DeviceBuffer<int32_t> de(size_t(B) * K);
      DeviceBuffer<uint32_t> done(std::vector<uint32_t>(size_t(cuda::route_chunks(B)), 0));
      for (int run = 0; run < 2; ++run) {
        dw.poison(), dl.poison(), de.poison();
        cuda::launch_route(router, dx.get(), B, dl.get(), done.get(), de.get(), dw.get(), nullptr);
        const std::string what = rc.name(B) + ", run " + std::to_string(run);
        EXPECT_LE(test::rel_err(dl.download(), logits), kTol) << what;
        expect_routing(de, dw, ref, K, what);
        for (uint32_t v : done.download()) EXPECT_EQ(v, 0u) << what << ": a chunk counter left set";
      }
    }
  }
}

// The router normalizing its input (in its kernel for one token or in the one-cluster kernel,
// else by a launch first) leaves the normalized rows for the experts, as floats and where asked
// as fragment rows, and routes as the CPU does after its own norm. The one-cluster kernel: 8 and 16 rows a block, one and two 8-weight groups
// per thread and round (4096 wide), BF16 and F32, one token and three.
TEST(CudaOps, RoutingWithNormMatchesCpu) {
  std::mt19937 rng(25);
  for (const RouterCase& rc : {RouterCase{router_config(false, 128, 8, 1, 1, true), WeightFormat::BF16, 2048, 4},
                               RouterCase{router_config(false, 128, 8, 1, 1, true), WeightFormat::BF16, 4096, 4},
                               RouterCase{router_config(false, 128, 8, 1, 1, true), WeightFormat::F32, 2048, 4},
                               RouterCase{router_config(true, 256, 8, 8, 4, true), WeightFormat::BF16, 176, 4},
                               RouterCase{router_config(false, 128, 8, 1, 1, true), WeightFormat::NVFP4, 2048},
                               RouterCase{router_config(true, 256, 8, 8, 4, true), WeightFormat::NVFP4, 176}}) {
    const ModelConfig& c = rc.c;
    const int H = rc.H, E = int(c.num_experts), K = int(c.experts_per_token);
    RandomLinear w(E, H, rc.f, rng);
    const auto bias = test::random_floats(size_t(E), rng, 0.1f);
    const auto g = test::random_floats(size_t(H), rng);
    DeviceBuffer<float> dbias(bias), dg(g);
    const cuda::DRouter router = cuda::make_router(c, w.dev, dbias.get());
    expect_cluster(router, rc);
    for (int B : {1, 3}) {
      const auto x = test::random_floats(size_t(B) * H, rng, 3.0f);
      std::vector<float> xn(x.size()), logits(size_t(B) * E);
      cpu::rms_norm(x.data(), g.data(), B, H, 1e-6f, xn.data());
      ThreadPool pool(1);
      cpu::linear(w.host, xn.data(), B, logits.data(), pool);
      const cpu::Routing ref = cpu::route(c, logits.data(), B, bias);
      DeviceBuffer<float> dx(x), dxn(x.size()), dw(size_t(B) * K), dl(size_t(B) * E);
      DeviceBuffer<int32_t> de(size_t(B) * K);
      DeviceBuffer<uint32_t> done(std::vector<uint32_t>(size_t(cuda::route_chunks(B)), 0));
      DeviceBuffer<uint32_t> dxf(x.size());  // fragment rows too, where the width takes them
      const bool frag = H % 128 == 0;
      dxn.poison(), dw.poison(), dl.poison(), de.poison(), dxf.poison();
      EXPECT_EQ(cuda::route_fuses_norm(router, B), B == 1 || cuda::route_in_cluster(router, B));
      cuda::launch_route(router, dx.get(), B, dl.get(), done.get(), de.get(), dw.get(), nullptr,
                         cuda::RowNorm{dg.get(), 1e-6f, dxn.get(), frag ? dxf.get() : nullptr});
      const std::string what = rc.name(B);
      const std::vector<float> got_xn = dxn.download();
      EXPECT_LE(test::rel_err(got_xn, xn), kTol) << what << ": the normalized rows";
      if (frag) {
        EXPECT_LE(test::rel_err(unfrag(dxf.download(), B, H), got_xn), 1e-6) << what << ": the fragment rows";
      }
      EXPECT_LE(test::rel_err(dl.download(), logits), kTol) << what;
      expect_routing(de, dw, ref, K, what);
    }
  }
}

// Widths that are multiples of 64 in NVFP4 or BF16 take the expert-grouped tensor-core kernels
// from 4 tokens on (up to 40 tokens here: more than 8 tokens share an expert, so an expert's
// tokens span several groups of 8; 512 wide, few experts: tiles split over up to 4 warps); fewer
// tokens the per-slot kernels, whose down projection at one token runs on tensor cores when the
// down matrices are NVFP4 with widths that are multiples of 128 (640: its 5 chunks split into
// parts of 3 and 2; a shared expert twice as wide: two rounds of loads per part). The grouped
// kernels take NVFP4 matrices whose inputs are multiples of 128 wide in fragment rows (slot_mma.cuh):
// gate/up of 128-, 256-, 512- and 640-wide inputs, down of 128-, 512-, 640- and 1024-wide ones
// (the suite reruns this test with KESTREL_MOE_FRAG=0); so does gate/up at one token (one chunk
// a warp at 128; 5 chunks over 2 warps at 640), writing floats for the CUDA-core down kernel at
// 128 x 64 and fragment rows for the tensor-core one elsewhere.
struct MoeCase {
  int H, I;
  WeightFormat f;
  bool grouped, slot_down_mma;
  int shared_I = 0;  // 0: I
};

TEST(CudaOps, MoeMatchesCpu) {
  std::mt19937 rng(9);
  const int E = 16, K = 4;
  for (const MoeCase& mc :
       {MoeCase{96, 48, WeightFormat::NVFP4, false, false}, MoeCase{128, 64, WeightFormat::NVFP4, true, false},
        MoeCase{192, 128, WeightFormat::BF16, true, false}, MoeCase{512, 128, WeightFormat::NVFP4, true, true},
        MoeCase{640, 640, WeightFormat::NVFP4, true, true}, MoeCase{256, 512, WeightFormat::NVFP4, true, true, 1024}})
  for (bool shared : {false, true}) {
    const int H = mc.H, I = mc.I, SI = mc.shared_I ? mc.shared_I : I, A = std::max(I, SI);
    ModelConfig c = router_config(shared, E, K, shared ? 4 : 1, shared ? 2 : 1, true);
    c.hidden_size = H;
    c.moe_intermediate_size = I;
    c.num_shared_experts = shared ? 1 : 0;
    std::vector<std::unique_ptr<RandomLinear>> keep;
    auto make = [&](int out, int in) {
      keep.push_back(std::make_unique<RandomLinear>(out, in, mc.f, rng));
      return keep.back().get();
    };
    MoeWeights mw;
    RandomLinear* router = make(E, H);
    mw.router = router->host;
    mw.correction_bias = test::random_floats(E, rng, 0.1f);
    std::vector<cuda::DLinear> dg, du, dd;
    for (int e = 0; e < E; ++e) {
      RandomLinear *g = make(I, H), *u = make(I, H), *d = make(H, I);
      mw.experts.push_back({g->host, u->host, d->host});
      dg.push_back(g->dev), du.push_back(u->dev), dd.push_back(d->dev);
    }
    cuda::DMoe dm;
    if (shared) {
      RandomLinear *g = make(SI, H), *u = make(SI, H), *d = make(H, SI);
      mw.has_shared = true;
      mw.shared = {g->host, u->host, d->host};
      dm.has_shared = 1;
      dm.shared_gate = g->dev, dm.shared_up = u->dev, dm.shared_down = d->dev;
    }
    DeviceBuffer<cuda::DLinear> bg(dg.size()), bu(du.size()), bd(dd.size());
    bg.upload(dg), bu.upload(du), bd.upload(dd);
    DeviceBuffer<float> dbias(mw.correction_bias);
    dm.router = cuda::make_router(c, router->dev, dbias.get());
    dm.gate = bg.get(), dm.up = bu.get(), dm.down = bd.get();
    dm.width = I;
    cuda::describe_experts(dm, dg, du, dd);
    ASSERT_EQ(dm.tensor_cores, mc.grouped ? 1 : 0);
    ASSERT_EQ(dm.slot_down_mma, mc.slot_down_mma ? 1 : 0);
    if (!std::getenv("KESTREL_MOE_FRAG") && !std::getenv("KESTREL_MOE_ONE_TOKEN_MMA")) {  // one token's gate/up
      EXPECT_EQ(cuda::moe_one_token_takes_fragment_rows(dm), mc.f == WeightFormat::NVFP4 && H % 128 == 0);
    }
    dm.local_experts = E;
    // Expert parallelism: a rank holding experts E/2 .. E-1 (and no shared expert) adds only theirs.
    cuda::DMoe half = dm;
    half.first_expert = E / 2;
    half.local_experts = E / 2;
    half.gate = bg.get() + E / 2, half.up = bu.get() + E / 2, half.down = bd.get() + E / 2;
    half.has_shared = 0;
    MoeWeights mw_half = mw;
    mw_half.experts.erase(mw_half.experts.begin(), mw_half.experts.begin() + E / 2);
    mw_half.first_expert = E / 2;
    mw_half.has_shared = false;
    for (bool ep : {false, true}) {
      for (int B : {1, 2, 3, 4, 8, 40}) {
        const auto x = test::random_floats(size_t(B) * H, rng);
        const auto resid = test::random_floats(size_t(B) * H, rng);
        std::vector<float> out(size_t(B) * H);
        ThreadPool pool(1);
        cpu::moe_forward(c, ep ? mw_half : mw, x.data(), B, out.data(), pool);
        const std::vector<float> moe_only = out;
        for (size_t i = 0; i < out.size(); ++i) out[i] += resid[i];
        DeviceBuffer<float> dx(x), dr(resid);
        DeviceBuffer<int32_t> se(size_t(B) * K);
        DeviceBuffer<float> sw(size_t(B) * K), sa(size_t(B) * (K + 1) * A), sl(size_t(B) * E);
        DeviceBuffer<float> so(size_t(B) * (K + 1) * H);
        DeviceBuffer<uint32_t> done(std::vector<uint32_t>(size_t(cuda::route_chunks(B)), 0));
        DeviceBuffer<uint32_t> sxf(size_t(B) * H);
        sa.poison(), so.poison(), sxf.poison();
        // Without fragment rows of x at 3 tokens (the per-slot kernels, which take 2 and 3 tokens
        // only then) and at 8 (each tile splits x, and down takes floats).
        const bool no_frag = B == 3 || B == 8;
        cuda::MoeScratch s{se.get(), sw.get(), sa.get(), A, sl.get(), done.get(), so.get(), no_frag ? nullptr : sxf.get()};
        cuda::launch_moe(ep ? half : dm, dx.get(), B, dr.get(), s, nullptr);
        std::vector<float> got = dr.download();
        const std::string what = std::string(format_name(mc.f)) + " " + std::to_string(H) + "x" + std::to_string(I) +
                                 (shared ? ", shared " + std::to_string(SI) + " wide" : "") + (ep ? ", experts 8..15" : "") + ", batch " +
                                 std::to_string(B);
        EXPECT_LE(test::rel_err(got, out), 1e-5) << what;
        for (size_t i = 0; i < got.size(); ++i) got[i] -= resid[i];  // the experts' sum alone
        EXPECT_LE(test::rel_err(got, moe_only), 2e-5) << what << " (the MoE output alone)";
      }
    }
  }
}

// The split of decode attention covers every position in at most 64 chunks of whole KV blocks,
// whatever the parallelism it is asked to fill the GPU with; long contexts are cut into chunks of
// at most 256 positions while 64 splits suffice.
TEST(CudaOps, AttentionSplitCutsWholeBlocks) {
  for (int parallel : {0, 1, 4, 32, 256, 4096})
    for (int ctx : {1, 15, 16, 17, 70, 100, 1000, 4096, 4097, 8192, 16384, 131072}) {
      const cuda::AttentionSplit s = cuda::attention_split(ctx, parallel);
      const std::string at = std::to_string(ctx) + " positions, parallel " + std::to_string(parallel);
      EXPECT_EQ(s.chunk % cuda::kKvBlock, 0) << at;
      EXPECT_GE(s.splits, 1) << at;
      EXPECT_LE(s.splits, 64) << at;
      EXPECT_GE(int64_t(s.splits) * s.chunk, ctx) << at;
      EXPECT_LT(int64_t(s.splits - 1) * s.chunk, ctx) << at << ": an empty split";
      if (parallel > 0 && ctx <= 64 * 256) {
        EXPECT_LE(s.chunk, 256) << at;
      }
    }
  // One sequence of 4 KV heads over 1024 positions: many short chunks.
  EXPECT_GE(cuda::attention_split(1024, 4).splits, 32);
}

// The one-kernel GQA attention takes the largest cluster that keeps one wave of blocks, where
// that is at most 2 blocks, and leaves the other grids to the split path.
TEST(CudaOps, AttentionClusterFillsOneWave) {
  if (std::getenv("KESTREL_ATT_CLUSTER")) GTEST_SKIP() << "KESTREL_ATT_CLUSTER moves the bound";
  int dev = 0, sms = 0;
  ASSERT_EQ(cudaGetDevice(&dev), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), cudaSuccess);
  EXPECT_EQ(cuda::attention_cluster(sms / 4), 0);  // clusters of 4 would fit: the splits instead
  EXPECT_EQ(cuda::attention_cluster(sms / 4 + 1), 2);
  EXPECT_EQ(cuda::attention_cluster(sms / 2), 2);
  EXPECT_EQ(cuda::attention_cluster(sms / 2 + 1), 1);
  EXPECT_EQ(cuda::attention_cluster(sms), 1);
  EXPECT_EQ(cuda::attention_cluster(sms + 1), 0);
}

// Query heads per attention block divide each KV head's group; 8 only once the batch holds 2 x
// SMs query heads (a batch of 64 does here), 4 at most above head_dim 128.
TEST(CudaOps, AttentionHeadsPerBlock) {
  EXPECT_EQ(cuda::attention_heads_per_block(32, 4, 128, 64), 8);
  EXPECT_EQ(cuda::attention_heads_per_block(32, 4, 128, 1), 4);
  EXPECT_EQ(cuda::attention_heads_per_block(96, 8, 128, 64), 4);
  EXPECT_EQ(cuda::attention_heads_per_block(6, 2, 64, 64), 1);
  EXPECT_EQ(cuda::attention_heads_per_block(16, 2, 256, 64), 4);
  EXPECT_EQ(cuda::attention_heads_per_block(4, 4, 64, 64), 1);
}

// QK norm + rotary + the key/value store, then decode attention, in a paged cache of float32 or
// BF16 values: the identity block tables and shuffled ones (over a pool with unused NaN blocks)
// give the CPU's result and the same bits as each other, whatever the split. With BF16 the CPU
// reference holds the history and the new key and value rounded to BF16, as the cache does; a new
// key's element may round the other way when the GPU's norm and rotation differ from the CPU's in
// the last float bit, so the outputs get a looser bound.
void check_qk_rope_attention(cuda::KvType type) {
  std::mt19937 rng(13);
  const bool bf16 = type == cuda::KvType::BF16;
  const double tol = bf16 ? 1e-4 : 1e-5, key_tol = bf16 ? 2e-3 : 1e-5;
  auto cached = [&](std::vector<float> v) { return bf16 ? test::bf16_round(std::move(v)) : v; };
  struct Case {
    int nq, nkv, hd, rot;
    bool norm, interleaved;
    int B = 3;
  };
  // Query heads per KV head 4, 1, 3, 2, 8, 12 and 8 at head_dim 256 (blocks of 4, 1, 1, 2, 4, 4, 4
  // heads); blocks of 8 heads take batches of 2 x SMs query heads (5 x 64 here).
  for (const Case& cs : {Case{8, 2, 64, 64, true, false}, Case{4, 4, 128, 64, false, false},
                         Case{6, 2, 16, 8, true, true}, Case{2, 1, 256, 256, false, false},
                         Case{16, 2, 128, 64, true, false}, Case{12, 1, 64, 32, false, true},
                         Case{8, 1, 256, 128, true, false}, Case{64, 8, 64, 64, true, false, 5}}) {
    const int B = cs.B, cap = 70;
    std::vector<int32_t> pos = {0, 17, 69};
    for (int b = 3; b < B; ++b) pos.push_back(int32_t((29 * b) % cap));
    RopeConfig rc;
    rc.theta = 10000.0;
    rc.rotary_dim = cs.rot;
    rc.interleaved = cs.interleaved;
    cpu::RopeTables tables(rc);
    const auto qn = test::random_floats(size_t(cs.hd), rng), kn = test::random_floats(size_t(cs.hd), rng);
    // Per sequence: history keys/values for positions < pos, then the new token's q, k, v.
    std::vector<KvCache> caches;
    const size_t row = size_t(cs.nkv) * cs.hd;
    std::vector<std::vector<float>> hist_k(B), hist_v(B);  // [pos[b], row]
    const auto q = test::random_floats(size_t(B) * cs.nq * cs.hd, rng);
    const auto k = test::random_floats(size_t(B) * row, rng), v = test::random_floats(size_t(B) * row, rng);
    std::vector<float> ref(q.size());
    for (int b = 0; b < B; ++b) {
      caches.emplace_back(1, cs.nkv, cs.hd, cap);
      KvCache& c = caches.back();
      c.reserve(cap);  // every position is written below
      hist_k[size_t(b)] = cached(test::random_floats(size_t(pos[size_t(b)]) * row, rng));
      hist_v[size_t(b)] = cached(test::random_floats(size_t(pos[size_t(b)]) * row, rng));
      for (int p = 0; p < pos[size_t(b)]; ++p) {
        std::copy_n(hist_k[size_t(b)].data() + size_t(p) * row, row, c.k(0, p));
        std::copy_n(hist_v[size_t(b)].data() + size_t(p) * row, row, c.v(0, p));
      }
      std::vector<float> qb(q.begin() + b * cs.nq * cs.hd, q.begin() + (b + 1) * cs.nq * cs.hd);
      std::vector<float> kb(k.begin() + b * row, k.begin() + (b + 1) * row);
      if (cs.norm) {
        cpu::rms_norm(qb.data(), qn.data(), cs.nq, cs.hd, 1e-6f, qb.data());
        cpu::rms_norm(kb.data(), kn.data(), cs.nkv, cs.hd, 1e-6f, kb.data());
      }
      cpu::apply_rope(qb.data(), cs.nq, cs.hd, pos[size_t(b)], tables);
      cpu::apply_rope(kb.data(), cs.nkv, cs.hd, pos[size_t(b)], tables);
      kb = cached(kb);
      const std::vector<float> vb = cached(std::vector<float>(v.begin() + b * row, v.begin() + (b + 1) * row));
      std::copy(kb.begin(), kb.end(), c.k(0, pos[size_t(b)]));
      std::copy(vb.begin(), vb.end(), c.v(0, pos[size_t(b)]));
      c.commit(pos[size_t(b)]);
      ThreadPool pool(1);
      cpu::attention(qb.data(), 1, pos[size_t(b)], cs.nq, cs.nkv, cs.hd, 1.0f / std::sqrt(float(cs.hd)), c, 0,
                     ref.data() + size_t(b) * cs.nq * cs.hd, pool);
    }
    // Split counts of both policies, one split, 9 and 7 (GQA attention cuts each sequence's
    // length into that many chunks of whole blocks; the chunk given is for MLA); then one kernel
    // in clusters of 16, 4 and 1 blocks (the length cut among a cluster's blocks instead).
    const cuda::AttentionSplit splits[] = {cuda::attention_split(cap), cuda::attention_split(cap, B * cs.nkv),
                                           cuda::AttentionSplit{1, cap}, cuda::AttentionSplit{9, 8},
                                           cuda::AttentionSplit{7, 11}, cuda::AttentionSplit{1, cap, 16},
                                           cuda::AttentionSplit{1, cap, 4}, cuda::AttentionSplit{1, cap, 1}};
    std::vector<std::vector<float>> identity_out;  // per split
    for (bool shuffled : {false, true}) {
      test::PagedKv kv(B, cap, int(row), shuffled, rng, 5, type);
      for (int b = 0; b < B; ++b)
        for (int p = 0; p < pos[size_t(b)]; ++p) {
          std::copy_n(hist_k[size_t(b)].data() + size_t(p) * row, row, kv.k(b, p));
          std::copy_n(hist_v[size_t(b)].data() + size_t(p) * row, row, kv.v(b, p));
        }
      kv.upload();
      DeviceBuffer<float> dq(q), dk(k), dv(v), dout(q.size()), dqn(qn), dkn(kn);
      DeviceBuffer<float> dinv(tables.inv_freq);
      DeviceBuffer<int32_t> dpos(pos);
      cuda::RopeArgs ra{dinv.get(), 1.0f, cs.rot, cs.interleaved};
      const cuda::KvLayer kvl = kv.layer();
      cuda::launch_qk_rope_store(dq.get(), dk.get(), dv.get(), B, cs.nq, cs.nkv, cs.hd, cs.norm ? dqn.get() : nullptr,
                                 cs.norm ? dkn.get() : nullptr, 1e-6f, ra, dpos.get(), kvl, nullptr);
      for (int b = 0; b < B; ++b) {  // the new rows went into the sequence's own block
        const int n = pos[size_t(b)] + 1;
        const std::vector<float> kr = kv.k_rows(b, n), vr = kv.v_rows(b, n);
        const float* want_k = caches[size_t(b)].k(0, n - 1);
        EXPECT_LE(test::rel_err(std::vector<float>(kr.end() - int64_t(row), kr.end()), std::vector<float>(want_k, want_k + row)),
                  key_tol) << "sequence " << b;
        EXPECT_EQ(std::vector<float>(vr.end() - int64_t(row), vr.end()),
                  cached(std::vector<float>(v.begin() + b * row, v.begin() + (b + 1) * row))) << "sequence " << b;
      }
      // Where the heads' values make whole fragment rows, the output as those too (o's input).
      const bool frag = (cs.nq * cs.hd) % 128 == 0;
      DeviceBuffer<uint32_t> dfrag(q.size());
      for (size_t i = 0; i < std::size(splits); ++i) {
        const cuda::AttentionSplit split = splits[i];
        DeviceBuffer<float> scratch(cuda::attention_scratch_floats(B, cs.nq, cs.hd, split));
        dout.poison(), dfrag.poison();
        const int launches = cuda::launch_decode_attention(dq.get(), B, cs.nq, cs.nkv, cs.hd,
                                                           1.0f / std::sqrt(float(cs.hd)), dpos.get(), kvl, split,
                                                           scratch.get(), dout.get(), nullptr, nullptr,
                                                           frag ? dfrag.get() : nullptr);
        EXPECT_EQ(launches, split.cluster ? 1 : 2);
        const auto got = dout.download();
        const std::string what = "hd " + std::to_string(cs.hd) + ", " +
                                 (split.cluster ? "clusters of " + std::to_string(split.cluster)
                                                : std::to_string(split.splits) + " splits");
        EXPECT_LE(test::rel_err(got, ref), tol) << what << (shuffled ? ", shuffled tables" : "");
        if (frag) {
          EXPECT_LE(test::rel_err(unfrag(dfrag.download(), B, cs.nq * cs.hd), got), 1e-6) << what << ", fragment rows";
        }
        if (!shuffled) identity_out.push_back(got);
        else EXPECT_EQ(got, identity_out[i]) << what;
      }
      // The QK step inside the attention kernel: q as projected, and each row's new position NaN
      // in the cache (upload() restores the history alone), so every split must attend to the
      // key it made and store it.
      DeviceBuffer<float> dq_raw(q);
      const cuda::QkPrep prep{dk.get(), dv.get(), cs.norm ? dqn.get() : nullptr, cs.norm ? dkn.get() : nullptr, 1e-6f, ra};
      for (const cuda::AttentionSplit& split : splits) {
        const std::string what = "QK step inside, hd " + std::to_string(cs.hd) + ", " +
                                 (split.cluster ? "clusters of " + std::to_string(split.cluster)
                                                : std::to_string(split.splits) + " splits") +
                                 (shuffled ? ", shuffled tables" : "");
        kv.upload();
        DeviceBuffer<float> scratch(cuda::attention_scratch_floats(B, cs.nq, cs.hd, split));
        dout.poison();
        const int launches = cuda::launch_decode_attention(dq_raw.get(), B, cs.nq, cs.nkv, cs.hd,
                                                           1.0f / std::sqrt(float(cs.hd)), dpos.get(), kvl, split,
                                                           scratch.get(), dout.get(), nullptr, &prep);
        EXPECT_EQ(launches, split.cluster ? 1 : 2);
        EXPECT_LE(test::rel_err(dout.download(), ref), tol) << what;
        EXPECT_EQ(dq_raw.download(), q) << what;
        for (int b = 0; b < B; ++b) {
          const int n = pos[size_t(b)] + 1;
          const std::vector<float> kr = kv.k_rows(b, n), vr = kv.v_rows(b, n);
          const float* want_k = caches[size_t(b)].k(0, n - 1);
          EXPECT_LE(test::rel_err(std::vector<float>(kr.end() - int64_t(row), kr.end()), std::vector<float>(want_k, want_k + row)),
                    key_tol) << what << ", sequence " << b;
          EXPECT_EQ(std::vector<float>(vr.end() - int64_t(row), vr.end()),
                    cached(std::vector<float>(v.begin() + b * row, v.begin() + (b + 1) * row))) << what << ", sequence " << b;
        }
      }
    }
  }
}

TEST(CudaOps, QkRopeAttentionMatchCpu) { check_qk_rope_attention(cuda::KvType::F32); }
TEST(CudaOps, QkRopeAttentionOfBf16CacheMatchCpu) { check_qk_rope_attention(cuda::KvType::BF16); }

// A prefill step: the batch rows are consecutive positions of one sequence (table row 0 for
// every row); each row attends to the positions up to its own, including the rows stored in the
// same step.
TEST(CudaOps, QkRopeAttentionOfOneSequenceMatchCpu) {
  std::mt19937 rng(19);
  const int nq = 4, nkv = 2, hd = 64, cap = 50, start = 30, T = 8;
  const size_t row = size_t(nkv) * hd;
  RopeConfig rc;
  rc.theta = 10000.0;
  rc.rotary_dim = hd;
  cpu::RopeTables tables(rc);
  const auto q = test::random_floats(size_t(T) * nq * hd, rng);
  const auto k = test::random_floats(size_t(T) * row, rng), v = test::random_floats(size_t(T) * row, rng);
  const auto hk = test::random_floats(size_t(start) * row, rng), hv = test::random_floats(size_t(start) * row, rng);
  KvCache c(1, nkv, hd, cap);
  c.reserve(start + T);
  std::vector<float> qr(q);
  for (int p = 0; p < start + T; ++p) {
    if (p < start) {
      std::copy_n(hk.data() + size_t(p) * row, row, c.k(0, p));
      std::copy_n(hv.data() + size_t(p) * row, row, c.v(0, p));
      continue;
    }
    const int t = p - start;
    std::copy_n(k.data() + size_t(t) * row, row, c.k(0, p));
    cpu::apply_rope(c.k(0, p), nkv, hd, p, tables);
    std::copy_n(v.data() + size_t(t) * row, row, c.v(0, p));
    cpu::apply_rope(qr.data() + size_t(t) * nq * hd, nq, hd, p, tables);
  }
  c.commit(start);
  std::vector<float> ref(q.size());
  ThreadPool pool(1);
  cpu::attention(qr.data(), T, start, nq, nkv, hd, 0.125f, c, 0, ref.data(), pool);

  test::PagedKv kv(1, cap, int(row), true, rng);
  for (int p = 0; p < start; ++p) {
    std::copy_n(hk.data() + size_t(p) * row, row, kv.k(0, p));
    std::copy_n(hv.data() + size_t(p) * row, row, kv.v(0, p));
  }
  kv.upload();
  std::vector<int32_t> pos(T);
  std::iota(pos.begin(), pos.end(), start);
  DeviceBuffer<float> dq(q), dk(k), dv(v), dout(q.size()), dinv(tables.inv_freq);
  DeviceBuffer<int32_t> dpos(pos);
  const cuda::AttentionSplit split = cuda::attention_split(cap);
  DeviceBuffer<float> scratch(cuda::attention_scratch_floats(T, nq, hd, split));
  cuda::RopeArgs ra{dinv.get(), 1.0f, hd, 0};
  dout.poison();
  cuda::launch_qk_rope_store(dq.get(), dk.get(), dv.get(), T, nq, nkv, hd, nullptr, nullptr, 1e-6f, ra, dpos.get(),
                             kv.layer(true), nullptr);
  cuda::launch_decode_attention(dq.get(), T, nq, nkv, hd, 0.125f, dpos.get(), kv.layer(true), split, scratch.get(),
                                dout.get(), nullptr);
  EXPECT_LE(test::rel_err(dout.download(), ref), 1e-5) << "splits";
  dout.poison();
  cuda::launch_decode_attention(dq.get(), T, nq, nkv, hd, 0.125f, dpos.get(), kv.layer(true),
                                cuda::AttentionSplit{1, cap, 8}, nullptr, dout.get(), nullptr);
  EXPECT_LE(test::rel_err(dout.download(), ref), 1e-5) << "clusters of 8";
  // The QK step inside attention needs rows of distinct sequences: these see each other's keys.
  const cuda::QkPrep prep{dk.get(), dv.get(), nullptr, nullptr, 1e-6f, ra};
  EXPECT_FALSE(cuda::attention_takes_qk_step(kv.layer(true), T));
  EXPECT_THROW(cuda::launch_decode_attention(dq.get(), T, nq, nkv, hd, 0.125f, dpos.get(), kv.layer(true), split,
                                             scratch.get(), dout.get(), nullptr, &prep),
               std::exception);
}

// The per-op report's read chains (bench --ops): a time per kernel that grows with its bytes, from
// an empty-ish kernel to one that cannot be under its bytes at 5 TB/s (above the H200's).
TEST(CudaOps, ReadChainTimesKernels) {
  cudaStream_t s;
  KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));  // a graph cannot capture the legacy stream
  for (const bool early : {false, true}) {
    const double small = cuda::chained_read_us(size_t(64) << 10, early, s);
    const double large = cuda::chained_read_us(size_t(64) << 20, early, s);
    EXPECT_GT(small, 0.0) << (early ? "reads before the wait" : "reads after the wait");
    EXPECT_GT(large, double(size_t(64) << 20) / 5e12 * 1e6) << (early ? "reads before the wait" : "reads after the wait");
    EXPECT_GT(large, 2 * small) << (early ? "reads before the wait" : "reads after the wait");
  }
  KESTREL_CUDA_CHECK(cudaStreamDestroy(s));
}

TEST(CudaOps, EmbedAndArgmax) {
  std::mt19937 rng(17);
  RandomLinear table(50, 64, WeightFormat::BF16, rng);
  const std::vector<int32_t> tokens = {3, 49, 0};
  std::vector<float> ref(tokens.size() * 64);
  for (size_t i = 0; i < tokens.size(); ++i) table.host.dequant_row(tokens[i], ref.data() + i * 64);
  DeviceBuffer<int32_t> dt(tokens);
  DeviceBuffer<float> dx(ref.size());
  dx.poison();
  cuda::launch_embed(table.dev, dt.get(), 3, dx.get(), nullptr);
  EXPECT_EQ(dx.download(), ref);

  const int V = 5000;
  auto logits = test::random_floats(size_t(2) * V, rng);
  logits[1234] = 100.0f;
  logits[V + 4321] = 100.0f;
  logits[V + 4999] = 100.0f;  // a tie resolves to the lower id
  DeviceBuffer<float> dl(logits);
  DeviceBuffer<int32_t> next(2);
  DeviceBuffer<uint8_t> scratch(cuda::argmax_scratch_bytes(2));
  KESTREL_CUDA_CHECK(cudaMemset(scratch.get(), 0, cuda::argmax_scratch_bytes(2)));
  const cuda::ArgmaxScratch as = cuda::argmax_scratch(scratch.get(), 2);
  cuda::launch_argmax(dl.get(), 2, V, next.get(), as, nullptr);
  EXPECT_EQ(next.download(), (std::vector<int32_t>{1234, 4321}));
  // Again with the winner moved: the completion counters must have been reset.
  logits[1234] = 0.0f;
  logits[17] = 100.0f;
  dl.upload(logits);
  next.poison();
  cuda::launch_argmax(dl.get(), 2, V, next.get(), as, nullptr);
  EXPECT_EQ(next.download(), (std::vector<int32_t>{17, 4321}));
}

// DSA top-k: the device selection equals a CPU sort by (score desc, position asc), kept in
// position order, on rows shorter and longer than top-k, with many exact ties (quantized scores,
// zeros as relu makes them) and negative scores.
TEST(CudaOps, TopkSelectMatchesCpu) {
  std::mt19937 rng(23);
  const int ctx = 5000, topk = 2048;
  const std::vector<int32_t> positions = {10, 2047, 2048, 4999, 3000};
  const int B = int(positions.size());
  std::vector<float> scores(size_t(B) * ctx);
  std::uniform_int_distribution<int> level(-40, 40);
  for (size_t i = 0; i < scores.size(); ++i) scores[i] = i % 3 == 0 ? 0.0f : float(level(rng)) * 0.25f;
  DeviceBuffer<float> ds(scores);
  DeviceBuffer<int32_t> dp(positions), sel(static_cast<size_t>(B) * topk), cnt(static_cast<size_t>(B));
  sel.poison();
  cuda::launch_topk_select(ds.get(), B, ctx, topk, dp.get(), sel.get(), cnt.get(), nullptr);
  const auto got = sel.download();
  const auto got_count = cnt.download();
  for (int b = 0; b < B; ++b) {
    const int len = positions[size_t(b)] + 1, n = std::min(len, topk);
    std::vector<int32_t> idx(static_cast<size_t>(len));
    std::iota(idx.begin(), idx.end(), 0);
    const float* sc = scores.data() + size_t(b) * ctx;
    std::stable_sort(idx.begin(), idx.end(), [&](int32_t x, int32_t y) { return sc[x] > sc[y]; });
    idx.resize(size_t(n));
    std::sort(idx.begin(), idx.end());
    ASSERT_EQ(got_count[size_t(b)], n) << "row " << b;
    EXPECT_EQ(std::vector<int32_t>(got.begin() + size_t(b) * topk, got.begin() + size_t(b) * topk + n), idx)
        << "row " << b;
  }
}

// The DSA indexer at GLM-5's shape (32 heads of 128): the key store (LayerNorm + rotary into the
// paged index cache) and the scores of every cached position against the CPU formula, with the
// identity block tables and shuffled ones (the same bits).
TEST(CudaOps, IndexScoresMatchCpu) {
  std::mt19937 rng(31);
  cuda::IndexerShape x{32, 128, 64, 2048};
  const int ctx = 300;
  const std::vector<int32_t> pos = {299, 5};
  const int B = int(pos.size());
  RopeConfig rc;
  rc.theta = 10000.0;
  rc.rotary_dim = x.rope;
  cpu::RopeTables tables(rc);
  const auto keys = test::random_floats(size_t(B) * ctx * x.dim, rng);  // cached keys, positions < pos[b]
  const auto q = test::random_floats(size_t(B) * x.heads * x.dim, rng);
  const auto w = test::random_floats(size_t(B) * x.heads, rng);
  const auto ik = test::random_floats(size_t(B) * x.dim, rng);
  const auto norm_w = test::random_floats(size_t(x.dim), rng), norm_b = test::random_floats(size_t(x.dim), rng, 0.1f);
  // The CPU: rotated queries, the new key of each row at pos[b].
  std::vector<float> qr(q), new_key(ik.size());
  for (int b = 0; b < B; ++b) {
    cpu::apply_rope(qr.data() + size_t(b) * x.heads * x.dim, x.heads, x.dim, pos[size_t(b)], tables);
    float* nk = new_key.data() + size_t(b) * x.dim;
    cpu::layer_norm(ik.data() + size_t(b) * x.dim, norm_w.data(), norm_b.data(), 1, x.dim, 1e-6f, nk);
    cpu::apply_rope(nk, 1, x.dim, pos[size_t(b)], tables);
  }
  std::vector<std::vector<float>> want(B);
  for (int b = 0; b < B; ++b)
    for (int j = 0; j <= pos[size_t(b)]; ++j) {
      const float* key = j == pos[size_t(b)] ? new_key.data() + size_t(b) * x.dim : keys.data() + (size_t(b) * ctx + j) * x.dim;
      double s = 0;
      for (int h = 0; h < x.heads; ++h) {
        const float d = cpu::dot(qr.data() + (size_t(b) * x.heads + h) * x.dim, key, x.dim);
        s += double(w[size_t(b) * x.heads + h]) / std::sqrt(double(x.heads)) * std::max(0.0, d / std::sqrt(double(x.dim)));
      }
      want[size_t(b)].push_back(float(s));
    }
  std::vector<float> identity_scores;
  for (bool shuffled : {false, true}) {
    SCOPED_TRACE(shuffled ? "shuffled tables" : "identity tables");
    test::PagedKv cache(B, ctx, x.dim, shuffled, rng);
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < pos[size_t(b)]; ++j) std::copy_n(keys.data() + (size_t(b) * ctx + j) * x.dim, x.dim, cache.k(b, j));
    cache.upload();
    DeviceBuffer<float> dq(q), dw(w), dik(ik), dnw(norm_w), dnb(norm_b), dinv(tables.inv_freq),
        ds(static_cast<size_t>(B) * ctx);
    DeviceBuffer<int32_t> dp(pos);
    ds.poison();
    cuda::RopeArgs ra{dinv.get(), 1.0f, x.rope, 0};
    cuda::launch_index_prep(dq.get(), dik.get(), B, x, dnw.get(), dnb.get(), ra, dp.get(), cache.layer(), nullptr);
    cuda::launch_index_scores(dq.get(), dw.get(), B, x, dp.get(), cache.layer(), ctx, ds.get(), nullptr);
    const auto got = ds.download();
    for (int b = 0; b < B; ++b) {
      const auto stored = cache.k_rows(b, pos[size_t(b)] + 1);
      EXPECT_LT(test::rel_l2(stored.data() + size_t(pos[size_t(b)]) * x.dim, new_key.data() + size_t(b) * x.dim, x.dim),
                kTol)
          << "the key of row " << b;
      EXPECT_LT(test::rel_l2(got.data() + size_t(b) * ctx, want[size_t(b)].data(), int64_t(want[size_t(b)].size())), kTol)
          << "row " << b;
    }
    std::vector<float> live;  // the scores the kernel writes
    for (int b = 0; b < B; ++b) live.insert(live.end(), got.begin() + b * ctx, got.begin() + b * ctx + pos[size_t(b)] + 1);
    if (!shuffled) identity_scores = live;
    else EXPECT_EQ(live, identity_scores);
  }
}

// Absorbed MLA decode (latent store, query absorption, attention over the latent rows, value
// absorption) against the CPU's expanded form, dense and with a position selection, in a paged
// cache.
TEST(CudaOps, MlaAttentionMatchesCpu) {
  std::mt19937 rng(29);
  ModelConfig c;
  c.num_heads = 12;  // two groups of 8 heads, the second partial
  c.num_kv_heads = 12;
  c.mla = MlaConfig{0, 96, 32, 16, 24, 0.1f, 1e-6f};  // rank 96: a partial 64-column slice
  c.attention = AttentionKind::Mla;
  c.rope.rotary_dim = 16;
  c.rope.interleaved = true;
  c.rms_norm_eps = 1e-5f;
  const MlaConfig& m = c.mla;
  const int heads = 12, lat = int(m.latent()), qk = int(m.qk_head_dim()), ctx = 40;
  RandomLinear kv_b(heads * int(m.qk_nope_head_dim + m.v_head_dim), int(m.kv_lora_rank), WeightFormat::BF16, rng);
  const std::vector<float> norm = test::random_floats(size_t(m.kv_lora_rank), rng);
  const std::vector<float> inv_freq = c.rope.inv_freq();
  DeviceBuffer<float> d_norm(norm), d_inv(inv_freq);
  cuda::RopeArgs rope;
  rope.inv_freq = d_inv.get();
  rope.rotary_dim = 16;
  rope.interleaved = 1;
  cuda::MlaShape ms{heads, int(m.qk_nope_head_dim), int(m.qk_rope_head_dim), int(m.v_head_dim), int(m.kv_lora_rank)};

  // Nine sequences (more than the 8 batch rows one absorption block serves), each with its own
  // blocks of a paged cache filled by the kernels, at positions 21..37; the identity block tables
  // and shuffled ones (the same bits).
  std::vector<int32_t> pos;
  for (int b = 0; b < 9; ++b) pos.push_back(21 + 2 * b);
  const int B = int(pos.size());
  std::vector<std::vector<float>> kv_in;  // the kv_a outputs stored at step p
  std::vector<std::vector<float>> host_lat(B, std::vector<float>(size_t(ctx) * lat));
  cpu::RopeTables tables(c.rope);
  for (int p = 0; p <= 37; ++p) {
    kv_in.push_back(test::random_floats(size_t(B) * lat, rng));
    for (int b = 0; b < B; ++b) {
      const int at = std::min<int32_t>(p, pos[size_t(b)]);
      float* row = host_lat[size_t(b)].data() + size_t(at) * lat;
      std::copy_n(kv_in.back().data() + size_t(b) * lat, lat, row);
      cpu::rms_norm(row, norm.data(), 1, m.kv_lora_rank, 1e-6f, row);
      cpu::apply_rope(row + m.kv_lora_rank, 1, m.qk_rope_head_dim, at, tables);
    }
  }

  // Queries and the expected output: keys and values expanded from the latents, softmax attention.
  const auto q = test::random_floats(size_t(B) * heads * qk, rng);
  std::vector<std::vector<int32_t>> chosen[2];  // dense, sparse
  std::vector<float> want[2];
  for (bool sparse : {false, true}) {
    std::vector<std::vector<int32_t>>& ch = chosen[sparse];
    ch.resize(size_t(B));
    for (int b = 0; b < B; ++b)
      for (int j = 0; j <= pos[size_t(b)]; ++j)
        if (!sparse || j % 3 != 1) ch[size_t(b)].push_back(j);
    std::vector<float>& wt = want[sparse];
    wt.assign(size_t(B) * heads * m.v_head_dim, 0.0f);
    for (int b = 0; b < B; ++b) {
      const int len = pos[size_t(b)] + 1;
      std::vector<float> lat_rows(size_t(len) * m.kv_lora_rank), kvb(size_t(len) * kv_b.host.out);
      for (int j = 0; j < len; ++j)
        std::copy_n(host_lat[size_t(b)].data() + size_t(j) * lat, m.kv_lora_rank, lat_rows.data() + size_t(j) * m.kv_lora_rank);
      ThreadPool pool(1);
      cpu::linear(kv_b.host, lat_rows.data(), len, kvb.data(), pool);
      for (int h = 0; h < heads; ++h) {
        std::vector<float> qh(q.begin() + (size_t(b) * heads + h) * qk, q.begin() + (size_t(b) * heads + h + 1) * qk);
        cpu::apply_rope(qh.data() + m.qk_nope_head_dim, 1, m.qk_rope_head_dim, pos[size_t(b)], tables);
        std::vector<float> p;
        for (int j : ch[size_t(b)]) {
          const float* kn = kvb.data() + size_t(j) * kv_b.host.out + size_t(h) * (m.qk_nope_head_dim + m.v_head_dim);
          p.push_back((cpu::dot(qh.data(), kn, m.qk_nope_head_dim) +
                       cpu::dot(qh.data() + m.qk_nope_head_dim,
                                host_lat[size_t(b)].data() + size_t(j) * lat + m.kv_lora_rank, m.qk_rope_head_dim)) *
                      m.softmax_scale);
        }
        cpu::softmax(p.data(), int64_t(p.size()));
        float* o = wt.data() + (size_t(b) * heads + h) * m.v_head_dim;
        for (size_t i = 0; i < p.size(); ++i) {
          const float* v = kvb.data() + size_t(ch[size_t(b)][i]) * kv_b.host.out +
                           size_t(h) * (m.qk_nope_head_dim + m.v_head_dim) + m.qk_nope_head_dim;
          for (int e = 0; e < m.v_head_dim; ++e) o[e] += p[i] * v[e];
        }
      }
    }
  }

  std::map<std::pair<int, bool>, std::vector<float>> identity_out;  // (splits, sparse)
  for (bool shuffled : {false, true}) {
    SCOPED_TRACE(shuffled ? "shuffled tables" : "identity tables");
    test::PagedKv cache(B, ctx, lat, shuffled, rng);
    const cuda::KvLayer kvl = cache.layer();
    for (int p = 0; p <= 37; ++p) {
      std::vector<int32_t> at;
      for (int32_t pb : pos) at.push_back(std::min<int32_t>(p, pb));
      DeviceBuffer<float> dkv(kv_in[size_t(p)]);
      DeviceBuffer<int32_t> dat(at);
      cuda::launch_mla_latent_store(dkv.get(), B, ms, d_norm.get(), 1e-6f, rope, dat.get(), kvl, nullptr);
    }
    for (int b = 0; b < B; ++b) {
      const int n = pos[size_t(b)] + 1;
      EXPECT_LT(test::rel_l2(cache.k_rows(b, n).data(), host_lat[size_t(b)].data(), int64_t(n) * lat), kTol)
          << "the latent rows of sequence " << b;
    }
    // One split (this capacity's) and 3 and 7: each row's length (or selection) cut into that many
    // chunks of whole blocks, empty ones included.
    for (const cuda::AttentionSplit split : {cuda::attention_split(ctx), cuda::AttentionSplit{3, 16},
                                             cuda::AttentionSplit{7, 16}})
    for (bool sparse : {false, true}) {
      SCOPED_TRACE(std::to_string(split.splits) + " splits");
      DeviceBuffer<float> dq(q), dqa(size_t(B) * heads * lat), datt(size_t(B) * heads * m.kv_lora_rank),
          dout(size_t(B) * heads * m.v_head_dim);
      DeviceBuffer<int32_t> dpos(pos);
      DeviceBuffer<float> scratch(cuda::attention_scratch_floats(B, heads, int(m.kv_lora_rank), split));
      std::vector<int32_t> sel(size_t(B) * ctx, 0), cnt(B);
      for (int b = 0; b < B; ++b) {
        std::copy(chosen[sparse][size_t(b)].begin(), chosen[sparse][size_t(b)].end(), sel.begin() + size_t(b) * ctx);
        cnt[size_t(b)] = int32_t(chosen[sparse][size_t(b)].size());
      }
      DeviceBuffer<int32_t> dsel(sel), dcnt(cnt);
      cuda::AttentionSelect select;
      if (sparse) select = {dsel.get(), dcnt.get(), ctx};
      dout.poison();
      cuda::launch_mla_query(dq.get(), B, ms, kv_b.dev, rope, dpos.get(), dqa.get(), nullptr);
      cuda::launch_mla_attention(dqa.get(), B, ms, m.softmax_scale, dpos.get(), kvl, split, select, scratch.get(),
                                 datt.get(), nullptr);
      cuda::launch_mla_output(datt.get(), B, ms, kv_b.dev, dout.get(), nullptr);
      const auto got = dout.download();
      EXPECT_LT(test::rel_l2(got.data(), want[sparse].data(), int64_t(want[sparse].size())), 1e-4)
          << (sparse ? "sparse" : "dense");
      const std::pair<int, bool> key{split.splits, sparse};
      if (!shuffled) identity_out[key] = got;
      else EXPECT_EQ(got, identity_out[key]) << (sparse ? "sparse" : "dense");
    }
  }
}

}  // namespace
}  // namespace kestrel
