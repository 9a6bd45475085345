#include <cfloat>

#include "backend/cuda/check.h"
#include "backend/cuda/dequant.cuh"
#include "backend/cuda/misc.h"

namespace kestrel::cuda {
namespace {

__global__ void embed_kernel(DLinear t, const int32_t* __restrict__ tokens, float* __restrict__ x) {
  const int b = blockIdx.x, row = tokens[b], H = t.in;
  float* o = x + size_t(b) * H;
  for (int k = threadIdx.x; k < H; k += blockDim.x) {
    float v;
    switch (t.format) {
      case DFormat::F32: v = reinterpret_cast<const float*>(t.data)[size_t(row) * H + k]; break;
      case DFormat::F16: v = __half2float(reinterpret_cast<const __half*>(t.data)[size_t(row) * H + k]); break;
      case DFormat::BF16: v = __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(t.data)[size_t(row) * H + k]); break;
      default: {
        const uint8_t byte = t.data[size_t(row) * (H / 2) + k / 2];
        const float2 w = e2m1x2_scaled(byte);
        v = (k & 1 ? w.y : w.x) * kE2M1Unscale * e4m3_to_float(t.scales[size_t(row) * (H / 16) + k / 16]) * t.scale2;
      }
    }
    o[k] = v;
  }
}

__global__ void argmax_kernel(const float* __restrict__ logits, int vocab, int32_t* __restrict__ next) {
  __shared__ float sv[32];
  __shared__ int si[32];
  const float* l = logits + size_t(blockIdx.x) * vocab;
  float best = -FLT_MAX;
  int idx = vocab;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x)
    if (l[i] > best) best = l[i], idx = i;
  for (int o = 16; o > 0; o >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
    if (ob > best || (ob == best && oi < idx)) best = ob, idx = oi;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) sv[warp] = best, si[warp] = idx;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < int(blockDim.x >> 5); ++w)
      if (sv[w] > best || (sv[w] == best && si[w] < idx)) best = sv[w], idx = si[w];
    next[blockIdx.x] = idx;
  }
}

}  // namespace

void launch_embed(const DLinear& table, const int32_t* tokens, int batch, float* x, cudaStream_t s) {
  embed_kernel<<<batch, 256, 0, s>>>(table, tokens, x);
  KESTREL_CUDA_LAUNCHED();
}

void launch_argmax(const float* logits, int batch, int vocab, int32_t* next, cudaStream_t s) {
  argmax_kernel<<<batch, 1024, 0, s>>>(logits, vocab, next);
  KESTREL_CUDA_LAUNCHED();
}

}  // namespace kestrel::cuda
