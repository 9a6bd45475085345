#include "backend/cuda/gpu_slots.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "backend/cuda/check.h"

namespace kestrel::cuda {
namespace {

int checked_slots(int slots) {
  if (slots < 1 || slots > GpuSlots::kMaxSlots)
    fail("--max-batch ", slots, ": the GPU runs 1 to ", GpuSlots::kMaxSlots, " sequences at once");
  return slots;
}

// The blocks the slots share (the spare block comes on top): kv_positions in whole blocks, or
// for 0 a whole context per slot where 90% of every GPU's free memory holds it (the rest is for
// the decoders' buffers and graphs), else as many as it holds.
int64_t pool_blocks(const GpuModel& model, int slots, int context, int64_t kv_positions, KvType kv) {
  if (kv_positions > 0) return std::max<int64_t>(1, kv_positions / KvBlockPool::kBlock);
  const int64_t want = int64_t(slots) * KvBlockPool::blocks_for(context);
  std::vector<int64_t> fit(size_t(model.ranks()));
  std::vector<size_t> free_bytes(fit.size());
  model.each_rank([&](int r) {
    size_t free = 0, total = 0;
    KESTREL_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    free_bytes[size_t(r)] = free;
    fit[size_t(r)] = int64_t(0.9 * double(free) / double(Decoder::kv_block_bytes(model.part(r), kv))) - 1;
  });
  int64_t blocks = want;
  for (int r = 0; r < model.ranks(); ++r) {
    if (fit[size_t(r)] < 1)
      fail("GPU ", r, " has ", free_bytes[size_t(r)] >> 20, " MiB free after loading the model: no room for a KV cache (",
           Decoder::kv_block_bytes(model.part(r), kv), " bytes per block of ", KvBlockPool::kBlock, " positions)");
    blocks = std::min(blocks, fit[size_t(r)]);
  }
  return blocks;
}

}  // namespace

GpuSlots::GpuSlots(const GpuModel& model, int slots, int context, int64_t kv_positions, KvType kv, bool prefix_cache)
    : model_(model), context_(context),
      tables_(pool_blocks(model, checked_slots(slots), context, kv_positions, kv), slots, context, prefix_cache),
      pos_(size_t(slots), 0), chains_(size_t(slots)), vocab_(model.part(0).config().vocab_size) {
  const int ranks = model.ranks();
  decs_.resize(size_t(ranks));
  prefill_.resize(size_t(ranks));
  for (int r = 0; r < ranks; ++r)
    kv_bytes_ = std::max(kv_bytes_, size_t(tables_.pool_blocks()) * Decoder::kv_block_bytes(model.part(r), kv));
  model.each_rank([&](int r) {
    KvSource pool;
    pool.blocks = tables_.pool_blocks();
    pool.type = kv;
    decs_[size_t(r)] = std::make_unique<Decoder>(model.part(r), slots, context, false, model.link(r), pool);
    KvSource borrow;
    borrow.borrow = decs_[size_t(r)].get();
    prefill_[size_t(r)] = std::make_unique<Decoder>(model.part(r), kPrefillChunk, context, true, model.link(r), borrow);
  });
  gemm_prompt_.assign(size_t(slots), 0);
  if (ranks == 1 && !model.link(0) && context >= kGemmMinPrompt &&
      GemmPrefill::unsupported(model.part(0)).empty())
    gemm_chunk_ = std::min(kGemmChunk, context);
  KESTREL_CUDA_CHECK(cudaSetDevice(0));
  KESTREL_CUDA_CHECK(cudaMallocHost(&logits_, size_t(slots) * size_t(vocab_) * 4));
  KESTREL_CUDA_CHECK(cudaMallocHost(&drawn_, 2 * size_t(slots) * 4));
}

GpuSlots::~GpuSlots() {
  try {
    model_.each_rank([&](int r) {
      if (r == 0) gemm_.reset();    // fills prefill_[0]'s cache
      prefill_[size_t(r)].reset();  // borrows the batched decoder's pool
      decs_[size_t(r)].reset();
    });
  } catch (const std::exception&) {
  }
  if (logits_) cudaFreeHost(logits_);
  if (drawn_) cudaFreeHost(drawn_);
}

std::string GpuSlots::kv_summary() const {
  char gib[32];
  std::snprintf(gib, sizeof gib, "%.2f", double(kv_bytes_) / double(1 << 30));
  return std::to_string(kv_positions()) + " KV positions (" + kv_type_name(decs_[0]->kv_type()) + "), " + gib + " GiB" + (model_.ranks() > 1 ? " per GPU" : "");
}

std::string GpuSlots::describe() const { return "cuda, " + model_.describe() + ", " + kv_summary(); }

SequenceSlots::Opened GpuSlots::open(int64_t positions, std::span<const int32_t> prompt) {
  if (positions > context_) fail("a sequence of ", positions, " positions is longer than the GPU context of ", context_);
  for (int i = 0; i < slots(); ++i)
    if (!tables_.is_open(i)) {  // the lowest free slot, so that steps run as few rows as possible
      std::vector<uint64_t> hashes;
      const std::vector<int32_t> cached =
          tables_.ids().match(prompt, (int64_t(prompt.size()) - 1) / KvBlocks::kBlock, &hashes);
      tables_.open(i, positions, cached);
      chains_[size_t(i)].start(prompt, hashes);
      gemm_prompt_[size_t(i)] = gemm_chunk_ > 0 && prompt.size() >= size_t(kGemmMinPrompt);
      pos_[size_t(i)] = int32_t(cached.size()) * KvBlocks::kBlock;
      return {i, pos_[size_t(i)]};
    }
  fail("internal: no free sequence slot of ", slots());
}

void GpuSlots::run(std::span<const Job> jobs) {
  if (jobs.empty()) return;
  int rows = 0;  // of the batched decode step
  std::vector<const Job*> prefill;
  for (const Job& j : jobs) {
    if (j.tokens.empty() || int64_t(j.tokens.size()) > max_chunk() ||
        (j.all_logits && j.tokens.size() > size_t(kPrefillChunk)))
      fail("internal: the GPU runs 1 to ", max_chunk(), " tokens per sequence and step (", kPrefillChunk,
           " for every row's logits), not ", j.tokens.size());
    if (j.slot < 0 || j.slot >= slots() || !tables_.is_open(j.slot)) fail("internal: slot ", j.slot, " is not open");
    const int64_t end = pos_[size_t(j.slot)] + int64_t(j.tokens.size());
    if (end > tables_.held(j.slot) * KvBlockPool::kBlock)
      fail("internal: the sequence in slot ", j.slot, " would hold ", end, " positions, more than the ",
           tables_.held(j.slot) * KvBlockPool::kBlock, " of its KV blocks");
    if (j.tokens.size() > 1) prefill.push_back(&j);
    else rows = std::max(rows, j.slot + 1);
  }
  // Rows of the batched step without a job run token 0 at their next unwritten position (after
  // this run's prefill; a slot in use writes that position again with its real token later) or
  // at 0 (a free slot); their logits are not read. What they write past a sequence's blocks, or
  // for a free slot, goes to the spare block (kv_block_tables.h).
  std::vector<int32_t> next(pos_);
  for (const Job* j : prefill) next[size_t(j->slot)] += int32_t(j->tokens.size());
  std::vector<int32_t> tokens(size_t(rows), 0), positions(size_t(rows), 0);
  for (int i = 0; i < rows; ++i)
    if (tables_.is_open(i)) positions[size_t(i)] = std::min(next[size_t(i)], context_ - 1);
  for (const Job& j : jobs)
    if (j.tokens.size() == 1) tokens[size_t(j.slot)] = j.tokens[0];
  const std::vector<int> changed = tables_.changed();
  const size_t V = size_t(vocab_);
  // Jobs whose next token is drawn on the GPU (sample.h) rather than on the host. Only rank 0
  // samples (the other ranks' next tokens are not read); rows that do not sample stay greedy.
  auto on_gpu = [](const Job& j) { return j.logits && j.sample && !needs_history(j.sample->options); };
  // Leading tokens of a long prompt's chunk that the GEMM prefill runs: all of them, or all but
  // the last where that token's row draws on the GPU (the decoder's step samples; the GEMM
  // prefill has logits only).
  auto gemm_tokens = [&](const Job& j) {
    const int n = int(j.tokens.size());
    if (gemm_chunk_ == 0 || !gemm_prompt_[size_t(j.slot)] || j.all_logits) return 0;
    return on_gpu(j) ? n - 1 : n;
  };
  for (const Job* j : prefill)
    if (!gemm_ && gemm_tokens(*j) > 0) {
      try {
        model_.each_rank([&](int) { gemm_ = std::make_unique<GemmPrefill>(model_.part(0), *prefill_[0], gemm_chunk_); });
      } catch (const std::exception& e) {
        gemm_chunk_ = 0;  // from the next step on, chunks of 64 (max_chunk)
        cudaGetLastError();  // an allocation that failed leaves its error behind
        std::fprintf(stderr, "kestrel: prompts prefill on the decode step's chunks: the GEMM prefill's scratch did not fit (%s)\n",
                     e.what());
      }
    }
  std::vector<SampleParams> params(static_cast<size_t>(rows));
  bool sample = false;
  for (const Job& j : jobs)
    if (j.tokens.size() == 1 && on_gpu(j)) {
      params[size_t(j.slot)] = sample_params(j.sample->options, j.sample->draw);
      sample = true;
    }
  int32_t* const drawn_decode = drawn_;
  int32_t* const drawn_prefill = drawn_ + size_t(slots());
  model_.each_rank([&](int r) {
    const cudaStream_t s = model_.stream(r);
    Decoder& dec = *decs_[size_t(r)];
    for (int slot : changed) dec.set_table(slot, tables_.row(slot), s);  // before any step reads them
    const size_t stride = size_t(dec.table_stride());
    for (const Job* j : prefill) {  // every rank runs the same steps in the same order
      Decoder& p = *prefill_[size_t(r)];
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(p.table(), dec.table() + size_t(j->slot) * stride, stride * 4,
                                         cudaMemcpyDeviceToDevice, s));
      const int n = int(j->tokens.size()), g = gemm_tokens(*j), pos0 = pos_[size_t(j->slot)];
      if (g > 0) {  // one GPU: rank 0
        const bool logits = g == n && j->logits;
        gemm_->run(j->tokens.data(), g, pos0, s, logits);
        if (logits)
          KESTREL_CUDA_CHECK(
              cudaMemcpyAsync(logits_ + size_t(j->slot) * V, gemm_->logits(), V * 4, cudaMemcpyDeviceToHost, s));
      }
      // The rest on the decoder, 64 tokens a step. Only the last position's logits are made; with
      // an offer the GPU takes, its token is drawn from them (pageable parameters: staged before
      // the call returns).
      for (int i = g; i < n; i += kPrefillChunk) {
        const int m = std::min(kPrefillChunk, n - i);
        const bool last = i + m == n, draw = last && r == 0 && on_gpu(*j);
        int32_t pos[kPrefillChunk];
        for (int b = 0; b < m; ++b) pos[b] = pos0 + i + b;
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(p.tokens(), j->tokens.data() + i, size_t(m) * 4, cudaMemcpyHostToDevice, s));
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(p.positions(), pos, size_t(m) * 4, cudaMemcpyHostToDevice, s));
        if (draw) {
          const SampleParams pp = sample_params(j->sample->options, j->sample->draw);
          KESTREL_CUDA_CHECK(
              cudaMemcpyAsync(p.sample_params() + (m - 1), &pp, sizeof(SampleParams), cudaMemcpyHostToDevice, s));
        }
        p.step_graph(m, false, s, j->all_logits ? Decoder::Logits::All : Decoder::Logits::Last, draw);
        if (!last) continue;
        if (draw)
          KESTREL_CUDA_CHECK(cudaMemcpyAsync(drawn_prefill + j->slot, p.next() + (m - 1), 4, cudaMemcpyDeviceToHost, s));
        else if (r == 0 && j->all_logits)  // a verification (m == n): every row (pageable: done when the call returns)
          KESTREL_CUDA_CHECK(cudaMemcpyAsync(j->logits, p.logits(), size_t(m) * V * 4, cudaMemcpyDeviceToHost, s));
        else if (r == 0 && j->logits)
          KESTREL_CUDA_CHECK(cudaMemcpyAsync(logits_ + size_t(j->slot) * V, p.logits() + size_t(m - 1) * V, V * 4,
                                             cudaMemcpyDeviceToHost, s));
      }
    }
    if (rows > 0) {
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(dec.tokens(), tokens.data(), size_t(rows) * 4, cudaMemcpyHostToDevice, s));
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(dec.positions(), positions.data(), size_t(rows) * 4, cudaMemcpyHostToDevice, s));
      const bool draw = r == 0 && sample;
      if (draw)
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(dec.sample_params(), params.data(), size_t(rows) * sizeof(SampleParams),
                                           cudaMemcpyHostToDevice, s));
      dec.step_graph(rows, false, s, Decoder::Logits::All, draw);
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
  tables_.clear_changed();  // only once every rank has them (a failed run sends them again)
  for (const Job& j : jobs) {
    pos_[size_t(j.slot)] += int32_t(j.tokens.size());
    // A verification's blocks are published by the rewind that follows it.
    chains_[size_t(j.slot)].wrote(j.tokens, tables_.row(j.slot), tables_.ids(), !j.all_logits);
    if (on_gpu(j)) *j.sample->token = (j.tokens.size() == 1 ? drawn_decode : drawn_prefill)[j.slot];
    else if (j.logits && !(j.all_logits && j.tokens.size() > 1)) std::memcpy(j.logits, logits_ + size_t(j.slot) * V, V * 4);
  }
}

void GpuSlots::rewind(int slot, int64_t position) {
  if (slot < 0 || slot >= slots() || !tables_.is_open(slot)) fail("internal: slot ", slot, " is not open");
  if (position < 0 || position > pos_[size_t(slot)])
    fail("internal: slot ", slot, " rewound to ", position, " of its ", pos_[size_t(slot)], " positions");
  // The rows after `position` stay in the cache until later tokens overwrite them; nothing reads
  // past a sequence's position.
  pos_[size_t(slot)] = int32_t(position);
  PrefixChain& chain = chains_[size_t(slot)];
  chain.rewind(size_t(position));
  chain.publish(tables_.row(slot), tables_.ids());
}

}  // namespace kestrel::cuda
