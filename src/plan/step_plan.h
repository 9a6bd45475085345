// The persistent decode step as data. Every op of one decode step is cut into tiles; each tile is
// an instruction in one SM's queue with the activation ranges it reads and writes, the weight and
// cache bytes it streams, the counters it waits on and the one it advances. A persistent kernel
// (one resident block per SM) only interprets it; check_step_plan (step_plan_check.h) proves on
// the CPU that any timing of the queues computes what running the instructions one after another
// in program order computes, and cpu::run_step_plan executes that order with the reference
// kernels; `kestrel plan` prints it. Counters count up across steps and are never reset: a wait
// of step s (from 0) is for s * producers + producers.
//
// How a plan is made (make_step_plan), in one place:
//   1. ops in program order, layer by layer, each cut into tiles by a rule per op (tile_rows):
//      row tiles of whole quanta that do not straddle a head or an expert, attention per KV head
//      and split of the positions;
//   2. tiles go to SMs op by op, each to the SM with the least work so far (bytes plus a fixed
//      cost per instruction), so every queue is in program order;
//   3. edges from the accesses: a read depends on the unit's last writer, a write on the unit's
//      readers since and its last writer; edges that the others imply are dropped (vector clocks
//      over the SMs at the level of single instructions);
//   4. a producer op's tiles are grouped into counters by union-find over what each consumer
//      needs (tiles one consumer needs share a counter: per head where consumers are per head,
//      one counter where a consumer reads all), so every tile advances exactly one counter;
//   5. a wait that the instruction's other waits and its queue already imply is dropped (vector
//      clocks over SMs: exact, not a heuristic).
// Tails (the attention's combine, the route) are in no queue: each has one wait, and the block
// whose tile completes that counter runs it next. To the clocks and the proof a tail is a queue
// of its own (any timing of it is covered; running it on the completing block is one of them).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/model_config.h"

namespace kestrel {

enum class StepOp : uint8_t {
  Embed,          // the tokens' embedding rows -> Hidden
  AttnNormQkv,    // RMSNorm of Hidden, then rows [a, b) of q | k | v (+ bias) -> Qkv
  AttnSplit,      // KV head a, split b of the positions: its query heads' QK norm and rotary, partial
                  // softmax attention -> AttnPart; the last split also stores the step's key and value
  AttnCombine,    // KV head a: its splits combined -> AttnOut rows of its query heads
  OProj,          // rows [a, b) of o (+ bias) added to Hidden
  FfnNormRouter,  // RMSNorm of Hidden, router rows [a, b) -> RouterLogits
  Route,          // scores, (group-limited) top-k and weights per token; the batch's distinct experts
  ExpertGateUp,   // expert position c (the c-th distinct expert), rows [a, b) of silu(gate) * up -> ExpertMid
  SharedGateUp,   // shared experts' rows [a, b) of silu(gate) * up -> SharedMid
  ExpertDown,     // rows [a, b) of the routed experts' weighted down sum (+ shared down) added to Hidden
  MlpGateUp,      // dense layers: RMSNorm of Hidden, rows [a, b) of silu(gate) * up -> Mid
  MlpDown,        // rows [a, b) of down added to Hidden
  HeadNormLogits, // final RMSNorm of Hidden, LM head rows [a, b) -> Logits
  // Multi-head latent attention (DeepSeek-V3), absorbed: attention runs in latent space.
  MlaNormProj,      // RMSNorm of Hidden, rows [a, b) of q_a | kv_a (or q | kv_a without a q latent) -> MlaProj
  MlaLatent,        // the latent's RMSNorm and rotary, into the cache; the q latent's RMSNorm -> QLat
  MlaQb,            // rows [a, b) of q_b over QLat -> Qkv (the queries)
  MlaAbsorbQ,       // head a: its query's rotary, its non-rotary part carried into latent space -> QAbs
  MlaAttnSplit,     // split a of the positions, every head: partial softmax over the latent rows -> AttnPart
  MlaCombineAbsorb, // heads [a, b): the splits combined in latent space, then out through W_UV -> AttnOut
  // GLM-5's DSA indexer (layers that run their own; the others read the last Selection).
  IndexProj,        // rows [a, b) of wq_b (over QLat) | wk | weights_proj (over the normed Hidden) -> IndexQ
  IndexPrep,        // the key's LayerNorm and rotary, into the index cache; the queries' rotary
  IndexScore,       // split a of the positions: every cached position's score -> IndexScores
  IndexTopK,        // each token's index_topk best positions -> Selection
};
inline constexpr int kStepOpCount = 23;
const char* step_op_name(StepOp op);

// Activation buffers. Ranges are in units of one token's row, the same range for every token of
// the batch (KvCache: units of (layer, KV head), one per layer for MLA; for GQA the positions
// before the step's, whose key and value are KvNew, in the same units; AttnPart: (KV head, split),
// for MLA one per split holding every head; Routes: one unit). Qkv holds MLA's queries.
enum class StepBuf : uint8_t {
  Hidden, Qkv, KvCache, AttnPart, AttnOut, RouterLogits, Routes, ExpertMid, SharedMid, Mid, Logits,
  MlaProj, QLat, QAbs, IndexQ, IndexCache, IndexScores, Selection, KvNew
};
inline constexpr int kStepBufCount = 19;
const char* step_buf_name(StepBuf b);

struct StepSpan {
  StepBuf buf;
  int64_t begin = 0, end = 0;
};

struct StepInstr {
  StepOp op;
  int32_t layer = -1;                // -1: outside the layers (embedding, head)
  int64_t a = 0, b = 0, c = 0;       // the op's tile (see StepOp)
  std::vector<StepSpan> reads, writes;
  double weight_bytes = 0;           // weights streamed (stored bytes, scales included)
  double cache_bytes = 0;            // KV cache read at the plan's context (all tokens)
  int32_t sm = -1, slot = -1;        // queue and position in it; -1 for a tail
  // A tail is in no queue: the block whose tile completes the tail's one wait runs it right
  // after that tile (a weightless step that would otherwise cost a hop between SMs).
  bool tail = false;
  std::vector<int32_t> waits;        // counters
  int32_t signal = -1;               // the counter it advances when done
};

struct StepCounter {
  int32_t producers = 0;  // tiles that advance it once per step
  int32_t first = -1;     // the first of them (program order), naming it
};

struct StepPlanOptions {
  int batch = 1;
  int sms = 132;             // persistent blocks, one per SM
  int64_t context = 1024;    // positions attended (for the cache bytes and the number of splits)
  int64_t row_quantum = 16;  // rows of a tile are whole multiples of this (tensor-core tile height)
  double kv_value_bytes = 2; // bytes per cached key or value element (BF16)
  double instr_cost = 16384; // bytes of streaming one instruction's overhead is worth when balancing
};

struct StepPlan {
  StepPlanOptions options;
  std::string architecture;
  int64_t layers = 0, hidden = 0, qkv_rows = 0, heads = 0, kv_heads = 0, head_dim = 0;
  int64_t splits = 0;            // attention splits per KV head
  int64_t expert_positions = 0;  // distinct experts a step may run: min(experts, batch * top_k)
  int64_t expert_rows = 0, shared_rows = 0, mlp_rows = 0, vocab = 0;
  int64_t att_rows = 0;          // AttnOut per token: heads x head_dim (MLA: heads x v_head_dim)
  bool mla = false;              // head_dim is then qk_head_dim, kv_heads the heads
  int64_t q_lora = 0, kv_lora = 0, nope = 0, rope_dim = 0, v_dim = 0, proj_rows = 0;
  int64_t index_heads = 0, index_dim = 0, index_topk = 0, index_rows = 0;  // DSA: index_rows = heads x dim + dim + heads
  std::vector<int64_t> units;    // per StepBuf: units per token
  std::vector<StepInstr> instrs; // program order
  std::vector<StepCounter> counters;
  std::vector<std::vector<int32_t>> queues;  // per SM: instruction indices in program order
  std::vector<int32_t> tails;                // the tails, in program order

  double weight_bytes() const;
  std::vector<int32_t> tail_of_counters() const;  // per counter: the tail that waits on it, or -1
  double cache_bytes() const;
};

// Fails naming what is not planned yet (split models are not).
StepPlan make_step_plan(const ModelConfig& c, const StepPlanOptions& o);

// The rows of a tile rule: `rows` cut into tiles of whole `quantum`s (the last may be short) that
// do not straddle a boundary every `group` rows, about `target` tiles in all. [begin, end) pairs.
std::vector<std::pair<int64_t, int64_t>> tile_rows(int64_t rows, int64_t group, int64_t quantum, int64_t target);

}  // namespace kestrel
