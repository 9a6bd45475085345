#include "backend/cuda/check.h"
#include "backend/cuda/norm_rope.h"

namespace kestrel::cuda {
namespace {

__device__ float block_sum(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = 0.0f;
  for (int i = 0; i < warps; ++i) t += red[i];
  return t;
}

__global__ void rms_norm_kernel(const float* __restrict__ x, const float* __restrict__ w, int n, float eps,
                                float* __restrict__ out) {
  __shared__ float red[32];
  const float* xr = x + size_t(blockIdx.x) * n;
  float* o = out + size_t(blockIdx.x) * n;
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
  const int pos = positions[b];
  float ss = 0.0f;
  for (int i = threadIdx.x; i < hd; i += blockDim.x) {
    buf[i] = src[i];
    ss += buf[i] * buf[i];
  }
  if (norm) {
    const float inv = rsqrtf(block_sum(ss, red) / float(hd) + eps);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) buf[i] = norm[i] * (buf[i] * inv);
  }
  __syncthreads();
  float* dst = is_q ? q + (size_t(b) * nq + h) * hd : cache.k + size_t(b) * cache.seq_stride + (size_t(pos) * nkv + kh) * hd;
  const int half = rope.rotary_dim / 2;
  for (int i = threadIdx.x; i < hd; i += blockDim.x) {
    float r = buf[i];
    if (i < rope.rotary_dim) {
      // Pair (a, b) rotated by angle pos * inv_freq[j].
      const int j = rope.interleaved ? i / 2 : (i < half ? i : i - half);
      const int a = rope.interleaved ? 2 * j : j, c = rope.interleaved ? 2 * j + 1 : j + half;
      const float f = float(pos) * rope.inv_freq[j];
      const float cs = cosf(f) * rope.scaling, sn = sinf(f) * rope.scaling;
      r = (i == a) ? buf[a] * cs - buf[c] * sn : buf[c] * cs + buf[a] * sn;
    }
    dst[i] = r;
  }
  if (!is_q) {
    const float* vs = v + (size_t(b) * nkv + kh) * hd;
    float* vd = cache.v + size_t(b) * cache.seq_stride + (size_t(pos) * nkv + kh) * hd;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) vd[i] = vs[i];
  }
}

}  // namespace

void launch_rms_norm(const float* x, const float* w, int rows, int n, float eps, float* out, cudaStream_t s) {
  rms_norm_kernel<<<rows, 256, 0, s>>>(x, w, n, eps, out);
  KESTREL_CUDA_LAUNCHED();
}

void launch_qk_rope_store(float* q, const float* k, const float* v, int batch, int nq, int nkv, int hd,
                          const float* q_norm, const float* k_norm, float eps, const RopeArgs& rope,
                          const int32_t* positions, KvLayer cache, cudaStream_t s) {
  qk_rope_store_kernel<<<dim3(unsigned(batch), unsigned(nq + nkv)), 64, size_t(hd) * sizeof(float), s>>>(
      q, k, v, nq, nkv, hd, q_norm, k_norm, eps, rope, positions, cache);
  KESTREL_CUDA_LAUNCHED();
}

}  // namespace kestrel::cuda
