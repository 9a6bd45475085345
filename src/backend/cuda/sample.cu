#include <climits>
#include <cmath>
#include <cstdint>

#include "backend/cuda/check.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/philox.h"
#include "backend/cuda/sample.h"

namespace kestrel::cuda {
namespace {

constexpr int kThreads = 1024, kWarps = kThreads / 32, kBins = 256, kUnroll = 4;  // kUnroll float4 loads
constexpr unsigned kFull = 0xffffffffu;

// The block's scratch. A field written by one thread for all is written only after a barrier
// that every thread passes after its last read of the previous value.
struct Shared {
  uint64_t hist[kBins];   // count or mass per radix digit
  uint64_t above[kBins];  // the sum over higher digits
  uint64_t warp[kWarps];  // per-warp partials of block scans and reductions
  uint64_t total, base;
  int index, owner;
};

// Unsigned keys in the order of the floats (-0 sorts with +0, since the host compares with ==).
__device__ __forceinline__ uint32_t order_key(float v) {
  const uint32_t u = __float_as_uint(v == 0.0f ? 0.0f : v);
  return u & 0x80000000u ? ~u : u | 0x80000000u;
}
__device__ __forceinline__ float key_value(uint32_t k) {
  return __uint_as_float(k & 0x80000000u ? k & 0x7fffffffu : ~k);
}

// exp((x - max) / T), and the same as fixed point of `unit` per 1.0: `unit` is 2^(62 - ceil(log2
// vocab)), so a row sums to at most 2^62; a nonzero probability is at least 1, so the support is
// every token whose float probability is nonzero, as on the host.
struct Weights {
  float max, inv_t, unit;
  __device__ __forceinline__ float e(float x) const { return x == max ? 1.0f : expf((x - max) * inv_t); }
  __device__ __forceinline__ uint64_t fixed(float e) const {
    if (!(e > 0.0f)) return 0;
    const uint64_t q = __float2ull_rn(e * unit);
    return q > 0 ? q : 1;
  }
  __device__ __forceinline__ uint64_t mass(float x) const { return fixed(e(x)); }
};

// A cut-off in the host's order (logit descending, then id ascending): keeps keys above `key`
// and, of the tokens at `key`, those with ids up to `last`. The default keeps everything.
struct Cut {
  uint32_t key = 0;
  int last = INT_MAX;
  __device__ __forceinline__ bool keeps(uint32_t k, int i) const { return k > key || (k == key && i <= last); }
};

// f(i, x[i], in_range) over the row, every thread making the same number of calls (so warp
// collectives inside f are safe): the ids before the first 16-byte boundary, then float4 loads
// strided by the block (coalesced, kUnroll of them in flight per thread), then the last few.
template <typename F>
__device__ __forceinline__ void for_each(const float* __restrict__ x, int n, F&& f) {
  const int t = int(threadIdx.x);
  const int head = min(n, int((16u - (unsigned(reinterpret_cast<uintptr_t>(x)) & 15u)) & 15u) / 4);
  f(t, t < head ? x[t] : 0.0f, t < head);
  const float4* x4 = reinterpret_cast<const float4*>(x + head);
  const int n4 = (n - head) / 4;
  for (int base = 0; base < n4; base += kThreads * kUnroll) {
    float4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = base + u * kThreads + t;
      v[u] = j < n4 ? x4[j] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = base + u * kThreads + t, i = head + 4 * j;
      const bool ok = j < n4;
      f(i, v[u].x, ok);
      f(i + 1, v[u].y, ok);
      f(i + 2, v[u].z, ok);
      f(i + 3, v[u].w, ok);
    }
  }
  const int i = head + 4 * n4 + t;
  f(i, i < n ? x[i] : 0.0f, i < n);
}

// hist[bin] += v for the lanes that `take`. Lanes of a warp with the same bin are summed first
// (logits crowd into a few digits, and 32 lanes adding to one shared word would serialize):
// counts by popc, masses (< 2^63) by three hardware 32-bit reductions of 21-bit limbs (a limb's
// sum over 32 lanes stays below 2^26). All lanes of the warp call it.
__device__ __forceinline__ void hist_add(uint64_t* hist, uint32_t bin, uint64_t v, bool take, bool counts) {
  if (!__any_sync(kFull, take)) return;
  const unsigned peers = __match_any_sync(kFull, take ? bin : 0xffffffffu);
  uint64_t sum;
  if (counts) {
    sum = uint64_t(__popc(int(peers)));
  } else {
    constexpr uint64_t limb = (1ull << 21) - 1;
    const uint64_t lo = __reduce_add_sync(peers, unsigned(v & limb));
    const uint64_t mid = __reduce_add_sync(peers, unsigned(v >> 21 & limb));
    const uint64_t hi = __reduce_add_sync(peers, unsigned(v >> 42));
    sum = lo + (mid << 21) + (hi << 42);
  }
  if (take && int(threadIdx.x & 31) == __ffs(int(peers)) - 1)
    atomicAdd(reinterpret_cast<unsigned long long*>(hist + bin), static_cast<unsigned long long>(sum));
}

// Largest v over the block.
__device__ uint64_t block_max(uint64_t v, Shared& sh) {
  for (int o = 16; o > 0; o >>= 1) {
    const uint64_t y = __shfl_xor_sync(kFull, v, o);
    v = y > v ? y : v;
  }
  if ((threadIdx.x & 31) == 0) sh.warp[threadIdx.x >> 5] = v;
  __syncthreads();
  for (int w = 0; w < kWarps; ++w) v = sh.warp[w] > v ? sh.warp[w] : v;
  __syncthreads();
  return v;
}

// After a histogram pass: sh.above[b] = the sum of the digits above b; returns the total.
__device__ uint64_t scan_bins(Shared& sh) {
  __syncthreads();
  const int t = int(threadIdx.x), lane = t & 31, warp = t >> 5;
  uint64_t incl = 0;
  if (t < kBins) {  // thread t holds digit kBins - 1 - t: the scan runs from the top digit down
    incl = sh.hist[kBins - 1 - t];
    for (int o = 1; o < 32; o <<= 1) {
      const uint64_t y = __shfl_up_sync(kFull, incl, unsigned(o));
      if (lane >= o) incl += y;
    }
    if (lane == 31) sh.warp[warp] = incl;
  }
  __syncthreads();
  if (t < kBins) {
    uint64_t before = 0;
    for (int w = 0; w < warp; ++w) before += sh.warp[w];
    sh.above[kBins - 1 - t] = before + incl - sh.hist[kBins - 1 - t];
    if (t == kBins - 1) sh.total = before + incl;
  }
  __syncthreads();
  return sh.total;
}

// Where a radix selection ended: the key, the weight of the keys above it and of the key itself.
struct Selected {
  bool found = false;
  uint32_t key = 0;
  uint64_t above = 0, at = 0;
};

// Radix selection from the top: the key at which the weight of the tokens `in(key, id)` (their
// count, or with !counts their mass), summed from the largest key down, reaches the target,
// which target_of gives from the total weight (0: no selection). 8 bits of the key per pass.
template <typename In, typename Target>
__device__ Selected radix_select(const float* __restrict__ x, int n, bool counts, const Weights& w, In in,
                                 Target target_of, Shared& sh) {
  Selected s;
  uint32_t prefix = 0, mask = 0;
  uint64_t target = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = int(threadIdx.x); b < kBins; b += kThreads) sh.hist[b] = 0;
    __syncthreads();
    for_each(x, n, [&](int i, float v, bool ok) {
      const uint32_t k = order_key(v);
      const bool take = ok && (k & mask) == prefix && in(k, i);
      hist_add(sh.hist, (k >> shift) & 0xffu, take && !counts ? w.mass(v) : 1, take, counts);
    });
    const uint64_t total = scan_bins(sh);
    if (shift == 24) {
      target = target_of(total);
      if (target == 0) return s;  // the same for every thread
    }
    // Exactly one digit b has above[b] < t <= above[b] + hist[b] (0 < t <= total).
    const uint64_t t = target - s.above;
    if (threadIdx.x < kBins && sh.above[threadIdx.x] < t && t <= sh.above[threadIdx.x] + sh.hist[threadIdx.x])
      sh.index = int(threadIdx.x);
    __syncthreads();
    const int b = sh.index;
    s.above += sh.above[b];
    s.at = sh.hist[b];
    prefix |= uint32_t(b) << shift;
    mask |= 0xffu << shift;
    __syncthreads();
  }
  s.found = true;
  s.key = prefix;
  return s;
}

// The first id, in vocabulary order, at which the running sum of weight(id, x[id]) exceeds
// target_of(total) (which must be less than the total). Each thread sums a contiguous range of
// ids; a block scan of those sums finds the range holding the crossing, which warp 0 then
// searches 32 ids at a time. `total` receives the row's total weight.
template <typename Weight, typename Target>
__device__ int find_running(const float* __restrict__ x, int n, Weight weight, Target target_of, Shared& sh,
                            uint64_t& total) {
  const int t = int(threadIdx.x), lane = t & 31, warp = t >> 5;
  const int per = (n + kThreads - 1) / kThreads;
  const int begin = min(n, t * per), end = min(n, begin + per);
  uint64_t s = 0;
#pragma unroll 4
  for (int i = begin; i < end; ++i) s += weight(i, x[i]);
  uint64_t incl = s;
  for (int o = 1; o < 32; o <<= 1) {
    const uint64_t y = __shfl_up_sync(kFull, incl, unsigned(o));
    if (lane >= o) incl += y;
  }
  if (lane == 31) sh.warp[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const uint64_t own = sh.warp[lane];
    uint64_t wi = own;
    for (int o = 1; o < 32; o <<= 1) {
      const uint64_t y = __shfl_up_sync(kFull, wi, unsigned(o));
      if (lane >= o) wi += y;
    }
    sh.warp[lane] = wi - own;
    if (lane == 31) sh.total = wi;
  }
  __syncthreads();
  total = sh.total;
  const uint64_t before = sh.warp[warp] + incl - s, target = target_of(total);
  if (before <= target && target < before + s) sh.owner = t, sh.base = before;
  __syncthreads();
  if (warp == 0) {
    const int b0 = min(n, sh.owner * per), e0 = min(n, b0 + per);
    uint64_t run = sh.base;
    for (int i0 = b0; i0 < e0; i0 += 32) {
      const int i = i0 + lane;
      uint64_t inc = i < e0 ? weight(i, x[i]) : 0;
      for (int o = 1; o < 32; o <<= 1) {
        const uint64_t y = __shfl_up_sync(kFull, inc, unsigned(o));
        if (lane >= o) inc += y;
      }
      const unsigned hit = __ballot_sync(kFull, run + inc > target);
      if (hit) {
        if (lane == __ffs(int(hit)) - 1) sh.index = i;
        break;
      }
      run += __shfl_sync(kFull, inc, 31);
    }
  }
  __syncthreads();
  const int found = sh.index;
  __syncthreads();
  return found;
}

// One block per row (sample.h).
__global__ void __launch_bounds__(kThreads) sample_kernel(const float* __restrict__ logits, int n,
                                                          const SampleParams* __restrict__ params,
                                                          int32_t* __restrict__ tokens, float* __restrict__ dist) {
  __shared__ Shared sh;
  pdl_enter();
  const int row = int(blockIdx.x);
  const float* x = logits + size_t(row) * size_t(n);
  float* d = dist ? dist + size_t(row) * size_t(n) : nullptr;
  const SampleParams p = params[row];

  // The argmax: the largest key, then the lowest id (complemented, so that the max takes it).
  uint64_t best = 0;
  for_each(x, n, [&](int i, float v, bool ok) {
    const uint64_t c = uint64_t(order_key(v)) << 32 | uint32_t(~i);
    if (ok && c > best) best = c;
  });
  best = block_max(best, sh);
  const int argmax = int(~uint32_t(best));
  if (!(p.temperature > 0.0f)) {
    if (threadIdx.x == 0) tokens[row] = argmax;
    if (d)
      for (int i = int(threadIdx.x); i < n; i += kThreads) d[i] = i == argmax ? 1.0f : 0.0f;
    return;
  }
  const int log2n = n > 1 ? 32 - __clz(n - 1) : 0;
  const Weights w{key_value(uint32_t(best >> 32)), 1.0f / p.temperature,
                  __uint_as_float(uint32_t(127 + 62 - log2n) << 23)};
  uint64_t total = 0;

  // Top-k: the k-th largest key; of the tokens at it, the first k - (count above) by id.
  Cut topk;
  if (p.top_k > 0 && p.top_k < n) {
    const uint64_t k = uint64_t(p.top_k);
    const Selected s = radix_select(
        x, n, true, w, [](uint32_t, int) { return true; }, [&](uint64_t) { return k; }, sh);
    topk.key = s.key;
    const uint64_t ties = k - s.above;  // kept of the s.at tokens at the key
    if (ties < s.at)
      topk.last = find_running(
          x, n, [&](int, float v) -> uint64_t { return order_key(v) == s.key; }, [&](uint64_t) { return ties - 1; },
          sh, total);
  }

  // Top-p over what top-k kept: a token stays while the mass before it (in the host's order) is
  // below top_p of the total, i.e. below cut = ceil(top_p * total) in fixed point. The token
  // where the running mass reaches cut is the last kept; of the tokens tied with it, those whose
  // mass before stays below cut.
  Cut topp;
  if (p.top_p < 1.0f) {
    uint64_t cut = 0;
    const Selected s = radix_select(
        x, n, false, w, [&](uint32_t k, int i) { return topk.keeps(k, i); },
        [&](uint64_t mass) -> uint64_t {
          const double c = ceil(double(p.top_p) * double(mass));
          cut = c < double(mass) ? uint64_t(c) : 0;  // 0: the whole mass stays
          return cut;
        },
        sh);
    if (s.found) {
      topp.key = s.key;
      const uint64_t m = w.mass(key_value(s.key));  // of each token at the key (s.at > 0, so m > 0)
      const uint64_t ties = (cut - s.above + m - 1) / m;
      if (ties < s.at / m)
        topp.last = find_running(
            x, n,
            [&](int i, float v) -> uint64_t {
              const uint32_t k = order_key(v);
              return k == s.key && topk.keeps(k, i);
            },
            [&](uint64_t) { return ties - 1; }, sh, total);
    }
  }

  // Min-p (p >= min_p * p_max, where p_max's weight is exp(0) = 1) and the draw.
  const float min_p = p.min_p;
  auto kept = [&](int i, float v) -> uint64_t {
    const uint32_t k = order_key(v);
    if (!topk.keeps(k, i) || !topp.keeps(k, i)) return 0;
    const float e = w.e(v);
    return min_p > 0.0f && !(e >= min_p) ? 0 : w.fixed(e);
  };
  const uint64_t bits = sample_bits(p.seed, p.counter);
  const int token = find_running(x, n, kept, [&](uint64_t mass) { return scale_bits(bits, mass); }, sh, total);
  if (threadIdx.x == 0) tokens[row] = token;
  if (d)
    for (int i = int(threadIdx.x); i < n; i += kThreads) d[i] = float(double(kept(i, x[i])) / double(total));
}

}  // namespace

SampleParams sample_params(const SamplerOptions& o, uint64_t draw) {
  SampleParams p;
  p.temperature = o.temperature;
  p.top_k = o.top_k;
  p.top_p = o.top_p;
  p.min_p = o.min_p;
  p.seed = o.seed;
  p.counter = draw;
  return p;
}

void launch_sample(const float* logits, int batch, int vocab, const SampleParams* params, int32_t* tokens,
                   cudaStream_t s, float* dist) {
  if (batch < 0 || vocab < 1) fail("launch_sample: batch ", batch, " must be >= 0 and vocab ", vocab, " >= 1");
  if (batch == 0) return;
  launch(sample_kernel, dim3(unsigned(batch)), dim3(kThreads), 0, s, logits, vocab, params, tokens, dist);
  KESTREL_CUDA_LAUNCHED();
}

}  // namespace kestrel::cuda
