#include "backend/cuda/check.h"
#include "backend/cuda/kv_paged.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/norm_rope.h"
#include "backend/cuda/reduce.cuh"

namespace kestrel::cuda {
namespace {

constexpr int kNormThreads = 256, kNormPer = 8;  // float4 per thread: rows up to 8192 in one pass

// One block per row. Rows of up to 4 * kNormThreads * kNormPer floats (a multiple of 4) are held
// in registers: the weights are loaded before waiting on the previous kernel and all loads of x
// are in flight at once, so the kernel costs one memory latency instead of one per loop step.
__global__ void __launch_bounds__(kNormThreads) rms_norm_kernel(const float* __restrict__ x,
                                                                const float* __restrict__ w, int n, float eps,
                                                                float* __restrict__ out) {
  __shared__ float red[32];
  const float* xr = x + size_t(blockIdx.x) * n;
  float* o = out + size_t(blockIdx.x) * n;
  if (n % 4 == 0 && n <= 4 * kNormThreads * kNormPer) {
    const int n4 = n / 4;
    float4 wv[kNormPer], xv[kNormPer];
    #pragma unroll
    for (int i = 0; i < kNormPer; ++i) {
      const int j = threadIdx.x + i * kNormThreads;
      if (j < n4) wv[i] = __ldg(reinterpret_cast<const float4*>(w) + j);
    }
    pdl_enter();
    float ss = 0.0f;
    #pragma unroll
    for (int i = 0; i < kNormPer; ++i) {
      const int j = threadIdx.x + i * kNormThreads;
      xv[i] = j < n4 ? reinterpret_cast<const float4*>(xr)[j] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      ss += xv[i].x * xv[i].x + xv[i].y * xv[i].y + xv[i].z * xv[i].z + xv[i].w * xv[i].w;
    }
    const float inv = rsqrtf(block_sum(ss, red) / float(n) + eps);
    #pragma unroll
    for (int i = 0; i < kNormPer; ++i) {
      const int j = threadIdx.x + i * kNormThreads;
      if (j < n4)
        reinterpret_cast<float4*>(o)[j] = make_float4(wv[i].x * (xv[i].x * inv), wv[i].y * (xv[i].y * inv),
                                                      wv[i].z * (xv[i].z * inv), wv[i].w * (xv[i].w * inv));
    }
    return;
  }
  pdl_enter();
  float ss = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
  const float inv = rsqrtf(block_sum(ss, red) / float(n) + eps);
  for (int i = threadIdx.x; i < n; i += blockDim.x) o[i] = w[i] * (xr[i] * inv);
}

// One block per (token, head); heads [0, nq) are queries, [nq, nq + nkv) keys (values are
// copied alongside their key head).
__global__ void qk_rope_store_kernel(float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                                     int nq, int nkv, int hd, const float* __restrict__ q_norm,
                                     const float* __restrict__ k_norm, float eps, RopeArgs rope,
                                     const int32_t* __restrict__ positions, KvLayer cache) {
  extern __shared__ float buf[];  // hd floats
  __shared__ float red[32];
  const int b = blockIdx.x, h = blockIdx.y;
  const bool is_q = h < nq;
  const int kh = h - nq;
  const float* src = is_q ? q + (size_t(b) * nq + h) * hd : k + (size_t(b) * nkv + kh) * hd;
  const float* norm = is_q ? q_norm : k_norm;
  pdl_enter();
  const int pos = positions[b];
  float ss = 0.0f;
  #pragma unroll 4
  for (int i = threadIdx.x; i < hd; i += blockDim.x) {
    buf[i] = src[i];
    ss += buf[i] * buf[i];
  }
  if (norm) {
    const float inv = rsqrtf(block_sum(ss, red) / float(hd) + eps);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) buf[i] = norm[i] * (buf[i] * inv);
  }
  __syncthreads();
  const size_t at = is_q ? 0 : kv_offset(cache, b, pos) + size_t(kh) * hd;
  float* dst = is_q ? q + (size_t(b) * nq + h) * hd : cache.k + at;
  for (int i = threadIdx.x; i < hd; i += blockDim.x)
    dst[i] = i < rope.rotary_dim ? rotated(buf, i, pos, rope.inv_freq, rope.scaling, rope.rotary_dim, rope.interleaved)
                                 : buf[i];
  if (!is_q) {
    const float* vs = v + (size_t(b) * nkv + kh) * hd;
    float* vd = cache.v + at;
    #pragma unroll 4
    for (int i = threadIdx.x; i < hd; i += blockDim.x) vd[i] = vs[i];
  }
}

}  // namespace

void launch_rms_norm(const float* x, const float* w, int rows, int n, float eps, float* out, cudaStream_t s) {
  launch(rms_norm_kernel, dim3(unsigned(rows)), dim3(kNormThreads), 0, s, x, w, n, eps, out);
  KESTREL_CUDA_LAUNCHED();
}

void launch_qk_rope_store(float* q, const float* k, const float* v, int batch, int nq, int nkv, int hd,
                          const float* q_norm, const float* k_norm, float eps, const RopeArgs& rope,
                          const int32_t* positions, KvLayer cache, cudaStream_t s) {
  if (!cache.table || cache.row != nkv * hd)
    fail("internal: a KV cache of rows of ", cache.row, " floats for ", nkv, " heads of ", hd);
  launch(qk_rope_store_kernel, dim3(unsigned(batch), unsigned(nq + nkv)), dim3(64), size_t(hd) * sizeof(float), s, q,
         k, v, nq, nkv, hd, q_norm, k_norm, eps, rope, positions, cache);
  KESTREL_CUDA_LAUNCHED();
}

}  // namespace kestrel::cuda
