// Tokenizers built from a GGUF file's tokenizer.* metadata, for models shipped without a
// tokenizer.json, and the loader that picks a model's tokenizer source.
#pragma once
#include <string>

#include "formats/gguf_vocab.h"
#include "text/tokenizer.h"

namespace kestrel::text {

// The tokenizer.json a GGUF vocabulary stands for: the tokenizer transformers builds from the same
// metadata. Supported: tokenizer.ggml.model "gpt2" (byte-level BPE) with tokenizer.ggml.pre
// "default", "gpt-2", "smollm", "llama-bpe", "llama3", "llama-v3" or "qwen2"; and "llama"
// (SentencePiece BPE with byte fallback; merges from the file or derived from the scores;
// add_space_prefix; Phi-3's variant; not Gemma's). CONTROL tokens become special added tokens,
// USER_DEFINED ones plain added tokens. `label` names the file in errors.
std::string gguf_tokenizer_json(const GgufVocab& v, const std::string& label = "GGUF");

Tokenizer tokenizer_from_gguf(const GgufVocab& v, const std::string& label = "GGUF");

// A model's tokenizer: for a folder, its tokenizer.json, else the vocabulary of the one .gguf file
// in it; for a .gguf file, its vocabulary. Fails naming the path when there is neither.
Tokenizer load_tokenizer_for_model(const std::string& path);

}  // namespace kestrel::text
