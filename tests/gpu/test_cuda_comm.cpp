// Collectives among the GPUs of this machine, one thread per GPU: NCCL, the one-shot all-reduce
// and its fused add + RMSNorm against host references, graph capture and replay, the one-rank
// paths, and that a rank left alone gives up instead of hanging. Every test runs on one GPU;
// with two or more the same tests communicate (the parts that need two GPUs skip on one).
// Outputs are poisoned with NaN before each run.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <thread>

#include "backend/cpu/ops.h"
#include "backend/cuda/allreduce.h"
#include "backend/cuda/nccl_comm.h"
#include "backend/cuda/rank_threads.h"
#include "device_buffer.h"

namespace kestrel {
namespace {

using test::DeviceBuffer;

constexpr int64_t kSmallFloats = 4096;  // the threshold of the second group: its fallback at small sizes

int gpu_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return std::min(n, cuda::OneShotGroup::kMaxRanks);
}

// Transfers on the rank's (non-blocking) stream, finished before they return.
void put(float* d, const std::vector<float>& h, cudaStream_t s) {
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(d, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice, s));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
}
std::vector<float> get(const float* d, size_t n, cudaStream_t s) {
  std::vector<float> h(n);
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost, s));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
  return h;
}
void poison(float* d, size_t n, cudaStream_t s) { KESTREL_CUDA_CHECK(cudaMemsetAsync(d, 0xff, n * sizeof(float), s)); }

// Streams, communicators and one-shot groups over `devices` (rank r = devices[r]): one group
// with the default threshold and one whose fallback starts at kSmallFloats. Without peer access
// the groups are missing (oneshot_error says why) and only the NCCL tests run.
struct Ranks {
  std::vector<int> devices;
  std::vector<cudaStream_t> streams;
  std::vector<std::unique_ptr<cuda::NcclCommunicator>> nccl;
  std::unique_ptr<cuda::OneShotGroup> group, small;
  std::vector<std::unique_ptr<cuda::OneShotAllReduce>> oneshot, oneshot_small;
  std::unique_ptr<cuda::RankThreads> threads;
  std::string oneshot_error;

  // with_fallback false: the one-shot ranks get no NCCL fallback (one rank needs none).
  explicit Ranks(std::vector<int> devs, bool with_fallback = true) : devices(std::move(devs)) {
    for (int d : devices) {
      cuda::DeviceGuard g(d);
      streams.push_back(nullptr);
      KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&streams.back(), cudaStreamNonBlocking));
    }
    nccl = cuda::make_nccl_communicators(devices, streams);
    threads = std::make_unique<cuda::RankThreads>(devices);
    try {
      group = std::make_unique<cuda::OneShotGroup>(devices);
      small = std::make_unique<cuda::OneShotGroup>(devices, kSmallFloats);
    } catch (const Error& e) {
      oneshot_error = e.what();
      group.reset();
      small.reset();
      return;
    }
    for (int r = 0; r < size(); ++r) {
      Communicator* fb = with_fallback ? nccl[size_t(r)].get() : nullptr;
      oneshot.push_back(std::make_unique<cuda::OneShotAllReduce>(*group, r, streams[size_t(r)], fb));
      oneshot_small.push_back(std::make_unique<cuda::OneShotAllReduce>(*small, r, streams[size_t(r)], fb));
    }
  }
  ~Ranks() {
    for (auto s : streams) cudaStreamSynchronize(s);
    oneshot.clear();
    oneshot_small.clear();
    group.reset();
    small.reset();
    nccl.clear();
    for (auto s : streams) cudaStreamDestroy(s);
  }
  int size() const { return int(devices.size()); }
  // fn(rank) on every rank's thread; a failure aborts everything so that no rank hangs.
  void run(const std::function<void(int)>& fn) {
    threads->run(fn, [this] {
      if (group) group->abort();
      if (small) small->abort();
      nccl[0]->abort();
    });
  }
};

std::vector<int> all_gpus() {
  std::vector<int> d;
  for (int i = 0; i < gpu_count(); ++i) d.push_back(i);
  return d;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Within tol of the double-precision sum over ranks: norm-wise, and element-wise against the
// sum of magnitudes (a float sum in any order stays within (ranks - 1) * 2^-24 of it).
::testing::AssertionResult near_sum(const std::vector<float>& got, const std::vector<std::vector<float>>& parts,
                                    double tol) {
  const size_t n = parts[0].size();
  if (got.size() != n) return ::testing::AssertionFailure() << "size " << got.size() << ", expected " << n;
  std::vector<float> ref(n);
  for (size_t i = 0; i < n; ++i) {
    double s = 0, mag = 0;
    for (const auto& p : parts) {
      s += p[i];
      mag += std::fabs(p[i]);
    }
    ref[i] = float(s);
    if (!(std::fabs(double(got[i]) - s) <= tol * mag + 1e-30))
      return ::testing::AssertionFailure() << "element " << i << " of " << n << ": " << got[i] << ", expected " << s;
  }
  const double e = test::rel_err(got, ref);
  if (!(e <= tol)) return ::testing::AssertionFailure() << "relative error " << e << " over " << n << " floats";
  return ::testing::AssertionSuccess();
}

std::vector<std::vector<float>> random_parts(int ranks, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<float>> v;
  for (int r = 0; r < ranks; ++r) v.push_back(test::random_floats(n, rng));
  return v;
}

// x + the float sum of the parts in rank order, then rmsnorm(x) * w (w may be empty).
void add_norm_reference(const std::vector<std::vector<float>>& parts, std::vector<float>& x, const std::vector<float>& w,
                        float eps, int rows, int hidden, std::vector<float>& xn) {
  for (size_t i = 0; i < x.size(); ++i) {
    float s = parts[0][i];
    for (size_t p = 1; p < parts.size(); ++p) s += parts[p][i];
    x[i] += s;
  }
  xn.assign(x.size(), 0.0f);
  if (!w.empty()) cpu::rms_norm(x.data(), w.data(), rows, hidden, eps, xn.data());
}

const std::vector<int64_t> kSizes = {1, 7, 1024, 4096 + 3, 65536, 300000};

class CudaComm : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (gpu_count() == 0) return;
    try {
      ranks_ = new Ranks(all_gpus());
    } catch (const Error& e) {
      setup_error_ = e.what();
    }
  }
  static void TearDownTestSuite() {
    delete ranks_;
    ranks_ = nullptr;
  }
  void SetUp() override {
    if (!setup_error_.empty()) FAIL() << setup_error_;
    if (!ranks_) GTEST_SKIP() << "no GPU";
    if (ranks_->size() < 2) std::printf("[ note     ] one GPU: the collectives run their one-rank paths\n");
  }
  void TearDown() override {
    if (!ranks_ || !ranks_->group) return;
    EXPECT_NO_THROW(ranks_->group->check());
    EXPECT_NO_THROW(ranks_->small->check());
  }
  // The one-shot tests fail, naming the GPU pair, where the groups could not be made.
  static bool have_groups() { return ranks_->oneshot_error.empty(); }
  static Ranks* ranks_;
  static std::string setup_error_;
};
Ranks* CudaComm::ranks_ = nullptr;
std::string CudaComm::setup_error_;

TEST_F(CudaComm, NcclAllReduceAndAllGather) {
  Ranks& R = *ranks_;
  const int N = R.size();
  for (int64_t n : kSizes) {
    const auto parts = random_parts(N, size_t(n), uint32_t(n));
    std::vector<std::vector<float>> red(static_cast<size_t>(N)), gathered(static_cast<size_t>(N));
    R.run([&](int r) {
      const cudaStream_t s = R.streams[size_t(r)];
      DeviceBuffer<float> buf(static_cast<size_t>(n)), in(static_cast<size_t>(n)), out(static_cast<size_t>(n * N));
      put(buf.get(), parts[size_t(r)], s);
      put(in.get(), parts[size_t(r)], s);
      poison(out.get(), size_t(n * N), s);
      R.nccl[size_t(r)]->all_reduce_sum(buf.get(), n);
      R.nccl[size_t(r)]->all_gather(in.get(), n, out.get());
      red[size_t(r)] = get(buf.get(), size_t(n), s);
      gathered[size_t(r)] = get(out.get(), size_t(n * N), s);
    });
    std::vector<float> concat;
    for (const auto& p : parts) concat.insert(concat.end(), p.begin(), p.end());
    for (int r = 0; r < N; ++r) {
      EXPECT_TRUE(near_sum(red[size_t(r)], parts, 1e-6)) << "rank " << r << ", " << n << " floats";
      EXPECT_TRUE(same_bits(red[size_t(r)], red[0])) << "rank " << r << " differs from rank 0, " << n << " floats";
      EXPECT_TRUE(same_bits(gathered[size_t(r)], concat)) << "all_gather on rank " << r << ", " << n << " floats";
    }
  }
}

// Out of place (the partial must stay as it was), in place, and from pointers off the 16-byte
// alignment (the kernel's scalar form); 300000 floats take the NCCL fallback.
TEST_F(CudaComm, OneShotAllReduceSum) {
  if (!have_groups()) FAIL() << ranks_->oneshot_error;
  Ranks& R = *ranks_;
  const int N = R.size();
  for (int64_t n : kSizes) {
    const auto parts = random_parts(N, size_t(n), uint32_t(n) + 17);
    const size_t un = size_t(n), uN = size_t(N);
    std::vector<std::vector<float>> out_of_place(uN), in_place(uN), unaligned(uN), kept(uN);
    R.run([&](int r) {
      const cudaStream_t s = R.streams[size_t(r)];
      auto& ar = *R.oneshot[size_t(r)];
      DeviceBuffer<float> partial(un), out(un), buf(un), p1(un + 1), o1(un + 1);
      put(partial.get(), parts[size_t(r)], s);
      put(buf.get(), parts[size_t(r)], s);
      put(p1.get() + 1, parts[size_t(r)], s);
      poison(out.get(), size_t(n), s);
      poison(o1.get(), size_t(n) + 1, s);
      ar.all_reduce_sum(partial.get(), out.get(), n, s);
      ar.all_reduce_sum(buf.get(), buf.get(), n, s);
      ar.all_reduce_sum(p1.get() + 1, o1.get() + 1, n, s);
      out_of_place[size_t(r)] = get(out.get(), size_t(n), s);
      in_place[size_t(r)] = get(buf.get(), size_t(n), s);
      unaligned[size_t(r)] = get(o1.get() + 1, size_t(n), s);
      kept[size_t(r)] = get(partial.get(), size_t(n), s);
    });
    for (int r = 0; r < N; ++r) {
      const std::string at = "rank " + std::to_string(r) + ", " + std::to_string(n) + " floats";
      EXPECT_TRUE(near_sum(out_of_place[size_t(r)], parts, 1e-6)) << at;
      EXPECT_TRUE(same_bits(out_of_place[size_t(r)], out_of_place[0])) << at << ": differs from rank 0";
      EXPECT_TRUE(same_bits(in_place[size_t(r)], out_of_place[size_t(r)])) << at << ": in place";
      EXPECT_TRUE(same_bits(unaligned[size_t(r)], out_of_place[size_t(r)])) << at << ": unaligned";
      EXPECT_TRUE(same_bits(kept[size_t(r)], parts[size_t(r)])) << at << ": the partial changed";
    }
  }
}

// Rows 1..8 of several widths, through the default group (one-shot throughout) and the small
// one (above kSmallFloats: NCCL, then the one-rank add + norm kernel); one case per width
// without a norm weight (only the add). hidden 100 takes the kernel's scalar form.
TEST_F(CudaComm, OneShotAddNorm) {
  if (!have_groups()) FAIL() << ranks_->oneshot_error;
  Ranks& R = *ranks_;
  const int N = R.size();
  const float eps = 1e-6f;
  struct Case {
    int rows = 0, hidden = 0;
    bool norm = true, small = false;
    std::vector<std::vector<float>> parts;
    std::vector<float> x, w;
    std::vector<std::vector<float>> x_out, xn_out;  // per rank
  };
  std::vector<Case> cases;
  std::mt19937 rng(7);
  for (int small = 0; small < 2; ++small)
    for (int hidden : {64, 100, 2048, 5120, 7168})
      for (int rows = 1; rows <= 8; ++rows) {
        Case c;
        c.rows = rows;
        c.hidden = hidden;
        c.norm = rows != 3;
        c.small = small != 0;
        const size_t n = size_t(rows) * size_t(hidden);
        c.parts = random_parts(N, n, uint32_t(rng()));
        c.x = test::random_floats(n, rng);
        if (c.norm) {
          c.w = test::random_floats(size_t(hidden), rng, 0.1f);
          for (float& v : c.w) v += 1.0f;
        }
        c.x_out.resize(size_t(N));
        c.xn_out.resize(size_t(N));
        cases.push_back(std::move(c));
      }
  R.run([&](int r) {
    const cudaStream_t s = R.streams[size_t(r)];
    for (auto& c : cases) {
      const size_t n = size_t(c.rows) * size_t(c.hidden);
      auto& ar = c.small ? *R.oneshot_small[size_t(r)] : *R.oneshot[size_t(r)];
      DeviceBuffer<float> partial(n), x(n), xn(n), w(size_t(c.hidden));
      put(partial.get(), c.parts[size_t(r)], s);
      put(x.get(), c.x, s);
      if (c.norm) put(w.get(), c.w, s);
      poison(xn.get(), n, s);
      ar.all_reduce_add_norm(partial.get(), x.get(), c.norm ? w.get() : nullptr, eps, c.norm ? xn.get() : nullptr,
                             c.rows, c.hidden, s);
      c.x_out[size_t(r)] = get(x.get(), n, s);
      if (c.norm) c.xn_out[size_t(r)] = get(xn.get(), n, s);
    }
  });
  for (auto& c : cases) {
    std::vector<float> x = c.x, xn;
    add_norm_reference(c.parts, x, c.w, eps, c.rows, c.hidden, xn);
    for (int r = 0; r < N; ++r) {
      const std::string at = "rank " + std::to_string(r) + ", " + std::to_string(c.rows) + " x " +
                             std::to_string(c.hidden) + (c.small ? ", small group" : "") + (c.norm ? "" : ", no norm");
      EXPECT_LE(test::rel_err(c.x_out[size_t(r)], x), 1e-6) << at << ": x";
      EXPECT_TRUE(same_bits(c.x_out[size_t(r)], c.x_out[0])) << at << ": x differs from rank 0";
      if (!c.norm) continue;
      EXPECT_LE(test::rel_err(c.xn_out[size_t(r)], xn), 1e-5) << at << ": xn";
      EXPECT_TRUE(same_bits(c.xn_out[size_t(r)], c.xn_out[0])) << at << ": xn differs from rank 0";
    }
  }
}

// One graph per rank holding three one-shot calls (a sum, the fused add + norm, an in-place
// sum), replayed 100 times on fresh inputs, with a plain call after every tenth replay: the
// epochs advance on the device across replays and plain calls alike.
TEST_F(CudaComm, OneShotInGraphReplays) {
  if (!have_groups()) FAIL() << ranks_->oneshot_error;
  Ranks& R = *ranks_;
  const int N = R.size();
  constexpr int kReplays = 100;
  constexpr int64_t na = 4096 + 3, nc = 1000;
  constexpr int rows = 2, hidden = 2048;
  constexpr size_t nb = size_t(rows) * hidden;
  const float eps = 1e-5f;
  struct Replay {
    std::vector<std::vector<float>> a, b, c;  // per rank
    std::vector<float> x;
  };
  std::vector<Replay> in(kReplays);
  std::mt19937 rng(11);
  std::vector<float> w = test::random_floats(size_t(hidden), rng, 0.1f);
  for (float& v : w) v += 1.0f;
  for (auto& rp : in) {
    rp.a = random_parts(N, size_t(na), uint32_t(rng()));
    rp.b = random_parts(N, nb, uint32_t(rng()));
    rp.c = random_parts(N, size_t(nc), uint32_t(rng()));
    rp.x = test::random_floats(nb, rng);
  }
  struct Result {
    std::vector<float> a, x, xn, c, plain;
  };
  std::vector<std::vector<Result>> out(static_cast<size_t>(N), std::vector<Result>(kReplays));
  R.run([&](int r) {
    const cudaStream_t s = R.streams[size_t(r)];
    auto& ar = *R.oneshot[size_t(r)];
    const size_t una = size_t(na), unc = size_t(nc);
    DeviceBuffer<float> a(una), a_out(una), b(nb), x(nb), xn(nb), dw(w), c(unc), plain(una);
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());  // dw's upload ran on the legacy stream
    cudaGraph_t graph;
    KESTREL_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    try {
      ar.all_reduce_sum(a.get(), a_out.get(), na, s);
      ar.all_reduce_add_norm(b.get(), x.get(), dw.get(), eps, xn.get(), rows, hidden, s);
      ar.all_reduce_sum(c.get(), c.get(), nc, s);
    } catch (...) {
      cudaStreamEndCapture(s, &graph);
      throw;
    }
    KESTREL_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    cudaGraphExec_t exec;
    KESTREL_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    KESTREL_CUDA_CHECK(cudaGraphDestroy(graph));
    try {
      for (int i = 0; i < kReplays; ++i) {
        const Replay& rp = in[size_t(i)];
        put(a.get(), rp.a[size_t(r)], s);
        put(b.get(), rp.b[size_t(r)], s);
        put(c.get(), rp.c[size_t(r)], s);
        put(x.get(), rp.x, s);
        poison(a_out.get(), size_t(na), s);
        poison(xn.get(), nb, s);
        KESTREL_CUDA_CHECK(cudaGraphLaunch(exec, s));
        Result& res = out[size_t(r)][size_t(i)];
        if (i % 10 == 9) {
          poison(plain.get(), size_t(na), s);
          ar.all_reduce_sum(a.get(), plain.get(), na, s);
          res.plain = get(plain.get(), size_t(na), s);
        }
        res.a = get(a_out.get(), size_t(na), s);
        res.x = get(x.get(), nb, s);
        res.xn = get(xn.get(), nb, s);
        res.c = get(c.get(), size_t(nc), s);
      }
    } catch (...) {
      cudaGraphExecDestroy(exec);
      throw;
    }
    KESTREL_CUDA_CHECK(cudaGraphExecDestroy(exec));
  });
  int bad = 0;
  for (int i = 0; i < kReplays && bad < 5; ++i) {
    const Replay& rp = in[size_t(i)];
    std::vector<float> x = rp.x, xn;
    add_norm_reference(rp.b, x, w, eps, rows, hidden, xn);
    for (int r = 0; r < N; ++r) {
      const Result& res = out[size_t(r)][size_t(i)];
      const std::string at = "replay " + std::to_string(i) + ", rank " + std::to_string(r);
      const bool ok = near_sum(res.a, rp.a, 1e-6) && near_sum(res.c, rp.c, 1e-6) &&
                      test::rel_err(res.x, x) <= 1e-6 && test::rel_err(res.xn, xn) <= 1e-5 &&
                      same_bits(res.a, out[0][size_t(i)].a) && same_bits(res.xn, out[0][size_t(i)].xn) &&
                      (i % 10 != 9 || same_bits(res.plain, res.a));
      EXPECT_TRUE(ok) << at << ": sum " << near_sum(res.a, rp.a, 1e-6).message() << "; in place "
                      << near_sum(res.c, rp.c, 1e-6).message() << "; x err " << test::rel_err(res.x, x)
                      << "; xn err " << test::rel_err(res.xn, xn);
      bad += !ok;
    }
  }
}

// One rank and no fallback communicator: every path runs without communicating, above the
// one-shot size too, and gives the partial (plus x) back.
TEST(CudaCommOneRank, EveryPathAddsThePartial) {
  if (gpu_count() < 1) GTEST_SKIP() << "no GPU";
  Ranks R({0}, /*with_fallback=*/false);
  ASSERT_TRUE(R.oneshot_error.empty()) << R.oneshot_error;
  const float eps = 1e-6f;
  std::mt19937 rng(5);
  const auto big = test::random_floats(300000, rng);
  const int rows = 3, hidden = 2048;  // 6144 floats: above the small group's one-shot size
  const size_t n = size_t(rows) * hidden;
  const auto partial = test::random_floats(n, rng), x0 = test::random_floats(n, rng);
  auto w = test::random_floats(size_t(hidden), rng, 0.1f);
  for (float& v : w) v += 1.0f;
  std::vector<float> sum_out, sum_in_place, gathered, nccl_sum, nccl_gathered, via_comm;
  std::vector<std::vector<float>> x_out(2), xn_out(2);
  R.run([&](int) {
    const cudaStream_t s = R.streams[0];
    DeviceBuffer<float> p(big.size()), o(big.size()), q(big.size());
    put(p.get(), big, s);
    put(q.get(), big, s);
    poison(o.get(), big.size(), s);
    R.oneshot[0]->all_reduce_sum(p.get(), o.get(), int64_t(big.size()), s);
    R.oneshot[0]->all_reduce_sum(q.get(), q.get(), int64_t(big.size()), s);
    sum_out = get(o.get(), big.size(), s);
    sum_in_place = get(q.get(), big.size(), s);
    poison(o.get(), big.size(), s);
    R.oneshot[0]->all_gather(p.get(), int64_t(big.size()), o.get());
    gathered = get(o.get(), big.size(), s);
    R.oneshot[0]->all_reduce_sum(q.get(), int64_t(big.size()));  // the Communicator form
    via_comm = get(q.get(), big.size(), s);
    for (int g = 0; g < 2; ++g) {
      auto& ar = g ? *R.oneshot_small[0] : *R.oneshot[0];
      DeviceBuffer<float> dp(partial), dx(x0), dw(w), dxn(n);
      KESTREL_CUDA_CHECK(cudaDeviceSynchronize());  // the uploads ran on the legacy stream
      poison(dxn.get(), n, s);
      ar.all_reduce_add_norm(dp.get(), dx.get(), dw.get(), eps, dxn.get(), rows, hidden, s);
      x_out[size_t(g)] = get(dx.get(), n, s);
      xn_out[size_t(g)] = get(dxn.get(), n, s);
    }
    DeviceBuffer<float> nb(big), ng(big.size());
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
    poison(ng.get(), big.size(), s);
    R.nccl[0]->all_reduce_sum(nb.get(), int64_t(big.size()));
    R.nccl[0]->all_gather(p.get(), int64_t(big.size()), ng.get());
    nccl_sum = get(nb.get(), big.size(), s);
    nccl_gathered = get(ng.get(), big.size(), s);
  });
  EXPECT_TRUE(same_bits(sum_out, big));
  EXPECT_TRUE(same_bits(sum_in_place, big));
  EXPECT_TRUE(same_bits(gathered, big));
  EXPECT_TRUE(same_bits(via_comm, big));
  EXPECT_TRUE(same_bits(nccl_sum, big));
  EXPECT_TRUE(same_bits(nccl_gathered, big));
  std::vector<float> x = x0, xn;
  add_norm_reference({partial}, x, w, eps, rows, hidden, xn);
  for (int g = 0; g < 2; ++g) {
    EXPECT_TRUE(same_bits(x_out[size_t(g)], x)) << (g ? "small group" : "default group");
    EXPECT_LE(test::rel_err(xn_out[size_t(g)], xn), 1e-5) << (g ? "small group" : "default group");
  }
  // The same kernel as the standalone add + norm.
  DeviceBuffer<float> dp(partial), dx(x0), dw(w), dxn(n);
  dxn.poison();
  cuda::launch_add_norm(dp.get(), dx.get(), dw.get(), eps, dxn.get(), rows, hidden, nullptr);
  EXPECT_TRUE(same_bits(dx.download(), x));
  EXPECT_TRUE(same_bits(dxn.download(), xn_out[0]));
}

TEST(CudaCommOneRank, NcclAbortMakesLaterCallsFail) {
  if (gpu_count() < 1) GTEST_SKIP() << "no GPU";
  cuda::DeviceGuard g(0);
  cudaStream_t s;
  KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  {
    auto comms = cuda::make_nccl_communicators({0}, {s});
    DeviceBuffer<float> buf(16);
    comms[0]->all_reduce_sum(buf.get(), 16);
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
    comms[0]->abort();
    EXPECT_NO_THROW(comms[0]->abort());  // a second abort does nothing
    try {
      comms[0]->all_reduce_sum(buf.get(), 16);
      ADD_FAILURE() << "a collective after abort() did not fail";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("aborted"), std::string::npos) << e.what();
    }
  }
  cudaStreamDestroy(s);
}

// A rank whose peer never comes gives up after the group's timeout, marks the group failed
// (later kernels return at once) and check() names both ranks; an abort releases a waiting
// kernel at once and makes later calls fail.
TEST(CudaCommTwoRanks, LoneRankGivesUpInsteadOfHanging) {
  if (gpu_count() < 2) GTEST_SKIP() << "needs two GPUs (this machine has " << gpu_count() << ")";
  using clock = std::chrono::steady_clock;
  cuda::DeviceGuard dg(0);
  cudaStream_t s;
  KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  DeviceBuffer<float> p(4096), o(4096);
  auto seconds = [](clock::time_point t0) { return std::chrono::duration<double>(clock::now() - t0).count(); };
  {
    cuda::OneShotGroup group({0, 1}, cuda::OneShotGroup::kDefaultMaxFloats, /*timeout_ms=*/300);
    cuda::OneShotAllReduce ar(group, 0, s);
    auto t0 = clock::now();
    ar.all_reduce_sum(p.get(), o.get(), 4096, s);  // rank 1 never calls
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
    const double waited = seconds(t0);
    EXPECT_GE(waited, 0.25);
    EXPECT_LT(waited, 10.0);
    try {
      group.check();
      ADD_FAILURE() << "check() did not report the timeout";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("rank 0 (GPU 0) waited more than 300 ms for rank 1"), std::string::npos)
          << e.what();
    }
    t0 = clock::now();
    ar.all_reduce_sum(p.get(), o.get(), 4096, s);  // the group has failed: returns at once
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
    EXPECT_LT(seconds(t0), 0.2);
  }
  {
    cuda::OneShotGroup group({0, 1}, cuda::OneShotGroup::kDefaultMaxFloats, /*timeout_ms=*/60000);
    cuda::OneShotAllReduce ar(group, 0, s);
    ar.all_reduce_sum(p.get(), o.get(), 4096, s);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const auto t0 = clock::now();
    ar.abort();
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
    EXPECT_LT(seconds(t0), 5.0);
    try {
      group.check();
      ADD_FAILURE() << "check() did not report the abort";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("aborted"), std::string::npos) << e.what();
    }
    EXPECT_THROW(ar.all_reduce_sum(p.get(), o.get(), 4096, s), Error);
  }
  cudaStreamDestroy(s);
}

}  // namespace
}  // namespace kestrel
