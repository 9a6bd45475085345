#include "backend/cuda/upload.h"

#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <thread>

#include "backend/cuda/check.h"
#include "common/thread_pool.h"
#include "model/load_progress.h"

namespace kestrel::cuda {
namespace {

constexpr uint64_t kAlign = 256;  // what cudaMalloc gives; vector loads need 16
constexpr double kGiB = double(1ull << 30);

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// The pinned buffers, their events and the stream, freed after the copies in flight finish
// (also when a CUDA call fails midway, or an allocation in make()).
struct Staging {
  std::vector<uint8_t*> buffers;
  std::vector<cudaEvent_t> events;
  cudaStream_t stream = nullptr;

  void make(int n, size_t bytes) {
    KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    for (int i = 0; i < n; ++i) {
      void* p = nullptr;
      const cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
      if (e != cudaSuccess)
        fail("cannot pin ", n, " staging buffers of ", bytes >> 20, " MiB for the weight upload: ", cudaGetErrorString(e));
      buffers.push_back(static_cast<uint8_t*>(p));
      cudaEvent_t ev;
      KESTREL_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
      events.push_back(ev);
    }
  }
  ~Staging() {
    if (stream) cudaStreamSynchronize(stream);
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    for (uint8_t* p : buffers) cudaFreeHost(p);
    if (stream) cudaStreamDestroy(stream);
  }
};

}  // namespace

UploadMeter::UploadMeter(int gpus) : UploadMeter(gpus, progress_shown(Progress::Auto)) {}

UploadMeter::UploadMeter(int gpus, bool show)
    : gpus_(gpus), show_(show), start_(std::chrono::steady_clock::now()), drawn_(start_) {}

void UploadMeter::expect(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  expected_ += bytes;
}

void UploadMeter::done(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  done_ += bytes;
  const auto now = std::chrono::steady_clock::now();
  if (!show_ || now - drawn_ < std::chrono::milliseconds(100)) return;
  drawn_ = now;
  char buf[128];
  std::snprintf(buf, sizeof buf, "uploading: %.1f/%.1f GiB", double(done_) / kGiB, double(expected_) / kGiB);
  draw(buf, "");
}

void UploadMeter::draw(const std::string& line, const char* end) {
  // Spaces clear what a longer line left behind.
  std::fprintf(stderr, "\r%s%*s%s", line.c_str(), int(shown_ > line.size() ? shown_ - line.size() : 0), "", end);
  std::fflush(stderr);
  shown_ = line.size();
}

void UploadMeter::report() {
  const double s = seconds();
  std::lock_guard<std::mutex> lock(mu_);
  const std::string where = gpus_ > 1 ? "on " + std::to_string(gpus_) + " GPUs" : "on the GPU";
  char buf[160];
  std::snprintf(buf, sizeof buf, "weights %s: %.2f GiB in %.1f s (%.1f GB/s)", where.c_str(), double(done_) / kGiB, s,
                s > 0 ? double(done_) / s / 1e9 : 0.0);
  if (show_) {
    draw(buf, "\n");
  } else {
    std::fprintf(stderr, "%s\n", buf);
    std::fflush(stderr);
  }
}

uint64_t UploadMeter::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

double UploadMeter::seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

WeightArena::WeightArena(uint64_t size) : capacity_(size), measuring_(false) {
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, std::max<uint64_t>(size, kAlign));
  if (e == cudaErrorMemoryAllocation) {
    size_t free = 0, total = 0;
    cudaGetLastError();  // clear the allocation error
    cudaMemGetInfo(&free, &total);
    fail("out of GPU memory: the weights need ", size >> 20, " MiB, ", free >> 20, " MiB of ", total >> 20,
         " MiB are free");
  }
  if (e != cudaSuccess) fail("cannot allocate ", size >> 20, " MiB for the weights on the GPU: ", cudaGetErrorString(e));
  base_ = static_cast<uint8_t*>(p);
}

WeightArena::~WeightArena() {
  if (base_) cudaFree(base_);
}

const uint8_t* WeightArena::put(const void* host, size_t n, const std::string& what) {
  const uint64_t offset = align_up(size_, kAlign);
  if (!measuring_) {
    if (offset + n > capacity_)
      fail(what, ": does not fit the weight arena (", offset + n, " bytes of ", capacity_,
           " placed; the measuring pass saw other tensors)");
    if (n > 0 && !host) fail(what, ": no host data to upload");
    if (n > 0) ranges_.push_back({static_cast<const uint8_t*>(host), offset, n});
  }
  size_ = offset + n;
  return measuring_ ? reinterpret_cast<const uint8_t*>(uintptr_t(offset)) : base_ + offset;
}

const uint8_t* WeightArena::put_copy(const void* host, size_t n, const std::string& what) {
  if (measuring_) return put(nullptr, n, what);
  const auto* b = static_cast<const uint8_t*>(host);
  return put(copies_.emplace_back(b, b + n).data(), n, what);
}

void WeightArena::upload(const UploadOptions& o) {
  if (measuring_) fail("internal: upload() on a measuring weight arena");
  if (size_ == 0) return;
  // Chunk k of the arena, bytes [k * stage, (k + 1) * stage), goes through buffer k % buffers.
  const uint64_t stage = std::min<uint64_t>(std::max<size_t>(o.staging_bytes, 1), size_);
  const uint64_t chunks = (size_ + stage - 1) / stage;
  const int nbuf = int(std::min<uint64_t>(uint64_t(std::max(o.buffers, 2)), chunks));
  const int threads =
      o.threads > 0 ? o.threads : int(std::clamp(std::thread::hardware_concurrency(), 1u, 8u));
  Staging st;
  st.make(nbuf, size_t(stage));
  ThreadPool pool(threads);
  size_t first = 0;  // the first range that ends after the current chunk's start
  for (uint64_t k = 0; k < chunks; ++k) {
    const uint64_t begin = k * stage, end = std::min(size_, begin + stage);
    const int b = int(k % uint64_t(nbuf));
    uint8_t* buf = st.buffers[size_t(b)];
    if (k >= uint64_t(nbuf)) KESTREL_CUDA_CHECK(cudaEventSynchronize(st.events[size_t(b)]));  // buffer free again
    while (first < ranges_.size() && ranges_[first].offset + ranges_[first].n <= begin) ++first;
    // Split the chunk into pieces for the threads; each copies the parts of ranges inside its piece.
    const uint64_t len = end - begin, parts = std::min<uint64_t>(len, uint64_t(threads) * 4);
    const uint64_t piece = (len + parts - 1) / parts;
    pool.parallel_for(size_t(parts), 1, [&](size_t p0, size_t p1) {
      const uint64_t lo = begin + p0 * piece, hi = std::min(end, begin + p1 * piece);
      if (lo >= hi) return;
      // The first range ending after lo (ranges are sorted by offset and do not overlap).
      auto it = std::partition_point(ranges_.begin() + std::ptrdiff_t(first), ranges_.end(),
                                     [&](const Range& r) { return r.offset + r.n <= lo; });
      for (; it != ranges_.end() && it->offset < hi; ++it) {
        const uint64_t a = std::max(lo, it->offset), z = std::min(hi, it->offset + it->n);
        std::memcpy(buf + (a - begin), it->host + (a - it->offset), size_t(z - a));
      }
    });
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(base_ + begin, buf, size_t(len), cudaMemcpyHostToDevice, st.stream));
    KESTREL_CUDA_CHECK(cudaEventRecord(st.events[size_t(b)], st.stream));
    if (o.meter) o.meter->done(len);
  }
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(st.stream));
}

void* WeightArena::release() {
  void* p = base_;
  base_ = nullptr;
  return p;
}

}  // namespace kestrel::cuda
