#include <cmath>
#include <cstdio>

#include "backend/cuda/check.h"
#include "backend/cuda/device_model.h"
#include "parallel/shard.h"
#include "common/numeric.h"

namespace kestrel::cuda {
namespace {

__device__ __forceinline__ uint32_t hash32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return uint32_t(x);
}

// Random matrices are functions of (seed, element index in the whole matrix), so a rank's block
// of a split model holds exactly the values of the same block of the unsplit model.
// Byte (r, c) of a block starting at row row0, byte col0 of a matrix with full_row bytes per row.
__global__ void fill_bytes_kernel(uint8_t* p, int64_t rows, int64_t row, int64_t row0, int64_t col0, int64_t full_row,
                                  uint64_t seed) {
  const size_t n = size_t(rows * row);
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const size_t full = size_t(row0 + int64_t(i) / row) * full_row + size_t(col0 + int64_t(i) % row);
    p[i] = uint8_t(hash32(seed * 0x9E3779B97F4A7C15ull + full));
  }
}

__global__ void fill_const_kernel(uint8_t* p, size_t n, uint8_t v) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) p[i] = v;
}

// Uniform in [-a, a] as BF16, element (r, c) of the block as fill_bytes_kernel.
__global__ void fill_bf16_kernel(uint16_t* p, int64_t rows, int64_t row, int64_t row0, int64_t col0, int64_t full_row,
                                 float a, uint64_t seed) {
  const size_t n = size_t(rows * row);
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const size_t full = size_t(row0 + int64_t(i) / row) * full_row + size_t(col0 + int64_t(i) % row);
    const float u = float(hash32(seed * 0x9E3779B97F4A7C15ull + full)) * (2.0f / 4294967296.0f) - 1.0f;
    const float v = u * a;
    uint32_t bits = __float_as_uint(v);
    p[i] = uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  }
}

uint64_t name_seed(const std::string& name, uint64_t seed) {  // FNV-1a
  uint64_t h = 1469598103934665603ull ^ seed;
  for (unsigned char ch : name) h = (h ^ ch) * 1099511628211ull;
  return h;
}

uint8_t nearest_e4m3(float v) {
  uint8_t best = 0;
  for (int b = 0; b < 0x7f; ++b)
    if (std::fabs(e4m3_to_f32(uint8_t(b)) - v) < std::fabs(e4m3_to_f32(best) - v)) best = uint8_t(b);
  return best;
}

}  // namespace

DeviceModel::~DeviceModel() {
  for (void* p : allocations_) cudaFree(p);
}

void* DeviceModel::alloc(size_t bytes) {
  void* p = nullptr;
  if (bytes == 0) bytes = 16;
  cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess)
    fail("out of GPU memory: ", bytes >> 20, " MiB more needed after ", bytes_ >> 20, " MiB of weights (",
         cudaGetErrorString(e), ")");
  allocations_.push_back(p);
  bytes_ += bytes;
  return p;
}

const float* DeviceModel::floats(const std::vector<float>& v) {
  if (v.empty()) return nullptr;
  void* p = alloc(v.size() * 4);
  KESTREL_CUDA_CHECK(cudaMemcpy(p, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
  return static_cast<const float*>(p);
}

const DLinear* DeviceModel::put_array(const std::vector<DLinear>& v) {
  void* p = alloc(v.size() * sizeof(DLinear));
  KESTREL_CUDA_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(DLinear), cudaMemcpyHostToDevice));
  return static_cast<const DLinear*>(p);
}

// Random weights of about unit activation scale: NVFP4 codes uniform over all 16 values with one
// block scale for the whole matrix, BF16 uniform in +-sqrt(3/in) (in: the whole matrix's).
DLinear DeviceModel::make_random(const std::string& name, const RandomBlock& b, bool nvfp4, uint64_t seed) {
  DLinear d;
  d.out = int(b.rows);
  d.in = int(b.cols);
  const size_t n = size_t(b.rows) * size_t(b.cols);
  seed = name_seed(name, seed);
  if (nvfp4) {
    if (b.cols % 16 != 0 || b.col0 % 16 != 0 || b.full_in % 16 != 0)
      fail("random NVFP4 weights need columns in blocks of 16: ", name);
    d.format = DFormat::NVFP4;
    auto* codes = static_cast<uint8_t*>(alloc(n / 2));
    auto* scales = static_cast<uint8_t*>(alloc(n / 16));
    fill_bytes_kernel<<<1024, 256>>>(codes, b.rows, b.cols / 2, b.row0, b.col0 / 2, b.full_in / 2, seed);
    // E2M1 codes uniform over 16 values have variance ~7.4; scale to variance 1/in.
    fill_const_kernel<<<1024, 256>>>(scales, n / 16, nearest_e4m3(float(1.0 / std::sqrt(7.4 * double(b.full_in)))));
    KESTREL_CUDA_LAUNCHED();
    d.data = codes;
    d.scales = scales;
    d.scale2 = 1.0f;
  } else {
    d.format = DFormat::BF16;
    auto* w = static_cast<uint16_t*>(alloc(n * 2));
    fill_bf16_kernel<<<1024, 256>>>(w, b.rows, b.cols, b.row0, b.col0, b.full_in, float(std::sqrt(3.0 / double(b.full_in))),
                                    seed);
    KESTREL_CUDA_LAUNCHED();
    d.data = reinterpret_cast<const uint8_t*>(w);
  }
  return d;
}

namespace {

void check_not_fp8(const Linear& l) {
  if (l.format == WeightFormat::FP8) fail("FP8 linears are not on the GPU yet: ", l.name);
}

void check_kv_b(const Linear& l) {
  check_not_fp8(l);
  if (l.format != WeightFormat::BF16)
    fail(l.name, ": the CUDA MLA kernels read kv_b_proj as BF16, found ", format_name(l.format),
         " (keep attention out of the quantized modules)");
}

// A matrix's codes (or dense values), NVFP4 block scales and bias placed in the arena.
DLinear place_linear(WeightArena& a, const Linear& l) {
  check_not_fp8(l);
  if (uint8_t(l.format) > uint8_t(WeightFormat::NVFP4))
    fail(l.name, ": the CUDA backend reads F32, F16, BF16 and NVFP4 weights, not ", format_name(l.format));
  DLinear d;
  d.out = int32_t(l.out);
  d.in = int32_t(l.in);
  d.format = DFormat(uint8_t(l.format));
  if (l.format == WeightFormat::NVFP4) {
    d.data = a.put(l.data, size_t(l.out) * size_t(l.in / 2), l.name);
    d.scales = a.put(l.scales, size_t(l.out) * size_t(l.in / 16), l.name + " (block scales)");
    d.scale2 = l.scale2;
  } else {
    d.data = a.put(l.data, l.row_bytes() * size_t(l.out), l.name);
  }
  if (!l.bias.empty()) d.bias = reinterpret_cast<const float*>(a.put(l.bias.data(), l.bias.size() * 4, l.name + " (bias)"));
  return d;
}

const float* place_floats(WeightArena& a, const std::vector<float>& v, const std::string& what) {
  return v.empty() ? nullptr : reinterpret_cast<const float*>(a.put(v.data(), v.size() * 4, what));
}

// Device arrays of descriptors (the experts'), copied: the host vectors are temporaries.
const DLinear* place_array(WeightArena& a, const std::vector<DLinear>& v, const std::string& what) {
  return reinterpret_cast<const DLinear*>(a.put_copy(v.data(), v.size() * sizeof(DLinear), what));
}

}  // namespace

// Run twice by upload(): on a measuring arena, then on one of the measured size.
void DeviceModel::place(const Model& m, WeightArena& a) {
  const ModelConfig& c = m.config;
  const ModelWeights& w = m.weights;
  embed_ = place_linear(a, w.embed);
  const bool tied = w.lm_head.data == w.embed.data && w.lm_head.out == w.embed.out;  // not when split by vocabulary
  lm_head_ = tied ? embed_ : place_linear(a, w.lm_head);
  final_norm_ = place_floats(a, w.final_norm, "model.norm");
  const std::vector<float> inv_freq = c.rope.inv_freq();
  inv_freq_ = inv_freq.empty() ? nullptr
                               : reinterpret_cast<const float*>(a.put_copy(inv_freq.data(), inv_freq.size() * 4, "rotary frequencies"));
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LayerWeights& L = w.layers[i];
    const std::string p = "model.layers." + std::to_string(i) + ".";
    DLayer l;
    l.attn_norm = place_floats(a, L.attn_norm, p + "input_layernorm");
    l.ffn_norm = place_floats(a, L.ffn_norm, p + "post_attention_layernorm");
    if (c.is_mla()) {
      const MlaWeights& x = L.mla;
      check_kv_b(x.kv_b);
      if (c.mla.q_lora_rank > 0) {
        l.mla.q_a = place_linear(a, x.q_a);
        l.mla.q_b = place_linear(a, x.q_b);
        l.mla.q_a_norm = place_floats(a, x.q_a_norm, p + "self_attn.q_a_layernorm");
      } else {
        l.mla.q = place_linear(a, x.q);
      }
      l.mla.kv_a = place_linear(a, x.kv_a);
      l.mla.kv_b = place_linear(a, x.kv_b);
      l.mla.kv_a_norm = place_floats(a, x.kv_a_norm, p + "self_attn.kv_a_layernorm");
      l.mla.has_indexer = x.has_indexer;
      if (x.has_indexer) {
        l.mla.index_wq_b = place_linear(a, x.indexer.wq_b);
        l.mla.index_wk = place_linear(a, x.indexer.wk);
        l.mla.index_weights = place_linear(a, x.indexer.weights_proj);
        l.mla.index_norm_w = place_floats(a, x.indexer.k_norm, p + "self_attn.indexer.k_norm");
        l.mla.index_norm_b = place_floats(a, x.indexer.k_norm_bias, p + "self_attn.indexer.k_norm bias");
      }
    } else {
      l.q = place_linear(a, L.q);
      l.k = place_linear(a, L.k);
      l.v = place_linear(a, L.v);
    }
    l.o = place_linear(a, L.o);
    l.q_norm = place_floats(a, L.q_norm, p + "self_attn.q_norm");
    l.k_norm = place_floats(a, L.k_norm, p + "self_attn.k_norm");
    l.is_moe = L.is_moe;
    if (!L.is_moe) {
      l.gate = place_linear(a, L.mlp.gate);
      l.up = place_linear(a, L.mlp.up);
      l.down = place_linear(a, L.mlp.down);
      expert_bytes_.push_back(0);
    } else {
      DMoe& moe = l.moe;
      moe.router = make_router(c, place_linear(a, L.moe.router),
                               place_floats(a, L.moe.correction_bias, p + "router correction bias"));
      std::vector<DLinear> g, u, dn;
      for (const GatedFfn& e : L.moe.experts) {
        g.push_back(place_linear(a, e.gate));
        u.push_back(place_linear(a, e.up));
        dn.push_back(place_linear(a, e.down));
      }
      describe_experts(moe, g, u, dn);
      moe.gate = place_array(a, g, p + "expert gate descriptors");
      moe.up = place_array(a, u, p + "expert up descriptors");
      moe.down = place_array(a, dn, p + "expert down descriptors");
      expert_bytes_.push_back(g[0].bytes() + u[0].bytes() + dn[0].bytes());
      moe.width = int(c.moe_intermediate_size);
      moe.first_expert = int(L.moe.first_expert);
      moe.local_experts = int(L.moe.experts.size());
      moe.has_shared = L.moe.has_shared;
      if (L.moe.has_shared) {
        moe.shared_gate = place_linear(a, L.moe.shared.gate);
        moe.shared_up = place_linear(a, L.moe.shared.up);
        moe.shared_down = place_linear(a, L.moe.shared.down);
      }
    }
    layers_.push_back(l);
  }
}

std::unique_ptr<DeviceModel> DeviceModel::upload(const Model& m, const UploadOptions& o) {
  uint64_t size = 0;
  {
    WeightArena measuring;
    DeviceModel(m.config).place(m, measuring);
    size = measuring.size();
  }
  if (o.meter) o.meter->expect(size);
  WeightArena arena(size);
  std::unique_ptr<DeviceModel> d(new DeviceModel(m.config));
  d->place(m, arena);
  if (arena.size() != size) fail("internal: the weight arena measured ", size, " bytes and placed ", arena.size());
  arena.upload(o);
  d->allocations_.push_back(arena.release());
  d->bytes_ = size;
  return d;
}

std::unique_ptr<DeviceModel> DeviceModel::random(const ModelConfig& full, uint64_t seed, const Layout& layout, int rank) {
  const ShardDims sd = shard_dims(full, layout, rank);
  const ModelConfig& c = sd.config;
  std::unique_ptr<DeviceModel> d(new DeviceModel(c));
  const int H = int(c.hidden_size), hd = int(c.head_dim);
  // A whole matrix, its output rows [r0, r0 + rows) of full_out, or its input columns [c0, c0 + cols) of full_in.
  auto whole = [&](const std::string& name, int64_t out, int64_t in, bool bf16 = false) {
    return d->make_random(name, {in, 0, out, 0, in}, !bf16 && c.quant.quantizes(name), seed);
  };
  auto rows = [&](const std::string& name, int64_t r0, int64_t n, int64_t in) {
    return d->make_random(name, {in, r0, n, 0, in}, c.quant.quantizes(name), seed);
  };
  auto cols = [&](const std::string& name, int64_t out, int64_t c0, int64_t n, int64_t full_in) {
    return d->make_random(name, {full_in, 0, out, c0, n}, c.quant.quantizes(name), seed);
  };
  d->embed_ = whole("model.embed_tokens", c.vocab_size, H, true);
  d->lm_head_ = c.tie_word_embeddings && !layout.split()
                    ? d->embed_
                    : d->make_random(c.tie_word_embeddings ? "model.embed_tokens" : "lm_head",
                                     {H, sd.vocab.begin, sd.vocab.end - sd.vocab.begin, 0, H}, false, seed);
  const std::vector<float> ones(size_t(std::max<int64_t>(H, hd)), 1.0f);
  d->final_norm_ = d->floats(std::vector<float>(size_t(H), 1.0f));
  d->inv_freq_ = d->floats(c.rope.inv_freq());
  const float* norm_h = d->floats(std::vector<float>(size_t(H), 1.0f));
  const float* norm_hd = d->floats(std::vector<float>(size_t(hd), 1.0f));
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    DLayer l;
    l.attn_norm = l.ffn_norm = norm_h;
    if (c.is_mla()) {
      // kv_b stays BF16 (the absorbed kernels read it so); biases are left out.
      const MlaConfig& m = c.mla;
      const int64_t nh = c.num_heads, h0 = sd.head0, qk = m.qk_head_dim(), r = m.kv_lora_rank;
      const int64_t kvh = m.qk_nope_head_dim + m.v_head_dim, fh = full.num_heads;
      const std::string a = p + "self_attn.";
      if (m.q_lora_rank > 0) {
        l.mla.q_a = whole(a + "q_a_proj", m.q_lora_rank, H);
        l.mla.q_b = rows(a + "q_b_proj", h0 * qk, nh * qk, m.q_lora_rank);
        l.mla.q_a_norm = d->floats(std::vector<float>(size_t(m.q_lora_rank), 1.0f));
      } else {
        l.mla.q = rows(a + "q_proj", h0 * qk, nh * qk, H);
      }
      l.mla.kv_a = whole(a + "kv_a_proj_with_mqa", m.latent(), H);
      l.mla.kv_b = d->make_random(a + "kv_b_proj", {r, h0 * kvh, nh * kvh, 0, r}, false, seed);
      l.mla.kv_a_norm = d->floats(std::vector<float>(size_t(r), 1.0f));
      l.o = cols(a + "o_proj", H, h0 * m.v_head_dim, nh * m.v_head_dim, fh * m.v_head_dim);
      const IndexerConfig& ix = c.indexer;
      l.mla.has_indexer = ix.enabled() && ix.own[size_t(i)];
      if (l.mla.has_indexer) {
        l.mla.index_wq_b = whole(a + "indexer.wq_b", ix.heads * ix.head_dim, m.q_lora_rank);
        l.mla.index_wk = whole(a + "indexer.wk", ix.head_dim, H);
        l.mla.index_weights = whole(a + "indexer.weights_proj", ix.heads, H);
        l.mla.index_norm_w = d->floats(std::vector<float>(size_t(ix.head_dim), 1.0f));
        l.mla.index_norm_b = d->floats(std::vector<float>(size_t(ix.head_dim), 0.0f));
      }
    } else {
      const int64_t nh = c.num_heads, nkv = c.num_kv_heads;
      l.q = rows(p + "self_attn.q_proj", sd.head0 * hd, nh * hd, H);
      l.k = rows(p + "self_attn.k_proj", sd.kv_head0 * hd, nkv * hd, H);
      l.v = rows(p + "self_attn.v_proj", sd.kv_head0 * hd, nkv * hd, H);
      l.o = cols(p + "self_attn.o_proj", H, sd.head0 * hd, nh * hd, full.num_heads * hd);
    }
    if (c.qkv_bias && !c.is_mla()) {
      l.q.bias = d->floats(std::vector<float>(size_t(l.q.out), 0.0f));
      l.k.bias = d->floats(std::vector<float>(size_t(l.k.out), 0.0f));
      l.v.bias = d->floats(std::vector<float>(size_t(l.v.out), 0.0f));
    }
    if (c.qk_norm) l.q_norm = l.k_norm = norm_hd;
    l.is_moe = c.is_moe_layer(i);
    if (!l.is_moe) {
      const int64_t I = c.intermediate_size, i0 = sd.ffn0;
      l.gate = rows(p + "mlp.gate_proj", i0, I, H);
      l.up = rows(p + "mlp.up_proj", i0, I, H);
      l.down = cols(p + "mlp.down_proj", H, i0, I, full.intermediate_size);
    } else {
      DMoe& moe = l.moe;
      const int E = int(c.num_experts), I = int(c.moe_intermediate_size);
      const int first = int(sd.first_expert), local = int(sd.experts);
      const float* bias =
          c.router == RouterKind::SigmoidBias ? d->floats(std::vector<float>(size_t(E), 0.0f)) : nullptr;
      moe.router = make_router(c, whole(p + c.moe_prefix + ".gate", E, H, true), bias);
      std::vector<DLinear> g, u, dn;
      const std::string ep = p + c.moe_prefix + ".experts.";
      const int64_t x0 = sd.expert_col0, FI = full.moe_intermediate_size;
      for (int e = first; e < first + local; ++e) {
        g.push_back(rows(ep + std::to_string(e) + "." + c.expert_gate, x0, I, H));
        u.push_back(rows(ep + std::to_string(e) + "." + c.expert_up, x0, I, H));
        dn.push_back(cols(ep + std::to_string(e) + "." + c.expert_down, H, x0, I, FI));
      }
      describe_experts(moe, g, u, dn);
      moe.gate = d->put_array(g);
      moe.up = d->put_array(u);
      moe.down = d->put_array(dn);
      d->expert_bytes_.push_back(g[0].bytes() + u[0].bytes() + dn[0].bytes());
      moe.width = I;
      moe.first_expert = first;
      moe.local_experts = local;
      moe.has_shared = c.num_shared_experts > 0;
      if (moe.has_shared) {
        const int64_t S = sd.shared_width, s0 = sd.shared0, FS = full.moe_intermediate_size * full.num_shared_experts;
        moe.shared_gate = rows(p + "mlp.shared_experts.gate_proj", s0, S, H);
        moe.shared_up = rows(p + "mlp.shared_experts.up_proj", s0, S, H);
        moe.shared_down = cols(p + "mlp.shared_experts.down_proj", H, s0, S, FS);
      }
    }
    if (!l.is_moe) d->expert_bytes_.push_back(0);
    d->layers_.push_back(l);
    std::fprintf(stderr, "\rrandom weights: layer %lld/%lld, %.1f GiB", (long long)i + 1, (long long)c.num_layers,
                 double(d->bytes_) / (1ull << 30));
  }
  std::fprintf(stderr, "\n");
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  return d;
}

}  // namespace kestrel::cuda
