#include "backend/cuda/check.h"
#include "backend/cuda/session.h"

namespace kestrel::cuda {

Session::Session(const DeviceModel& model, int max_context)
    : dec_(model, 1, max_context), vocab_(model.config().vocab_size) {
  KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

Session::~Session() {
  if (stream_) cudaStreamDestroy(stream_);
}

void Session::run(std::span<const int32_t> tokens, float* logits, bool all) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (pos_ >= dec_.max_context())
      fail("the sequence reached its context of ", dec_.max_context(), " tokens");
    const int32_t in[2] = {tokens[i], pos_};
    // Pageable sources: the copies complete (staged) before these calls return.
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(dec_.tokens(), &in[0], 4, cudaMemcpyHostToDevice, stream_));
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(dec_.positions(), &in[1], 4, cudaMemcpyHostToDevice, stream_));
    dec_.step_graph(1, false, stream_);
    ++pos_;
    const bool want = logits && (all || i + 1 == tokens.size());
    if (want) {
      float* dst = logits + (all ? int64_t(i) * vocab_ : 0);
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(dst, dec_.logits(), size_t(vocab_) * 4, cudaMemcpyDeviceToHost, stream_));
    }
  }
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

}  // namespace kestrel::cuda
