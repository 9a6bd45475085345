// Normalizers of tokenizer.json: NFC, NFD, NFKC, NFKD, Lowercase, Prepend, Replace, Strip and
// Sequence. They run on each stretch of text between added tokens, before pre-tokenization.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

namespace kestrel::text {

class Normalizer {
 public:
  // `j` is the "normalizer" object; `where` names the file and path for errors.
  static std::unique_ptr<Normalizer> from_json(const nlohmann::json& j, const std::string& where);
  virtual ~Normalizer() = default;
  // `s` is valid UTF-8 and stays so.
  virtual void normalize(std::string& s) const = 0;
};

}  // namespace kestrel::text
