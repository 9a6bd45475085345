// Synthetic prompts for load generation: deterministic English-like text of a given length.
#pragma once
#include <cstdint>
#include <string>

namespace kestrel::client {

// About `tokens` tokens of text made of sentences of 6 to 14 common English words, each ended by
// a period. The text counts a word or a period as one token, which is what byte-level BPE
// vocabularies trained on English (GPT-2, Llama 3, Qwen, SmolLM) make of most of these words:
// with the SmolLM2 tokenizer, prompts of 32 counted tokens were 31 to 33 real ones and of 512,
// 511 to 514 (the server's usage.prompt_tokens, which `kestrel loadgen` reports when it is sent).
// `seed` picks the words (the same seed, the same text), so requests of a run can each have
// their own prompt and a server's prefix cache does not turn all but the first into cache hits.
std::string synthetic_prompt(int tokens, uint64_t seed);

}  // namespace kestrel::client
