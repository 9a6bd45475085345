#include "client/prompt.h"

#include <cctype>
#include <iterator>

namespace kestrel::client {
namespace {

// Common words, each one token (with its leading space) in English byte-level BPE vocabularies.
constexpr const char* kWords[] = {
    "the",    "of",     "and",    "to",     "in",     "is",     "that",   "for",    "it",     "as",
    "was",    "with",   "be",     "by",     "on",     "not",    "he",     "this",   "are",    "or",
    "his",    "from",   "at",     "which",  "but",    "have",   "an",     "had",    "they",   "you",
    "were",   "their",  "one",    "all",    "we",     "can",    "her",    "has",    "there",  "been",
    "if",     "more",   "when",   "will",   "would",  "who",    "so",     "no",     "she",    "other",
    "its",    "may",    "these",  "about",  "them",   "than",   "some",   "time",   "into",   "only",
    "do",     "could",  "new",    "two",    "first",  "then",   "any",    "like",   "my",     "now",
    "over",   "such",   "our",    "man",    "me",     "even",   "most",   "made",   "after",  "also",
    "did",    "many",   "before", "must",   "through","back",   "years",  "where",  "much",   "your",
    "way",    "well",   "down",   "should", "because","each",   "just",   "those",  "people", "how",
    "too",    "little", "state",  "good",   "very",   "make",   "world",  "still",  "own",    "see",
    "men",    "work",   "long",   "get",    "here",   "between","both",   "life",   "being",  "under",
    "never",  "day",    "same",   "another","know",   "while",  "last",   "might",  "great",  "old",
    "year",   "off",    "come",   "since",  "against","go",     "came",   "right",  "used",   "take",
    "three",  "house",  "water",  "light",  "river",  "city",   "small",  "night",  "road",   "land",
    "school", "story",  "music",  "field",  "book",   "tree",   "car",    "hand",   "eye",    "door",
};
constexpr uint64_t kCount = std::size(kWords);

uint64_t next(uint64_t& s) {  // splitmix64
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

std::string synthetic_prompt(int tokens, uint64_t seed) {
  std::string out;
  uint64_t s = seed;
  int left = tokens;
  while (left > 0) {
    const int words = 6 + int(next(s) % 9);  // 6..14 words, then a period
    for (int w = 0; w < words && left > 1; ++w, --left) {
      std::string word = kWords[next(s) % kCount];
      if (w == 0) word[0] = char(std::toupper(static_cast<unsigned char>(word[0])));
      if (!out.empty()) out += ' ';
      out += word;
    }
    if (left > 0) {
      if (out.empty()) out += "The";  // a one-token prompt: one word
      else out += '.';
      --left;
    }
  }
  return out;
}

}  // namespace kestrel::client
