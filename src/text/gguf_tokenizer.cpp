#include "text/gguf_tokenizer.h"

#include <array>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "formats/gguf.h"
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

std::string gguf_tokenizer_json(const GgufVocab& v, const std::string& label) {
  if (v.model != "gpt2")
    fail(label, ": metadata 'tokenizer.ggml.model': tokenizer model '", v.model,
         "' is not supported (supported: gpt2, byte-level BPE)");
  if (v.tokens.empty()) fail(label, ": metadata 'tokenizer.ggml.tokens': the vocabulary is empty");
  if (v.merges.empty()) fail(label, ": metadata 'tokenizer.ggml.merges': a gpt2 vocabulary needs merges");
  ojson pre = pre_tokenizer_for(v.pre, label);

  const auto alphabet = byte_alphabet();
  std::vector<bool> in_alphabet(512, false);
  for (uint32_t cp : alphabet) in_alphabet[cp] = true;

  ojson vocab = ojson::object();
  ojson added = ojson::array();
  for (size_t id = 0; id < v.tokens.size(); ++id) {
    const std::string& t = v.tokens[id];
    if (!utf8_valid(t)) fail(label, ": metadata 'tokenizer.ggml.tokens': token ", id, " is not valid UTF-8");
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
    if ((type == 3 && spelled) || type == 4) {
      added.push_back({{"id", id}, {"content", t}, {"single_word", false}, {"lstrip", false}, {"rstrip", false},
                       {"normalized", false}, {"special", type == 3}});
    }
  }

  ojson post = nullptr;
  if (v.add_bos && v.bos >= 0) {
    const std::string& bos = v.tokens[size_t(v.bos)];
    ojson a = {{"Sequence", {{"id", "A"}, {"type_id", 0}}}};
    ojson b = {{"SpecialToken", {{"id", bos}, {"type_id", 0}}}};
    post = {{"type", "TemplateProcessing"},
            {"single", ojson::array({b, a})},
            {"pair", ojson::array({b, a, {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}})},
            {"special_tokens", {{bos, {{"id", bos}, {"ids", {v.bos}}, {"tokens", {bos}}}}}}};
  }

  ojson j = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer", pre},
      {"post_processor", post},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", ""},
        {"end_of_word_suffix", ""},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"vocab", vocab},
        {"merges", v.merges}}},
  };
  return j.dump();
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
