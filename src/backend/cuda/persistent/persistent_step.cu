#include "backend/cuda/persistent/persistent_step.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "backend/cuda/check.h"
#include "backend/cuda/device_buffers.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/persistent/counters.cuh"
#include "backend/cuda/persistent/op_attention.cuh"
#include "backend/cuda/persistent/op_moe.cuh"
#include "backend/cuda/persistent/op_products.cuh"
#include "backend/cuda/persistent/weights.cuh"
#include "backend/cuda/persistent/program.h"
#include "plan/step_plan_check.h"

namespace kestrel::cuda {
namespace {

static_assert(std::is_trivially_copyable_v<DLayer>, "layers are copied to the device as they are");
static_assert(std::is_trivially_copyable_v<PProgram>, "the program is copied into shared memory as it is");

// staged: the instruction's weights (an attention split: its cached rows) in the stage
// (weights.cuh), else null. The expert tiles fill the stage themselves (bar, parity: its barrier
// and the phase it completes next).
__device__ __forceinline__ uint8_t* stage_now(const uint8_t* staged, uint8_t* stage) { return staged ? stage : nullptr; }

// By lane 0 of warp 1, before the wait, once the layer's descriptors are in s_layer: the small
// vectors the instruction reads after its wait (norm weights, the experts' descriptors) into the L2.
__device__ __forceinline__ void prefetch_vectors(const PProgram& P, const PInstr& in) {
  const DLayer& L = s_layer;
  const uint32_t H = uint32_t(P.hidden) * 4;
  switch (StepOp(in.op)) {
    case StepOp::AttnNormQkv: return bulk_prefetch_l2(L.attn_norm, H);
    case StepOp::FfnNormRouter:
    case StepOp::SharedGateUp:
    case StepOp::MlpGateUp: return bulk_prefetch_l2(L.ffn_norm, H);
    case StepOp::ExpertGateUp:
      bulk_prefetch_l2(L.ffn_norm, H);
      bulk_prefetch_l2(L.moe.gate, uint32_t(L.moe.local_experts) * sizeof(DLinear));
      return bulk_prefetch_l2(L.moe.up, uint32_t(L.moe.local_experts) * sizeof(DLinear));
    case StepOp::ExpertDown: return bulk_prefetch_l2(L.moe.down, uint32_t(L.moe.local_experts) * sizeof(DLinear));
    case StepOp::AttnSplit:
      if (L.q_norm) bulk_prefetch_l2(L.q_norm, uint32_t(P.head_dim) * 4);
      if (L.k_norm) bulk_prefetch_l2(L.k_norm, uint32_t(P.head_dim) * 4);
      return bulk_prefetch_l2(P.rope.inv_freq, uint32_t(P.rope.rotary_dim / 2) * 4);
    default: return;
  }
}
template <int B, class T>
__device__ void run_instr(const PProgram& P, const PInstr& in, float* smem, const uint8_t* staged, uint8_t* stage,
                          uint64_t* bar, uint32_t& parity) {
  const uint8_t* const st = staged;
  switch (StepOp(in.op)) {
    case StepOp::Embed: return embed_rows(P);
    case StepOp::AttnNormQkv: return norm_qkv<B>(P, in, st);
    case StepOp::AttnSplit: return attn_split<T>(P, in, smem, stage_now(staged, stage));
    case StepOp::AttnCombine: return attn_combine(P, in, smem);
    case StepOp::OProj: return o_proj<B>(P, in, st);
    case StepOp::FfnNormRouter: return norm_router<B>(P, in, st);
    case StepOp::Route: return route_tokens(P, in, smem);
    case StepOp::ExpertGateUp: return expert_gate_up<B>(P, in, stage, bar, parity);
    case StepOp::SharedGateUp: return shared_gate_up<B>(P, in, st);
    case StepOp::ExpertDown: return expert_down(P, in, smem, stage, bar, parity);
    case StepOp::MlpGateUp: return mlp_gate_up<B>(P, in, st);
    case StepOp::MlpDown: return mlp_down<B>(P, in, st);
    case StepOp::HeadNormLogits: return head_logits<B>(P, in);
    default: return;  // MLA's ops: refused when the plan is uploaded
  }
}

// By thread 0: instruction i's times (PProgram::trace).
__device__ __forceinline__ void write_trace(const PProgram& P, int32_t i, long long t0, long long t1) {
  long long* t = P.trace + kTraceSlots * size_t(i);
  t[0] = t0;
  t[1] = t1 - t0;
  t[2] = clock64() - t1;
  for (int m = 0; m < kTraceMarks; ++m) t[3 + m] = trace_marks[m] ? trace_marks[m] - t1 : 0;
}

// One block per SM runs its queue. B: the batch rounded up to 1, 2, 4 or 8 (the products' token
// count); T: the KV cache's values.
template <int B, class T>
__global__ void __launch_bounds__(kPersistentThreads, 1) persistent_step_kernel(const PProgram prog) {
  // The program in shared memory, where every op reads it by reference: a kernel parameter whose
  // address the ops take is copied to the thread's stack, and each field read from there is a
  // local-memory load that the weights streaming through the small L1 have evicted, an L2 round
  // trip (docs/PERF.md v35).
  __shared__ __align__(16) unsigned char s_prog[sizeof(PProgram)];
  if (threadIdx.x == 0) *reinterpret_cast<PProgram*>(s_prog) = prog;
  const PProgram& P = *reinterpret_cast<const PProgram*>(s_prog);
  float* const smem = persistent_smem;  // the ops' scratch first (op_rows.cuh)
  uint8_t* const stage = reinterpret_cast<uint8_t*>(smem) + prog.stage_offset;
  __shared__ uint32_t round;
  __shared__ int failed, staged_now;
  __shared__ int32_t next_tail;
  __shared__ uint64_t stage_bar;
  uint32_t parity = 0;  // of stage_bar's phase the next staged instruction completes
  if (threadIdx.x == 0) {
    round = *P.epoch + 1;
    failed = 0;
    xn_point = kNoNormPoint;
    s_layer_at = -1;
    mbar_init(&stage_bar);
  }
  __syncthreads();
  const int begin = P.queue_begin[blockIdx.x], end = P.queue_begin[blockIdx.x + 1];
  if (threadIdx.x == 0)
    for (int k = begin; k < end && k < begin + kPrefetchAhead; ++k) prefetch_instr(P, P.queue[k]);
  for (int k = begin; k < end; ++k) {
    const int32_t i = P.queue[k];
    const PInstr in = P.instrs[i];
    long long t0 = 0, t1 = 0;
    if (P.trace && threadIdx.x == 0) t0 = clock64();
    // The next split's cached rows (they wait on nothing) into the L2 by warp 0, during this one.
    if ((in.waits & kSplitNext) && threadIdx.x < 32) attn_split_prefetch<T>(P, P.instrs[P.queue[k + 1]], threadIdx.x);
    if (threadIdx.x < 32) {  // the weights first: they wait on nothing
      const bool st = StepOp(in.op) == StepOp::AttnSplit ? stage_split<T>(P, in, stage, &stage_bar, threadIdx.x)
                                                         : stage_instr(P, i, stage, &stage_bar, threadIdx.x);
      if (threadIdx.x == 0) staged_now = st;
    } else if (threadIdx.x < 64 && in.layer >= 0) {  // the layer's descriptors, then its vectors
      load_layer(P, in.layer, threadIdx.x - 32);
      if (threadIdx.x == 32) prefetch_vectors(P, in);
    }
    if (threadIdx.x == 0) {
      if (k + kPrefetchAhead < end) prefetch_instr(P, P.queue[k + kPrefetchAhead]);
      for (int w = 0; w < (in.waits & kWaitCount); ++w)
        if (!wait_counter(P.counters + in.wait[w], round * uint32_t(P.producers[in.wait[w]]), P.timeout_ns)) {
          atomicCAS(P.error, 0, i + 1);
          failed = 1;
          break;
        }
    }
    // Thread 0's acquire, then the barrier: what the producers wrote is visible to every thread
    // of the block (the pattern of CUTLASS's semaphore, without a fence of its own).
    __syncthreads();
    if (staged_now) {  // also before giving up: the copies land in this block's shared memory
      mbar_wait(&stage_bar, parity);
      parity ^= 1u;
    }
    if (failed) return;
    if (P.trace && threadIdx.x == 0) {
      for (int m = 0; m < kTraceMarks; ++m) trace_marks[m] = 0;
      t1 = clock64();
    }
    run_instr<B, T>(P, in, smem, staged_now ? stage : nullptr, stage, &stage_bar, parity);
    trace_mark(P, kTraceMarks - 1);
    __syncthreads();  // every thread's writes, then thread 0's release makes them visible with its count
    if (!(in.waits & kTailSignal)) {  // most tiles: the count, no tail, no barrier
      if (threadIdx.x == 0) {
        add_release(P.counters + in.signal, 1u);
        if (P.trace) write_trace(P, i, t0, t1);
      }
      continue;
    }
    // The count, then the tail of each counter this block completes (plan/step_plan.h).
    int32_t done = i, signal = in.signal;
    while (true) {
      if (threadIdx.x == 0) {
        const int32_t tail = P.tail_of[signal];
        if (tail < 0) {
          add_release(P.counters + signal, 1u);
          next_tail = -1;
        } else {
          const bool last = add_acq_rel(P.counters + signal, 1u) + 1u == round * uint32_t(P.producers[signal]);
          next_tail = last ? tail : -1;
        }
        if (P.trace) write_trace(P, done, t0, t1);
      }
      __syncthreads();  // next_tail, and thread 0's acquire before the tail reads
      const int32_t tail = next_tail;
      if (tail < 0) break;
      if (P.trace && threadIdx.x == 0) {
        for (int m = 0; m < kTraceMarks; ++m) trace_marks[m] = 0;
        t0 = t1 = clock64();
      }
      const PInstr tin = P.instrs[tail];
      run_instr<B, T>(P, tin, smem, nullptr, stage, &stage_bar, parity);
      trace_mark(P, kTraceMarks - 1);
      __syncthreads();
      done = tail;
      signal = tin.signal;
    }
  }
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(P.blocks_done, 1u) == gridDim.x - 1) {
      *P.blocks_done = 0;
      __threadfence();
      *P.epoch = round;
    }
  }
}

}  // namespace

struct PersistentStep::Device {
  PProgram program;
  std::vector<void*> owned;
  size_t smem = 0;
  int blocks = 0, counters = 0;
  void (*kernel)(PProgram) = nullptr;
  ~Device() {
    for (void* p : owned) cudaFree(p);
  }
};

PersistentStep::PersistentStep(const DeviceModel& model, Decoder& kv, StepPlan plan)
    : plan_(std::move(plan)), d_(std::make_unique<Device>()) {
  const ModelConfig& c = model.config();
  const StepPlan& p = plan_;
  const int B = p.options.batch;
  if (p.layers != c.num_layers || p.hidden != c.hidden_size || p.vocab != c.vocab_size)
    fail("persistent step: the plan is for another model (", p.architecture, ")");
  if (B < 1 || B > 8) fail("persistent step: 1 to 8 sequences, not ", B);
  if (p.mla) fail("persistent step: the CUDA interpreter has no MLA ops yet (", p.architecture, ")");
  if (B > kv.max_batch()) fail("persistent step: a plan of ", B, " sequences over a decoder of ", kv.max_batch());
  if (int(p.queues.size()) > sm_count())
    fail("persistent step: the plan has ", p.queues.size(), " queues; this GPU has ", sm_count(), " SMs");
  if (p.hidden % 4 != 0 || p.hidden > kRowNormMax) fail("persistent step: hidden size ", p.hidden, " (a multiple of 4 up to ", kRowNormMax, ")");
  if (p.head_dim > kMaxHeadDim || p.head_dim % 2)
    fail("persistent step: heads of ", p.head_dim, " dimensions (an even number up to ", kMaxHeadDim, ")");
  if (c.experts_per_token > 32) fail("persistent step: at most 32 experts per token, not ", c.experts_per_token);
  std::vector<void*>& owned = d_->owned;
  PProgram& P = d_->program;

  // Instructions and queues.
  const std::vector<int32_t> tail_of = p.tail_of_counters();
  std::vector<PInstr> instrs;
  instrs.reserve(p.instrs.size());
  for (int32_t i = 0; i < int32_t(p.instrs.size()); ++i) {
    const StepInstr& in = p.instrs[size_t(i)];
    if (in.waits.size() > size_t(kMaxWaits))
      fail("persistent step: ", describe_instr(p, i), " waits on ", in.waits.size(), " counters (at most ", kMaxWaits, ")");
    PInstr o{};
    o.op = uint8_t(in.op);
    o.waits = uint8_t(in.waits.size());
    if (!in.tail) {  // a tail's flags would not be read: it never comes from a queue
      const std::vector<int32_t>& q = p.queues[size_t(in.sm)];
      if (tail_of[size_t(in.signal)] >= 0) o.waits |= kTailSignal;
      if (size_t(in.slot) + 1 < q.size() && p.instrs[size_t(q[size_t(in.slot) + 1])].op == StepOp::AttnSplit) o.waits |= kSplitNext;
    }
    o.layer = int16_t(in.layer);
    o.a = int32_t(in.a), o.b = int32_t(in.b), o.c = int32_t(in.c);
    for (size_t w = 0; w < in.waits.size(); ++w) o.wait[w] = in.waits[w];
    o.signal = in.signal;
    instrs.push_back(o);
  }
  std::vector<int32_t> queue, begin{0};
  for (const auto& q : p.queues) {
    queue.insert(queue.end(), q.begin(), q.end());
    begin.push_back(int32_t(queue.size()));
  }
  std::vector<int32_t> producers;
  for (const StepCounter& k : p.counters) producers.push_back(k.producers);
  // The ops' scratch in shared memory: the largest of their needs; the weight stage after it.
  const size_t H = size_t(p.hidden), G = size_t(p.heads / p.kv_heads), hd = size_t(p.head_dim);
  const int chunk_max = (kv.max_context() + int(p.splits) - 1) / int(p.splits);
  const size_t scratch =
      (4 * std::max({split_scratch_floats(int(G), int(hd), chunk_max),
                     size_t(8) * size_t(std::max<int64_t>(c.num_experts, 1) + 64), G * size_t(p.splits),
                     size_t(kDownRows) * size_t(c.experts_per_token + 1), size_t(kMmaRedFloats)}) + 127) & ~size_t(127);
  constexpr size_t kSmemMax = 227 << 10;
  const int Bt = B == 1 ? 1 : B == 2 ? 2 : B <= 4 ? 4 : 8;  // the products' rows of x
  const size_t xn_bytes = size_t(Bt) * H * 4;
  size_t used = scratch;
  if (xn_bytes <= (48u << 10)) {
    P.xn_offset = uint32_t(used);
    used += (xn_bytes + 127) & ~size_t(127);
  }
  P.frag_offset = uint32_t(used);
  used += kFragBytes;
  if (used + (16 << 10) > kSmemMax)
    fail("persistent step: ", used, " bytes of shared memory before the weight stage (the attention's ", scratch,
         " at context ", kv.max_context(), " over ", p.splits, " splits)");
  const uint32_t stage_bytes = uint32_t(std::min<size_t>(kStageBytes, kSmemMax - used - 4096));  // 4 KB: the kernel's static shared memory
  d_->smem = used + stage_bytes;
  P.stage_offset = uint32_t(used);
  P.stage_bytes = stage_bytes;

  // Each instruction's fixed weight rows (the experts' are known only once the route ran):
  // staged when they fit the stage, else prefetched into the L2.
  std::vector<PRange> ranges;
  std::vector<int32_t> range_begin{0};
  int64_t staged_instrs = 0, mma_tiles = 0;
  {
    constexpr uint64_t kMaxPrefetch = 128 << 10;  // L2 bytes per range (the LM head's tiles are larger)
    const std::vector<DLayer>& L = model.layers();
    bool stage = false;  // this instruction's op reads the stage
    uint32_t at = 0;     // its stage's bytes so far
    auto rows = [&](const DLinear& W, int64_t r0, int64_t r1) {
      if (!W.data || r1 <= r0) return;
      const uint64_t rb = row_bytes(W), n = uint64_t(r1 - r0);
      const StagedRows st = stage_rows(W, int(r0), int(r1), &at, Bt);
      if (st.codes_stride) {  // padded rows (tensor cores): a run per row
        ranges.push_back({W.data + uint64_t(r0) * rb, uint32_t(rb), st.codes, uint32_t(n), st.codes_stride});
        ranges.push_back({W.scales + uint64_t(r0) * uint64_t(W.in / 16), uint32_t(W.in / 16), st.scales, uint32_t(n),
                          st.scales_stride});
        return;
      }
      ranges.push_back({W.data + uint64_t(r0) * rb, uint32_t(std::min<uint64_t>(n * rb, UINT32_MAX)), st.codes, 1, 0});
      if (W.format == DFormat::NVFP4)
        ranges.push_back({W.scales + uint64_t(r0) * uint64_t(W.in / 16), uint32_t(n * uint64_t(W.in / 16)), st.scales, 1, 0});
    };
    const int64_t qr = p.heads * p.head_dim, kr = p.kv_heads * p.head_dim;
    for (const StepInstr& in : p.instrs) {
      const DLayer* l = in.layer >= 0 ? &L[size_t(in.layer)] : nullptr;
      const size_t first = ranges.size();
      at = 0;
      stage = in.op == StepOp::AttnNormQkv || in.op == StepOp::OProj || in.op == StepOp::FfnNormRouter ||
              in.op == StepOp::SharedGateUp || in.op == StepOp::MlpGateUp || in.op == StepOp::MlpDown;
      switch (in.op) {
        case StepOp::AttnNormQkv:
          if (in.a < qr) rows(l->q, in.a, in.b);
          else if (in.a < qr + kr) rows(l->k, in.a - qr, in.b - qr);
          else rows(l->v, in.a - qr - kr, in.b - qr - kr);
          break;
        case StepOp::OProj: rows(l->o, in.a, in.b); break;
        case StepOp::FfnNormRouter: rows(l->moe.router.w, in.a, in.b); break;
        case StepOp::SharedGateUp:
          rows(l->moe.shared_gate, in.a, in.b);
          rows(l->moe.shared_up, in.a, in.b);
          break;
        case StepOp::ExpertDown:
          if (l->moe.has_shared) rows(l->moe.shared_down, in.a, in.b);
          break;
        case StepOp::MlpGateUp:
          rows(l->gate, in.a, in.b);
          rows(l->up, in.a, in.b);
          break;
        case StepOp::MlpDown: rows(l->down, in.a, in.b); break;
        case StepOp::HeadNormLogits: rows(model.lm_head(), in.a, in.b); break;
        default: break;
      }
      // Staged: every run 16-byte aligned in whole units, all of them within the stage.
      for (size_t r = first; r < ranges.size(); ++r) {
        const PRange& g = ranges[r];
        const uint64_t last = g.rows ? uint64_t(g.rows - 1) * g.stride : 0;
        stage = stage && reinterpret_cast<uintptr_t>(g.p) % 16 == 0 && g.bytes % 16 == 0 &&
                uint64_t(g.stage) + last + g.bytes <= stage_bytes;
      }
      stage = stage && ranges.size() > first;
      staged_instrs += stage;
      if (stage) mma_tiles += ranges[first].rows > 1 || ranges[first].stride > 0;
      if (in.op == StepOp::ExpertGateUp) {  // as expert_gate_up decides on the device (up: gate's shape and format)
        const DLinear& G = l->moe.expert_gate;
        uint32_t need = 0;
        stage_rows_packed(G, int(in.a), int(in.b), &need);
        stage_rows_packed(G, int(in.a), int(in.b), &need);
        mma_tiles += mma_tile_fits(G, Bt) && need <= stage_bytes;
      }
      for (size_t r = first; r < ranges.size(); ++r)
        if (!stage) {  // one run for the L2 instead
          PRange& g = ranges[r];
          g.bytes = uint32_t(std::min<uint64_t>(uint64_t(g.bytes) * g.rows, kMaxPrefetch));
          g.stage = kNotStaged, g.rows = 1, g.stride = 0;
        }
      range_begin.push_back(int32_t(ranges.size()));
    }
  }
  staged_instrs_ = staged_instrs;
  mma_tiles_ = mma_tiles;
  P.instrs = device_copy(instrs, owned);
  P.queue = device_copy(queue, owned);
  P.queue_begin = device_copy(begin, owned);
  P.producers = device_copy(producers, owned);
  P.tail_of = device_copy(tail_of, owned);
  P.ranges = device_copy(ranges, owned);
  P.range_begin = device_copy(range_begin, owned);
  P.counters = device_zeros<uint32_t>(producers.size(), owned);
  P.epoch = device_zeros<uint32_t>(1, owned);
  P.blocks_done = device_zeros<uint32_t>(1, owned);
  P.error = device_zeros<int32_t>(1, owned);
  d_->blocks = int(p.queues.size());
  d_->counters = int(producers.size());

  // The model and the cache.
  P.layers = device_copy(model.layers(), owned);
  std::vector<KvLayer> layers_kv;
  for (int l = 0; l < int(c.num_layers); ++l) layers_kv.push_back(kv.kv(l));
  P.kv = device_copy(layers_kv, owned);
  P.kv_bf16 = kv.kv_type() == KvType::BF16;
  P.embed = model.embed();
  P.lm_head = model.lm_head();
  P.final_norm = model.final_norm();
  P.rope.inv_freq = model.rope_inv_freq();
  P.rope.scaling = c.rope.attention_scaling();
  P.rope.rotary_dim = int(c.rope.rotary_dim);
  P.rope.interleaved = c.rope.interleaved;
  P.eps = c.rms_norm_eps;
  P.scale = 1.0f / std::sqrt(float(c.head_dim));
  P.batch = B;
  P.hidden = int(p.hidden);
  P.heads = int(p.heads);
  P.kv_heads = int(p.kv_heads);
  P.head_dim = int(p.head_dim);
  P.qkv_rows = int(p.qkv_rows);
  P.splits = int(p.splits);
  P.chunk_max = chunk_max;
  P.positions = int(p.expert_positions);
  P.expert_rows = int(p.expert_rows);
  P.shared_rows = int(p.shared_rows);
  P.mlp_rows = int(p.mlp_rows);
  P.vocab = int(p.vocab);
  P.experts = int(c.num_experts);
  P.top_k = int(c.experts_per_token);

  // Buffers: inputs of products hold 8 rows (the products read the B rows of their template).
  P.tokens = kv.tokens();
  P.pos = kv.positions();
  P.x = device_zeros<float>(8 * H, owned);
  P.qkv = device_zeros<float>(8 * size_t(p.qkv_rows), owned);
  P.part = device_zeros<float>(8 * size_t(p.kv_heads) * size_t(p.splits) * G * (hd + 2), owned);
  P.att = device_zeros<float>(8 * size_t(p.heads) * hd, owned);
  P.router = device_zeros<float>(8 * size_t(std::max<int64_t>(c.num_experts, 1)), owned);
  P.route_e = device_zeros<int32_t>(8 * size_t(std::max<int64_t>(c.experts_per_token, 1)), owned);
  P.route_w = device_zeros<float>(8 * size_t(std::max<int64_t>(c.experts_per_token, 1)), owned);
  P.position_expert = device_zeros<int32_t>(size_t(std::max<int64_t>(p.expert_positions, 1)), owned);
  P.expert_position = device_zeros<int32_t>(size_t(std::max<int64_t>(c.num_experts, 1)), owned);
  P.expert_mid = device_zeros<float>(8 * size_t(p.expert_positions) * size_t(p.expert_rows), owned);
  P.shared_mid = device_zeros<float>(8 * size_t(p.shared_rows), owned);
  P.mid = device_zeros<float>(8 * size_t(p.mlp_rows), owned);
  P.logits = device_zeros<float>(size_t(B) * size_t(p.vocab), owned);
  P.xn = device_zeros<float>(size_t(d_->blocks) * 8 * H, owned);
  logits_ = P.logits;

  auto pick = [&](auto bt) {
    constexpr int R = decltype(bt)::value;
    d_->kernel = P.kv_bf16 ? persistent_step_kernel<R, __nv_bfloat16> : persistent_step_kernel<R, float>;
  };
  if (Bt == 1) pick(std::integral_constant<int, 1>{});
  else if (Bt == 2) pick(std::integral_constant<int, 2>{});
  else if (Bt == 4) pick(std::integral_constant<int, 4>{});
  else pick(std::integral_constant<int, 8>{});
  KESTREL_CUDA_CHECK(cudaFuncSetAttribute(d_->kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(d_->smem)));
  int per_sm = 0;
  KESTREL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, d_->kernel, kPersistentThreads, d_->smem));
  if (per_sm < 1) fail("persistent step: a block of ", kPersistentThreads, " threads and ", d_->smem, " bytes does not fit an SM");
}

PersistentStep::~PersistentStep() = default;

void PersistentStep::run(cudaStream_t s) {
  launch_cooperative(d_->kernel, d_->blocks, kPersistentThreads, d_->smem, s, d_->program);
}

std::vector<PersistentStep::OpTime> PersistentStep::trace(cudaStream_t s) {
  const size_t n = plan_.instrs.size();
  long long* buf = nullptr;
  KESTREL_CUDA_CHECK(cudaMalloc(&buf, n * kTraceSlots * sizeof(long long)));
  KESTREL_CUDA_CHECK(cudaMemsetAsync(buf, 0, n * kTraceSlots * sizeof(long long), s));
  d_->program.trace = buf;
  run(s);
  d_->program.trace = nullptr;
  std::vector<long long> t(n * kTraceSlots);
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(t.data(), buf, t.size() * sizeof(long long), cudaMemcpyDeviceToHost, s));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
  KESTREL_CUDA_CHECK(cudaFree(buf));
  check();
  std::vector<OpTime> out(kStepOpCount);
  for (int op = 0; op < kStepOpCount; ++op) out[size_t(op)].op = StepOp(op);
  for (size_t i = 0; i < n; ++i) {
    OpTime& o = out[size_t(plan_.instrs[i].op)];
    ++o.tiles;
    const long long* ti = t.data() + kTraceSlots * i;
    o.wait_cycles += double(ti[1]);
    o.run_cycles += double(ti[2]);
    for (int m = 0; m < kTraceMarks; ++m)
      if (ti[3 + m] > 0) o.mark_cycles[size_t(m)] += double(ti[3 + m]), ++o.marked[size_t(m)];
  }
  std::erase_if(out, [](const OpTime& o) { return o.tiles == 0; });
  return out;
}

void PersistentStep::check() const {
  int32_t error = 0;
  KESTREL_CUDA_CHECK(cudaMemcpy(&error, d_->program.error, sizeof error, cudaMemcpyDeviceToHost));
  if (error > 0)
    fail("persistent step: ", describe_instr(plan_, error - 1), " waited past ",
         double(d_->program.timeout_ns) / 1e9, " s for a counter (a wrong plan, or a block not resident)");
}

void PersistentStep::reset() {
  const PProgram& P = d_->program;
  KESTREL_CUDA_CHECK(cudaMemset(P.counters, 0, size_t(d_->counters) * 4));
  KESTREL_CUDA_CHECK(cudaMemset(P.epoch, 0, 4));
  KESTREL_CUDA_CHECK(cudaMemset(P.blocks_done, 0, 4));
  KESTREL_CUDA_CHECK(cudaMemset(P.error, 0, 4));
}

}  // namespace kestrel::cuda
