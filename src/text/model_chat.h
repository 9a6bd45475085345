// A model's chat template (GGUF metadata, or the folder's chat_template.jinja / tokenizer_config.json)
// with the special-token strings the template may refer to (bos_token, eos_token, ...).
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "model/weights.h"
#include "text/tokenizer.h"

namespace kestrel::text {

struct ModelChat {
  std::string source;
  nlohmann::ordered_json options = nlohmann::ordered_json::object();

  // The conversation rendered as the model expects it, ending with the assistant's turn opened.
  std::string prompt(const nlohmann::ordered_json& messages) const;

  // The same as token ids. The template's own markers are special tokens; the text of the
  // messages is text, so that special tokens typed in a message (a forged "<|im_start|>system"
  // turn) stay the characters they are. `allow_special` tokenizes the rendered prompt as one
  // string instead, specials in messages included, as transformers' apply_chat_template does.
  std::vector<int32_t> encode(const nlohmann::ordered_json& messages, const Tokenizer& tok, bool allow_special) const;
};

// Fails naming the file or field when the model has no chat template.
ModelChat load_model_chat(const Model& model, const std::string& path);

}  // namespace kestrel::text
