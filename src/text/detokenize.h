// Decoders of tokenizer.json (ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence)
// and the incremental detokenizer that streams text as ids arrive.
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace kestrel::text {

class Decoder {
 public:
  // `j` is the "decoder" object; `where` names the file and path for errors.
  static std::unique_ptr<Decoder> from_json(const nlohmann::json& j, const std::string& where);
  virtual ~Decoder() = default;
  // Transforms the token strings, possibly merging them, as the reference decode_chain does.
  virtual void chain(std::vector<std::string>& tokens) const = 0;
  // Whether a run of <0xHH> tokens is decoded as one unit (its text can change until the run ends).
  virtual bool groups_byte_tokens() const { return false; }
};

// Token strings to text: the decoder's chain, then concatenation; without a decoder the tokens are
// joined with spaces, as the reference library does.
std::string decode_tokens(const Decoder* d, std::vector<std::string> tokens);

class Tokenizer;

// Turns ids into text one at a time. It never emits part of a UTF-8 character: text whose end may
// still change (an incomplete character, a run of byte-fallback tokens) is held back until the
// next ids settle it, and the concatenation of all chunks plus flush() equals
// Tokenizer::decode of all the ids. The tokenizer must outlive the decoder.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok, bool skip_special = true);
  std::string push(int32_t id);
  // Emits whatever is held and starts a new stream.
  std::string flush();

 private:
  void settle();
  size_t context_end(const std::string& text) const;

  const Tokenizer* tok_;
  bool skip_special_;
  std::vector<int32_t> ids_;  // ids_[0, context_) were emitted and give later ids their context
  size_t context_ = 0;
  std::string context_text_;  // decode of ids_[0, context_)
  size_t emitted_ = 0;        // bytes of the text after context_text_ already emitted
};

}  // namespace kestrel::text
