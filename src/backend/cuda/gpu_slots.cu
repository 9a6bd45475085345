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
  KESTREL_CUDA_CHECK(cudaMallocHost(&drawn_, 2 * size_t(slots) * 4));
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
  if (drawn_) cudaFreeHost(drawn_);
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
  // Jobs whose next token is drawn on the GPU (sample.h) rather than on the host. Only rank 0
  // samples (the other ranks' next tokens are not read); rows that do not sample stay greedy.
  auto on_gpu = [](const Job& j) { return j.logits && j.sample && !needs_history(j.sample->options); };
  std::vector<SampleParams> params(static_cast<size_t>(rows));
  bool sample = false;
  for (const Job& j : jobs)
    if (j.tokens.size() == 1 && on_gpu(j)) {
      params[size_t(j.slot)] = sample_params(j.sample->options, j.sample->draw);
      sample = true;
    }
  int32_t* const drawn_decode = drawn_;
  int32_t* const drawn_prefill = drawn_ + used_.size();
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
      const bool draw = r == 0 && on_gpu(*j);
      if (draw) {  // the last row draws, the others stay greedy (pageable: staged before the call returns)
        SampleParams pp[kPrefillChunk];
        pp[n - 1] = sample_params(j->sample->options, j->sample->draw);
        KESTREL_CUDA_CHECK(
            cudaMemcpyAsync(p->sample_params(), pp, size_t(n) * sizeof(SampleParams), cudaMemcpyHostToDevice, s));
      }
      p->step_graph(n, false, s, draw);
      if (draw)
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(drawn_prefill + j->slot, p->next() + (n - 1), 4, cudaMemcpyDeviceToHost, s));
      else if (r == 0 && j->logits)
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(logits_ + size_t(j->slot) * V, p->logits() + size_t(n - 1) * V, V * 4,
                                           cudaMemcpyDeviceToHost, s));
    }
    if (rows > 0) {
      Decoder& dec = *decs_[size_t(r)];
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(dec.tokens(), tokens.data(), size_t(rows) * 4, cudaMemcpyHostToDevice, s));
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(dec.positions(), positions.data(), size_t(rows) * 4, cudaMemcpyHostToDevice, s));
      const bool draw = r == 0 && sample;
      if (draw)
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(dec.sample_params(), params.data(), size_t(rows) * sizeof(SampleParams),
                                           cudaMemcpyHostToDevice, s));
      dec.step_graph(rows, false, s, draw);
      if (draw)
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(drawn_decode, dec.next(), size_t(rows) * 4, cudaMemcpyDeviceToHost, s));
      if (r == 0)
        for (const Job& j : jobs)
          if (j.tokens.size() == 1 && j.logits && !on_gpu(j))
            KESTREL_CUDA_CHECK(cudaMemcpyAsync(logits_ + size_t(j.slot) * V, dec.logits() + size_t(j.slot) * V, V * 4,
                                               cudaMemcpyDeviceToHost, s));
    }
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
  });
  for (const Job& j : jobs) {
    pos_[size_t(j.slot)] += int32_t(j.tokens.size());
    if (on_gpu(j)) *j.sample->token = (j.tokens.size() == 1 ? drawn_decode : drawn_prefill)[j.slot];
    else if (j.logits) std::memcpy(j.logits, logits_ + size_t(j.slot) * V, V * 4);
  }
}

}  // namespace kestrel::cuda
