#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backend/cuda/attention.h"
#include "backend/cuda/check.h"
#include "backend/cuda/gemv.h"
#include "backend/cuda/misc.h"
#include "backend/cuda/norm_rope.h"
#include "backend/cuda/prefill_attention.h"
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

bool is_bf16(const DLinear& w) { return w.format == DFormat::BF16; }
int64_t elements(const DLinear& w) { return int64_t(w.out) * w.in; }

}  // namespace

std::string GemmPrefill::unsupported(const DeviceModel& m) {
  const ModelConfig& c = m.config();
  if (c.is_mla()) return "multi-head latent attention";
  for (const DLayer& L : m.layers())
    if (L.is_moe) {
      if (L.moe.local_experts != L.moe.router.experts || L.moe.expert_gate.bias)
        return "experts split over ranks or with biases";
      // The grouped expert GEMM's (moe_gemm.h); the constructor checks every expert.
      const DFormat f = L.moe.expert_gate.format;
      if (f != DFormat::NVFP4 && f != DFormat::BF16) return "routed experts neither NVFP4 nor BF16";
      if (L.moe.width % 32 != 0 || c.hidden_size % 32 != 0) return "expert widths not a multiple of 32";
    }
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
  // experts), the largest dense matrix that needs converting, the most experts and pairs.
  size_t widest = std::max(H, nq * hd), act = 0, convert = 0, experts = 0, pairs = 0;
  auto dense = [&](const DLinear& w) {
    if (!is_bf16(w)) convert = std::max(convert, size_t(elements(w)));
  };
  for (const DLayer& L : m.layers()) {
    for (const DLinear* w : {&L.q, &L.k, &L.v, &L.o}) dense(*w);
    if (!L.is_moe) {
      for (const DLinear* w : {&L.gate, &L.up, &L.down}) dense(*w);
      act = std::max(act, N * size_t(L.gate.out));
      widest = std::max(widest, size_t(L.down.in));
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
    // The grouped expert GEMM reads the layer's device arrays of descriptors (DMoe::gate, up,
    // down) as its per-expert tables of pointers and scale2, built once at upload: every expert
    // must be in the layer's format (NVFP4 or BF16) and shape, NVFP4 codes and BF16 weights
    // 16-byte and scales 4-byte aligned.
    std::vector<DLinear> g(E), u(E), d(E);
    KESTREL_CUDA_CHECK(cudaMemcpy(g.data(), e.gate, E * sizeof(DLinear), cudaMemcpyDeviceToHost));
    KESTREL_CUDA_CHECK(cudaMemcpy(u.data(), e.up, E * sizeof(DLinear), cudaMemcpyDeviceToHost));
    KESTREL_CUDA_CHECK(cudaMemcpy(d.data(), e.down, E * sizeof(DLinear), cudaMemcpyDeviceToHost));
    const DFormat f = e.expert_gate.format;
    auto fits = [f](const DLinear& w, int out, int in) {
      return w.format == f && w.out == out && w.in == in && !w.bias && reinterpret_cast<uintptr_t>(w.data) % 16 == 0 &&
             (f == DFormat::BF16 || reinterpret_cast<uintptr_t>(w.scales) % 4 == 0);
    };
    for (size_t i = 0; i < E; ++i)
      if (!fits(g[i], e.width, int(H)) || !fits(u[i], e.width, int(H)) || !fits(d[i], int(H), e.width))
        fail("the GEMM prefill takes a layer's routed experts in one format and shape: layer ", &L - m.layers().data(),
             " expert ", i, " is not ", f == DFormat::BF16 ? "BF16" : "NVFP4", " [", e.width, ", ", H,
             "] gate and up, [", H, ", ", e.width, "] down, aligned, without biases");
  }
  KESTREL_CUBLAS_CHECK(cublasCreate(&blas_));
  tokens_ = buffer<int32_t>(N);
  positions_ = buffer<int32_t>(N);
  x_ = buffer<float>(N * H);
  xn_ = buffer<float>(N * H);
  xb_ = buffer<__nv_bfloat16>(N * widest);
  q_ = buffer<float>(N * nq * hd);
  k_ = buffer<float>(N * nkv * hd);
  v_ = buffer<float>(N * nkv * hd);
  if (!prefill_attention_takes(int(hd), cache.kv_type())) att_ = buffer<float>(N * nq * hd);  // the fallback's output
  h_ = buffer<float>(2 * act);
  act_ = buffer<__nv_bfloat16>(act);
  w_ = buffer<__nv_bfloat16>(convert);
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
    moe_scratch_ = buffer<int32_t>(size_t(moe_gemm_scratch_ints(int(experts))));
  }
  guard.done = true;
}

GemmPrefill::~GemmPrefill() { release(); }

void GemmPrefill::release() {
  for (void* b : buffers_) cudaFree(b);
  if (blas_) cublasDestroy(blas_);
}

void GemmPrefill::gemm(const Gemm& g) {
  KESTREL_CUBLAS_CHECK(cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, g.m, g.n, g.k, &g.alpha, g.a, CUDA_R_16BF, g.lda,
                                    g.b, CUDA_R_16BF, g.ldb, &g.beta, g.c, CUDA_R_32F, g.ldc, CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT));
}

void GemmPrefill::linear(const DLinear& w, const __nv_bfloat16* x, int n, float* y, int ldy, bool accumulate,
                         cudaStream_t s) {
  const __nv_bfloat16* a = reinterpret_cast<const __nv_bfloat16*>(w.data);
  if (!is_bf16(w)) {
    launch_to_bf16(w, w_, s);  // the previous GEMM that read w_ precedes it on the stream
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
  launch_silu_mul_bf16(h_, n, w, false, act_, s);
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
  const float scale = 1.0f / std::sqrt(float(hd));
  if (prefill_attention_takes(hd, kvl.type)) {  // on tensor cores, straight into the o projection's BF16 input
    launch_prefill_attention(q_, n, nq, nkv, hd, scale, pos, kvl, xb_, s);
    linear(L.o, xb_, n, x_, int(c.hidden_size), true, s);
    return;
  }
  // Other head sizes: the decode step's attention, a slice of rows at a time (its split scratch
  // grows with the rows), converted to BF16 after.
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
  // The routed experts, no host synchronization: gate and up of each sorted row into h_ [pairs,
  // 2I] (gate's columns then up's), SiLU x up into act_, down into ys_ [pairs, H], all grouped
  // GEMMs over the device's counts. The gathered rows and act_ are in the grouped GEMM's MMA
  // order (moe_gemm.h), which the gather and the activation write at no cost.
  const int I = e.width;
  launch_gather_rows(xb_, H, sort_.row_pair, pairs, K, true, xs_, s);
  MoeGemm gate_up;
  gate_up.parts[0] = e.gate, gate_up.parts[1] = e.up, gate_up.num_parts = 2;
  gate_up.format = e.expert_gate.format;
  gate_up.experts = E, gate_up.out = I, gate_up.in = H;
  launch_moe_gemm(gate_up, xs_, pairs, sort_.counts, moe_scratch_, h_, s);
  launch_silu_mul_bf16(h_, pairs, I, true, act_, s);
  MoeGemm down;
  down.parts[0] = e.down, down.num_parts = 1;
  down.format = e.expert_gate.format;
  down.experts = E, down.out = H, down.in = I;
  launch_moe_gemm(down, act_, pairs, sort_.counts, moe_scratch_, ys_, s);
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
