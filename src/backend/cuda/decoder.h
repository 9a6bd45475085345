// One decode step on the GPU for a batch of sequences: embedding, every layer, the LM head and
// greedy sampling (or, when asked, sampling with per-row parameters: sample.h), all on one stream
// with no host synchronization, so that the whole step is captured once per batch size as a
// CUDA graph and replayed. Each replay also advances tokens (to the sampled ones) and positions,
// so replays generate tokens back to back.
#pragma once
#include <cuda_runtime.h>

#include <map>
#include <span>
#include <tuple>
#include <vector>

#include "backend/cuda/attention.h"
#include "backend/cuda/device_model.h"
#include "backend/cuda/misc.h"
#include "backend/cuda/norm_rope.h"
#include "backend/cuda/op_timer.h"
#include "backend/cuda/sample.h"
#include "parallel/communicator.h"

namespace kestrel::cuda {

class OneShotAllReduce;

// What the decoder of one rank of a split model needs from the other ranks (rank_group.h).
struct RankLink {
  Communicator* comm = nullptr;        // all-gather of the LM head's vocabulary shares
  OneShotAllReduce* reduce = nullptr;  // x += the ranks' partial outputs, then the next RMSNorm
};

class Decoder;

// Where a decoder's KV cache lives: a pool of blocks of 16 positions and a block table per
// sequence (kv_layer.h).
struct KvSource {
  // A pool of its own of this many blocks, the tables set with set_table. 0: exactly
  // ceil(max_context / 16) blocks per sequence and identity tables (sequence b holds blocks
  // b * n .. b * n + n - 1), so the cache needs no set-up.
  int64_t blocks = 0;
  // Instead, the pool of this decoder (not one-sequence, same model and context): a one-sequence
  // decoder prefilling any of its sequences, whose one table row (table()) the caller fills
  // with that sequence's row before each step. It has that pool's type.
  const Decoder* borrow = nullptr;
  // The type of the cached values of an own pool. BF16 for GQA models only (MLA latents and
  // indexer keys stay float32).
  KvType type = KvType::F32;
};

class Decoder {
 public:
  // With `one_sequence`, the batch rows are consecutive positions of a single sequence sharing
  // one KV cache (prefill: a step over positions p .. p + n - 1 is causal attention over the
  // chunk, since every row's key and value are stored before attention reads them); otherwise
  // each row is its own sequence with its own cache.
  // With `link`, the model is one rank's part (parallel/shard.h): the attention and FFN outputs
  // are partial sums reduced across the ranks, and the logits gathered from their shares.
  // `kv`: where the KV cache lives (by default a pool of exactly enough with identity tables).
  Decoder(const DeviceModel& model, int max_batch, int max_context, bool one_sequence = false,
          const RankLink* link = nullptr, KvSource kv = {});
  ~Decoder();
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;

  // Inputs: token and position of each sequence (device arrays of max_batch entries).
  int32_t* tokens() { return tokens_; }
  int32_t* positions() { return positions_; }
  // Sampling parameters of each row (device array of max_batch entries), read by steps that
  // sample; the caller fills them before the step (a graph replay reads them then).
  SampleParams* sample_params() { return sample_params_; }
  // Outputs of the last step: logits [batch, vocab] and next tokens [batch] (greedy, or drawn
  // with sample_params() by a step that samples).
  const float* logits() const { return logits_; }
  const int32_t* next() const { return next_; }

  // Which rows get logits (and a greedy next token): every row, or only the last one (a prompt's
  // chunk of a one-sequence decoder, where only the last position's logits are wanted: the LM
  // head, the largest matrix, then runs for one row instead of up to a whole chunk).
  enum class Logits { All, Last };
  // Enqueues one step (kernels launched one by one) on the stream. With marks, each op is
  // reported as it is enqueued (OpTimer: an event after every op; OpGraph: during a capture).
  // With `sample`, the step ends with launch_sample over sample_params() (for the rows that get
  // logits) instead of the argmax.
  void step(int batch, cudaStream_t s, OpMarks* marks = nullptr, Logits rows = Logits::All, bool sample = false);
  // The same step through the CUDA graph for this batch size (captured on first use); when
  // `advance`, the graph ends by copying next -> tokens and incrementing positions.
  void step_graph(int batch, bool advance, cudaStream_t s, Logits rows = Logits::All, bool sample = false);
  // Kernel launches in one step (for the report).
  int launches_per_step() const { return launches_; }

  int max_batch() const { return max_batch_; }
  int max_context() const { return max_context_; }
  KvLayer kv(int layer) const;

  // The KV pool's blocks and the block tables: [sequences][table_stride()] block ids in device
  // memory (one row for a one-sequence decoder), read by every step, so graphs stay valid.
  int64_t kv_blocks() const { return kv_blocks_; }
  int table_stride() const { return table_stride_; }  // ceil(max_context / 16)
  int32_t* table() { return table_; }
  const int32_t* table() const { return table_; }
  // Sequence `seq`'s first blocks.size() table entries (the rest keep theirs), copied on `s`
  // before the next step enqueued there (the source may be reused once this returns).
  void set_table(int seq, std::span<const int32_t> blocks, cudaStream_t s);
  KvType kv_type() const { return kv_type_; }
  // Device memory of one block of 16 positions, all layers, for a model (or one rank's part).
  static size_t kv_block_bytes(const DeviceModel& model, KvType type);

 private:
  void advance(int batch, cudaStream_t s);
  // The attention block of an MLA layer (absorbed, see mla.h); `op` marks each op as in step().
  // `out` receives o_proj's output, added to it when `accumulate`.
  template <typename Op>
  void mla_attention(const DLayer& L, int layer, int batch, float* out, bool accumulate, cudaStream_t s, Op& op);
  // Split: x += sum over ranks of part_, then xn = RMSNorm(x) with `norm`.
  void reduce_add_norm(int batch, const float* norm, cudaStream_t s);
  // Split: the vocabulary shares of `rows` rows of logits from every rank into logits_ from row
  // `first` on.
  void gather_logits(int rows, int first, cudaStream_t s);
  KvLayer index_kv(int layer) const;
  template <typename T>
  T* buffer(size_t n);
  // The pools of a KV cache of kv_blocks_ blocks, zeroed (rows read before they are written
  // hold finite values).
  void allocate_kv_pool();

  const DeviceModel& m_;
  int max_batch_, max_context_, launches_ = 0;
  bool one_sequence_;
  const RankLink* link_;
  std::vector<void*> buffers_;
  float *part_ = nullptr, *shard_logits_ = nullptr, *gathered_ = nullptr;  // split only
  float *x_ = nullptr, *xn_ = nullptr, *q_ = nullptr, *k_ = nullptr, *v_ = nullptr, *att_ = nullptr, *act_ = nullptr;
  uint32_t* xf_ = nullptr;  // the normalized rows before q/k/v as fragment rows (launch_linear's RowNorm::frag)
  uint32_t* att_frag_ = nullptr;  // attention's output as fragment rows for o (launch_decode_attention's out_frag)
  float *logits_ = nullptr, *att_scratch_ = nullptr;
  // The KV pool (all layers, layer by layer: kv_blocks_ blocks of 16 rows each), owned or borrowed.
  void *kv_k_ = nullptr, *kv_v_ = nullptr;  // MLA: the latent rows; kv_v_ == kv_k_
  KvType kv_type_ = KvType::F32;
  float* index_pool_ = nullptr;              // DSA: the indexer keys of the layers that have one
  std::vector<int> index_slot_;              // per layer: its place in index_pool_, -1 without an indexer
  int64_t kv_blocks_ = 0;
  int32_t* table_ = nullptr;
  int table_stride_ = 0;
  AttentionSplit split_;  // MLA attention's
  AttentionSplit gqa_split(int batch) const {  // GQA attention's, per batch (fixed in each batch's graph)
    const ModelConfig& c = m_.config();
    AttentionSplit s = attention_split(max_context_, batch * int(c.num_kv_heads));
    const int nq = int(c.num_heads), gh = attention_heads_per_block(nq, int(c.num_kv_heads), int(c.head_dim), batch);
    s.cluster = attention_cluster(batch * (nq / gh));
    return s;
  }
  // MLA: q latent, kv latent, queries, queries in latent space, latent attention output, values;
  // DSA indexer: queries, key, head weights, scores, selected positions and their count.
  struct MlaBuffers {
    float *q_latent = nullptr, *kv_latent = nullptr, *q = nullptr, *q_abs = nullptr, *att = nullptr, *v = nullptr;
    float *iq = nullptr, *ik = nullptr, *iw = nullptr, *scores = nullptr;
    int32_t *select = nullptr, *select_count = nullptr;
  } mla_;
  int32_t *tokens_, *positions_, *next_;
  SampleParams* sample_params_;
  MoeScratch moe_;
  ArgmaxScratch argmax_;
  std::map<std::tuple<int, bool, Logits, bool>, cudaGraphExec_t> graphs_;  // (batch, advance, rows, sample)
};

}  // namespace kestrel::cuda
