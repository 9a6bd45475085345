// The persistent step's product tiles that are not experts: the embedding rows, q | k | v after
// the attention RMSNorm, o added to the residual, the router's rows after the FFN RMSNorm, a
// dense layer's gate/up and down, and the LM head after the final RMSNorm.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "backend/cuda/persistent/op_rows.cuh"

namespace kestrel::cuda {

__device__ inline void embed_rows(const PProgram& P) {
  const DLinear& E = P.embed;
  for (int b = 0; b < P.batch; ++b) {
    const size_t row = size_t(P.tokens[b]) * E.in;
    for (int i = threadIdx.x; i < P.hidden; i += blockDim.x) {
      const size_t k = row + i;
      P.x[size_t(b) * P.hidden + i] = E.format == DFormat::F32   ? reinterpret_cast<const float*>(E.data)[k]
                                      : E.format == DFormat::F16 ? __half2float(reinterpret_cast<const __half*>(E.data)[k])
                                                                 : __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(E.data)[k]);
    }
  }
}

// Rows [a, b) of q | k | v: a tile never straddles a head, so it lies in one of the three.
template <int B>
__device__ void norm_qkv(const PProgram& P, const PInstr& in, const uint8_t* stage) {
  const DLayer& L = layer_of(P, in.layer);
  float* xn = block_xn(P);
  norm_rows(P, L.attn_norm, attn_norm_point(in.layer), xn);
  trace_mark(P, 0);
  const int qr = P.heads * P.head_dim, kr = P.kv_heads * P.head_dim;
  const DLinear& W = in.a < qr ? L.q : in.a < qr + kr ? L.k : L.v;
  const int base = in.a < qr ? 0 : in.a < qr + kr ? qr : qr + kr;
  float* qkv = P.qkv;
  const int stride = P.qkv_rows;
  uint32_t at = 0;
  product_rows<B>(P, W, in.a - base, in.b - base, xn, P.hidden, stage, &at, RowsOut{qkv + base, stride, 0});
  trace_mark(P, 1);
}

template <int B>
__device__ void o_proj(const PProgram& P, const PInstr& in, const uint8_t* stage) {
  const int qr = P.heads * P.head_dim;
  uint32_t at = 0;
  product_rows<B>(P, layer_of(P, in.layer).o, in.a, in.b, P.att, qr, stage, &at, RowsOut{P.x, P.hidden, 1});
  trace_mark(P, 0);
}

template <int B>
__device__ void norm_router(const PProgram& P, const PInstr& in, const uint8_t* stage) {
  const DLayer& L = layer_of(P, in.layer);
  float* xn = block_xn(P);
  norm_rows(P, L.ffn_norm, ffn_norm_point(in.layer), xn);
  trace_mark(P, 0);
  uint32_t at = 0;
  product_rows<B>(P, L.moe.router.w, in.a, in.b, xn, P.hidden, stage, &at, RowsOut{P.router, P.experts, 0});
}

template <int B>
__device__ void mlp_gate_up(const PProgram& P, const PInstr& in, const uint8_t* stage) {
  const DLayer& L = layer_of(P, in.layer);
  float* xn = block_xn(P);
  norm_rows(P, L.ffn_norm, ffn_norm_point(in.layer), xn);
  uint32_t at = 0;
  product_gated_rows<B>(P, L.gate, L.up, in.a, in.b, xn, P.hidden, stage, &at, RowsOut{P.mid, P.mlp_rows, 0});
}

template <int B>
__device__ void mlp_down(const PProgram& P, const PInstr& in, const uint8_t* stage) {
  uint32_t at = 0;
  product_rows<B>(P, layer_of(P, in.layer).down, in.a, in.b, P.mid, P.mlp_rows, stage, &at, RowsOut{P.x, P.hidden, 1});
}

template <int B>
__device__ void head_logits(const PProgram& P, const PInstr& in) {
  float* xn = block_xn(P);
  norm_rows(P, P.final_norm, kFinalNormPoint, xn);
  tile_rows<B, false>(P.lm_head, in.a, in.b, xn, P.hidden, P.batch,
               [&](int row, int b, float v) { P.logits[size_t(b) * P.vocab + row] = v; });
}

}  // namespace kestrel::cuda
