#include "backend/cpu/forward.h"

#include <cmath>
#include <cstring>
#include <exception>
#include <thread>

#include "backend/cpu/attention.h"
#include "backend/cpu/linear.h"
#include "backend/cpu/mla.h"
#include "backend/cpu/moe.h"
#include "common/error.h"
#include "parallel/shard.h"
#include "parallel/thread_comm.h"

namespace kestrel::cpu {
namespace {

void check_tokens(std::span<const int32_t> tokens, int64_t vocab) {
  for (int32_t id : tokens)
    if (id < 0 || id >= vocab) fail("token id ", id, " is outside the vocabulary [0, ", vocab, ")");
}

RopeTables index_rope_of(const ModelConfig& c) {
  RopeTables t(c.rope);
  t.interleaved = c.indexer.rope_interleaved;
  return t;
}

}  // namespace

struct Forward::Split {
  std::vector<std::unique_ptr<Model>> shards;
  std::vector<std::unique_ptr<ThreadPool>> pools;
  std::vector<std::unique_ptr<Communicator>> comms;
  std::vector<std::unique_ptr<Forward>> ranks;
  std::vector<std::vector<float>> logits;  // ranks 1..n-1 gather the logits too; rank 0 into the caller's

  void connect() {
    comms = make_thread_communicators(int(ranks.size()));
    for (size_t r = 0; r < ranks.size(); ++r) ranks[r]->comm_ = comms[r].get();
  }
};

Forward::Forward(const Model& model, ThreadPool& pool, const Layout& layout)
    : model_(model), c_(model.config), pool_(pool), rope_(model.config.rope), index_rope_(index_rope_of(model.config)) {
  check_layout(layout, long(c_.num_experts));
  if (!layout.split()) return;
  split_ = std::make_unique<Split>();
  const int n = layout.ranks();
  for (int r = 0; r < n; ++r) {
    split_->shards.push_back(shard_model(model, layout, r));
    split_->pools.push_back(std::make_unique<ThreadPool>(std::max(1, pool.size() / n)));
    split_->ranks.push_back(std::unique_ptr<Forward>(new Forward(*split_->shards.back(), *split_->pools.back(), nullptr)));
  }
  split_->logits.resize(size_t(n));
  split_->connect();
}

Forward::Forward(const Model& shard, ThreadPool& pool, Communicator* comm)
    : model_(shard), c_(shard.config), pool_(pool), rope_(shard.config.rope), index_rope_(index_rope_of(shard.config)),
      comm_(comm) {}

Forward::~Forward() = default;

void Forward::set_observer(LinearObserver observe) {
  if (split_ && observe) fail("calibration observes the unsplit model (run it without --tp/--ep)");
  observe_ = std::move(observe);
}

KvCache Forward::make_cache(int64_t capacity) const {
  if (split_) {
    std::vector<KvCache> ranks;
    for (const auto& r : split_->ranks) ranks.push_back(r->make_cache(capacity));
    return KvCache(std::move(ranks));
  }
  return KvCache(c_.num_layers, kv_layout(), capacity);
}

KvLayout Forward::kv_layout() const {
  if (split_) fail("internal: a split model's KV layout differs per rank");
  return kv_layout_of(c_);
}

KvLayout kv_layout_of(const ModelConfig& c) {
  if (!c.is_mla()) return KvLayout{c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim, 0, {}};
  KvLayout layout{c.mla.latent(), 0, 0, {}};
  if (c.indexer.enabled()) {
    layout.index_row = c.indexer.head_dim;
    layout.index_layer = c.indexer.own;
  }
  return layout;
}

void Forward::gqa_attention(const LayerWeights& L, int64_t l, const float* xn, int64_t T, int64_t start,
                            KvCache& cache, float* out) {
  const LinearObserver* obs = observe_ ? &observe_ : nullptr;
  const int64_t hd = c_.head_dim, nq = c_.num_heads, nkv = c_.num_kv_heads;
  std::vector<float> q(static_cast<size_t>(T * nq * hd)), k(static_cast<size_t>(T * nkv * hd)),
      v(static_cast<size_t>(T * nkv * hd)), att(static_cast<size_t>(T * nq * hd));
  linear(L.q, xn, T, q.data(), pool_, obs);
  linear(L.k, xn, T, k.data(), pool_, obs);
  linear(L.v, xn, T, v.data(), pool_, obs);
  if (c_.qk_norm) {
    rms_norm(q.data(), L.q_norm.data(), T * nq, hd, c_.rms_norm_eps, q.data());
    rms_norm(k.data(), L.k_norm.data(), T * nkv, hd, c_.rms_norm_eps, k.data());
  }
  for (int64_t t = 0; t < T; ++t) {
    apply_rope(q.data() + t * nq * hd, nq, hd, start + t, rope_);
    apply_rope(k.data() + t * nkv * hd, nkv, hd, start + t, rope_);
    std::copy_n(k.data() + t * nkv * hd, nkv * hd, cache.k(l, start + t));
    std::copy_n(v.data() + t * nkv * hd, nkv * hd, cache.v(l, start + t));
  }
  attention(q.data(), T, start, nq, nkv, hd, 1.0f / std::sqrt(float(hd)), cache, l, att.data(), pool_);
  linear(L.o, att.data(), T, out, pool_, obs);
}

void Forward::run(std::span<const int32_t> tokens, KvCache& cache, float* logits, float* hidden) {
  if (!split_) return run_rank(tokens, cache, logits, hidden);
  const int64_t T = int64_t(tokens.size()), start = cache.length();
  if (T == 0) return;
  cache.reserve(T);
  check_tokens(tokens, c_.vocab_size);
  const size_t n = split_->ranks.size();
  std::vector<std::exception_ptr> errors(n);
  auto rank = [&](size_t r) {
    try {
      float* out = logits;
      if (r > 0 && logits) {
        split_->logits[r].resize(size_t(T * c_.vocab_size));
        out = split_->logits[r].data();
      }
      // after each layer's all-reduce every rank holds the whole residual stream: rank 0 reports it
      split_->ranks[r]->run_rank(tokens, cache.rank(int(r)), out, r == 0 ? hidden : nullptr);
    } catch (...) {
      errors[r] = std::current_exception();
      split_->comms[r]->abort();  // the others fail at their next collective instead of waiting
    }
  };
  std::vector<std::thread> threads;
  for (size_t r = 1; r < n; ++r) threads.emplace_back(rank, r);
  rank(0);
  for (std::thread& t : threads) t.join();
  // The first failure that is not another rank's abort says what went wrong.
  std::exception_ptr first;
  for (size_t r = 0; r < n && !first; ++r) {
    if (!errors[r]) continue;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const Error& e) {
      if (std::strncmp(e.what(), "collective aborted", 18) != 0) first = errors[r];
    } catch (...) {
      first = errors[r];
    }
  }
  for (size_t r = 0; r < n && !first; ++r)
    if (errors[r]) first = errors[r];
  if (first) {
    cache.truncate(start);
    split_->connect();  // an aborted group stays aborted: the next step gets a fresh one
    std::rethrow_exception(first);
  }
  cache.commit(T);
}

void Forward::gather_logits(const float* local, int64_t T, float* logits) {
  const int64_t V = c_.vocab_size, n = comm_->size();
  const VocabShare vs = vocab_share(V, int(n), comm_->rank());
  std::vector<float> mine(static_cast<size_t>(T * vs.share), 0.0f), all(static_cast<size_t>(n * T * vs.share));
  for (int64_t t = 0; t < T; ++t)
    std::copy_n(local + t * (vs.end - vs.begin), vs.end - vs.begin, mine.begin() + t * vs.share);
  comm_->all_gather(mine.data(), T * vs.share, all.data());
  for (int64_t r = 0; r < n; ++r) {
    const VocabShare rs = vocab_share(V, int(n), int(r));
    for (int64_t t = 0; t < T; ++t)
      std::copy_n(all.begin() + (r * T + t) * vs.share, rs.end - rs.begin, logits + t * V + rs.begin);
  }
}

void Forward::decoder_layer(const LayerWeights& L, int64_t l, float* x, float* xn, float* tmp, int64_t T,
                            int64_t start, KvCache& cache, Selection& selection) {
  const int64_t H = c_.hidden_size;
  const LinearObserver* obs = observe_ ? &observe_ : nullptr;
  rms_norm(x, L.attn_norm.data(), T, H, c_.rms_norm_eps, xn);
  if (c_.is_mla()) mla_attention(c_, L, l, xn, T, start, cache, rope_, index_rope_, selection, tmp, pool_, obs);
  else gqa_attention(L, l, xn, T, start, cache, tmp);
  if (comm_) comm_->all_reduce_sum(tmp, T * H);
  for (int64_t i = 0; i < T * H; ++i) x[i] += tmp[i];

  rms_norm(x, L.ffn_norm.data(), T, H, c_.rms_norm_eps, xn);
  if (L.is_moe) moe_forward(c_, L.moe, xn, T, tmp, pool_, obs);
  else gated_ffn(L.mlp, xn, T, tmp, pool_, obs);
  if (comm_) comm_->all_reduce_sum(tmp, T * H);
  for (int64_t i = 0; i < T * H; ++i) x[i] += tmp[i];
}

void Forward::run_rank(std::span<const int32_t> tokens, KvCache& cache, float* logits, float* hidden) {
  const int64_t T = int64_t(tokens.size()), H = c_.hidden_size, start = cache.length();
  if (T == 0) return;
  cache.reserve(T);
  check_tokens(tokens, c_.vocab_size);
  const ModelWeights& w = model_.weights;

  std::vector<float> x(static_cast<size_t>(T * H)), xn(static_cast<size_t>(T * H)), tmp(static_cast<size_t>(T * H));
  for (int64_t t = 0; t < T; ++t) w.embed.dequant_row(tokens[size_t(t)], x.data() + t * H);

  const LinearObserver* obs = observe_ ? &observe_ : nullptr;
  Selection selection;  // DSA: carried from a layer that selects to the layers that reuse it
  for (int64_t l = 0; l < c_.num_layers; ++l)
    decoder_layer(w.layers[size_t(l)], l, x.data(), xn.data(), tmp.data(), T, start, cache, selection);
  cache.commit(T);
  if (!logits && !hidden) return;
  rms_norm(x.data(), w.final_norm.data(), T, H, c_.rms_norm_eps, xn.data());
  if (hidden) std::copy(xn.begin(), xn.end(), hidden);
  if (!logits) return;
  if (!comm_) return linear(w.lm_head, xn.data(), T, logits, pool_, obs);
  std::vector<float> local(static_cast<size_t>(T * w.lm_head.out));
  linear(w.lm_head, xn.data(), T, local.data(), pool_, obs);
  gather_logits(local.data(), T, logits);
}

const MtpLayer& Forward::mtp_layer(size_t k) const {
  const auto& mtp = model_.weights.mtp;
  if (split_) fail("multi-token prediction runs on the unsplit model (without --tp/--ep)");
  if (k >= mtp.size())
    fail(c_.source, ": no MTP layer ", k, " (the checkpoint holds ", mtp.size(), "; num_nextn_predict_layers ",
         c_.num_nextn_predict_layers, ")");
  return mtp[k];
}

KvCache Forward::make_mtp_cache(int64_t capacity, size_t k) const {
  const MtpLayer& m = mtp_layer(k);
  KvLayout layout = kv_layout_of(c_);
  if (!layout.index_layer.empty()) layout.index_layer = {m.layer.mla.has_indexer};  // one layer: its own
  return KvCache(1, layout, capacity);
}

void Forward::run_mtp(std::span<const int32_t> next, const float* hidden, KvCache& cache, float* logits, size_t k,
                      float* out) {
  const MtpLayer& m = mtp_layer(k);
  const int64_t T = int64_t(next.size()), H = c_.hidden_size, start = cache.length();
  if (T == 0) return;
  cache.reserve(T);
  check_tokens(next, c_.vocab_size);
  const LinearObserver* obs = observe_ ? &observe_ : nullptr;

  // [enorm(embedding) | hnorm(hidden)] per position. Position 0 has no token before it whose
  // prediction it would refine, so its embedding is zero (as vLLM does).
  std::vector<float> cat(static_cast<size_t>(T * 2 * H)), e(static_cast<size_t>(H));
  for (int64_t t = 0; t < T; ++t) {
    float* row = cat.data() + t * 2 * H;
    if (start + t == 0) std::fill(e.begin(), e.end(), 0.0f);
    else m.embed.dequant_row(next[size_t(t)], e.data());
    rms_norm(e.data(), m.enorm.data(), 1, H, c_.rms_norm_eps, row);
    rms_norm(hidden + t * H, m.hnorm.data(), 1, H, c_.rms_norm_eps, row + H);
  }
  std::vector<float> x(static_cast<size_t>(T * H)), xn(static_cast<size_t>(T * H)), tmp(static_cast<size_t>(T * H));
  linear(m.eh_proj, cat.data(), T, x.data(), pool_, obs);
  Selection selection;
  decoder_layer(m.layer, 0, x.data(), xn.data(), tmp.data(), T, start, cache, selection);
  cache.commit(T);
  if (!logits && !out) return;
  rms_norm(x.data(), m.head_norm.data(), T, H, c_.rms_norm_eps, xn.data());
  if (out) std::copy(xn.begin(), xn.end(), out);
  if (logits) mtp_logits(xn.data(), T, logits, k);
}

void Forward::mtp_logits(const float* out, int64_t T, float* logits, size_t k) {
  linear(mtp_layer(k).head, out, T, logits, pool_, observe_ ? &observe_ : nullptr);
}

}  // namespace kestrel::cpu
