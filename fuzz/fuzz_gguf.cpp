// Any byte string given to the GGUF reader either parses into metadata and tensors whose bytes
// lie inside the input, or raises kestrel::Error; so do the model mapping, the vocabulary reader,
// the tokenizer built from the vocabulary (with a short text through it) and the dequantization of
// the first row of every tensor. Nothing else: no crash, no read out of bounds, no absurd
// allocation.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "common/error.h"
#include "formats/gguf.h"
#include "formats/gguf_vocab.h"
#include "model/gguf_model.h"
#include "text/gguf_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kestrel;
  try {
    GgufIndex g({data, size}, "fuzz.gguf");
    std::vector<float> row;
    for (const GgufTensor& t : g.tensors()) {
      if (t.data < data || t.data + t.nbytes > data + size) std::abort();
      const GgmlTypeInfo* info = ggml_type_info(uint32_t(t.type));
      if (!info) std::abort();
      if (!info->dequant || t.dims.empty() || t.dims[0] == 0 || t.dims[0] > 65536 || t.nbytes == 0) continue;
      row.resize(size_t(t.dims[0]));
      ggml_dequant_row(t.type, t.data, t.dims[0], row.data());
    }
    try {
      const text::Tokenizer tok = text::tokenizer_from_gguf(read_gguf_vocab(g), "fuzz.gguf");
      const std::vector<int32_t> ids = tok.encode("Hello  w\xC3\xb6rld \xE4\xB8\xAD<s>\n");
      (void)tok.decode(ids);
    } catch (const Error&) {
    }
    ModelConfig c = gguf_model_config(g);
    (void)c.summary();
    (void)c.rope.inv_freq();
    std::vector<std::vector<uint8_t>> owned;
    ModelWeights w = gguf_model_weights(g, c, owned);
    // Every weight view lies inside the input or the owned copies.
    auto check = [&](const Linear& l) {
      const uint8_t* end = l.data + l.bytes();
      bool inside = l.data >= data && end <= data + size;
      for (const auto& o : owned) inside |= l.data >= o.data() && end <= o.data() + o.size();
      if (!inside) std::abort();
      if (l.out > 0 && l.in > 0 && l.in <= 65536) {
        row.resize(size_t(l.in));
        l.dequant_row(l.out - 1, row.data());
      }
    };
    check(w.embed);
    check(w.lm_head);
    for (const auto& L : w.layers) {
      for (const Linear* l : {&L.q, &L.k, &L.v, &L.o}) check(*l);
      if (!L.is_moe) {
        for (const Linear* l : {&L.mlp.gate, &L.mlp.up, &L.mlp.down}) check(*l);
        continue;
      }
      check(L.moe.router);
      for (const auto& e : L.moe.experts)
        for (const Linear* l : {&e.gate, &e.up, &e.down}) check(*l);
      if (L.moe.has_shared)
        for (const Linear* l : {&L.moe.shared.gate, &L.moe.shared.up, &L.moe.shared.down}) check(*l);
    }
  } catch (const Error&) {
  }
  return 0;
}
