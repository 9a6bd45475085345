// The weight upload (backend/cuda/upload.h): every tensor a DeviceModel points to, downloaded
// again, equals byte for byte the host tensor it came from. Run with staging buffers far smaller
// than the model (chunks cut through tensors, buffers are reused, several threads pack one
// chunk) and with the default ones, on every fixture family unsplit and as one rank of a split
// model (TP2, whose column slices are copies the shard owns; EP2 for MoE families).
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "../unit/fixture.h"
#include "backend/cuda/check.h"
#include "backend/cuda/device_model.h"
#include "backend/cuda/upload.h"
#include "model/weights.h"
#include "parallel/shard.h"

namespace kestrel {
namespace {

// Counts what was compared, so that a test also sees that the whole arena was covered.
struct Checked {
  uint64_t bytes = 0;        // tensors compared
  int tensors = 0;
  uint64_t array_bytes = 0;  // expert descriptor arrays
  int arrays = 0;
};

void expect_bytes(const void* dev, const void* host, size_t n, const std::string& what, Checked& ck) {
  ASSERT_NE(dev, nullptr) << what << ": no device address";
  EXPECT_EQ(reinterpret_cast<uintptr_t>(dev) % 16, 0u) << what << ": device address not 16-byte aligned";
  std::vector<uint8_t> got(n);
  KESTREL_CUDA_CHECK(cudaMemcpy(got.data(), dev, n, cudaMemcpyDeviceToHost));
  const auto* h = static_cast<const uint8_t*>(host);
  size_t first = 0;
  while (first < n && got[first] == h[first]) ++first;
  EXPECT_EQ(first, n) << what << ": device bytes differ from the host tensor from byte " << first << " of " << n;
  ck.bytes += n;
  ck.tensors += 1;
}

void expect_floats(const float* dev, const std::vector<float>& host, const std::string& what, Checked& ck) {
  if (host.empty()) {
    EXPECT_EQ(dev, nullptr) << what << ": absent on the host but given a device address";
    return;
  }
  expect_bytes(dev, host.data(), host.size() * 4, what, ck);
}

void expect_linear(const Linear& h, const cuda::DLinear& d, Checked& ck) {
  ASSERT_EQ(d.out, h.out) << h.name;
  ASSERT_EQ(d.in, h.in) << h.name;
  ASSERT_EQ(uint8_t(d.format), uint8_t(h.format)) << h.name;
  if (h.format == WeightFormat::NVFP4) {
    expect_bytes(d.data, h.data, size_t(h.out) * size_t(h.in / 2), h.name + " codes", ck);
    expect_bytes(d.scales, h.scales, size_t(h.out) * size_t(h.in / 16), h.name + " block scales", ck);
    EXPECT_EQ(d.scale2, h.scale2) << h.name;
  } else {
    expect_bytes(d.data, h.data, h.bytes(), h.name, ck);
  }
  expect_floats(d.bias, h.bias, h.name + " bias", ck);
}

// A device array of expert descriptors, each against its host matrix.
void expect_experts(const cuda::DLinear* dev, const std::vector<GatedFfn>& experts, const Linear GatedFfn::*which,
                    Checked& ck) {
  ASSERT_NE(dev, nullptr);
  std::vector<cuda::DLinear> d(experts.size());
  KESTREL_CUDA_CHECK(cudaMemcpy(d.data(), dev, d.size() * sizeof(cuda::DLinear), cudaMemcpyDeviceToHost));
  ck.array_bytes += d.size() * sizeof(cuda::DLinear);
  ck.arrays += 1;
  for (size_t e = 0; e < experts.size(); ++e) expect_linear(experts[e].*which, d[e], ck);
}

void expect_ffn(const GatedFfn& h, const cuda::DLinear& g, const cuda::DLinear& u, const cuda::DLinear& dn,
                Checked& ck) {
  expect_linear(h.gate, g, ck);
  expect_linear(h.up, u, ck);
  expect_linear(h.down, dn, ck);
}

// Every tensor of m against where dm says it is, following model/weights.h's structure (not
// DeviceModel's code, so that a tensor placed under another's name is caught).
void expect_model(const Model& m, const cuda::DeviceModel& dm, Checked& ck) {
  const ModelWeights& w = m.weights;
  const ModelConfig& c = m.config;
  expect_linear(w.embed, dm.embed(), ck);
  if (w.lm_head.data != w.embed.data || w.lm_head.out != w.embed.out) expect_linear(w.lm_head, dm.lm_head(), ck);
  else EXPECT_EQ(dm.lm_head().data, dm.embed().data) << "a tied LM head should share the embedding";
  expect_floats(dm.final_norm(), w.final_norm, "model.norm", ck);
  expect_floats(dm.rope_inv_freq(), c.rope.inv_freq(), "rotary frequencies", ck);
  EXPECT_EQ(dm.layers().size(), w.layers.size());
  for (size_t i = 0; i < w.layers.size() && i < dm.layers().size(); ++i) {
    const LayerWeights& L = w.layers[i];
    const cuda::DLayer& l = dm.layers()[i];
    const std::string p = "model.layers." + std::to_string(i) + ".";
    expect_floats(l.attn_norm, L.attn_norm, p + "input_layernorm", ck);
    expect_floats(l.ffn_norm, L.ffn_norm, p + "post_attention_layernorm", ck);
    if (c.is_mla()) {
      const MlaWeights& a = L.mla;
      if (c.mla.q_lora_rank > 0) {
        expect_linear(a.q_a, l.mla.q_a, ck);
        expect_linear(a.q_b, l.mla.q_b, ck);
        expect_floats(l.mla.q_a_norm, a.q_a_norm, p + "q_a_layernorm", ck);
      } else {
        expect_linear(a.q, l.mla.q, ck);
      }
      expect_linear(a.kv_a, l.mla.kv_a, ck);
      expect_linear(a.kv_b, l.mla.kv_b, ck);
      expect_floats(l.mla.kv_a_norm, a.kv_a_norm, p + "kv_a_layernorm", ck);
      EXPECT_EQ(l.mla.has_indexer, a.has_indexer) << p;
      if (a.has_indexer) {
        expect_linear(a.indexer.wq_b, l.mla.index_wq_b, ck);
        expect_linear(a.indexer.wk, l.mla.index_wk, ck);
        expect_linear(a.indexer.weights_proj, l.mla.index_weights, ck);
        expect_floats(l.mla.index_norm_w, a.indexer.k_norm, p + "indexer k_norm", ck);
        expect_floats(l.mla.index_norm_b, a.indexer.k_norm_bias, p + "indexer k_norm bias", ck);
      }
    } else {
      expect_linear(L.q, l.q, ck);
      expect_linear(L.k, l.k, ck);
      expect_linear(L.v, l.v, ck);
    }
    expect_linear(L.o, l.o, ck);
    expect_floats(l.q_norm, L.q_norm, p + "q_norm", ck);
    expect_floats(l.k_norm, L.k_norm, p + "k_norm", ck);
    EXPECT_EQ(l.is_moe, L.is_moe) << p;
    if (!L.is_moe) {
      expect_ffn(L.mlp, l.gate, l.up, l.down, ck);
      continue;
    }
    const cuda::DMoe& moe = l.moe;
    expect_linear(L.moe.router, moe.router.w, ck);
    expect_floats(moe.router.bias, L.moe.correction_bias, p + "router correction bias", ck);
    EXPECT_EQ(moe.first_expert, L.moe.first_expert) << p;
    ASSERT_EQ(size_t(moe.local_experts), L.moe.experts.size()) << p;
    expect_experts(moe.gate, L.moe.experts, &GatedFfn::gate, ck);
    expect_experts(moe.up, L.moe.experts, &GatedFfn::up, ck);
    expect_experts(moe.down, L.moe.experts, &GatedFfn::down, ck);
    EXPECT_EQ(bool(moe.has_shared), L.moe.has_shared) << p;
    if (L.moe.has_shared) expect_ffn(L.moe.shared, moe.shared_gate, moe.shared_up, moe.shared_down, ck);
  }
}

struct Variant {
  const char* name;
  cuda::UploadOptions options;
};

std::vector<Variant> variants() {
  cuda::UploadOptions tiny;
  tiny.staging_bytes = 1000;  // not a multiple of the 256-byte placement: chunks cut tensors anywhere
  tiny.buffers = 3;
  tiny.threads = 3;
  cuda::UploadOptions two;
  two.staging_bytes = 40000;
  two.buffers = 2;
  two.threads = 1;
  return {{"default staging", {}}, {"1000-byte staging, 3 buffers, 3 threads", tiny},
          {"40000-byte staging, 2 buffers, 1 thread", two}};
}

void check_upload(const Model& m, const std::string& label) {
  for (const Variant& v : variants()) {
    SCOPED_TRACE(label + ", " + v.name);
    cuda::UploadMeter meter(1, false);
    cuda::UploadOptions o = v.options;
    o.meter = &meter;
    auto dm = cuda::DeviceModel::upload(m, o);
    EXPECT_EQ(meter.bytes(), dm->bytes()) << "the meter heard of every arena byte";
    Checked ck;
    expect_model(m, *dm, ck);
    // The arena holds what was compared, the expert descriptor arrays and < 256 bytes of
    // alignment before each of them: nothing was left out of the comparison.
    const uint64_t placed = ck.bytes + ck.array_bytes;
    EXPECT_GE(dm->bytes(), placed);
    EXPECT_LT(dm->bytes(), placed + uint64_t(ck.tensors + ck.arrays) * 256);
  }
}

class CudaUploadTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaUploadTest, DeviceBytesEqualHostTensors) {
  auto model = load_model(test::fixture_dir(GetParam()));
  check_upload(*model, "unsplit");
}

TEST_P(CudaUploadTest, SplitRankDeviceBytesEqualItsShard) {
  auto model = load_model(test::fixture_dir(GetParam()));
  std::vector<Layout> layouts = {{2, 1}};
  if (model->config.num_experts > 0) layouts.push_back({2, 2});
  for (const Layout& layout : layouts) {
    check_layout(layout, long(model->config.num_experts));
    auto shard = shard_model(*model, layout, 1);
    check_upload(*shard, layout.str() + " rank 1");
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaUploadTest, ::testing::ValuesIn(test::fixture_names()), test::fixture_test_name);

// FP8 checkpoints run on the CPU only: the upload refuses them before any device memory is
// taken, naming the first FP8 linear (so `--device auto` falls back to the CPU).
TEST(CudaUpload, Fp8LinearsAreRefusedByName) {
  for (const std::string& name : test::fp8_fixture_names()) {
    auto model = load_model(test::fixture_dir(name));
    try {
      cuda::DeviceModel::upload(*model, {});
      ADD_FAILURE() << name << ": uploaded";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("FP8 linears are not on the GPU yet: model.layers.0.self_attn."),
                std::string::npos)
          << name << ": " << e.what();
    }
  }
}

}  // namespace
}  // namespace kestrel
