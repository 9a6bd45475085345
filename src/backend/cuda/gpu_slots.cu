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
  prefill_.resize(size_t(model.ranks()));
  for (auto& p : prefill_) p.resize(size_t(slots));
  model.each_rank([&](int r) {
    decs_[size_t(r)] = std::make_unique<Decoder>(model.part(r), slots, context, false, model.link(r));
  });
  KESTREL_CUDA_CHECK(cudaSetDevice(0));
  KESTREL_CUDA_CHECK(cudaMallocHost(&logits_, size_t(slots) * size_t(vocab_) * 4));
}

GpuSlots::~GpuSlots() {
  try {
    model_.each_rank([&](int r) {
      prefill_[size_t(r)].clear();
      decs_[size_t(r)].reset();
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
  int rows = 0;  // of the batched decode step
  std::vector<const Job*> prefill;
  for (const Job& j : jobs) {
    if (j.tokens.empty() || j.tokens.size() > size_t(kPrefillChunk))
      fail("internal: the GPU runs 1 to ", kPrefillChunk, " tokens per sequence and step");
    if (!used_.at(size_t(j.slot))) fail("internal: slot ", j.slot, " is not open");
    if (pos_[size_t(j.slot)] + int64_t(j.tokens.size()) > context_)
      fail("the sequence in slot ", j.slot, " would pass the context of ", context_);
    if (j.tokens.size() > 1) prefill.push_back(&j);
    else rows = std::max(rows, j.slot + 1);
  }
  // Rows of the batched step without a job run token 0 at their next unwritten position (after
  // this run's prefill; a slot in use writes that position again with its real token later) or
  // at 0 (a free slot); their logits are not read.
  std::vector<int32_t> next(pos_);
  for (const Job* j : prefill) next[size_t(j->slot)] += int32_t(j->tokens.size());
  std::vector<int32_t> tokens(size_t(rows), 0), positions(size_t(rows), 0);
  for (int i = 0; i < rows; ++i)
    if (used_[size_t(i)]) positions[size_t(i)] = std::min(next[size_t(i)], context_ - 1);
  for (const Job& j : jobs)
    if (j.tokens.size() == 1) tokens[size_t(j.slot)] = j.tokens[0];
  const size_t V = size_t(vocab_);
  model_.each_rank([&](int r) {
    const cudaStream_t s = model_.stream(r);
    for (const Job* j : prefill) {  // every rank runs the same steps in the same order
      std::unique_ptr<Decoder>& p = prefill_[size_t(r)][size_t(j->slot)];
      if (!p) p = std::make_unique<Decoder>(model_.part(r), kPrefillChunk, context_, true, model_.link(r),
                                            decs_[size_t(r)].get(), j->slot);
      const int n = int(j->tokens.size());
      int32_t pos[kPrefillChunk];
      for (int i = 0; i < n; ++i) pos[i] = pos_[size_t(j->slot)] + i;
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(p->tokens(), j->tokens.data(), size_t(n) * 4, cudaMemcpyHostToDevice, s));
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(p->positions(), pos, size_t(n) * 4, cudaMemcpyHostToDevice, s));
      p->step_graph(n, false, s);
      if (r == 0 && j->logits)
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(logits_ + size_t(j->slot) * V, p->logits() + size_t(n - 1) * V, V * 4,
                                           cudaMemcpyDeviceToHost, s));
    }
    if (rows > 0) {
      Decoder& dec = *decs_[size_t(r)];
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(dec.tokens(), tokens.data(), size_t(rows) * 4, cudaMemcpyHostToDevice, s));
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(dec.positions(), positions.data(), size_t(rows) * 4, cudaMemcpyHostToDevice, s));
      dec.step_graph(rows, false, s);
      if (r == 0)
        for (const Job& j : jobs)
          if (j.tokens.size() == 1 && j.logits)
            KESTREL_CUDA_CHECK(cudaMemcpyAsync(logits_ + size_t(j.slot) * V, dec.logits() + size_t(j.slot) * V, V * 4,
                                               cudaMemcpyDeviceToHost, s));
    }
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
  });
  for (const Job& j : jobs) {
    pos_[size_t(j.slot)] += int32_t(j.tokens.size());
    if (j.logits) std::memcpy(j.logits, logits_ + size_t(j.slot) * V, V * 4);
  }
}

}  // namespace kestrel::cuda
