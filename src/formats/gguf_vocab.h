// The tokenizer description a GGUF file carries in its tokenizer.* metadata, checked for
// consistency, for building a tokenizer (text/) without the original tokenizer.json.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "formats/gguf.h"

namespace kestrel {

struct GgufVocab {
  std::string architecture;         // general.architecture: some families build their tokenizer differently
  std::string model;                // tokenizer.ggml.model: "gpt2" (byte-level BPE), "llama" (SentencePiece), ...
  std::string pre;                  // tokenizer.ggml.pre: pre-tokenizer name, e.g. "smollm", "qwen2", "llama-bpe"
  std::vector<std::string> tokens;  // id -> token text (byte-level BPE spelling for "gpt2")
  // id -> 1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte; may be empty
  std::vector<int32_t> token_types;
  std::vector<float> scores;        // id -> SentencePiece score; may be empty
  std::vector<std::string> merges;  // "a b" in priority order (BPE only)
  int64_t bos = -1, eos = -1, eot = -1, eom = -1, unk = -1, pad = -1, sep = -1;  // -1: not set
  bool add_bos = false, add_eos = false, add_space_prefix = false;
  bool has_add_bos = false;         // whether tokenizer.ggml.add_bos_token was present
  bool has_add_space_prefix = false;
  std::string chat_template;        // tokenizer.chat_template ("" if absent)
  std::map<std::string, std::string> named_templates;  // tokenizer.chat_template.NAME
};

// Reads the vocabulary of a GGUF file; fails naming the file and key when the arrays disagree in
// length or a special token id is outside the vocabulary.
GgufVocab read_gguf_vocab(const GgufIndex& g);

}  // namespace kestrel
