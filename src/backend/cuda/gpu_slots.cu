#include "backend/cuda/gpu_slots.h"

#include <algorithm>
#include <cstring>

#include "backend/cuda/check.h"

namespace kestrel::cuda {

GpuSlots::GpuSlots(const GpuModel& model, int slots, int context)
    : model_(model), context_(context), used_(size_t(slots), false), pos_(size_t(slots), 0),
      vocab_(model.part(0).config().vocab_size) {
  if (slots < 1 || slots > kMaxSlots) fail("--max-batch ", slots, ": the GPU runs 1 to ", kMaxSlots, " sequences at once");
  decs_.resize(size_t(model.ranks()));
  streams_.resize(size_t(model.ranks()));
  model.each_rank([&](int r) {
    decs_[size_t(r)] = std::make_unique<Decoder>(model.part(r), slots, context, false, model.link(r));
    if (model.group()) {
      streams_[size_t(r)] = model.group()->stream(r);
    } else {
      KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&streams_[size_t(r)], cudaStreamNonBlocking));
    }
  });
  KESTREL_CUDA_CHECK(cudaSetDevice(0));
  KESTREL_CUDA_CHECK(cudaMallocHost(&logits_, size_t(slots) * size_t(vocab_) * 4));
}

GpuSlots::~GpuSlots() {
  try {
    model_.each_rank([&](int r) {
      decs_[size_t(r)].reset();
      if (!model_.group()) cudaStreamDestroy(streams_[size_t(r)]);
    });
  } catch (const std::exception&) {
  }
  if (logits_) cudaFreeHost(logits_);
}

int GpuSlots::open(int64_t positions) {
  if (positions > context_) fail("a sequence of ", positions, " positions is longer than the GPU context of ", context_);
  for (size_t i = 0; i < used_.size(); ++i)
    if (!used_[i]) {  // the lowest free slot, so that steps run as few rows as possible
      used_[i] = true;
      pos_[i] = 0;
      return int(i);
    }
  fail("internal: no free sequence slot of ", used_.size());
}

void GpuSlots::run(std::span<const Job> jobs) {
  if (jobs.empty()) return;
  int rows = 0;
  for (const Job& j : jobs) {
    if (j.tokens.size() != 1) fail("internal: the GPU runs one token per sequence and step");
    if (!used_.at(size_t(j.slot))) fail("internal: slot ", j.slot, " is not open");
    if (pos_[size_t(j.slot)] >= context_) fail("the sequence in slot ", j.slot, " reached the context of ", context_);
    rows = std::max(rows, j.slot + 1);
  }
  // Rows without a job run token 0 at their next position (a slot in use: that position is
  // written again by its real token later) or at 0 (a free slot); their logits are not read.
  std::vector<int32_t> tokens(size_t(rows), 0), positions(size_t(rows), 0);
  for (int i = 0; i < rows; ++i)
    if (used_[size_t(i)]) positions[size_t(i)] = pos_[size_t(i)];
  for (const Job& j : jobs) tokens[size_t(j.slot)] = j.tokens[0];
  model_.each_rank([&](int r) {
    Decoder& dec = *decs_[size_t(r)];
    const cudaStream_t s = streams_[size_t(r)];
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(dec.tokens(), tokens.data(), size_t(rows) * 4, cudaMemcpyHostToDevice, s));
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(dec.positions(), positions.data(), size_t(rows) * 4, cudaMemcpyHostToDevice, s));
    dec.step_graph(rows, false, s);
    if (r == 0)
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(logits_, dec.logits(), size_t(rows) * size_t(vocab_) * 4,
                                         cudaMemcpyDeviceToHost, s));
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
  });
  for (const Job& j : jobs) {
    ++pos_[size_t(j.slot)];
    if (j.logits) std::memcpy(j.logits, logits_ + size_t(j.slot) * size_t(vocab_), size_t(vocab_) * 4);
  }
}

}  // namespace kestrel::cuda
