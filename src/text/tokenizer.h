// A tokenizer loaded from a Hugging Face tokenizer.json, giving the same ids as the `tokenizers`
// library: added tokens are cut out of the raw text first (longest match), the rest is normalized,
// pre-tokenized and split by the BPE model, and the post-processor adds BOS/EOS.
//
// Supported: model BPE (byte-level or sentencepiece-style with byte_fallback); normalizers NFC,
// NFD, NFKC, NFKD, Lowercase, Prepend, Replace, Strip, Sequence; pre-tokenizers Split, ByteLevel,
// Digits, Metaspace, Sequence; post-processors TemplateProcessing, ByteLevel, RobertaProcessing,
// BertProcessing, Sequence; decoders ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace,
// Sequence. Anything else is refused at load with an error naming the field. BPE dropout is
// ignored: encoding is deterministic.
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "text/detokenize.h"

namespace kestrel::text {

class Tokenizer {
 public:
  // Errors (kestrel::Error) name the file and the field that is wrong.
  static Tokenizer from_file(const std::string& path);
  static Tokenizer from_json_text(std::string_view json, const std::string& name = "tokenizer.json");

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // `text` must be valid UTF-8 (kestrel::Error otherwise). With parse_special false, special
  // added tokens are ordinary text (what a chat server wants for user content).
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = true, bool parse_special = true) const;
  // The same, with special tokens recognized only outside the byte ranges `literal` (sorted,
  // not overlapping): a special token's text that overlaps one of them is ordinary text there,
  // while the text around it is tokenized with it as one string. A chat prompt passes the ranges
  // its messages' text came to occupy, so that a user cannot type the template's markers.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens,
                              std::span<const std::pair<size_t, size_t>> literal) const;
  // The text of every special added token.
  std::vector<std::string> special_tokens() const;
  // Unknown ids are skipped, as the reference library does.
  std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;

  int32_t token_id(std::string_view token) const;  // -1 if none
  std::string_view token(int32_t id) const;        // empty if none
  size_t vocab_size() const;                       // 1 + the largest id
  bool is_special(int32_t id) const;
  // A <0xHH> token of a tokenizer whose decoder joins runs of them (sentencepiece byte fallback).
  bool is_byte_fallback_token(int32_t id) const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  static std::unique_ptr<Impl> load_impl(const nlohmann::json& j, const std::string& name);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kestrel::text
