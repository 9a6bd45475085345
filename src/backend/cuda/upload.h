// Copying a model's weights to the GPU fast. Every tensor gets a place in one device allocation
// (the arena, sized by a first pass over the tensors), then the arena is filled in order through
// a few pinned staging buffers: host threads pack the next buffer from the mapped checkpoint
// while the previous buffer's cudaMemcpyAsync runs, so reading the page cache and the PCIe copy
// overlap and no copy is pageable or synchronous.
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace kestrel::cuda {

// Progress of one upload or of several at once (the ranks of a split model, one thread each): a
// line on stderr rewritten in place while they run (when stderr is a terminal) and one line with
// the total at the end. Its clock starts when it is made.
class UploadMeter {
 public:
  // gpus: how many GPUs the uploads go to (for the final line); show: draw the in-place line
  // (by default when stderr is a terminal).
  explicit UploadMeter(int gpus = 1);
  UploadMeter(int gpus, bool show);
  void expect(uint64_t bytes);  // an upload's arena size, before its copies
  void done(uint64_t bytes);    // bytes copied; redraws the line at most 10 times a second
  // Prints "weights on the GPU: 16.85 GiB in 3.1 s (5.8 GB/s)" on stderr.
  void report();
  uint64_t bytes() const;
  double seconds() const;

 private:
  void draw(const std::string& line, const char* end);  // under mu_

  mutable std::mutex mu_;
  int gpus_;
  bool show_;
  uint64_t expected_ = 0, done_ = 0;
  std::chrono::steady_clock::time_point start_, drawn_;
  size_t shown_ = 0;  // length of the line on screen
};

struct UploadOptions {
  size_t staging_bytes = size_t(64) << 20;  // per pinned buffer
  int buffers = 4;                          // pinned buffers in flight (at least 2)
  int threads = 0;                          // host threads packing a buffer (0: up to 8, by cores)
  UploadMeter* meter = nullptr;             // progress, shared by the ranks of a split model
};

// One device allocation holding many host ranges at 256-byte aligned offsets. Made without a
// size, it only measures (put returns offsets from null, nothing is recorded for copying);
// made with the measured size, it allocates on the current device and upload() copies.
class WeightArena {
 public:
  WeightArena() = default;             // measuring
  explicit WeightArena(uint64_t size);  // allocating
  ~WeightArena();
  WeightArena(const WeightArena&) = delete;
  WeightArena& operator=(const WeightArena&) = delete;

  // Places n bytes of host memory that stays valid until upload(); returns their device address.
  // `what` names the tensor in errors.
  const uint8_t* put(const void* host, size_t n, const std::string& what);
  // The same for bytes the arena keeps a copy of (descriptor arrays, computed tables).
  const uint8_t* put_copy(const void* host, size_t n, const std::string& what);

  uint64_t size() const { return size_; }  // bytes placed so far, alignment padding included

  // Copies every placed range to the device and waits for the copies. Fails naming the CUDA call.
  void upload(const UploadOptions& o);
  // Hands the device allocation to the caller (cudaFree it); the arena then owns nothing.
  void* release();

 private:
  struct Range {
    const uint8_t* host;
    uint64_t offset, n;
  };
  uint8_t* base_ = nullptr;
  uint64_t capacity_ = 0, size_ = 0;
  bool measuring_ = true;
  std::vector<Range> ranges_;
  std::vector<std::vector<uint8_t>> copies_;  // a moved inner vector keeps its buffer
};

}  // namespace kestrel::cuda
