// The BPE merges a SentencePiece vocabulary implies when a GGUF file lists none: every split of a
// piece into two pieces of the vocabulary, ranked by the piece's score (best first), then by the
// lengths of the two halves (longer first), then by the vocabulary order. This is the order
// transformers' generate_merges gives, so BPE over these merges reproduces its tokenizer.
#pragma once
#include <string>
#include <utility>
#include <vector>

namespace kestrel::text {

// tokens[i] has score scores[i] (same length). Lengths are counted in code points.
std::vector<std::pair<std::string, std::string>> merges_from_scores(const std::vector<std::string>& tokens,
                                                                    const std::vector<float>& scores);

}  // namespace kestrel::text
