#include <algorithm>
#include <cmath>
#include <cstdio>

#include "backend/cuda/attention.h"
#include "backend/cuda/check.h"
#include "backend/cuda/gemv.h"
#include "backend/cuda/misc.h"
#include "backend/cuda/norm_rope.h"
#include "backend/cuda/prefill_gemm.h"

namespace kestrel::cuda {
namespace {

#define KESTREL_CUBLAS_CHECK(expr)                                                              \
  do {                                                                                          \
    cublasStatus_t kestrel_st_ = (expr);                                                        \
    if (kestrel_st_ != CUBLAS_STATUS_SUCCESS)                                                   \
      ::kestrel::fail("cuBLAS error at ", __FILE__, ":", __LINE__, ": ", #expr, ": ",           \
                      cublasGetStatusString(kestrel_st_));                                      \
  } while (0)

// Rows of one attention launch: its split scratch grows with rows x splits.
constexpr int kAttentionRows = 512;
// The converted experts of one round: all of Qwen3-30B-A3B's 128 (1.2 GB in BF16) in one, 3 for
// GLM-4.5-Air's.
constexpr size_t kExpertScratchBytes = size_t(1536) << 20;

bool is_bf16(const DLinear& w) { return w.format == DFormat::BF16; }
int64_t elements(const DLinear& w) { return int64_t(w.out) * w.in; }

}  // namespace

std::string GemmPrefill::unsupported(const DeviceModel& m) {
  const ModelConfig& c = m.config();
  if (c.is_mla()) return "multi-head latent attention";
  for (const DLayer& L : m.layers())
    if (L.is_moe && (L.moe.local_experts != L.moe.router.experts || L.moe.expert_gate.bias))
      return "experts split over ranks or with biases";
  if (m.lm_head().out != c.vocab_size) return "a split vocabulary";
  return {};
}

template <typename T>
T* GemmPrefill::buffer(size_t n) {
  void* p = nullptr;
  if (cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)) != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it
    fail("out of GPU memory for the prefill's buffers (", (n * sizeof(T)) >> 20, " MiB more)");
  }
  buffers_.push_back(p);
  return static_cast<T*>(p);
}

GemmPrefill::GemmPrefill(const DeviceModel& m, const Decoder& cache, int max_chunk)
    : m_(m), cache_(cache), max_chunk_(max_chunk) {
  if (const std::string why = unsupported(m); !why.empty()) fail("internal: the GEMM prefill does not take ", why);
  if (max_chunk < 1) fail("internal: a prefill chunk of ", max_chunk);
  struct FreeOnFailure {  // a constructor that fails frees what it took
    GemmPrefill& p;
    bool done = false;
    ~FreeOnFailure() {
      if (!done) p.release();
    }
  } guard{*this};
  const ModelConfig& c = m.config();
  const size_t N = size_t(max_chunk), H = size_t(c.hidden_size), hd = size_t(c.head_dim);
  const size_t nq = size_t(c.num_heads), nkv = size_t(c.num_kv_heads);
  // The widest input of a dense product, the widest gated activation (pairs x width for the
  // experts), the largest dense matrix that needs converting, and the experts' sizes.
  size_t widest = std::max(H, nq * hd), act = 0, convert = 0, experts = 0, pairs = 0, per_expert = 0;
  auto dense = [&](const DLinear& w) {
    if (!is_bf16(w)) convert = std::max(convert, size_t(elements(w)));
  };
  for (const DLayer& L : m.layers()) {
    for (const DLinear* w : {&L.q, &L.k, &L.v, &L.o}) dense(*w);
    if (!L.is_moe) {
      for (const DLinear* w : {&L.gate, &L.up, &L.down}) dense(*w);
      act = std::max(act, N * size_t(L.gate.out));
      widest = std::max(widest, size_t(L.down.in));
      gate_.emplace_back(), up_.emplace_back(), down_.emplace_back();
      continue;
    }
    const DMoe& e = L.moe;
    const size_t E = size_t(e.local_experts), K = size_t(e.router.top_k);
    experts = std::max(experts, E);
    pairs = std::max(pairs, N * K);
    act = std::max(act, N * K * size_t(e.width));
    if (e.has_shared) {
      for (const DLinear* w : {&e.shared_gate, &e.shared_up, &e.shared_down}) dense(*w);
      act = std::max(act, N * size_t(e.shared_gate.out));
    }
    // Host copies of the experts' descriptors: the conversion jobs and GEMMs are built per layer.
    std::vector<DLinear> g(E), u(E), d(E);
    KESTREL_CUDA_CHECK(cudaMemcpy(g.data(), e.gate, E * sizeof(DLinear), cudaMemcpyDeviceToHost));
    KESTREL_CUDA_CHECK(cudaMemcpy(u.data(), e.up, E * sizeof(DLinear), cudaMemcpyDeviceToHost));
    KESTREL_CUDA_CHECK(cudaMemcpy(d.data(), e.down, E * sizeof(DLinear), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < E; ++i) {
      size_t n = 0;
      for (const DLinear* w : {&g[i], &u[i], &d[i]})
        if (!is_bf16(*w)) n += size_t(elements(*w));
      per_expert = std::max(per_expert, n);
    }
    gate_.push_back(std::move(g)), up_.push_back(std::move(u)), down_.push_back(std::move(d));
  }
  if (per_expert > 0)
    experts_per_round_ = int(std::clamp<size_t>(kExpertScratchBytes / 2 / per_expert, 1, std::max<size_t>(experts, 1)));
  else
    experts_per_round_ = int(std::max<size_t>(experts, 1));
  KESTREL_CUBLAS_CHECK(cublasCreate(&blas_));
  tokens_ = buffer<int32_t>(N);
  positions_ = buffer<int32_t>(N);
  x_ = buffer<float>(N * H);
  xn_ = buffer<float>(N * H);
  xb_ = buffer<__nv_bfloat16>(N * widest);
  q_ = buffer<float>(N * nq * hd);
  k_ = buffer<float>(N * nkv * hd);
  v_ = buffer<float>(N * nkv * hd);
  att_ = buffer<float>(N * nq * hd);
  h_ = buffer<float>(2 * act);
  act_ = buffer<__nv_bfloat16>(act);
  w_ = buffer<__nv_bfloat16>(std::max(convert, size_t(experts_per_round_) * per_expert));
  out_logits_ = buffer<float>(size_t(c.vocab_size));
  if (experts > 0) {
    router_w_ = buffer<float>(experts * H);
    router_logits_ = buffer<float>(N * experts);
    route_e_ = buffer<int32_t>(pairs);
    route_w_ = buffer<float>(pairs);
    sort_.counts = buffer<int32_t>(experts);
    sort_.row_pair = buffer<int32_t>(pairs);
    sort_.pair_row = buffer<int32_t>(pairs);
    xs_ = buffer<__nv_bfloat16>(pairs * H);
    ys_ = buffer<float>(pairs * H);
    jobs_cap_ = 3 * experts;
    ptrs_cap_ = 9 * experts;  // gate, up and down of every expert: A, B and C each
    KESTREL_CUDA_CHECK(cudaMallocHost(&counts_h_, experts * sizeof(int32_t)));
    KESTREL_CUDA_CHECK(cudaMallocHost(&jobs_h_, jobs_cap_ * sizeof(Bf16Job)));
    KESTREL_CUDA_CHECK(cudaMallocHost(&ptrs_h_, ptrs_cap_ * sizeof(void*)));
    jobs_d_ = buffer<Bf16Job>(jobs_cap_);
    ptrs_d_ = buffer<const void*>(ptrs_cap_);
  }
  guard.done = true;
}

GemmPrefill::~GemmPrefill() { release(); }

void GemmPrefill::release() {
  for (void* b : buffers_) cudaFree(b);
  cudaFreeHost(counts_h_), cudaFreeHost(jobs_h_), cudaFreeHost(ptrs_h_);
  if (blas_) cublasDestroy(blas_);
}

void GemmPrefill::gemm(const Gemm& g) {
  KESTREL_CUBLAS_CHECK(cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, g.m, g.n, g.k, &g.alpha, g.a, CUDA_R_16BF, g.lda,
                                    g.b, CUDA_R_16BF, g.ldb, &g.beta, g.c, CUDA_R_32F, g.ldc, CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT));
}

void GemmPrefill::gemms(const std::vector<Gemm>& g, cudaStream_t s) {
  if (g.empty()) return;
  const int n = int(g.size());
  if (grouped_ && ptrs_h_ && ptrs_used_ + 3 * size_t(n) <= ptrs_cap_) {
    // The pointer arrays go to the device; the sizes and scalars stay on the host (the grouped
    // call reads them before it returns).
    const void** hp = ptrs_h_ + ptrs_used_;
    const void** dp = ptrs_d_ + ptrs_used_;
    for (int i = 0; i < n; ++i) hp[i] = g[size_t(i)].a, hp[n + i] = g[size_t(i)].b, hp[2 * n + i] = g[size_t(i)].c;
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(dp, hp, 3 * size_t(n) * sizeof(void*), cudaMemcpyHostToDevice, s));
    ptrs_used_ += 3 * size_t(n);
    const size_t G = g.size();
    std::vector<cublasOperation_t> ta(G, CUBLAS_OP_T), tb(G, CUBLAS_OP_N);
    std::vector<int> m(G), nn(G), k(G), lda(G), ldb(G), ldc(G), size(G, 1);
    std::vector<float> alpha(G), beta(G);
    for (size_t i = 0; i < G; ++i) {
      m[i] = g[i].m, nn[i] = g[i].n, k[i] = g[i].k, lda[i] = g[i].lda, ldb[i] = g[i].ldb, ldc[i] = g[i].ldc;
      alpha[i] = g[i].alpha, beta[i] = g[i].beta;
    }
    const cublasStatus_t st = cublasGemmGroupedBatchedEx(
        blas_, ta.data(), tb.data(), m.data(), nn.data(), k.data(), alpha.data(), dp, CUDA_R_16BF, lda.data(), dp + n,
        CUDA_R_16BF, ldb.data(), beta.data(), const_cast<void* const*>(dp + 2 * n), CUDA_R_32F, ldc.data(), n,
        size.data(), CUBLAS_COMPUTE_32F);
    if (st == CUBLAS_STATUS_SUCCESS) return;
    if (st != CUBLAS_STATUS_NOT_SUPPORTED && st != CUBLAS_STATUS_INVALID_VALUE)
      fail("cuBLAS error in the grouped GEMM: ", cublasGetStatusString(st));
    grouped_ = false;  // this library does not take BF16 -> float32 groups: one call per GEMM
    std::fprintf(stderr, "cuBLAS refused the grouped GEMM (%s): one call per expert from here\n",
                 cublasGetStatusString(st));
  }
  for (const Gemm& x : g) gemm(x);
}

void GemmPrefill::linear(const DLinear& w, const __nv_bfloat16* x, int n, float* y, int ldy, bool accumulate,
                         cudaStream_t s) {
  const __nv_bfloat16* a = reinterpret_cast<const __nv_bfloat16*>(w.data);
  if (!is_bf16(w)) {
    launch_to_bf16(Bf16Job{w, w_}, s);  // the previous GEMM that read w_ precedes it on the stream
    a = w_;
  }
  Gemm g;
  g.a = a, g.lda = w.in;
  g.b = x, g.ldb = w.in;
  g.c = y, g.ldc = ldy;
  g.m = w.out, g.n = n, g.k = w.in;
  g.alpha = bf16_alpha(w), g.beta = accumulate ? 1.0f : 0.0f;
  gemm(g);
  launch_add_bias(y, w.bias, n, w.out, ldy, s);
}

void GemmPrefill::gated_mlp(const DLinear& gate, const DLinear& up, const DLinear& down, int n, cudaStream_t s) {
  const int w = gate.out, H = int(m_.config().hidden_size);
  linear(gate, xb_, n, h_, 2 * w, false, s);
  linear(up, xb_, n, h_ + w, 2 * w, false, s);
  launch_silu_mul_bf16(h_, n, w, act_, s);
  linear(down, act_, n, x_, H, true, s);
}

void GemmPrefill::attention(int layer, int n, int pos, cudaStream_t s) {
  const ModelConfig& c = m_.config();
  const DLayer& L = m_.layers()[size_t(layer)];
  const int hd = int(c.head_dim), nq = int(c.num_heads), nkv = int(c.num_kv_heads);
  linear(L.q, xb_, n, q_, nq * hd, false, s);
  linear(L.k, xb_, n, k_, nkv * hd, false, s);
  linear(L.v, xb_, n, v_, nkv * hd, false, s);
  RopeArgs rope;
  rope.inv_freq = m_.rope_inv_freq();
  rope.scaling = c.rope.attention_scaling();
  rope.rotary_dim = int(c.rope.rotary_dim);
  rope.interleaved = c.rope.interleaved;
  const KvLayer kvl = cache_.kv(layer);
  // Every row's key and value are in the cache before any row attends: causal over the chunk.
  launch_qk_rope_store(q_, k_, v_, n, nq, nkv, hd, L.q_norm, L.k_norm, c.rms_norm_eps, rope, positions_, kvl, s);
  // The decode step's attention, a slice of rows at a time (its split scratch grows with the rows).
  const float scale = 1.0f / std::sqrt(float(hd));
  const size_t row = size_t(nq) * size_t(hd);
  for (int r0 = 0; r0 < n; r0 += kAttentionRows) {
    const int rows = std::min(kAttentionRows, n - r0);
    AttentionSplit split = attention_split(pos + n, rows * nkv);
    split.cluster = 0;
    const size_t need = attention_scratch_floats(rows, nq, hd, split);
    if (need > att_scratch_floats_) {  // grows to the longest prompt seen
      KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
      if (att_scratch_) {
        KESTREL_CUDA_CHECK(cudaFree(att_scratch_));
        buffers_.erase(std::find(buffers_.begin(), buffers_.end(), static_cast<void*>(att_scratch_)));
      }
      att_scratch_ = nullptr, att_scratch_floats_ = 0;
      att_scratch_ = buffer<float>(need);
      att_scratch_floats_ = need;
    }
    launch_decode_attention(q_ + size_t(r0) * row, rows, nq, nkv, hd, scale, positions_ + r0, kvl, split, att_scratch_,
                            att_ + size_t(r0) * row, s);
  }
  launch_f32_to_bf16(att_, int64_t(n) * int64_t(row), xb_, s);
  linear(L.o, xb_, n, x_, int(c.hidden_size), true, s);
}

void GemmPrefill::moe(int layer, int n, cudaStream_t s) {
  const DMoe& e = m_.layers()[size_t(layer)].moe;
  const DRouter& r = e.router;
  const int H = int(m_.config().hidden_size), E = r.experts, K = r.top_k, pairs = n * K;
  // The router in float32 (its weights converted, not rounded; a few GFLOP per chunk): BF16
  // inputs could flip a near tie, and with it the experts a token runs, against the decode step.
  const float* rw = reinterpret_cast<const float*>(r.w.data);
  if (r.w.format != DFormat::F32) {
    launch_to_f32(r.w, router_w_, s);
    rw = router_w_;
  }
  const float one = 1.0f, zero = 0.0f;
  KESTREL_CUBLAS_CHECK(cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, E, n, H, &one, rw, CUDA_R_32F, H, xn_, CUDA_R_32F,
                                    H, &zero, router_logits_, CUDA_R_32F, E, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  launch_add_bias(router_logits_, r.w.bias, n, E, E, s);
  launch_select_experts(r, router_logits_, n, route_e_, route_w_, s);
  launch_expert_sort(route_e_, pairs, E, sort_, s);
  launch_gather_rows(xb_, H, sort_.row_pair, pairs, K, xs_, s);
  // First version: the counts come to the host once per MoE layer, which then converts only the
  // experts that received tokens and sizes each expert's GEMM (cuBLAS's grouped GEMM takes its
  // sizes from host memory). The wait drains the GPU's queue once per layer; the issue's goal is
  // a grouped GEMM that reads the counts on the device (docs/PERF.md v38).
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(counts_h_, sort_.counts, size_t(E) * 4, cudaMemcpyDeviceToHost, s));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
  jobs_used_ = ptrs_used_ = 0;  // the previous layer's staged copies have all run
  const std::vector<DLinear>&gate = gate_[size_t(layer)], &up = up_[size_t(layer)], &down = down_[size_t(layer)];
  const int I = e.width;
  int first_row = 0;  // of the current round
  for (int x = 0; x < E;) {
    // A round: the next experts_per_round_ experts with tokens, their weights converted together.
    std::vector<int> round;
    int rows = 0;
    for (; x < E && int(round.size()) < experts_per_round_; ++x)
      if (counts_h_[x] > 0) round.push_back(x), rows += counts_h_[x];
    if (round.empty()) break;
    Bf16Job* jobs = jobs_h_ + jobs_used_;
    int njobs = 0;
    int64_t most = 0;
    std::vector<const __nv_bfloat16*> wg(round.size()), wu(round.size()), wd(round.size());
    __nv_bfloat16* at = w_;
    auto place = [&](const DLinear& w) {  // the BF16 weights of w: its own, or converted into w_
      if (is_bf16(w)) return reinterpret_cast<const __nv_bfloat16*>(w.data);
      jobs[njobs++] = Bf16Job{w, at};
      most = std::max(most, elements(w));
      const __nv_bfloat16* p = at;
      at += elements(w);
      return p;
    };
    for (size_t i = 0; i < round.size(); ++i) {
      const int ex = round[i];
      wg[i] = place(gate[size_t(ex)]), wu[i] = place(up[size_t(ex)]), wd[i] = place(down[size_t(ex)]);
    }
    if (njobs > 0) {
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(jobs_d_ + jobs_used_, jobs, size_t(njobs) * sizeof(Bf16Job),
                                         cudaMemcpyHostToDevice, s));
      launch_to_bf16(jobs_d_ + jobs_used_, njobs, most, s);
      jobs_used_ += size_t(njobs);
    }
    // gate and up of each expert's rows into h_ [rows, 2I], then the activation, then down into ys_.
    std::vector<Gemm> gu, dn;
    int row = first_row;
    for (size_t i = 0; i < round.size(); ++i) {
      const int ex = round[i], cnt = counts_h_[ex];
      Gemm g;
      g.b = xs_ + size_t(row) * H, g.ldb = H;
      g.m = I, g.n = cnt, g.k = H, g.lda = H, g.ldc = 2 * I;
      g.a = wg[i], g.c = h_ + size_t(row) * 2 * I, g.alpha = bf16_alpha(gate[size_t(ex)]);
      gu.push_back(g);
      g.a = wu[i], g.c = h_ + size_t(row) * 2 * I + I, g.alpha = bf16_alpha(up[size_t(ex)]);
      gu.push_back(g);
      Gemm d;
      d.a = wd[i], d.lda = I;
      d.b = act_ + size_t(row) * I, d.ldb = I;
      d.c = ys_ + size_t(row) * H, d.ldc = H;
      d.m = H, d.n = cnt, d.k = I, d.alpha = bf16_alpha(down[size_t(ex)]);
      dn.push_back(d);
      row += cnt;
    }
    gemms(gu, s);
    launch_silu_mul_bf16(h_ + size_t(first_row) * 2 * I, rows, I, act_ + size_t(first_row) * I, s);
    gemms(dn, s);
    first_row += rows;
  }
  launch_combine_experts(ys_, H, sort_.pair_row, route_w_, n, K, x_, s);
  if (e.has_shared) gated_mlp(e.shared_gate, e.shared_up, e.shared_down, n, s);
}

void GemmPrefill::run(const int32_t* tokens, int n, int pos, cudaStream_t s, bool logits) {
  if (n < 1 || n > max_chunk_) fail("internal: a prefill chunk of ", n, " tokens, at most ", max_chunk_);
  if (pos + n > cache_.max_context())
    fail("the sequence would hold ", pos + n, " tokens, more than its context of ", cache_.max_context());
  const ModelConfig& c = m_.config();
  const int H = int(c.hidden_size);
  const float eps = c.rms_norm_eps;
  KESTREL_CUBLAS_CHECK(cublasSetStream(blas_, s));
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(tokens_, tokens, size_t(n) * 4, cudaMemcpyHostToDevice, s));
  launch_iota(positions_, pos, n, s);
  launch_embed(m_.embed(), tokens_, n, x_, s);
  for (int l = 0; l < int(m_.layers().size()); ++l) {
    const DLayer& L = m_.layers()[size_t(l)];
    launch_rms_norm(x_, L.attn_norm, n, H, eps, xn_, s);
    launch_f32_to_bf16(xn_, int64_t(n) * H, xb_, s);
    attention(l, n, pos, s);
    launch_rms_norm(x_, L.ffn_norm, n, H, eps, xn_, s);
    launch_f32_to_bf16(xn_, int64_t(n) * H, xb_, s);
    if (L.is_moe) moe(l, n, s);
    else gated_mlp(L.gate, L.up, L.down, n, s);
  }
  if (!logits) return;
  // The final norm and the LM head for the last row only, on the decode step's kernels.
  const float* last = x_ + size_t(n - 1) * H;
  launch_rms_norm(last, m_.final_norm(), 1, H, eps, xn_, s);
  const LinearJob head[1] = {{m_.lm_head(), out_logits_}};
  launch_linear(head, 1, xn_, 1, false, s);
}

}  // namespace kestrel::cuda
