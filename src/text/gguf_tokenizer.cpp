#include "text/gguf_tokenizer.h"

#include <array>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "formats/gguf.h"
#include "text/spm_merges.h"
#include "text/utf8.h"

namespace kestrel::text {
namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

constexpr const char* kLlama3Split =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen2Split =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// The byte-level alphabet: byte -> code point, as GPT-2 spells bytes.
std::array<uint32_t, 256> byte_alphabet() {
  std::array<uint32_t, 256> map{};
  uint32_t extra = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    map[b] = printable ? b : extra++;
  }
  return map;
}

ojson byte_level(bool use_regex) {
  return {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", use_regex}};
}

ojson split_then_bytes(const char* regex) {
  ojson split = {{"type", "Split"}, {"pattern", {{"Regex", regex}}}, {"behavior", "Isolated"}, {"invert", false}};
  return {{"type", "Sequence"}, {"pretokenizers", ojson::array({split, byte_level(false)})}};
}

ojson pre_tokenizer_for(const std::string& pre, const std::string& label) {
  if (pre.empty() || pre == "default" || pre == "gpt-2" || pre == "gpt2") return byte_level(true);
  if (pre == "smollm") {
    ojson digits = {{"type", "Digits"}, {"individual_digits", true}};
    return {{"type", "Sequence"}, {"pretokenizers", ojson::array({digits, byte_level(true)})}};
  }
  if (pre == "llama-bpe" || pre == "llama3" || pre == "llama-v3") return split_then_bytes(kLlama3Split);
  if (pre == "qwen2") return split_then_bytes(kQwen2Split);
  fail(label, ": metadata 'tokenizer.ggml.pre': pre-tokenizer '", pre,
       "' is not supported (supported: default, gpt-2, smollm, llama-bpe, llama3, llama-v3, qwen2)");
}

}  // namespace

namespace {

ojson added_token(const std::string& content, size_t id, bool special) {
  return {{"id", id}, {"content", content}, {"single_word", false}, {"lstrip", false}, {"rstrip", false},
          {"normalized", false}, {"special", special}};
}

// BOS before and EOS after the text, as the file's add_bos_token / add_eos_token say.
ojson post_processor(const GgufVocab& v, bool add_bos, bool add_eos) {
  add_bos = add_bos && v.bos >= 0;
  add_eos = add_eos && v.eos >= 0;
  if (!add_bos && !add_eos) return nullptr;
  ojson single = ojson::array(), pair = ojson::array(), specials = ojson::object();
  auto special = [&](int64_t id, int type_id) {
    const std::string& t = v.tokens[size_t(id)];
    specials[t] = {{"id", t}, {"ids", {id}}, {"tokens", {t}}};
    return ojson{{"SpecialToken", {{"id", t}, {"type_id", type_id}}}};
  };
  for (int seq = 0; seq < 2; ++seq) {
    ojson& out = seq == 0 ? single : pair;
    for (int part = 0; part <= seq; ++part) {
      if (add_bos) out.push_back(special(v.bos, part));
      out.push_back({{"Sequence", {{"id", part == 0 ? "A" : "B"}, {"type_id", part}}}});
      if (add_eos) out.push_back(special(v.eos, part));
    }
  }
  return {{"type", "TemplateProcessing"}, {"single", single}, {"pair", pair}, {"special_tokens", specials}};
}

ojson bpe_model(ojson vocab, ojson merges, bool byte_fallback) {
  return {{"type", "BPE"},
          {"dropout", nullptr},
          {"unk_token", nullptr},
          {"continuing_subword_prefix", nullptr},
          {"end_of_word_suffix", nullptr},
          {"fuse_unk", byte_fallback},
          {"byte_fallback", byte_fallback},
          {"ignore_merges", false},
          {"vocab", std::move(vocab)},
          {"merges", std::move(merges)}};
}

ojson byte_level_json(const GgufVocab& v, const std::string& label) {
  if (v.merges.empty()) fail(label, ": metadata 'tokenizer.ggml.merges': a gpt2 vocabulary needs merges");
  ojson pre = pre_tokenizer_for(v.pre, label);

  const auto alphabet = byte_alphabet();
  std::vector<bool> in_alphabet(512, false);
  for (uint32_t cp : alphabet) in_alphabet[cp] = true;

  ojson vocab = ojson::object();
  ojson added = ojson::array();
  for (size_t id = 0; id < v.tokens.size(); ++id) {
    const std::string& t = v.tokens[id];
    bool spelled = true;
    for (size_t i = 0; i < t.size() && spelled;) {
      char32_t cp = 0;
      i += utf8_decode(t, i, cp);
      spelled = cp < in_alphabet.size() && in_alphabet[cp];
    }
    std::string key = t;
    if (!spelled) {
      key.clear();
      for (unsigned char b : t) utf8_append(key, alphabet[b]);
    }
    vocab[key] = id;
    const int32_t type = id < v.token_types.size() ? v.token_types[id] : 1;
    if ((type == 3 && spelled) || type == 4) added.push_back(added_token(t, id, type == 3));
  }
  return {{"added_tokens", added},
          {"normalizer", nullptr},
          {"pre_tokenizer", pre},
          {"post_processor", post_processor(v, v.add_bos, v.add_eos)},
          {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
          {"model", bpe_model(vocab, v.merges, false)}};
}

// SentencePiece BPE, as transformers builds it from the same metadata (LlamaTokenizer): the pieces
// as spelled, with "▁" for spaces and <0xHH> byte-fallback pieces; the file's merges or those the
// scores imply; a Metaspace pre-tokenizer that prefixes "▁" to the start of the text (unless
// add_space_prefix is false); BOS unless add_bos_token is false. Control tokens, and the named
// BOS/EOS/unknown/padding tokens, are special; user-defined ones are plain added tokens.
ojson sentencepiece_json(const GgufVocab& v, const std::string& label) {
  const std::string& arch = v.architecture;
  if (arch.rfind("gemma", 0) == 0)
    fail(label, ": metadata 'tokenizer.ggml.model': the SentencePiece vocabulary of ", arch,
         " is not supported (Gemma files spell spaces and order merges differently)");
  if (!v.pre.empty() && v.pre != "default")
    fail(label, ": metadata 'tokenizer.ggml.pre': pre-tokenizer '", v.pre,
         "' is not supported with a llama (SentencePiece) vocabulary (supported: default)");
  const std::string space = "\xE2\x96\x81";  // U+2581
  const bool prefix = !v.has_add_space_prefix || v.add_space_prefix;

  ojson vocab = ojson::object();
  ojson added = ojson::array();
  for (size_t id = 0; id < v.tokens.size(); ++id) {
    vocab[v.tokens[id]] = id;
    const int32_t type = id < v.token_types.size() ? v.token_types[id] : 1;
    const auto i = int64_t(id);
    const bool named = i == v.bos || i == v.eos || i == v.unk || i == v.pad;
    if (type == 3 || named) added.push_back(added_token(v.tokens[id], id, true));
    else if (type == 4) added.push_back(added_token(v.tokens[id], id, false));
  }
  ojson merges = ojson::array();
  if (!v.merges.empty()) {
    merges = v.merges;
  } else {
    if (v.scores.empty())
      fail(label, ": metadata 'tokenizer.ggml.scores': a llama vocabulary without merges needs scores to derive them");
    for (auto& [a, b] : merges_from_scores(v.tokens, v.scores)) merges.push_back({std::move(a), std::move(b)});
  }

  ojson normalizer = nullptr, pre = nullptr;
  if (arch == "phi3") {
    // transformers gives Phi-3 the prefix by a normalizer, which also prefixes text after a special token.
    normalizer = {{"type", "Sequence"},
                  {"normalizers", ojson::array({{{"type", "Prepend"}, {"prepend", space}},
                                                {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", space}}})}};
  } else {
    pre = {{"type", "Metaspace"}, {"replacement", space}, {"prepend_scheme", prefix ? "first" : "never"}, {"split", false}};
  }
  ojson decoders = ojson::array({{{"type", "Replace"}, {"pattern", {{"String", space}}}, {"content", " "}},
                                 {{"type", "ByteFallback"}},
                                 {{"type", "Fuse"}}});
  if (prefix || arch == "phi3") decoders.push_back({{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}});
  return {{"added_tokens", added},
          {"normalizer", normalizer},
          {"pre_tokenizer", pre},
          {"post_processor", post_processor(v, !v.has_add_bos || v.add_bos, v.add_eos)},
          {"decoder", {{"type", "Sequence"}, {"decoders", decoders}}},
          {"model", bpe_model(vocab, merges, true)}};
}

}  // namespace

std::string gguf_tokenizer_json(const GgufVocab& v, const std::string& label) {
  if (v.tokens.empty()) fail(label, ": metadata 'tokenizer.ggml.tokens': the vocabulary is empty");
  for (size_t id = 0; id < v.tokens.size(); ++id)
    if (!utf8_valid(v.tokens[id])) fail(label, ": metadata 'tokenizer.ggml.tokens': token ", id, " is not valid UTF-8");
  ojson j;
  if (v.model == "gpt2") j = byte_level_json(v, label);
  else if (v.model == "llama") j = sentencepiece_json(v, label);
  else
    fail(label, ": metadata 'tokenizer.ggml.model': tokenizer model '", v.model,
         "' is not supported (supported: gpt2, byte-level BPE; llama, SentencePiece BPE)");
  j["version"] = "1.0";
  j["truncation"] = nullptr;
  j["padding"] = nullptr;
  try {
    return j.dump();
  } catch (const nlohmann::json::exception&) {
    fail(label, ": the vocabulary holds a string (a merge or an added token) that is not valid UTF-8");
  }
}

Tokenizer tokenizer_from_gguf(const GgufVocab& v, const std::string& label) {
  return Tokenizer::from_json_text(gguf_tokenizer_json(v, label), label + " (tokenizer.ggml.*)");
}

Tokenizer load_tokenizer_for_model(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) fail(path, ": no such file or folder");
  auto from_gguf = [](const std::string& file) {
    GgufFile g(file);
    if (!g.index().has("tokenizer.ggml.model"))
      fail(file, ": no tokenizer: the GGUF has no tokenizer.ggml.* metadata and there is no tokenizer.json");
    return tokenizer_from_gguf(read_gguf_vocab(g.index()), file);
  };
  if (!fs::is_directory(path, ec)) {
    if (!is_gguf_file(path)) fail(path, ": not a model folder or a .gguf file, so no tokenizer can be found");
    return from_gguf(path);
  }
  const fs::path json = fs::path(path) / "tokenizer.json";
  if (fs::exists(json, ec)) return Tokenizer::from_file(json.string());
  std::vector<std::string> ggufs;
  for (const auto& e : fs::directory_iterator(path, ec))
    if (e.is_regular_file() && e.path().extension() == ".gguf") ggufs.push_back(e.path().string());
  if (ggufs.size() == 1) return from_gguf(ggufs[0]);
  if (ggufs.size() > 1) fail(path, ": no tokenizer.json, and ", ggufs.size(), " .gguf files to choose from");
  fail(path, ": no tokenizer: neither tokenizer.json nor a .gguf file with a vocabulary");
}

}  // namespace kestrel::text
