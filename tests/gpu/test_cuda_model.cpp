// Whole models on the GPU decode path against the CPU reference and transformers' logits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "../unit/fixture.h"
#include "backend/cpu/forward.h"
#include "backend/cuda/decoder.h"
#include "backend/cuda/device_model.h"
#include "backend/cuda/graph_profile.h"
#include "backend/cuda/session.h"
#include "device_buffer.h"
#include "formats/json_file.h"
#include "model/weights.h"

namespace kestrel {
namespace {

constexpr double kVsCpu = 1e-4;        // GPU decode vs CPU decode, per position
constexpr double kVsReference = 1e-3;  // GPU decode vs transformers, per position
// A sequence in a batch vs alone: NVFP4 matrices take the tensor-core path from 2 tokens and the
// CUDA-core path for 1, so results differ by rounding (both are checked against the CPU at 1e-5
// per op); everything else is the same code. Measured worst over 3 random layers: 2.9e-6
// (Qwen3-30B-A3B) and 7.6e-6 (GLM-4.5-Air).
constexpr double kBatchVsSingle = 1e-5;
// A BF16 KV cache vs the CPU's float32 one: keys and values rounded to 8 significant bits.
constexpr double kBf16CacheVsCpu = 1e-2;

class CudaModelTest : public ::testing::TestWithParam<std::string> {};

void set_inputs(cuda::Decoder& d, const std::vector<int32_t>& tokens, const std::vector<int32_t>& positions) {
  KESTREL_CUDA_CHECK(cudaMemcpy(d.tokens(), tokens.data(), tokens.size() * 4, cudaMemcpyHostToDevice));
  KESTREL_CUDA_CHECK(cudaMemcpy(d.positions(), positions.data(), positions.size() * 4, cudaMemcpyHostToDevice));
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
}

// A non-blocking stream for graph capture (the legacy default stream cannot be captured).
struct Stream {
  cudaStream_t s;
  Stream() { KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(s); }
};

// The CPU reference's logits for every token of a fixture's sequence, run at once: [tokens, vocab].
std::vector<float> cpu_sequence_logits(const Model& model, const test::Reference& ref) {
  ThreadPool pool(2);
  cpu::Forward fwd(model, pool);
  KvCache cache = fwd.make_cache(int64_t(ref.tokens.size()));
  std::vector<float> out(ref.tokens.size() * size_t(ref.vocab));
  fwd.run(ref.tokens, cache, out.data());
  return out;
}

std::vector<float> logits_of(const cuda::Decoder& d, int batch, int64_t vocab) {
  std::vector<float> v(static_cast<size_t>(batch * vocab));
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  KESTREL_CUDA_CHECK(cudaMemcpy(v.data(), d.logits(), v.size() * 4, cudaMemcpyDeviceToHost));
  return v;
}

TEST_P(CudaModelTest, DecodeMatchesCpuAndTransformers) {
  const std::string dir = test::fixture_dir(GetParam());
  auto model = load_model(dir);
  const test::Reference ref = test::load_reference(dir);
  const int64_t T = int64_t(ref.tokens.size()), V = ref.vocab;
  auto dm = cuda::DeviceModel::upload(*model);
  cuda::Decoder dec(*dm, 3, int(T));

  ThreadPool pool(2);
  cpu::Forward fwd(*model, pool);
  KvCache cache = fwd.make_cache(T);
  std::vector<float> cpu_logits(static_cast<size_t>(V));
  double worst_cpu = 0, worst_ref = 0;
  for (int64_t t = 0; t < T; ++t) {
    set_inputs(dec, {ref.tokens[size_t(t)]}, {int32_t(t)});
    dec.step(1, nullptr);
    const auto g = logits_of(dec, 1, V);
    fwd.run({ref.tokens.data() + t, 1}, cache, cpu_logits.data());
    const double ec = test::rel_l2(g.data(), cpu_logits.data(), V);
    const double er = test::rel_l2(g.data(), ref.logits.data() + t * V, V);
    EXPECT_LE(ec, kVsCpu) << "position " << t;
    EXPECT_LE(er, kVsReference) << "position " << t;
    worst_cpu = std::max(worst_cpu, ec);
    worst_ref = std::max(worst_ref, er);
  }
  std::printf("  GPU decode: worst rel L2 %.2e vs CPU, %.2e vs transformers\n", worst_cpu, worst_ref);
}

// Rewinding a Session (speculative decoding's rejected drafts) forgets the positions after it:
// running the same tokens again there gives the same logits, and other tokens those of a session
// that never saw the forgotten ones (to the rounding of chunks of other lengths).
TEST_P(CudaModelTest, SessionRewind) {
  const std::string dir = test::fixture_dir(GetParam());
  auto model = load_model(dir);
  const test::Reference ref = test::load_reference(dir);
  const int64_t T = int64_t(ref.tokens.size()), V = ref.vocab;
  ASSERT_GE(T, 4);
  auto dm = cuda::DeviceModel::upload(*model);
  cuda::Session s(*dm, int(T) + 4);
  std::vector<float> first(size_t(T * V)), again(size_t(2 * V)), other(size_t(2 * V)), fresh(size_t(T * V));
  s.run(ref.tokens, first.data(), true);
  s.rewind(int(T) - 2);
  EXPECT_EQ(s.position(), T - 2);
  s.run({ref.tokens.data() + T - 2, 2}, again.data(), true);
  for (int i = 0; i < 2; ++i)
    EXPECT_LE(test::rel_l2(again.data() + i * V, first.data() + (T - 2 + i) * V, V), kVsCpu) << "position " << T - 2 + i;
  // Other tokens after the rewind: as if the forgotten ones had never run.
  std::vector<int32_t> alt(ref.tokens.begin(), ref.tokens.end());
  alt[size_t(T - 2)] = (alt[size_t(T - 2)] + 1) % int32_t(V);
  alt[size_t(T - 1)] = (alt[size_t(T - 1)] + 3) % int32_t(V);
  s.rewind(int(T) - 2);
  s.run({alt.data() + T - 2, 2}, other.data(), true);
  cuda::Session clean(*dm, int(T) + 4);
  clean.run(alt, fresh.data(), true);
  for (int i = 0; i < 2; ++i)
    EXPECT_LE(test::rel_l2(other.data() + i * V, fresh.data() + (T - 2 + i) * V, V), kVsCpu) << "position " << T - 2 + i;
  EXPECT_THROW(s.rewind(int(T) + 1), Error);
}

// A Session (what generate and logits run on the GPU) gives the CPU's logits for a prompt run
// at once, then for tokens run one by one after it, and refuses to run past its context.
TEST_P(CudaModelTest, SessionMatchesCpu) {
  const std::string dir = test::fixture_dir(GetParam());
  auto model = load_model(dir);
  const test::Reference ref = test::load_reference(dir);
  const int64_t T = int64_t(ref.tokens.size()), V = ref.vocab, P = T / 2;
  auto dm = cuda::DeviceModel::upload(*model);
  cuda::Session session(*dm, int(T));
  const std::vector<float> want = cpu_sequence_logits(*model, ref);
  std::vector<float> got(static_cast<size_t>(P * V));
  session.run({ref.tokens.data(), size_t(P)}, got.data(), true);
  for (int64_t t = 0; t < P; ++t)
    EXPECT_LE(test::rel_l2(got.data() + t * V, want.data() + t * V, V), kVsCpu) << "position " << t;
  std::vector<float> last(static_cast<size_t>(V));
  for (int64_t t = P; t < T; ++t) {
    session.run({ref.tokens.data() + t, 1}, last.data(), false);
    EXPECT_LE(test::rel_l2(last.data(), want.data() + t * V, V), kVsCpu) << "position " << t;
  }
  EXPECT_EQ(session.position(), T);
  EXPECT_THROW(session.run({ref.tokens.data(), 1}, last.data(), false), Error);

  // The whole sequence at once: prefill steps of `chunk` positions sharing one cache (3: several
  // steps and a shorter last one; the default: one step), with every position's logits, then
  // with the last position's only (the LM head runs for that row alone).
  for (const int chunk : {3, cuda::Session::kDefaultChunk}) {
    SCOPED_TRACE("chunk " + std::to_string(chunk));
    cuda::Session whole(*dm, int(T), chunk);
    std::vector<float> every(static_cast<size_t>(T * V));
    whole.run(ref.tokens, every.data(), true);
    for (int64_t t = 0; t < T; ++t)
      EXPECT_LE(test::rel_l2(every.data() + t * V, want.data() + t * V, V), kVsCpu) << "prefill position " << t;
    whole.reset();
    std::fill(last.begin(), last.end(), std::nanf(""));
    whole.run(ref.tokens, last.data(), false);
    EXPECT_LE(test::rel_l2(last.data(), want.data() + (T - 1) * V, V), kVsCpu) << "last-row logits";
  }
}

// A BF16 KV cache (the GPU's default for grouped-query attention): the CPU's logits to the
// rounding of the cached keys and values, for a prompt prefilled in chunks of 3 and tokens run
// one by one after it. MLA models refuse it (their latents are cached as float32).
TEST_P(CudaModelTest, Bf16CacheStaysCloseToCpu) {
  const std::string dir = test::fixture_dir(GetParam());
  auto model = load_model(dir);
  const test::Reference ref = test::load_reference(dir);
  const int64_t T = int64_t(ref.tokens.size()), V = ref.vocab, P = T / 2;
  auto dm = cuda::DeviceModel::upload(*model);
  if (model->config.is_mla()) {
    EXPECT_THROW(cuda::Session(*dm, int(T), 3, cuda::KvType::BF16), Error);
    return;
  }
  cuda::Session session(*dm, int(T), 3, cuda::KvType::BF16);
  const std::vector<float> want = cpu_sequence_logits(*model, ref);
  std::vector<float> got(static_cast<size_t>(T * V));
  session.run({ref.tokens.data(), size_t(P)}, got.data(), true);
  for (int64_t t = P; t < T; ++t) session.run({ref.tokens.data() + t, 1}, got.data() + t * V, false);
  double worst = 0;
  for (int64_t t = 0; t < T; ++t) {
    const double e = test::rel_l2(got.data() + t * V, want.data() + t * V, V);
    EXPECT_LE(e, kBf16CacheVsCpu) << "position " << t;
    worst = std::max(worst, e);
  }
  EXPECT_GT(worst, 1e-7) << "a BF16 cache rounds: logits equal to the float32 CPU's mean it was not used";
  std::printf("  BF16 KV cache: worst rel L2 %.2e vs CPU\n", worst);
}

// Three sequences decoding side by side give what each gives alone (to rounding); the graph replay gives what
// the plain launches give; and a graph that advances by itself generates the CPU's greedy text.
TEST_P(CudaModelTest, BatchAndGraphAgree) {
  const std::string dir = test::fixture_dir(GetParam());
  auto model = load_model(dir);
  const test::Reference ref = test::load_reference(dir);
  const int64_t V = ref.vocab;
  auto dm = cuda::DeviceModel::upload(*model);
  const int steps = 6;
  cuda::Decoder single(*dm, 1, steps), batched(*dm, 3, steps);
  Stream stream;
  const std::vector<std::vector<int32_t>> seqs = {
      {ref.tokens[0], ref.tokens[1], ref.tokens[2], ref.tokens[3], ref.tokens[4], ref.tokens[5]},
      {ref.tokens[5], ref.tokens[4], ref.tokens[3], ref.tokens[2], ref.tokens[1], ref.tokens[0]},
      {ref.tokens[9], ref.tokens[9], ref.tokens[8], ref.tokens[7], ref.tokens[6], ref.tokens[5]}};
  double worst = 0;
  for (int t = 0; t < steps; ++t) {
    set_inputs(batched, {seqs[0][size_t(t)], seqs[1][size_t(t)], seqs[2][size_t(t)]}, {t, t, t});
    batched.step_graph(3, false, stream.s);
    const auto all = logits_of(batched, 3, V);
    for (int b = 0; b < 3; ++b) {
      // The single-sequence decoder replays sequence b from the start each time (its cache is
      // overwritten position by position, so this is the same computation as decoding alone).
      for (int u = 0; u <= t; ++u) {
        set_inputs(single, {seqs[size_t(b)][size_t(u)]}, {u});
        single.step(1, nullptr);
      }
      const auto one = logits_of(single, 1, V);
      const double e = test::rel_l2(all.data() + b * V, one.data(), V);
      EXPECT_LE(e, kBatchVsSingle) << "sequence " << b << " step " << t;
      worst = std::max(worst, e);
    }
  }
  std::printf("  batch of 3 vs alone: worst rel L2 %.2e\n", worst);

  // Greedy generation by graph replays alone.
  cuda::Decoder gen(*dm, 1, 16);
  set_inputs(gen, {ref.tokens[0]}, {0});
  std::vector<int32_t> got;
  for (int i = 0; i < 12; ++i) {
    gen.step_graph(1, true, stream.s);
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream.s));
    int32_t tok;
    KESTREL_CUDA_CHECK(cudaMemcpy(&tok, gen.tokens(), 4, cudaMemcpyDeviceToHost));
    got.push_back(tok);
  }
  ThreadPool pool(2);
  cpu::Forward fwd(*model, pool);
  KvCache cache = fwd.make_cache(16);
  std::vector<float> l(static_cast<size_t>(V));
  std::vector<int32_t> want;
  int32_t cur = ref.tokens[0];
  for (int i = 0; i < 12; ++i) {
    fwd.run({&cur, 1}, cache, l.data());
    cur = int32_t(std::max_element(l.begin(), l.end()) - l.begin());
    want.push_back(cur);
  }
  EXPECT_EQ(got, want);
}

// The batched decoder on a pool of its own with shuffled block tables (and blocks no table
// names) gives the identity tables' logits bit for bit. Then a one-sequence decoder borrowing
// that pool prefills sequence 1 afresh in sequence 1's blocks (its table row copied from the
// batched decoder's), and the batched decoder goes on decoding it: the CPU's logits throughout.
TEST_P(CudaModelTest, PagedTablesAndABorrowedPoolMatchCpu) {
  const std::string dir = test::fixture_dir(GetParam());
  auto model = load_model(dir);
  const test::Reference ref = test::load_reference(dir);
  const int64_t T = int64_t(ref.tokens.size()), V = ref.vocab;
  auto dm = cuda::DeviceModel::upload(*model);
  const int B = 3;
  cuda::Decoder ident(*dm, B, int(T));
  const int n = ident.table_stride();
  EXPECT_EQ(n, (T + 15) / 16);
  EXPECT_EQ(ident.kv_blocks(), int64_t(B) * n);
  cuda::KvSource own;
  own.blocks = int64_t(B) * n + 7;
  cuda::Decoder paged(*dm, B, int(T), false, nullptr, own);
  ASSERT_EQ(paged.kv_blocks(), own.blocks);
  std::vector<int32_t> ids(size_t(own.blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937 rng(3);
  std::shuffle(ids.begin(), ids.end(), rng);
  for (int b = 0; b < B; ++b) paged.set_table(b, {ids.data() + size_t(b) * size_t(n), size_t(n)}, nullptr);

  auto token = [&](int b, int64_t t) { return ref.tokens[size_t(b == 1 ? T - 1 - t : (t + b) % T)]; };
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> tokens, positions;
    for (int b = 0; b < B; ++b) {
      tokens.push_back(token(b, t));
      positions.push_back(int32_t(t));
    }
    set_inputs(ident, tokens, positions);
    ident.step(B, nullptr);
    set_inputs(paged, tokens, positions);
    paged.step(B, nullptr);
    EXPECT_EQ(logits_of(paged, B, V), logits_of(ident, B, V)) << "step " << t;
  }

  const std::vector<float> want = cpu_sequence_logits(*model, ref);
  cuda::KvSource borrow;
  borrow.borrow = &paged;
  cuda::Decoder prefill(*dm, 8, int(T), true, nullptr, borrow);
  EXPECT_EQ(prefill.kv_blocks(), paged.kv_blocks());
  KESTREL_CUDA_CHECK(cudaMemcpy(prefill.table(), paged.table() + size_t(n), size_t(n) * 4, cudaMemcpyDeviceToDevice));
  const int64_t P = T / 2;
  for (int64_t i = 0; i < P; i += 8) {
    const int c = int(std::min<int64_t>(8, P - i));
    std::vector<int32_t> tokens(ref.tokens.begin() + i, ref.tokens.begin() + i + c), positions(static_cast<size_t>(c));
    std::iota(positions.begin(), positions.end(), int32_t(i));
    set_inputs(prefill, tokens, positions);
    prefill.step(c, nullptr);
    const auto got = logits_of(prefill, c, V);
    for (int r = 0; r < c; ++r)
      EXPECT_LE(test::rel_l2(got.data() + r * V, want.data() + (i + r) * V, V), kVsCpu) << "prefill position " << i + r;
  }
  for (int64_t t = P; t < T; ++t) {  // rows 0 and 2 rewrite position 0 of their own sequences
    set_inputs(paged, {ref.tokens[0], ref.tokens[size_t(t)], ref.tokens[0]}, {0, int32_t(t), 0});
    paged.step(B, nullptr);
    const auto got = logits_of(paged, B, V);
    EXPECT_LE(test::rel_l2(got.data() + V, want.data() + t * V, V), kVsCpu) << "position " << t;
  }
}

// The graph profile of a step (kestrel bench --ops, kestrel profile) sees every op and every
// kernel of the step once, and leaves the decoder as a real step would.
TEST_P(CudaModelTest, GraphProfileCoversTheStep) {
  const std::string dir = test::fixture_dir(GetParam());
  auto model = load_model(dir);
  const test::Reference ref = test::load_reference(dir);
  auto dm = cuda::DeviceModel::upload(*model);
  const int B = 2;
  cuda::Decoder dec(*dm, B, 4);
  Stream stream;
  set_inputs(dec, {ref.tokens[0], ref.tokens[1]}, {0, 0});
  dec.step(B, stream.s);
  const std::vector<float> want = logits_of(dec, B, ref.vocab);
  const cuda::GraphProfile p = cuda::profile_graph(dec, B, 2, stream.s);
  int nodes = 0;
  std::vector<std::string> names;
  for (const auto& o : p.ops) {
    EXPECT_GE(o.nodes, o.calls) << o.name << ": an op without kernels";
    nodes += o.nodes;
    names.push_back(o.name);
  }
  EXPECT_EQ(nodes, dec.launches_per_step());
  for (const char* op : {"embed", "rms_norm", "attention", "lm_head", "argmax"})
    EXPECT_NE(std::find(names.begin(), names.end(), op), names.end()) << op;
  EXPECT_GT(p.step_ms, 0.0);
  EXPECT_LE(test::rel_err(logits_of(dec, B, ref.vocab), want), 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Families, CudaModelTest, ::testing::ValuesIn(test::fixture_names()), [](const auto& info) {
  std::string n = info.param;
  for (char& ch : n)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return n;
});

// The first layers of real MoE shapes with random weights: a batch of 8 sequences (the
// expert-grouped tensor-core MoE kernels: the fixtures' experts are too narrow for them) against
// each sequence alone (the per-slot kernels), and the graph replay against plain launches.
TEST(CudaRandomModel, MoeBatchOfEightMatchesEachSequenceAlone) {
  for (const char* name : {"qwen3-30b-a3b-nvfp4", "glm-4.5-air-nvfp4"}) {
    SCOPED_TRACE(name);
    const std::string path = std::string(KESTREL_FIXTURES) + "/../../configs/" + name + ".json";
    ModelConfig c = parse_model_config_and_quant(read_json_file(path), path);
    c.num_layers = 3;  // GLM-4.5-Air: one dense layer, then two with routed and shared experts
    c.moe_layer.resize(3);
    const auto dm = cuda::DeviceModel::random(c);
    const int B = 8;
    const int64_t V = c.vocab_size;
    std::vector<int32_t> tokens(B), positions(B, 0);
    for (int b = 0; b < B; ++b) tokens[size_t(b)] = int32_t((int64_t(b) * 7919 + 5) % V);
    Stream st;
    cuda::Decoder batch(*dm, B, 4);
    set_inputs(batch, tokens, positions);
    batch.step(B, st.s);
    const std::vector<float> plain = logits_of(batch, B, V);
    set_inputs(batch, tokens, positions);
    batch.step_graph(B, false, st.s);
    EXPECT_LE(test::rel_err(logits_of(batch, B, V), plain), 1e-6) << "graph replay vs plain launches";
    cuda::Decoder one(*dm, 1, 4);
    double worst = 0;
    for (int b = 0; b < B; ++b) {
      set_inputs(one, {tokens[size_t(b)]}, {0});
      one.step(1, st.s);
      worst = std::max(worst, test::rel_l2(&plain[size_t(b * V)], logits_of(one, 1, V).data(), V));
    }
    EXPECT_LE(worst, kBatchVsSingle);
    std::printf("  random %s, 3 layers: batch of 8 vs alone: worst rel L2 %.2e\n", name, worst);
  }
}

}  // namespace
}  // namespace kestrel
