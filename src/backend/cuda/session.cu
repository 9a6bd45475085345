#include <algorithm>

#include "backend/cuda/check.h"
#include "backend/cuda/session.h"

namespace kestrel::cuda {

Session::Session(const DeviceModel& model, int max_context)
    : dec_(model, kChunk, max_context, true), vocab_(model.config().vocab_size) {
  KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

Session::~Session() {
  if (stream_) cudaStreamDestroy(stream_);
}

void Session::run(std::span<const int32_t> tokens, float* logits, bool all) {
  if (pos_ + int64_t(tokens.size()) > dec_.max_context())
    fail("the sequence would hold ", pos_ + int64_t(tokens.size()), " tokens, more than its context of ",
         dec_.max_context());
  for (size_t i = 0; i < tokens.size(); i += kChunk) {
    const int n = int(std::min<size_t>(kChunk, tokens.size() - i));
    int32_t pos[kChunk];
    for (int b = 0; b < n; ++b) pos[b] = pos_ + b;
    // Pageable sources: the copies complete (staged) before these calls return.
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(dec_.tokens(), tokens.data() + i, size_t(n) * 4, cudaMemcpyHostToDevice, stream_));
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(dec_.positions(), pos, size_t(n) * 4, cudaMemcpyHostToDevice, stream_));
    dec_.step_graph(n, false, stream_);
    pos_ += n;
    if (!logits) continue;
    if (all) {
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(logits + int64_t(i) * vocab_, dec_.logits(), size_t(n) * size_t(vocab_) * 4,
                                         cudaMemcpyDeviceToHost, stream_));
    } else if (i + size_t(n) == tokens.size()) {
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(logits, dec_.logits() + int64_t(n - 1) * vocab_, size_t(vocab_) * 4,
                                         cudaMemcpyDeviceToHost, stream_));
    }
  }
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

}  // namespace kestrel::cuda
