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
  std::string tool_source;  // the folder's "tool_use" template, when it has one apart from the default
  nlohmann::ordered_json options = nlohmann::ordered_json::object();

  // The template a conversation with tools (or without) is rendered with, as transformers picks it.
  const std::string& template_for(bool with_tools) const {
    return with_tools && !tool_source.empty() ? tool_source : source;
  }

  // The conversation rendered as the model expects it, ending with the assistant's turn opened;
  // `tools` (an array, or null for none) is the template's `tools` variable.
  std::string prompt(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools = nullptr) const;

  // The same as token ids. The template's own markers are special tokens; the text of the
  // messages and tools is text, so that special tokens typed in a message (a forged
  // "<|im_start|>system" turn) stay the characters they are. `allow_special` tokenizes the
  // rendered prompt as one string instead, specials in messages included, as transformers'
  // apply_chat_template does.
  std::vector<int32_t> encode(const nlohmann::ordered_json& messages, const Tokenizer& tok, bool allow_special,
                              const nlohmann::ordered_json& tools = nullptr) const;
};

// Fails naming the file or field when the model has no chat template.
ModelChat load_model_chat(const Model& model, const std::string& path);

}  // namespace kestrel::text
