// Per-op timing of a decode step: an event recorded on the stream after each op, so that the
// time between consecutive events is that op's time (launch gap included). Used with plain
// launches only: events inside a graph capture would be captured, not recorded.
#pragma once
#include <cuda_runtime.h>

#include <string>
#include <vector>

namespace kestrel::cuda {

struct OpTime {
  std::string name;
  double bytes = 0;  // bytes the op must read or write at least
  float ms = 0;
};

// Told about the ops of a decode step as the decoder enqueues them: begin() before the first,
// mark() after each with the op's name and the bytes it must move. OpTimer records events;
// OpGraph (graph_profile.h) notes which nodes of a captured step belong to which op.
class OpMarks {
 public:
  virtual ~OpMarks() = default;
  virtual void begin(cudaStream_t s) = 0;
  virtual void mark(const std::string& name, double bytes, cudaStream_t s) = 0;
};

class OpTimer : public OpMarks {
 public:
  ~OpTimer() override;
  void begin(cudaStream_t s) override;
  void mark(const std::string& name, double bytes, cudaStream_t s) override;
  std::vector<OpTime> finish();  // synchronizes; times of this step

 private:
  cudaEvent_t event();
  std::vector<cudaEvent_t> pool_;
  size_t used_ = 0;
  std::vector<OpTime> ops_;
};

}  // namespace kestrel::cuda
