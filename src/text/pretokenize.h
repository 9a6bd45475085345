// Pre-tokenizers of tokenizer.json: Split, ByteLevel, Digits, Metaspace and Sequence. Each turns
// a list of pieces of text into a finer list; the BPE model then sees each piece alone.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace kestrel::text {

struct Piece {
  std::string text;
  bool at_start = false;  // begins at offset 0 of the original input (Metaspace's "first" scheme)
};

class PreTokenizer {
 public:
  // `j` is the "pre_tokenizer" object; `where` names the file and path for errors.
  static std::unique_ptr<PreTokenizer> from_json(const nlohmann::json& j, const std::string& where);
  virtual ~PreTokenizer() = default;
  // Replaces `pieces` by their pre-tokens; empty pieces are dropped.
  virtual void run(std::vector<Piece>& pieces) const = 0;
};

// The pieces of `text` as one whole input.
std::vector<std::string> pre_tokenize(const PreTokenizer& p, std::string_view text);

// GPT-2's reversible map from bytes to printable characters, as UTF-8 strings and back.
const std::string& byte_to_unicode(unsigned char b);
// The byte a byte-level character stands for, or -1.
int unicode_to_byte(char32_t c);

}  // namespace kestrel::text
