#include <algorithm>
#include <cmath>

#include "backend/cuda/attention.h"
#include "backend/cuda/check.h"
#include "backend/cuda/decoder.h"
#include "backend/cuda/gemv.h"
#include "backend/cuda/misc.h"
#include "backend/cuda/mla.h"
#include "backend/cuda/moe.h"
#include "backend/cuda/slot_mma.cuh"
#include "backend/cuda/allreduce.h"
#include "parallel/shard.h"
#include "plan/decode_cost.h"

namespace kestrel::cuda {
namespace {

// gathered [ranks, batch, share] -> logits [batch, vocab] (each rank's share padded to `share`).
__global__ void unshard_logits_kernel(const float* __restrict__ gathered, int ranks, int batch, int share, int vocab,
                                      float* __restrict__ logits) {
  const int b = blockIdx.y;
  for (int v = blockIdx.x * blockDim.x + threadIdx.x; v < vocab; v += gridDim.x * blockDim.x) {
    const int r = v / share, i = v - r * share;
    logits[size_t(b) * vocab + v] = gathered[(size_t(r) * batch + b) * share + i];
  }
}

__global__ void advance_kernel(int32_t* tokens, const int32_t* next, int32_t* positions, int batch) {
  const int b = threadIdx.x;
  if (b < batch) {
    tokens[b] = next[b];
    positions[b] += 1;
  }
}

}  // namespace

template <typename T>
T* Decoder::buffer(size_t n) {
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T));
  if (e != cudaSuccess) fail("out of GPU memory for decode buffers (", (n * sizeof(T)) >> 20, " MiB)");
  buffers_.push_back(p);
  return static_cast<T*>(p);
}

size_t Decoder::kv_block_bytes(const DeviceModel& model, KvType type) {
  const ModelConfig& c = model.config();
  size_t bytes = 0;  // per position, all layers
  if (c.is_mla()) {
    bytes = size_t(c.num_layers) * size_t(c.mla.latent()) * sizeof(float);
    for (const DLayer& L : model.layers())
      if (L.mla.has_indexer) bytes += size_t(c.indexer.head_dim) * sizeof(float);
  } else {
    bytes = size_t(c.num_layers) * 2 * size_t(c.num_kv_heads * c.head_dim) * kv_type_bytes(type);
  }
  return size_t(kKvBlock) * bytes;
}

void Decoder::allocate_kv_pool() {
  const ModelConfig& c = m_.config();
  const size_t rows = size_t(kv_blocks_) * kKvBlock * size_t(c.num_layers);  // of every layer
  const size_t bytes = size_t(kv_blocks_) * kv_block_bytes(m_, kv_type_);
  auto pool = [&](size_t values, size_t value_bytes) {
    void* p = nullptr;
    if (cudaMalloc(&p, std::max<size_t>(values, 1) * value_bytes) != cudaSuccess) {
      cudaGetLastError();  // not sticky: clear it
      fail("out of GPU memory for a KV cache of ", kv_blocks_, " blocks of ", kKvBlock, " positions (",
           bytes >> 20, " MiB)");
    }
    buffers_.push_back(p);
    KESTREL_CUDA_CHECK(cudaMemset(p, 0, values * value_bytes));
    return p;
  };
  if (c.is_mla()) {
    kv_k_ = kv_v_ = pool(rows * size_t(c.mla.latent()), sizeof(float));  // v reads the same rows
    int n = 0;
    for (const DLayer& L : m_.layers()) index_slot_.push_back(L.mla.has_indexer ? n++ : -1);
    if (n > 0)
      index_pool_ = static_cast<float*>(
          pool(size_t(kv_blocks_) * kKvBlock * size_t(n) * size_t(c.indexer.head_dim), sizeof(float)));
  } else {
    kv_k_ = pool(rows * size_t(c.num_kv_heads * c.head_dim), kv_type_bytes(kv_type_));
    kv_v_ = pool(rows * size_t(c.num_kv_heads * c.head_dim), kv_type_bytes(kv_type_));
  }
}

Decoder::Decoder(const DeviceModel& model, int max_batch, int max_context, bool one_sequence, const RankLink* link,
                 KvSource kv)
    : m_(model), max_batch_(max_batch), max_context_(max_context), one_sequence_(one_sequence), link_(link) {
  const Decoder* from = kv.borrow;
  if (from && (!one_sequence || &from->m_ != &model || from->max_context_ != max_context || from->one_sequence_ ||
               kv.blocks != 0))
    fail("internal: a decoder borrowing a KV pool must be one sequence's, of the same model and context");
  if (max_batch < 1 || max_context < 1) fail("internal: a decoder of batch ", max_batch, " and context ", max_context);
  // A constructor that fails (a KV pool larger than the free memory) frees what it took.
  struct FreeOnFailure {
    std::vector<void*>& buffers;
    bool done = false;
    ~FreeOnFailure() {
      if (!done)
        for (void* p : buffers) cudaFree(p);
    }
  } guard{buffers_};
  const ModelConfig& c = m_.config();
  const size_t B = size_t(max_batch), H = size_t(c.hidden_size), hd = size_t(c.head_dim);
  const size_t nq = size_t(c.num_heads), nkv = size_t(c.num_kv_heads);
  x_ = buffer<float>(B * H);
  xn_ = buffer<float>(B * H);
  if (!c.is_mla()) xf_ = buffer<uint32_t>(B * H);
  split_ = attention_split(max_context);
  const size_t seqs = one_sequence ? 1 : B, ctx = size_t(max_context);
  table_stride_ = int(KvBlockPool::blocks_for(max_context));
  if (from) {
    kv_k_ = from->kv_k_;
    kv_v_ = from->kv_v_;
    kv_type_ = from->kv_type_;
    index_pool_ = from->index_pool_;
    index_slot_ = from->index_slot_;
    kv_blocks_ = from->kv_blocks_;
  } else {
    if (kv.type != KvType::F32 && c.is_mla())
      fail("a ", kv_type_name(kv.type), " KV cache is for models with grouped-query attention; ", c.architecture,
           "'s MLA latents are cached as float32 (--kv-dtype f32 or auto)");
    kv_type_ = kv.type;
    kv_blocks_ = kv.blocks > 0 ? kv.blocks : int64_t(seqs) * table_stride_;
    if (kv_blocks_ >= INT32_MAX) fail("a KV cache of ", kv_blocks_, " blocks: block ids are 32-bit");
    allocate_kv_pool();
  }
  {
    // Identity tables (wrapped into the pool when it is smaller: every entry a valid block).
    std::vector<int32_t> ids(seqs * size_t(table_stride_));
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t(int64_t(i) % kv_blocks_);
    table_ = buffer<int32_t>(ids.size());
    KESTREL_CUDA_CHECK(cudaMemcpy(table_, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  }
  if (c.is_mla()) {
    const MlaConfig& m = c.mla;
    const size_t lat = size_t(m.latent());
    mla_.q_latent = buffer<float>(B * size_t(std::max<int64_t>(m.q_lora_rank, 1)));
    mla_.kv_latent = buffer<float>(B * lat);
    mla_.q = buffer<float>(B * nq * size_t(m.qk_head_dim()));
    mla_.q_abs = buffer<float>(B * nq * lat);
    mla_.att = buffer<float>(B * nq * size_t(m.kv_lora_rank));
    mla_.v = buffer<float>(B * nq * size_t(m.v_head_dim));
    att_scratch_ = buffer<float>(attention_scratch_floats(max_batch, int(nq), int(m.kv_lora_rank), split_));
    if (c.indexer.enabled()) {
      const IndexerConfig& ix = c.indexer;
      mla_.iq = buffer<float>(B * size_t(ix.heads * ix.head_dim));
      mla_.ik = buffer<float>(B * size_t(ix.head_dim));
      mla_.iw = buffer<float>(B * size_t(ix.heads));
      mla_.scores = buffer<float>(B * ctx);
      mla_.select = buffer<int32_t>(B * size_t(ix.topk));
      mla_.select_count = buffer<int32_t>(B);
    }
  } else {
    q_ = buffer<float>(B * nq * hd);
    k_ = buffer<float>(B * nkv * hd);
    v_ = buffer<float>(B * nkv * hd);
    att_ = buffer<float>(B * nq * hd);
    if ((nq * hd) % kFragChunk == 0 && hd % 4 == 0) att_frag_ = buffer<uint32_t>(B * nq * hd);
    size_t scratch = 0;
    for (int b = 1; b <= max_batch; ++b)
      scratch = std::max(scratch, attention_scratch_floats(b, int(nq), int(hd), gqa_split(b)));
    att_scratch_ = buffer<float>(scratch);
  }
  act_ = buffer<float>(B * size_t(std::max<int64_t>(c.intermediate_size, 1)));
  logits_ = buffer<float>(B * size_t(c.vocab_size));
  if (link_) {
    if (!link_->comm || !link_->reduce) fail("internal: a split decoder needs a communicator and an all-reduce");
    const VocabShare vs = vocab_share(c.vocab_size, link_->comm->size(), link_->comm->rank());
    if (m_.lm_head().out != vs.end - vs.begin)
      fail("internal: rank ", link_->comm->rank(), "'s LM head has ", m_.lm_head().out, " rows, its share is ",
           vs.end - vs.begin);
    part_ = buffer<float>(B * H);
    link_->reduce->reserve(int64_t(B * H));
    shard_logits_ = buffer<float>(B * size_t(vs.share));
    gathered_ = buffer<float>(size_t(link_->comm->size()) * B * size_t(vs.share));
    KESTREL_CUDA_CHECK(cudaMemset(shard_logits_, 0, B * size_t(vs.share) * 4));  // the padding past the vocabulary
  }
  tokens_ = buffer<int32_t>(B);
  positions_ = buffer<int32_t>(B);
  next_ = buffer<int32_t>(B);
  sample_params_ = buffer<SampleParams>(B);
  const std::vector<SampleParams> greedy(B);
  KESTREL_CUDA_CHECK(cudaMemcpy(sample_params_, greedy.data(), B * sizeof(SampleParams), cudaMemcpyHostToDevice));
  uint8_t* am = buffer<uint8_t>(argmax_scratch_bytes(max_batch));
  KESTREL_CUDA_CHECK(cudaMemset(am, 0, argmax_scratch_bytes(max_batch)));
  argmax_ = argmax_scratch(am, max_batch);
  KESTREL_CUDA_CHECK(cudaMemset(tokens_, 0, B * 4));
  KESTREL_CUDA_CHECK(cudaMemset(positions_, 0, B * 4));
  if (c.num_moe_layers() > 0) {
    const size_t slots = B * size_t(c.experts_per_token + (c.num_shared_experts > 0 ? 1 : 0));
    moe_.act_stride = int(std::max(c.moe_intermediate_size, c.moe_intermediate_size * c.num_shared_experts));
    moe_.experts = buffer<int32_t>(B * size_t(c.experts_per_token));
    moe_.weights = buffer<float>(B * size_t(c.experts_per_token));
    moe_.act = buffer<float>(slots * size_t(moe_.act_stride));
    moe_.logits = buffer<float>(B * size_t(c.num_experts));
    const size_t chunks = size_t(route_chunks(max_batch));
    moe_.route_done = buffer<uint32_t>(chunks);
    KESTREL_CUDA_CHECK(cudaMemset(moe_.route_done, 0, chunks * sizeof(uint32_t)));
    if (B >= 2) moe_.out = buffer<float>(slots * H);  // the expert-grouped kernels (KESTREL_MOE_GROUPED_MIN_BATCH)
    bool frag = false;  // the grouped kernels' input, and one token's gate/up
    for (const DLayer& L : m_.layers()) frag |= L.is_moe && moe_takes_fragment_rows(L.moe);
    if (frag) moe_.xf = buffer<uint32_t>(B * H);
  }
  guard.done = true;
}

Decoder::~Decoder() {
  for (auto& [key, g] : graphs_) cudaGraphExecDestroy(g);
  for (void* p : buffers_) cudaFree(p);
}

KvLayer Decoder::kv(int layer) const {
  const ModelConfig& c = m_.config();
  const int64_t row = c.is_mla() ? c.mla.latent() : c.num_kv_heads * c.head_dim;
  const size_t per_layer = size_t(kv_blocks_) * kKvBlock * size_t(row);
  const size_t value_bytes = c.is_mla() ? sizeof(float) : kv_type_bytes(kv_type_);
  KvLayer l;
  l.k = static_cast<char*>(kv_k_) + size_t(layer) * per_layer * value_bytes;
  l.v = static_cast<char*>(kv_v_) + size_t(layer) * per_layer * value_bytes;
  l.type = c.is_mla() ? KvType::F32 : kv_type_;
  l.table = table_;
  l.table_stride = one_sequence_ ? 0 : table_stride_;
  l.row = int(row);
  return l;
}

KvLayer Decoder::index_kv(int layer) const {
  const int slot = index_slot_.at(size_t(layer));
  if (slot < 0) fail("internal: layer ", layer, " has no indexer keys");
  const int64_t row = m_.config().indexer.head_dim;
  KvLayer l;
  l.k = l.v = index_pool_ + size_t(slot) * size_t(kv_blocks_) * kKvBlock * size_t(row);
  l.table = table_;
  l.table_stride = one_sequence_ ? 0 : table_stride_;
  l.row = int(row);
  return l;
}

void Decoder::set_table(int seq, std::span<const int32_t> blocks, cudaStream_t s) {
  const int seqs = one_sequence_ ? 1 : max_batch_;
  if (seq < 0 || seq >= seqs) fail("internal: block table row ", seq, " of ", seqs);
  if (blocks.size() > size_t(table_stride_))
    fail("internal: ", blocks.size(), " blocks for a block table row of ", table_stride_);
  for (int32_t b : blocks)
    if (b < 0 || b >= kv_blocks_) fail("internal: KV block ", b, " outside the pool of ", kv_blocks_);
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(table_ + size_t(seq) * size_t(table_stride_), blocks.data(), blocks.size() * 4,
                                     cudaMemcpyHostToDevice, s));
}

template <typename Op>
void Decoder::mla_attention(const DLayer& L, int layer, int batch, float* out, bool accumulate, cudaStream_t s, Op& op) {
  const ModelConfig& c = m_.config();
  const MlaConfig& mc = c.mla;
  const DMla& a = L.mla;
  MlaShape m;
  m.heads = int(c.num_heads);
  m.nope = int(mc.qk_nope_head_dim);
  m.rope = int(mc.qk_rope_head_dim);
  m.v = int(mc.v_head_dim);
  m.rank = int(mc.kv_lora_rank);
  RopeArgs rope;
  rope.inv_freq = m_.rope_inv_freq();
  rope.scaling = c.rope.attention_scaling();
  rope.rotary_dim = m.rope;
  rope.interleaved = c.rope.interleaved;
  const double act = 4.0 * batch;
  const bool lora = mc.q_lora_rank > 0;
  {
    const LinearJob jobs[2] = {{lora ? a.q_a : a.q, lora ? mla_.q_latent : mla_.q}, {a.kv_a, mla_.kv_latent}};
    launch_linear(jobs, 2, xn_, batch, false, s);
    op("mla_q_kv_a", 1, double(jobs[0].w.bytes() + a.kv_a.bytes()));
  }
  if (lora) {
    launch_rms_norm(mla_.q_latent, a.q_a_norm, batch, int(mc.q_lora_rank), mc.latent_norm_eps, mla_.q_latent, s);
    op("rms_norm", 1, 2 * act * double(mc.q_lora_rank));
    const LinearJob jobs[1] = {{a.q_b, mla_.q}};
    launch_linear(jobs, 1, mla_.q_latent, batch, false, s);
    op("mla_q_b", 1, double(a.q_b.bytes()));
  }
  const KvLayer kvl = kv(layer);
  launch_mla_latent_store(mla_.kv_latent, batch, m, a.kv_a_norm, mc.latent_norm_eps, rope, positions_, kvl, s);
  op("mla_latent_store", 1, 2 * act * m.latent());
  launch_mla_query(mla_.q, batch, m, a.kv_b, rope, positions_, mla_.q_abs, s);
  op("mla_absorb_q", 1, double(a.kv_b.bytes()) * m.nope / (m.nope + m.v));
  AttentionSelect select;
  if (c.indexer.enabled()) {
    const IndexerConfig& ix = c.indexer;
    if (a.has_indexer) {
      IndexerShape x;
      x.heads = int(ix.heads);
      x.dim = int(ix.head_dim);
      x.rope = m.rope;
      x.topk = int(ix.topk);
      RopeArgs irope = rope;
      irope.interleaved = ix.rope_interleaved;
      const LinearJob kw[2] = {{a.index_wk, mla_.ik}, {a.index_weights, mla_.iw}};
      launch_linear(kw, 2, xn_, batch, false, s);
      const LinearJob qj[1] = {{a.index_wq_b, mla_.iq}};
      launch_linear(qj, 1, mla_.q_latent, batch, false, s);
      op("index_proj", 2, double(a.index_wk.bytes() + a.index_weights.bytes() + a.index_wq_b.bytes()));
      const KvLayer ikv = index_kv(layer);
      launch_index_prep(mla_.iq, mla_.ik, batch, x, a.index_norm_w, a.index_norm_b, irope, positions_, ikv, s);
      launch_index_scores(mla_.iq, mla_.iw, batch, x, positions_, ikv, max_context_, mla_.scores, s);
      launch_topk_select(mla_.scores, batch, max_context_, x.topk, positions_, mla_.select, mla_.select_count, s);
      op("index_select", 3, 0.0);  // index keys read depend on the positions: the caller adds them
    }
    select.index = mla_.select;
    select.count = mla_.select_count;
    select.stride = int(ix.topk);
  }
  launch_mla_attention(mla_.q_abs, batch, m, mc.softmax_scale, positions_, kvl, split_, select, att_scratch_, mla_.att, s);
  op("attention", 2, 0.0);  // KV bytes depend on the positions: the caller adds them
  launch_mla_output(mla_.att, batch, m, a.kv_b, mla_.v, s);
  op("mla_absorb_v", 1, double(a.kv_b.bytes()) * m.v / (m.nope + m.v));
  const LinearJob o[1] = {{L.o, out}};
  launch_linear(o, 1, mla_.v, batch, accumulate, s);
  op("o_proj", 1, double(L.o.bytes()));
}

void Decoder::reduce_add_norm(int batch, const float* norm, cudaStream_t s) {
  const ModelConfig& c = m_.config();
  link_->reduce->all_reduce_add_norm(part_, x_, norm, c.rms_norm_eps, xn_, batch, int(c.hidden_size), s);
}

void Decoder::gather_logits(int rows, int first, cudaStream_t s) {
  const ModelConfig& c = m_.config();
  const int ranks = link_->comm->size();
  const int share = int(vocab_share(c.vocab_size, ranks, 0).share);
  link_->comm->all_gather(shard_logits_, int64_t(rows) * share, gathered_);
  const int threads = 256, blocks = std::min(1024, int((c.vocab_size + threads - 1) / threads));
  unshard_logits_kernel<<<dim3(unsigned(blocks), unsigned(rows)), threads, 0, s>>>(
      gathered_, ranks, rows, share, int(c.vocab_size), logits_ + size_t(first) * size_t(c.vocab_size));
  KESTREL_CUDA_LAUNCHED();
}

void Decoder::step(int batch, cudaStream_t s, OpMarks* marks, Logits rows, bool sample) {
  if (batch < 1 || batch > max_batch_) fail("decode batch ", batch, " outside 1..", max_batch_);
  if (rows == Logits::Last && !one_sequence_) fail("internal: last-row logits are for one-sequence decoders");
  const ModelConfig& c = m_.config();
  const int H = int(c.hidden_size), hd = int(c.head_dim), nq = int(c.num_heads), nkv = int(c.num_kv_heads);
  const float eps = c.rms_norm_eps, scale = 1.0f / std::sqrt(float(hd));
  RopeArgs rope;
  rope.inv_freq = m_.rope_inv_freq();
  rope.scaling = c.rope.attention_scaling();
  rope.rotary_dim = int(c.rope.rotary_dim);
  rope.interleaved = c.rope.interleaved;
  int n = 0;
  // Counts launches and, when observed, marks the end of an op with the bytes it must move.
  auto op = [&](const char* name, int launches, double bytes) {
    n += launches;
    if (marks) marks->mark(name, bytes, s);
  };
  const double act = 4.0 * batch;  // bytes per activation element of the batch
  if (marks) marks->begin(s);
  launch_embed(m_.embed(), tokens_, batch, x_, s);
  op("embed", 1, double(m_.embed().bytes()) / double(c.vocab_size) * batch + act * H);
  const double expected_experts = expected_distinct_experts(c, batch);
  // Split: each sublayer writes its partial output to part_; the all-reduce adds the ranks' sum
  // to x and applies the next RMSNorm (the first layer's attention norm runs on its own).
  const bool split = link_ != nullptr;
  float* const out = split ? part_ : x_;
  const int nL = int(m_.layers().size());
  auto reduce = [&](const float* next_norm) {
    reduce_add_norm(batch, next_norm, s);
    op("all_reduce", 1, 2 * act * H);
  };
  for (int l = 0; l < nL; ++l) {
    const DLayer& L = m_.layers()[size_t(l)];
    // Unsplit, the RMSNorms before q/k/v and before the router run inside those kernels where
    // they can (one token): a launch and a wait fewer each. From 2 tokens launch_linear launches
    // the one before q/k/v itself, which then also splits the rows for its tensor-core kernel.
    const LinearJob qkv[3] = {{L.q, q_}, {L.k, k_}, {L.v, v_}};
    const bool norm_in_qkv = !split && !c.is_mla();
    const bool fuse_ffn_norm = !split && L.is_moe && route_fuses_norm(L.moe.router, batch);
    if ((!split || l == 0) && !norm_in_qkv) {
      launch_rms_norm(x_, L.attn_norm, batch, H, eps, xn_, s);
      op("rms_norm", 1, 2 * act * H);
    }
    if (c.is_mla()) {
      mla_attention(L, l, batch, out, !split, s, op);
    } else {
      const KvLayer kvl = kv(l);
      if (norm_in_qkv) launch_linear(qkv, 3, x_, batch, false, s, RowNorm{L.attn_norm, eps, xn_, xf_});
      else launch_linear(qkv, 3, xn_, batch, false, s);
      const int norm_launches = norm_in_qkv && !linear_fuses_norm(qkv, 3, batch, xf_ != nullptr) ? 1 : 0;  // by launch_linear
      op("qkv_proj", 1 + norm_launches, double(L.q.bytes() + L.k.bytes() + L.v.bytes()));
      // QK norm, rotary embedding and the cache write: inside the attention kernel where it can.
      const QkPrep prep{k_, v_, L.q_norm, L.k_norm, eps, rope};
      const bool in_attention = attention_takes_qk_step(kvl, batch);
      if (!in_attention) {
        launch_qk_rope_store(q_, k_, v_, batch, nq, nkv, hd, L.q_norm, L.k_norm, eps, rope, positions_, kvl, s);
        op("qk_norm_rope", 1, act * (nq + 2 * nkv) * hd);
      }
      // Attention leaves its output as fragment rows too where o's tensor-core kernel takes them.
      const LinearJob o[1] = {{L.o, out}};
      uint32_t* att_frag = att_frag_ && linear_takes_fragment_rows(o, 1, batch) ? att_frag_ : nullptr;
      const int att_launches = launch_decode_attention(q_, batch, nq, nkv, hd, scale, positions_, kvl, gqa_split(batch),
                                                       att_scratch_, att_, s, in_attention ? &prep : nullptr, att_frag);
      op("attention", att_launches, 0.0);  // KV bytes depend on the positions: the caller adds them
      launch_linear(o, 1, att_, batch, !split, s, RowNorm{}, att_frag);
      op("o_proj", 1, double(L.o.bytes()));
    }
    if (split) {
      reduce(L.ffn_norm);
    } else if (!fuse_ffn_norm) {
      launch_rms_norm(x_, L.ffn_norm, batch, H, eps, xn_, s);
      op("rms_norm", 1, 2 * act * H);
    }
    if (L.is_moe) {
      // The router's normalization also leaves the rows as fragment rows where the experts read them.
      const bool xf_made = fuse_ffn_norm && moe_.xf && moe_reads_fragment_rows(L.moe, batch, moe_);
      if (fuse_ffn_norm)  // leaves the normalized row in xn_ for the experts
        launch_route(L.moe.router, x_, batch, moe_.logits, moe_.route_done, moe_.experts, moe_.weights, s,
                     RowNorm{L.ffn_norm, eps, xn_, xf_made ? moe_.xf : nullptr});
      else
        launch_route(L.moe.router, xn_, batch, moe_.logits, moe_.route_done, moe_.experts, moe_.weights, s);
      op("router", 1, double(L.moe.router.w.bytes()));
      if (split) KESTREL_CUDA_CHECK(cudaMemsetAsync(part_, 0, size_t(batch) * H * 4, s));  // the experts add to it
      const int expert_launches = launch_moe_experts(L.moe, xn_, batch, out, moe_, s, xf_made);
      // An expert-parallel rank holds local_experts of the num_experts; uniform routing touches its share.
      const double eb = double(m_.expert_bytes(size_t(l))) * expected_experts * L.moe.local_experts / double(c.num_experts);
      const double shared = L.moe.has_shared
                                ? double(L.moe.shared_gate.bytes() + L.moe.shared_up.bytes() + L.moe.shared_down.bytes())
                                : 0.0;
      op("experts", expert_launches, eb + shared);
    } else {
      launch_gated(L.gate, L.up, xn_, batch, act_, s);
      op("mlp_gate_up", 1, double(L.gate.bytes() + L.up.bytes()));
      const LinearJob d[1] = {{L.down, out}};
      launch_linear(d, 1, act_, batch, !split, s);
      op("mlp_down", 1, double(L.down.bytes()));
    }
    if (split) reduce(l + 1 < nL ? m_.layers()[size_t(l + 1)].attn_norm : m_.final_norm());
  }
  // Rows [first, batch) get logits and a next token.
  const int head_rows = rows == Logits::Last ? 1 : batch, first = batch - head_rows;
  const size_t V = size_t(c.vocab_size);
  const double hact = 4.0 * head_rows;
  float* const xn_first = xn_ + size_t(first) * H;
  if (!split) {
    launch_rms_norm(x_ + size_t(first) * H, m_.final_norm(), head_rows, H, eps, xn_first, s);
    op("rms_norm", 1, 2 * hact * H);
  }
  const LinearJob head[1] = {{m_.lm_head(), split ? shard_logits_ : logits_ + size_t(first) * V}};
  launch_linear(head, 1, xn_first, head_rows, false, s);
  op("lm_head", 1, double(m_.lm_head().bytes()));
  if (split) {
    gather_logits(head_rows, first, s);
    op("gather_logits", 2, 2 * hact * double(c.vocab_size));
  }
  if (sample) {
    launch_sample(logits_ + size_t(first) * V, head_rows, int(c.vocab_size), sample_params_ + first, next_ + first, s);
    op("sample", 1, hact * double(c.vocab_size));
  } else {
    launch_argmax(logits_ + size_t(first) * V, head_rows, int(c.vocab_size), next_ + first, argmax_, s);
    op("argmax", 1, hact * double(c.vocab_size));
  }
  launches_ = n;
}

void Decoder::advance(int batch, cudaStream_t s) {
  advance_kernel<<<1, 32 * ((batch + 31) / 32), 0, s>>>(tokens_, next_, positions_, batch);
  KESTREL_CUDA_LAUNCHED();
}

void Decoder::step_graph(int batch, bool adv, cudaStream_t s, Logits rows, bool sample) {
  const auto key = std::make_tuple(batch, adv, rows, sample);
  auto it = graphs_.find(key);
  if (it == graphs_.end()) {
    if (s == nullptr) fail("internal: CUDA graphs need a stream other than the legacy default stream");
    cudaGraph_t g;
    KESTREL_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    try {
      step(batch, s, nullptr, rows, sample);
      if (adv) advance(batch, s);
    } catch (...) {
      cudaStreamEndCapture(s, &g);
      throw;
    }
    KESTREL_CUDA_CHECK(cudaStreamEndCapture(s, &g));
    cudaGraphExec_t exec;
    KESTREL_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
    KESTREL_CUDA_CHECK(cudaGraphDestroy(g));
    it = graphs_.emplace(key, exec).first;
  }
  KESTREL_CUDA_CHECK(cudaGraphLaunch(it->second, s));
}

}  // namespace kestrel::cuda
