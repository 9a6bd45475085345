#include "apps/runner.h"

#include <cstdio>
#include <vector>

#include "apps/model_options.h"
#include "backend/cpu/forward.h"
#include "common/error.h"
#include "common/thread_pool.h"
#include "runtime/mtp_drafter.h"
#ifdef KESTREL_HAVE_CUDA
#include <cuda_runtime.h>

#include "backend/cuda/gpu_model.h"
#include "backend/cuda/sample.h"
#include "backend/cuda/session.h"
#endif

namespace kestrel::apps {
namespace {

class CpuRunner final : public Runner {
 public:
  CpuRunner(const Model& m, int64_t capacity, int threads, const Layout& layout, bool mtp_drafts)
      : pool_(threads), fwd_(m, pool_, layout), cache_(fwd_.make_cache(capacity)), vocab_(m.config.vocab_size),
        hidden_size_(m.config.hidden_size), layout_(layout) {
    if (!mtp_drafts) return;
    check_mtp_drafting(m, layout);
    mtp_ = std::make_unique<MtpDrafter>(fwd_, m.config, capacity);
  }
  void run(std::span<const int32_t> tokens, float* logits, bool all) override {
    // The MTP drafter reads the target's hidden states.
    float* hidden = nullptr;
    if (mtp_) {
      hidden_.resize(tokens.size() * size_t(hidden_size_));
      hidden = hidden_.data();
    }
    if (!logits || all || tokens.size() == 1) {
      fwd_.run(tokens, cache_, logits, hidden);
    } else {
      std::vector<float> every(tokens.size() * size_t(vocab_));
      fwd_.run(tokens, cache_, every.data(), hidden);
      std::copy(every.end() - vocab_, every.end(), logits);
    }
    if (mtp_) mtp_->ran(tokens, hidden);
  }
  std::vector<int32_t> draft_mtp(int32_t next, int k) override {
    return mtp_ ? mtp_->draft(next, k) : Runner::draft_mtp(next, k);
  }
  void reset() override {
    cache_.clear();
    if (mtp_) mtp_->reset();
  }
  void rewind(int64_t position) override {
    cache_.truncate(position);
    if (mtp_) mtp_->rewind(position);
  }
  int64_t position() const override { return cache_.length(); }
  int64_t vocab() const override { return vocab_; }
  std::string describe() const override {
    return "cpu, " + std::to_string(pool_.size()) + " threads" + (layout_.split() ? ", " + layout_.str() + " over threads" : "");
  }

 private:
  ThreadPool pool_;
  cpu::Forward fwd_;
  KvCache cache_;
  int64_t vocab_, hidden_size_;
  Layout layout_;
  std::unique_ptr<MtpDrafter> mtp_;  // with --speculative mtp
  std::vector<float> hidden_;
};

#ifdef KESTREL_HAVE_CUDA
class CudaRunner final : public Runner {
 public:
  CudaRunner(const Model& m, int64_t capacity, const Layout& layout, cuda::KvType kv) : gpus_(m, layout), kv_(kv) {
    if (capacity > INT32_MAX) fail("a context of ", capacity, " tokens is too long for the CUDA backend");
    session_ = std::make_unique<cuda::Session>(gpus_, int(capacity), cuda::Session::kDefaultChunk, kv);
  }
  void run(std::span<const int32_t> tokens, float* logits, bool all) override { session_->run(tokens, logits, all); }
  int32_t run_sample(std::span<const int32_t> tokens, float* logits, const SamplerOptions& o, uint64_t draw) override {
    if (needs_history(o)) return Runner::run_sample(tokens, logits, o, draw);
    return session_->run_sample(tokens, cuda::sample_params(o, draw));
  }
  void reset() override { session_->reset(); }
  void rewind(int64_t position) override { session_->rewind(int(position)); }
  int64_t position() const override { return session_->position(); }
  int64_t vocab() const override { return gpus_.part(0).config().vocab_size; }
  std::string describe() const override {
    return "cuda, " + gpus_.describe() + ", " + cuda::kv_type_name(kv_) + " KV cache";
  }

 private:
  cuda::GpuModel gpus_;
  cuda::KvType kv_;
  std::unique_ptr<cuda::Session> session_;
};

#endif

}  // namespace

bool gpu_present() {
#ifdef KESTREL_HAVE_CUDA
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
#else
  return false;
#endif
}

void check_device_option(const std::string& device) {
  if (device != "auto" && device != "cpu" && device != "cuda")
    fail("--device: expected auto, cpu or cuda, got '", device, "'");
}

std::unique_ptr<Runner> Runner::make(const Model& model, const std::string& device, int64_t capacity, int threads,
                                     const Layout& layout, const std::string& kv_dtype, bool mtp_drafts) {
  check_device_option(device);
  check_layout(layout, long(model.config.num_experts));
  check_kv_dtype_option(kv_dtype);
  if (mtp_drafts && device == "cuda")
    fail("--speculative mtp: drafting with the MTP layer is not built yet on the GPU (--device cpu runs it)");
  const bool gpu = device == "auto" && gpu_present();
  if (mtp_drafts && gpu) std::fprintf(stderr, "kestrel: running on the CPU: --speculative mtp drafts on the CPU only\n");
#ifdef KESTREL_HAVE_CUDA
  if (device == "cuda") {
    if (!gpu_present()) fail("--device cuda: no CUDA GPU is visible");
    return std::make_unique<CudaRunner>(model, capacity, layout, kv_type_for(model.config, kv_dtype));
  }
  if (gpu && !mtp_drafts) {
    const cuda::KvType kv = kv_type_for(model.config, kv_dtype);  // a refused --kv-dtype is the user's error
    try {
      return std::make_unique<CudaRunner>(model, capacity, layout, kv);
    } catch (const Error& e) {
      std::fprintf(stderr, "kestrel: running on the CPU: %s\n", e.what());
    }
  }
#else
  if (device == "cuda") fail("--device cuda: this kestrel was built without CUDA");
#endif
  if (kv_dtype == "bf16") fail("--kv-dtype bf16: the CPU backend caches keys and values as float32");
  return std::make_unique<CpuRunner>(model, capacity, threads, layout, mtp_drafts);
}

}  // namespace kestrel::apps
