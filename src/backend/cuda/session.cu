#include <algorithm>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/gpu_model.h"
#include "backend/cuda/prefill_gemm.h"
#include "backend/cuda/session.h"

namespace kestrel::cuda {

namespace {
int checked_chunk(int chunk) {
  if (chunk < 1 || chunk > 256) fail("prefill chunk ", chunk, " outside 1..256");
  return chunk;
}
int checked_min(int tokens) {
  if (tokens < 1) fail("GEMM prefill threshold ", tokens, " below 1 token");
  return tokens;
}
int checked_gemm_chunk(int chunk) {
  if (chunk < 0 || chunk > (1 << 16)) fail("GEMM prefill chunk ", chunk, " outside 0..65536");
  return chunk;
}
}  // namespace

Session::Session(const DeviceModel& model, int max_context, int chunk, KvType kv, int gemm_chunk,
                 int gemm_min_tokens)
    : chunk_(checked_chunk(chunk)), vocab_(model.config().vocab_size) {
  gemm_min_tokens_ = checked_min(gemm_min_tokens);
  if (checked_gemm_chunk(gemm_chunk) > 0 && GemmPrefill::unsupported(model).empty()) {
    gemm_model_ = &model;
    gemm_chunk_ = std::min(gemm_chunk, max_context);
  }
  KvSource own;
  own.type = kv;
  decs_.push_back(std::make_unique<Decoder>(model, chunk_, max_context, true, nullptr, own));
  KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&own_stream_, cudaStreamNonBlocking));
  streams_.push_back(own_stream_);
}

Session::Session(const GpuModel& model, int max_context, int chunk, KvType kv, int gemm_chunk, int gemm_min_tokens)
    : gpus_(&model), chunk_(checked_chunk(chunk)), vocab_(model.part(0).config().vocab_size) {
  gemm_min_tokens_ = checked_min(gemm_min_tokens);
  if (checked_gemm_chunk(gemm_chunk) > 0 && model.ranks() == 1 && !model.link(0) &&
      GemmPrefill::unsupported(model.part(0)).empty()) {
    gemm_model_ = &model.part(0);
    gemm_chunk_ = std::min(gemm_chunk, max_context);
  }
  decs_.resize(size_t(model.ranks()));
  for (int r = 0; r < model.ranks(); ++r) streams_.push_back(model.stream(r));
  KvSource own;
  own.type = kv;
  model.each_rank([&](int r) {
    decs_[size_t(r)] = std::make_unique<Decoder>(model.part(r), chunk_, max_context, true, model.link(r), own);
  });
}

Session::~Session() {
  gemm_.reset();
  if (gpus_) {
    try {
      gpus_->each_rank([&](int r) { decs_[size_t(r)].reset(); });  // each on its own GPU
    } catch (const std::exception&) {
      decs_.clear();  // a failed group: freed from here
    }
  }
  if (own_stream_) cudaStreamDestroy(own_stream_);
}

void Session::run(std::span<const int32_t> tokens, float* logits, bool all) {
  if (pos_ + int64_t(tokens.size()) > decs_[0]->max_context())
    fail("the sequence would hold ", pos_ + int64_t(tokens.size()), " tokens, more than its context of ",
         decs_[0]->max_context());
  if (gpus_) gpus_->each_rank([&](int r) { run_rank(r, tokens, logits, all); });
  else run_rank(0, tokens, logits, all);
  pos_ += int(tokens.size());
}

int32_t Session::run_sample(std::span<const int32_t> tokens, const SampleParams& params) {
  if (tokens.empty()) fail("internal: sampling needs at least one token to run");
  if (pos_ + int64_t(tokens.size()) > decs_[0]->max_context())
    fail("the sequence would hold ", pos_ + int64_t(tokens.size()), " tokens, more than its context of ",
         decs_[0]->max_context());
  int32_t token = -1;
  if (gpus_) gpus_->each_rank([&](int r) { run_rank(r, tokens, nullptr, false, &params, &token); });
  else run_rank(0, tokens, nullptr, false, &params, &token);
  pos_ += int(tokens.size());
  return token;
}

size_t Session::gemm_tokens(size_t tokens, bool all, bool sample) const {
  // Every position's logits (logits --all, perplexity) stay on the decode step, which has them.
  if (!gemm_model_ || all || tokens < size_t(gemm_min_tokens_)) return 0;
  // A drawn token's row runs through the decode step, which samples it.
  return sample ? tokens - 1 : tokens;
}

void Session::run_rank(int rank, std::span<const int32_t> tokens, float* logits, bool all, const SampleParams* sample,
                       int32_t* token) {
  Decoder& dec = *decs_[size_t(rank)];
  const cudaStream_t stream = streams_[size_t(rank)];
  if (rank > 0) logits = nullptr, sample = nullptr;  // rank 0 hands out the results
  int pos = pos_;
  // The GEMM prefill's chunks first (one rank only), then the rest on the decode step's.
  const size_t gemm = gemm_tokens(tokens.size(), all, sample != nullptr);
  if (gemm > 0) {
    if (!gemm_) gemm_ = std::make_unique<GemmPrefill>(*gemm_model_, dec, gemm_chunk_);
    for (size_t i = 0; i < gemm; i += size_t(gemm_chunk_)) {
      const int n = int(std::min<size_t>(size_t(gemm_chunk_), gemm - i));
      const bool last = i + size_t(n) == tokens.size();
      gemm_->run(tokens.data() + i, n, pos, stream, last && logits);
      pos += n;
      if (last && logits)
        KESTREL_CUDA_CHECK(
            cudaMemcpyAsync(logits, gemm_->logits(), size_t(vocab_) * 4, cudaMemcpyDeviceToHost, stream));
    }
    tokens = tokens.subspan(gemm);
    if (tokens.empty()) {
      KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream));
      return;
    }
  }
  // Every rank runs the same steps (their collectives pair up), so the rows that get logits
  // follow `all`, not whether this rank copies them out.
  const Decoder::Logits rows = all ? Decoder::Logits::All : Decoder::Logits::Last;
  std::vector<int32_t> p(static_cast<size_t>(chunk_));
  for (size_t i = 0; i < tokens.size(); i += size_t(chunk_)) {
    const int n = int(std::min<size_t>(size_t(chunk_), tokens.size() - i));
    const bool draw = sample && i + size_t(n) == tokens.size();  // the last token's row draws
    for (int b = 0; b < n; ++b) p[size_t(b)] = pos + b;
    // Pageable sources: the copies complete (staged) before these calls return.
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(dec.tokens(), tokens.data() + i, size_t(n) * 4, cudaMemcpyHostToDevice, stream));
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(dec.positions(), p.data(), size_t(n) * 4, cudaMemcpyHostToDevice, stream));
    if (draw)  // the other rows stay greedy
      KESTREL_CUDA_CHECK(
          cudaMemcpyAsync(dec.sample_params() + (n - 1), sample, sizeof(SampleParams), cudaMemcpyHostToDevice, stream));
    dec.step_graph(n, false, stream, rows, draw);
    pos += n;
    if (draw) KESTREL_CUDA_CHECK(cudaMemcpyAsync(token, dec.next() + (n - 1), 4, cudaMemcpyDeviceToHost, stream));
    if (!logits) continue;
    if (all) {
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(logits + int64_t(i) * vocab_, dec.logits(), size_t(n) * size_t(vocab_) * 4,
                                         cudaMemcpyDeviceToHost, stream));
    } else if (i + size_t(n) == tokens.size()) {
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(logits, dec.logits() + int64_t(n - 1) * vocab_, size_t(vocab_) * 4,
                                         cudaMemcpyDeviceToHost, stream));
    }
  }
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream));
}

}  // namespace kestrel::cuda
