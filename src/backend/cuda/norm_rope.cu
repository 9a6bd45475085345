#include "backend/cuda/check.h"
#include "backend/cuda/kv_paged.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/norm_rope.h"
#include "backend/cuda/reduce.cuh"
#include "backend/cuda/slot_mma.cuh"

namespace kestrel::cuda {
namespace {

// One block per row. Rows of up to kRowNormMax floats (a multiple of 4) take block_rms_norm:
// weights loaded before waiting on the previous kernel, all of x's loads in flight at once.
__global__ void __launch_bounds__(kRowNormThreads) rms_norm_kernel(const float* __restrict__ x,
                                                                   const float* __restrict__ w, int n, float eps,
                                                                   float* __restrict__ out) {
  __shared__ float red[32];
  const float* xr = x + size_t(blockIdx.x) * n;
  float* o = out + size_t(blockIdx.x) * n;
  if (n % 4 == 0 && n <= kRowNormMax) {
    float4 g[kRowNormPer];
    row_norm_weights(w, n, g);
    pdl_enter();
    block_rms_norm(xr, g, n, eps, o, red);
    return;
  }
  pdl_enter();
  float ss = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
  const float inv = rsqrtf(block_sum(ss, red) / float(n) + eps);
  for (int i = threadIdx.x; i < n; i += blockDim.x) o[i] = w[i] * (xr[i] * inv);
}

// rms_norm_kernel's first path (block_rms_norm's loads and expression) writing the rows as fragment
// rows, and as floats too unless out is null.
__global__ void __launch_bounds__(kRowNormThreads) rms_norm_frag_kernel(const float* __restrict__ x,
                                                                        const float* __restrict__ w, int n, float eps,
                                                                        float* __restrict__ out,
                                                                        uint32_t* __restrict__ xf) {
  __shared__ float red[32];
  const float* xr = x + size_t(blockIdx.x) * n;
  float4 g[kRowNormPer];
  row_norm_weights(w, n, g);
  pdl_enter();
  float4 xv[kRowNormPer];
  float ss = 0.0f;
  #pragma unroll
  for (int i = 0; i < kRowNormPer; ++i) {
    const int j = threadIdx.x + i * kRowNormThreads;
    xv[i] = j < n / 4 ? reinterpret_cast<const float4*>(xr)[j] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    ss += xv[i].x * xv[i].x + xv[i].y * xv[i].y + xv[i].z * xv[i].z + xv[i].w * xv[i].w;
  }
  const float inv = rsqrtf(block_sum(ss, red) / float(n) + eps);
  uint32_t* f = xf + size_t(blockIdx.x) * n;
  #pragma unroll
  for (int i = 0; i < kRowNormPer; ++i) {
    const int j = threadIdx.x + i * kRowNormThreads;
    if (j >= n / 4) continue;
    // block_rms_norm's expression, so that both forms hold the same values
    const float4 v = make_float4(g[i].x * (xv[i].x * inv), g[i].y * (xv[i].y * inv), g[i].z * (xv[i].z * inv),
                                 g[i].w * (xv[i].w * inv));
    if (out) reinterpret_cast<float4*>(out + size_t(blockIdx.x) * n)[j] = v;
    frag_store4(f, 4 * j, v);
  }
}

// One block per (token, head); heads [0, nq) are queries, [nq, nq + nkv) keys (values are
// copied alongside their key head). T: the cache's values (KvType).
template <class T>
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
  auto out = [&](int i) {
    return i < rope.rotary_dim ? rotated(buf, i, pos, rope.inv_freq, rope.scaling, rope.rotary_dim, rope.interleaved)
                               : buf[i];
  };
  if (is_q) {
    float* dst = q + (size_t(b) * nq + h) * hd;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) dst[i] = out(i);
    return;
  }
  const size_t at = kv_offset(cache, b, pos) + size_t(kh) * hd;
  T* kd = kv_rows<T>(cache.k) + at;
  for (int i = threadIdx.x; i < hd; i += blockDim.x) kd[i] = kv_value<T>(out(i));
  const float* vs = v + (size_t(b) * nkv + kh) * hd;
  T* vd = kv_rows<T>(cache.v) + at;
  #pragma unroll 4
  for (int i = threadIdx.x; i < hd; i += blockDim.x) vd[i] = kv_value<T>(vs[i]);
}

}  // namespace

void launch_rms_norm(const float* x, const float* w, int rows, int n, float eps, float* out, cudaStream_t s) {
  launch(rms_norm_kernel, dim3(unsigned(rows)), dim3(kRowNormThreads), 0, s, x, w, n, eps, out);
  KESTREL_CUDA_LAUNCHED();
}

void launch_rms_norm_frag(const float* x, const float* w, int rows, int n, float eps, float* out, uint32_t* xf,
                          cudaStream_t s) {
  if (n % kFragChunk != 0 || n > kRowNormMax) fail("internal: fragment rows of ", n, " values");
  launch(rms_norm_frag_kernel, dim3(unsigned(rows)), dim3(kRowNormThreads), 0, s, x, w, n, eps, out, xf);
  KESTREL_CUDA_LAUNCHED();
}

void launch_qk_rope_store(float* q, const float* k, const float* v, int batch, int nq, int nkv, int hd,
                          const float* q_norm, const float* k_norm, float eps, const RopeArgs& rope,
                          const int32_t* positions, KvLayer cache, cudaStream_t s) {
  if (!cache.table || cache.row != nkv * hd)
    fail("internal: a KV cache of rows of ", cache.row, " values for ", nkv, " heads of ", hd);
  auto* kernel = cache.type == KvType::BF16 ? qk_rope_store_kernel<__nv_bfloat16> : qk_rope_store_kernel<float>;
  launch(kernel, dim3(unsigned(batch), unsigned(nq + nkv)), dim3(64), size_t(hd) * sizeof(float), s, q, k, v, nq, nkv,
         hd, q_norm, k_norm, eps, rope, positions, cache);
  KESTREL_CUDA_LAUNCHED();
}

}  // namespace kestrel::cuda
