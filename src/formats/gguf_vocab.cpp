#include "formats/gguf_vocab.h"

#include "common/error.h"

namespace kestrel {

GgufVocab read_gguf_vocab(const GgufIndex& g) {
  GgufVocab v;
  const std::string p = "tokenizer.ggml.";
  v.architecture = g.get_str("general.architecture", "");
  v.model = g.get_str(p + "model", "");
  v.pre = g.get_str(p + "pre", "");
  v.tokens = g.get_str_array(p + "tokens");
  v.merges = g.get_str_array(p + "merges");
  if (v.tokens.empty()) fail(g.label(), ": no tokenizer vocabulary (metadata '", p, "tokens')");
  const size_t n = v.tokens.size();

  for (int64_t t : g.get_int_array(p + "token_type")) {
    if (t < INT32_MIN || t > INT32_MAX) fail(g.where(p + "token_type"), ": value ", t, " out of range");
    v.token_types.push_back(int32_t(t));
  }
  for (double s : g.get_float_array(p + "scores")) v.scores.push_back(float(s));
  if (!v.token_types.empty() && v.token_types.size() != n)
    fail(g.where(p + "token_type"), ": ", v.token_types.size(), " entries for ", n, " tokens");
  if (!v.scores.empty() && v.scores.size() != n)
    fail(g.where(p + "scores"), ": ", v.scores.size(), " entries for ", n, " tokens");

  auto id = [&](const char* name) -> int64_t {
    const std::string key = p + name;
    if (!g.has(key)) return -1;
    const int64_t x = g.get_int(key);
    // Some converters write 0xffffffff (u32 -1) for "none".
    if (x == 0xffffffffLL || x == -1) return -1;
    if (x < 0 || x >= int64_t(n)) fail(g.where(key), ": token id ", x, " is outside the vocabulary of ", n, " tokens");
    return x;
  };
  v.bos = id("bos_token_id");
  v.eos = id("eos_token_id");
  v.eot = id("eot_token_id");
  v.eom = id("eom_token_id");
  v.unk = id("unknown_token_id");
  v.pad = id("padding_token_id");
  v.sep = id("seperator_token_id");  // sic: llama.cpp's spelling of the key
  v.has_add_bos = g.has(p + "add_bos_token");
  v.add_bos = g.get_bool(p + "add_bos_token", false);
  v.add_eos = g.get_bool(p + "add_eos_token", false);
  v.has_add_space_prefix = g.has(p + "add_space_prefix");
  v.add_space_prefix = g.get_bool(p + "add_space_prefix", false);
  v.chat_template = g.get_str("tokenizer.chat_template", "");
  const std::string named = "tokenizer.chat_template.";
  for (const auto& [key, val] : g.metadata())
    if (key.rfind(named, 0) == 0 && key.size() > named.size())
      v.named_templates[key.substr(named.size())] = g.get_str(key, "");
  return v;
}

}  // namespace kestrel
