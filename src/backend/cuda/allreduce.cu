// Why the protocol of allreduce.h is safe (N ranks, one stream each, every rank making the
// same one-shot calls k = 1, 2, ... in the same order):
//  - Ordering of one rank's calls: call k's kernel reads the epoch only after pdl_enter(), that
//    is after every earlier kernel of the stream has completed (without PDL, stream order does
//    it), so it sees the epoch that call k-1's last block stored. Every kernel of the engine
//    calls pdl_enter() before touching memory, which keeps this true across other kernels.
//  - Data: a block reads a peer's share only after the peer's flag for this block reached the
//    call's epoch. The peer stored its share, fenced at system scope and then stored the flag
//    with release semantics; the waiting thread loads it with acquire semantics and the block
//    barrier passes that on; shares are loaded with ld.global.cv so no stale L1 line is used.
//  - Reuse of a buffer half: rank r's call k completes only after each of its blocks saw every
//    peer's flag of call k, so every peer had started call k and therefore finished call k-1
//    (all of its reads). Call k+1 on r writes the half of parity (k+1) & 1, last read in call
//    k-1: nobody reads it any more. A rank thus cannot get two calls ahead of a peer that
//    still reads: call k+2 needs the peer's flags of call k+2.
//  - Flags only grow, so a peer one call ahead (its flag already at k+1) releases a wait for k
//    (flags compare with >=; the data it points at, half k & 1, is still unchanged). Epochs are
//    64-bit: they never wrap.
//  - Blocks never wait for other blocks of their own grid: block b waits only for block b of
//    each peer, which computes the same slice (grids depend on the message size alone). No
//    co-residency is needed; a grid is at most kMaxBlocks blocks.
#include <algorithm>
#include <cstring>
#include <type_traits>

#include "backend/cuda/allreduce.h"
#include "backend/cuda/check.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/nccl_comm.h"
#include "backend/cuda/reduce.cuh"

namespace kestrel::cuda {

// Pinned host memory mapped on every GPU (with unified addressing the host pointer is valid in
// kernels of every device): the host sets `abort`, a kernel that gives up writes its rank's
// error word (kind << 8 | the peer it waited for).
struct OneShotStatus {
  unsigned int abort;
  unsigned int error[OneShotGroup::kMaxRanks];
};

namespace {

constexpr int kMaxRanks = OneShotGroup::kMaxRanks;
constexpr int kMaxBlocks = 64;  // flag slots per rank: no one-shot grid is larger
constexpr int kSumThreads = 512;
constexpr int64_t kSumFloatsPerBlock = 2048;  // one float4 per thread
constexpr int kNormThreads = 512;
constexpr unsigned kTimedOut = 1, kAborted = 2;

// In each rank's device memory. Peers write the flag slots (remote stores); the rest is the
// rank's own.
struct Control {
  unsigned long long epoch;  // one-shot calls this rank has completed
  unsigned int done;         // blocks of the running call that have finished
  unsigned int failed;       // set on every rank when one gives up: kernels return at once
  alignas(128) unsigned long long flags[kMaxBlocks][kMaxRanks];  // [block][peer]: the peer's latest epoch
};

// The kernels' view of the group from one rank: constant for the group's life, so a captured
// graph stays valid; everything that changes from call to call is in device memory.
struct Peers {
  float* buf[kMaxRanks];
  Control* ctl[kMaxRanks];
  OneShotStatus* status;
  long long half;  // floats in one parity half of a buffer
  unsigned long long timeout_ns;
  int rank, nranks;
};

__device__ __forceinline__ unsigned long long ld_acquire_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned int ld_volatile(const unsigned int* p) { return *(const volatile unsigned int*)p; }

// Marks the group failed on every rank (their waiting blocks stop too) and says why.
__device__ void give_up(const Peers& g, unsigned kind, int peer) {
  volatile unsigned int* err = &g.status->error[g.rank];
  if (*err == 0) *err = kind << 8 | unsigned(peer);
  for (int p = 0; p < g.nranks; ++p) *(volatile unsigned int*)&g.ctl[p]->failed = 1;
  __threadfence_system();
}

// The epoch of this call, the same for every block; 0 when the group has failed.
__device__ unsigned long long begin_call(const Peers& g) {
  __shared__ unsigned long long epoch;
  if (threadIdx.x == 0) {
    const volatile Control* c = g.ctl[g.rank];
    epoch = c->failed ? 0ull : c->epoch + 1;
  }
  __syncthreads();
  return epoch;
}

// The block's share of this call is in the rank's own buffer: publish it to the peers, then
// wait until each peer's block of the same index has published its share. False when the
// group failed (timeout, abort, or another rank gave up): the block must return.
__device__ bool exchange(const Peers& g, unsigned long long epoch) {
  __shared__ int ok;
  if (threadIdx.x == 0) ok = 1;
  __syncthreads();  // every thread's stores into the buffer are made before the fence below
  if (threadIdx.x < 32) {
    if (threadIdx.x == 0) {
      __threadfence_system();
      for (int p = 0; p < g.nranks; ++p)
        if (p != g.rank) st_release_sys(&g.ctl[p]->flags[blockIdx.x][g.rank], epoch);
    }
    __syncwarp();
    const int p = int(threadIdx.x);  // thread p waits for peer p
    if (p < g.nranks && p != g.rank) {
      Control* mine = g.ctl[g.rank];
      const unsigned long long* flag = &mine->flags[blockIdx.x][p];
      const unsigned long long t0 = global_ns();
      for (unsigned spin = 1; ld_acquire_sys(flag) < epoch; ++spin) {
        if (ld_volatile(&mine->failed)) {
          ok = 0;
          break;
        }
        if (spin % 1024 == 0) {  // host memory and the clock: now and then
          if (ld_volatile(&g.status->abort)) {
            give_up(g, kAborted, p);
            ok = 0;
            break;
          }
          if (global_ns() - t0 > g.timeout_ns) {
            give_up(g, kTimedOut, p);
            ok = 0;
            break;
          }
        }
      }
    }
  }
  __syncthreads();
  return ok != 0;
}

// Counts the block out; the call's last block stores the epoch for the next call. Every block
// read the epoch (begin_call) before it is counted, so none can see the new value.
__device__ void end_call(const Peers& g, unsigned long long epoch) {
  if (threadIdx.x != 0) return;
  Control* c = g.ctl[g.rank];
  __threadfence();
  if (atomicAdd(&c->done, 1u) == gridDim.x - 1) {
    *(volatile unsigned int*)&c->done = 0;
    *(volatile unsigned long long*)&c->epoch = epoch;
  }
}

__device__ __forceinline__ float add(float a, float b) { return a + b; }
__device__ __forceinline__ float4 add(float4 a, float4 b) {
  return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}
__device__ __forceinline__ float sq(float a) { return a * a; }
__device__ __forceinline__ float sq(float4 a) { return a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w; }

// Element i (in units of T) of the sum over ranks of the buffers' half at `off` floats, added
// in rank order 0..N-1 (all loads issued first), so every rank computes the same bits.
template <typename T>
__device__ __forceinline__ T rank_sum(const Peers& g, long long off, long long i) {
  T v[kMaxRanks];
  #pragma unroll
  for (int p = 0; p < kMaxRanks; ++p)
    if (p < g.nranks) v[p] = __ldcv(reinterpret_cast<const T*>(g.buf[p] + off) + i);
  T s = v[0];
  #pragma unroll
  for (int p = 1; p < kMaxRanks; ++p)
    if (p < g.nranks) s = add(s, v[p]);
  return s;
}

// Block b owns floats [b * per_block, (b + 1) * per_block) (per_block a multiple of 4). Vec:
// partial and out are 16-byte aligned, so all but the last 0-3 floats move as float4.
template <bool Vec>
__global__ void __launch_bounds__(kSumThreads) sum_kernel(Peers g, const float* partial, float* out, long long n,
                                                          long long per_block) {
  using T = std::conditional_t<Vec, float4, float>;
  constexpr int W = Vec ? 4 : 1;
  pdl_enter();
  const unsigned long long epoch = begin_call(g);
  if (epoch == 0) return;
  const long long beg = blockIdx.x * per_block, end = min(n, beg + per_block);
  const long long off = (epoch & 1) * g.half;
  const long long u_beg = beg / W, u_end = end / W, tail = u_end * W;  // units of T, then single floats
  T* mine = reinterpret_cast<T*>(g.buf[g.rank] + off);
  for (long long i = u_beg + threadIdx.x; i < u_end; i += blockDim.x) mine[i] = reinterpret_cast<const T*>(partial)[i];
  if constexpr (Vec)
    for (long long i = tail + threadIdx.x; i < end; i += blockDim.x) g.buf[g.rank][off + i] = partial[i];
  if (!exchange(g, epoch)) return;
  for (long long i = u_beg + threadIdx.x; i < u_end; i += blockDim.x) reinterpret_cast<T*>(out)[i] = rank_sum<T>(g, off, i);
  if constexpr (Vec)
    for (long long i = tail + threadIdx.x; i < end; i += blockDim.x) out[i] = rank_sum<float>(g, off, i);
  end_call(g, epoch);
}

// x[r] += sum over ranks of partial[r]; xn[r] = rmsnorm(x[r]) * w unless w is null. Block b
// takes rows b, b + gridDim.x, ... With g.nranks == 1 the partial is added as it is (no
// communication). Vec: hidden % 4 == 0 and every pointer 16-byte aligned.
template <bool Vec>
__global__ void __launch_bounds__(kNormThreads) add_norm_kernel(Peers g, const float* partial, float* x,
                                                                const float* __restrict__ w, float eps, float* xn,
                                                                int rows, int hidden) {
  using T = std::conditional_t<Vec, float4, float>;
  constexpr int W = Vec ? 4 : 1;
  __shared__ float red[32];
  pdl_enter();
  const bool comm = g.nranks > 1;
  const unsigned long long epoch = comm ? begin_call(g) : 1;
  if (epoch == 0) return;
  const long long off = (epoch & 1) * g.half;
  const int units = hidden / W;
  if (comm) {
    T* mine = reinterpret_cast<T*>(g.buf[g.rank] + off);
    for (int r = blockIdx.x; r < rows; r += gridDim.x)
      for (int i = threadIdx.x; i < units; i += blockDim.x)
        mine[size_t(r) * units + i] = reinterpret_cast<const T*>(partial)[size_t(r) * units + i];
    if (!exchange(g, epoch)) return;
  }
  for (int r = blockIdx.x; r < rows; r += gridDim.x) {
    T* xr = reinterpret_cast<T*>(x) + size_t(r) * units;
    float ss = 0.0f;
    // Each thread rereads in the norm loop exactly the elements it wrote here.
    for (int i = threadIdx.x; i < units; i += blockDim.x) {
      const long long at = (long long)r * units + i;
      const T s = comm ? rank_sum<T>(g, off, at) : reinterpret_cast<const T*>(partial)[at];
      const T v = add(xr[i], s);
      xr[i] = v;
      ss += sq(v);
    }
    if (w) {
      const float inv = rsqrtf(block_sum(ss, red) / float(hidden) + eps);
      T* o = reinterpret_cast<T*>(xn) + size_t(r) * units;
      const T* wv = reinterpret_cast<const T*>(w);
      for (int i = threadIdx.x; i < units; i += blockDim.x) {
        if constexpr (Vec) {
          const float4 v = xr[i], c = wv[i];
          o[i] = make_float4(c.x * (v.x * inv), c.y * (v.y * inv), c.z * (v.z * inv), c.w * (v.w * inv));
        } else {
          o[i] = wv[i] * (xr[i] * inv);
        }
      }
    }
  }
  if (comm) end_call(g, epoch);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

int norm_threads(int units) { return std::min(kNormThreads, std::max(64, (units + 31) / 32 * 32)); }

void launch_add_norm_peers(const Peers& g, const float* partial, float* x, const float* w, float eps, float* xn,
                           int rows, int hidden, cudaStream_t s) {
  const bool vec = hidden % 4 == 0 && aligned16(partial) && aligned16(x) && aligned16(w) && aligned16(xn);
  const int blocks = g.nranks > 1 ? std::min(rows, kMaxBlocks) : rows;
  launch(vec ? add_norm_kernel<true> : add_norm_kernel<false>, dim3(unsigned(blocks)),
         dim3(unsigned(norm_threads(vec ? hidden / 4 : hidden))), 0, s, g, partial, x, w, eps, xn, rows, hidden);
  KESTREL_CUDA_LAUNCHED();
}

Peers local_peers() {
  Peers g = {};
  g.nranks = 1;
  return g;
}

}  // namespace

void launch_add_norm(const float* add, float* x, const float* w, float eps, float* xn, int rows, int hidden,
                     cudaStream_t s) {
  if (rows < 1 || hidden < 1) fail("add_norm: ", rows, " rows of ", hidden, " floats");
  launch_add_norm_peers(local_peers(), add, x, w, eps, xn, rows, hidden, s);
}

// ---- the group ----

OneShotGroup::OneShotGroup(const std::vector<int>& devices, int64_t max_floats, int timeout_ms)
    : devices_(devices), max_floats_((max_floats + 3) / 4 * 4), timeout_ms_(timeout_ms) {
  if (devices.empty() || devices.size() > size_t(kMaxRanks))
    fail("one-shot all-reduce: ", devices.size(), " GPUs given (1 to ", kMaxRanks, " supported)");
  if (max_floats < 1) fail("one-shot all-reduce: max_floats must be positive, got ", max_floats);
  if (timeout_ms < 1) fail("one-shot all-reduce: timeout_ms must be positive, got ", timeout_ms);
  for (size_t i = 0; i < devices.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      if (devices[i] == devices[j]) fail("one-shot all-reduce: GPU ", devices[i], " is listed twice");
  if (size() > 1) check_peer_access(devices);
  bufs_.assign(devices.size(), nullptr);
  ctls_.assign(devices.size(), nullptr);
  try {
    KESTREL_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&status_), sizeof(OneShotStatus),
                                     cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(status_, 0, sizeof(OneShotStatus));
    if (size() > 1)
      for (int r = 0; r < size(); ++r) {
        DeviceGuard dg(devices_[size_t(r)]);
        KESTREL_CUDA_CHECK(cudaMalloc(&bufs_[size_t(r)], size_t(2 * max_floats_) * sizeof(float)));
        KESTREL_CUDA_CHECK(cudaMalloc(&ctls_[size_t(r)], sizeof(Control)));
        KESTREL_CUDA_CHECK(cudaMemset(ctls_[size_t(r)], 0, sizeof(Control)));
        KESTREL_CUDA_CHECK(cudaDeviceSynchronize());  // the zeroed control words before any peer kernel
      }
  } catch (...) {
    release();
    throw;
  }
}

OneShotGroup::~OneShotGroup() { release(); }

void OneShotGroup::release() {
  for (size_t r = 0; r < bufs_.size(); ++r) {  // unified addressing: no device switch needed
    if (bufs_[r]) cudaFree(bufs_[r]);
    if (ctls_[r]) cudaFree(ctls_[r]);
  }
  bufs_.clear();
  ctls_.clear();
  if (status_) cudaFreeHost(status_);
  status_ = nullptr;
}

void OneShotGroup::abort() {
  *(volatile unsigned int*)&status_->abort = 1;
}

bool OneShotGroup::aborted() const { return *(const volatile unsigned int*)&status_->abort != 0; }

void OneShotGroup::check() const {
  for (int r = 0; r < size(); ++r) {
    const unsigned e = *(const volatile unsigned int*)&status_->error[r];
    if (e == 0) continue;
    const int peer = std::min(int(e & 0xff), size() - 1);
    if (e >> 8 == kTimedOut)
      fail("one-shot all-reduce: rank ", r, " (GPU ", device(r), ") waited more than ", timeout_ms_,
           " ms for rank ", peer, " (GPU ", device(peer), "): did every rank make the same calls?");
    fail("one-shot all-reduce: rank ", r, " (GPU ", device(r), ") stopped waiting for rank ", peer,
         ": the group was aborted");
  }
  if (aborted()) fail("one-shot all-reduce: the group was aborted");
}

// ---- one rank's view ----

namespace {

Peers rank_peers(const std::vector<float*>& bufs, const std::vector<void*>& ctls, OneShotStatus* status, int64_t half,
                 int timeout_ms, int rank) {
  Peers g = {};
  for (size_t p = 0; p < bufs.size(); ++p) {
    g.buf[p] = bufs[p];
    g.ctl[p] = static_cast<Control*>(ctls[p]);
  }
  g.status = status;
  g.half = half;
  g.timeout_ns = (unsigned long long)timeout_ms * 1000000ull;
  g.rank = rank;
  g.nranks = int(bufs.size());
  return g;
}

}  // namespace

OneShotAllReduce::OneShotAllReduce(OneShotGroup& group, int rank, cudaStream_t stream, Communicator* fallback,
                                   cudaStream_t fallback_stream)
    : group_(group), rank_(rank), stream_(stream), fallback_(fallback),
      fallback_stream_(fallback_stream ? fallback_stream : stream) {
  if (rank < 0 || rank >= group.size()) fail("one-shot all-reduce: rank ", rank, " of a group of ", group.size());
  if (fallback && (fallback->size() != group.size() || fallback->rank() != rank))
    fail("one-shot all-reduce: rank ", rank, " of ", group.size(), " given a fallback communicator that is rank ",
         fallback->rank(), " of ", fallback->size());
  if (fallback) {
    DeviceGuard dg(group.device(rank));
    KESTREL_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
    KESTREL_CUDA_CHECK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
  }
}

OneShotAllReduce::~OneShotAllReduce() {
  if (fork_) cudaEventDestroy(fork_);
  if (join_) cudaEventDestroy(join_);
  if (scratch_) cudaFree(scratch_);
}

template <typename F>
void OneShotAllReduce::on_fallback(cudaStream_t s, F&& call) {
  if (!fallback_)
    fail("one-shot all-reduce: rank ", rank_, ": a message above the group's ", group_.max_floats(),
         " floats needs a fallback communicator, and none was given");
  if (s == fallback_stream_) {
    call();
    return;
  }
  // The fallback's stream joins the caller's and the caller waits for it: plain or captured.
  KESTREL_CUDA_CHECK(cudaEventRecord(fork_, s));
  KESTREL_CUDA_CHECK(cudaStreamWaitEvent(fallback_stream_, fork_, 0));
  call();
  KESTREL_CUDA_CHECK(cudaEventRecord(join_, fallback_stream_));
  KESTREL_CUDA_CHECK(cudaStreamWaitEvent(s, join_, 0));
}

void OneShotAllReduce::reserve(int64_t floats) {
  if (size() > 1 && floats > group_.max_floats()) scratch(floats, stream_);
}

float* OneShotAllReduce::scratch(int64_t n, cudaStream_t s) {
  if (n <= scratch_floats_) return scratch_;
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  KESTREL_CUDA_CHECK(cudaStreamIsCapturing(s, &cs));
  if (cs != cudaStreamCaptureStatusNone)
    fail("one-shot all-reduce: rank ", rank_, ": the fused call's fallback needs ", n,
         " floats of scratch while the stream is being captured; make one call of this size before capturing");
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());  // the old scratch may still be in use
  if (scratch_) KESTREL_CUDA_CHECK(cudaFree(scratch_));
  scratch_ = nullptr;
  scratch_floats_ = 0;
  KESTREL_CUDA_CHECK(cudaMalloc(&scratch_, size_t(n) * sizeof(float)));
  scratch_floats_ = n;
  return scratch_;
}

void OneShotAllReduce::all_reduce_sum(const float* partial, float* out, int64_t n, cudaStream_t s) {
  if (n < 0) fail("one-shot all-reduce: all_reduce_sum of ", n, " floats");
  if (group_.aborted()) fail("one-shot all-reduce: rank ", rank_, ": the group was aborted");
  if (n == 0) return;
  DeviceGuard dg(group_.device(rank_));
  if (size() == 1) {
    if (out != partial)
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(out, partial, size_t(n) * sizeof(float), cudaMemcpyDeviceToDevice, s));
    return;
  }
  if (n > group_.max_floats()) {
    if (out != partial)
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(out, partial, size_t(n) * sizeof(float), cudaMemcpyDeviceToDevice, s));
    on_fallback(s, [&] { fallback_->all_reduce_sum(out, n); });
    return;
  }
  const Peers g = rank_peers(group_.bufs_, group_.ctls_, group_.status_, group_.max_floats(), group_.timeout_ms_, rank_);
  int64_t blocks = std::clamp<int64_t>((n + kSumFloatsPerBlock - 1) / kSumFloatsPerBlock, 1, kMaxBlocks);
  const int64_t per_block = ((n + blocks - 1) / blocks + 3) / 4 * 4;
  blocks = (n + per_block - 1) / per_block;
  const bool vec = aligned16(partial) && aligned16(out);
  launch(vec ? sum_kernel<true> : sum_kernel<false>, dim3(unsigned(blocks)), dim3(kSumThreads), 0, s, g, partial, out,
         (long long)n, (long long)per_block);
  KESTREL_CUDA_LAUNCHED();
}

void OneShotAllReduce::all_reduce_add_norm(const float* partial, float* x, const float* norm_weight, float eps,
                                           float* xn, int rows, int hidden, cudaStream_t s) {
  if (rows < 1 || hidden < 1) fail("one-shot all-reduce: add_norm of ", rows, " rows of ", hidden, " floats");
  if (norm_weight && !xn) fail("one-shot all-reduce: add_norm with a norm weight needs an output");
  if (group_.aborted()) fail("one-shot all-reduce: rank ", rank_, ": the group was aborted");
  DeviceGuard dg(group_.device(rank_));
  const int64_t n = int64_t(rows) * hidden;
  if (size() == 1) {
    launch_add_norm_peers(local_peers(), partial, x, norm_weight, eps, xn, rows, hidden, s);
    return;
  }
  if (n <= group_.max_floats()) {
    const Peers g = rank_peers(group_.bufs_, group_.ctls_, group_.status_, group_.max_floats(), group_.timeout_ms_, rank_);
    launch_add_norm_peers(g, partial, x, norm_weight, eps, xn, rows, hidden, s);
    return;
  }
  // Above the one-shot size: NCCL sums a copy of the partial in place, then the one-rank kernel.
  float* sum = scratch(n, s);
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(sum, partial, size_t(n) * sizeof(float), cudaMemcpyDeviceToDevice, s));
  on_fallback(s, [&] { fallback_->all_reduce_sum(sum, n); });
  launch_add_norm_peers(local_peers(), sum, x, norm_weight, eps, xn, rows, hidden, s);
}

void OneShotAllReduce::all_gather(const float* in, int64_t n, float* out) {
  if (n < 0) fail("one-shot all-reduce: all_gather of ", n, " floats");
  if (group_.aborted()) fail("one-shot all-reduce: rank ", rank_, ": the group was aborted");
  if (n == 0) return;
  DeviceGuard dg(group_.device(rank_));
  if (size() == 1) {
    if (out != in)
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(out, in, size_t(n) * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
    return;
  }
  on_fallback(stream_, [&] { fallback_->all_gather(in, n, out); });
}

void OneShotAllReduce::abort() {
  group_.abort();
  if (fallback_) fallback_->abort();
}

}  // namespace kestrel::cuda
