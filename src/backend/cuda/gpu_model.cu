#include "backend/cuda/gpu_model.h"

#include "backend/cuda/check.h"
#include "parallel/shard.h"

namespace kestrel::cuda {

namespace {
std::string gpu_name() {
  cudaDeviceProp p{};
  return cudaGetDeviceProperties(&p, 0) == cudaSuccess ? std::string(p.name) : std::string("GPU 0");
}
}  // namespace

GpuModel::GpuModel(const Model& m, const Layout& layout) : layout_(layout) {
  if (!layout.split()) {
    UploadOptions o;
    UploadMeter meter(1);
    o.meter = &meter;
    parts_.push_back(DeviceModel::upload(m, o));
    meter.report();
    KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  } else {
    group_ = std::make_unique<RankGroup>(layout.ranks());
    // The ranks upload at once, each on its GPU with its own staging buffers and threads.
    UploadOptions o;
    UploadMeter meter(layout.ranks());
    o.meter = &meter;
    std::vector<std::unique_ptr<Model>> shards;
    for (int r = 0; r < layout.ranks(); ++r) shards.push_back(shard_model(m, layout, r));
    parts_.resize(shards.size());
    group_->run([&](int r) { parts_[size_t(r)] = DeviceModel::upload(*shards[size_t(r)], o); });
    meter.report();
  }
  gpu_ = gpu_name();
}

GpuModel::GpuModel(const ModelConfig& c) {
  parts_.push_back(DeviceModel::random(c));
  KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  gpu_ = gpu_name();
}

GpuModel::~GpuModel() {
  if (stream_) cudaStreamDestroy(stream_);
  if (!group_) return;
  try {
    group_->run([&](int r) { parts_[size_t(r)].reset(); });  // each freed on its GPU
  } catch (const std::exception&) {
  }
  parts_.clear();
}

void GpuModel::each_rank(const std::function<void(int)>& fn) const {
  if (group_) {
    group_->run(fn);
    return;
  }
  KESTREL_CUDA_CHECK(cudaSetDevice(0));
  fn(0);
}

std::string GpuModel::describe() const {
  return layout_.split() ? std::to_string(layout_.ranks()) + " x " + gpu_ + ", " + layout_.str() : gpu_;
}

}  // namespace kestrel::cuda
