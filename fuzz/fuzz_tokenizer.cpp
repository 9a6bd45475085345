// libFuzzer target for the tokenizer: the input is either a tokenizer.json to load (first byte
// even) or text to encode and bytes to decode as ids with two built-in tokenizers, a byte-level
// one and a sentencepiece-style one with byte fallback. Anything may throw kestrel::Error; nothing
// may crash, streamed text must add up to the full decode, and literal spans over the built-in
// tokenizers must agree with parsing specials (no span) and not parsing them (one span over all).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/error.h"
#include "text/pretokenize.h"
#include "text/tokenizer.h"

namespace {

using kestrel::text::Tokenizer;

nlohmann::json added(const std::string& content, bool special, bool lstrip, bool rstrip, bool single_word) {
  return {{"content", content}, {"special", special},         {"lstrip", lstrip}, {"rstrip", rstrip},
          {"single_word", single_word}, {"normalized", false}, {"id", 0}};
}

Tokenizer byte_level() {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[kestrel::text::byte_to_unicode(static_cast<unsigned char>(b))] = b;
  const std::vector<std::pair<std::string, std::string>> merges = {{"Ġ", "t"}, {"h", "e"}, {"Ġt", "he"}, {"i", "n"}, {"Ġ", "Ġ"}};
  nlohmann::json m = nlohmann::json::array();
  for (const auto& [a, b] : merges) {
    vocab[a + b] = vocab.size();
    m.push_back(a + " " + b);
  }
  const std::string re =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  nlohmann::json j = {
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", m}, {"ignore_merges", true}}},
      {"normalizer", {{"type", "NFC"}}},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"}, {"pattern", {{"Regex", re}}}, {"behavior", "Isolated"}, {"invert", false}},
          {{"type", "Digits"}, {"individual_digits", false}},
          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"added_tokens",
       {added("<|s|>", true, false, false, false), added("<m>", true, true, true, false), added("he", false, false, false, true)}}};
  return Tokenizer::from_json_text(j.dump(), "fuzz byte-level");
}

Tokenizer sentencepiece() {
  nlohmann::json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    vocab[name] = vocab.size();
  }
  for (const char* t : {"▁", "a", "b", "c", "t", "h", "e", "▁t", "he", "▁the"}) vocab[t] = vocab.size();
  nlohmann::json j = {
      {"model",
       {{"type", "BPE"}, {"vocab", vocab}, {"merges", {"▁ t", "h e", "▁t he"}}, {"unk_token", "<unk>"},
        {"byte_fallback", true}, {"fuse_unk", true}}},
      {"normalizer",
       {{"type", "Sequence"},
        {"normalizers",
         {{{"type", "Prepend"}, {"prepend", "▁"}}, {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "▁"}}}}}},
      {"decoder",
       {{"type", "Sequence"},
        {"decoders",
         {{{"type", "Replace"}, {"pattern", {{"String", "▁"}}}, {"content", " "}},
          {{"type", "ByteFallback"}},
          {{"type", "Fuse"}},
          {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single", {{{"SpecialToken", {{"id", "<s>"}}}}, {{"Sequence", {{"id", "A"}}}}}},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}}},
      {"added_tokens", {added("<unk>", true, false, false, false), added("<s>", true, false, false, false)}}};
  return Tokenizer::from_json_text(j.dump(), "fuzz sentencepiece");
}

void exercise(const Tokenizer& tok, const std::string& text, const uint8_t* data, size_t size, bool built_in) {
  for (bool parse : {true, false}) {
    try {
      const auto ids = tok.encode(text, true, parse);
      tok.decode(ids, false);
    } catch (const kestrel::Error&) {
    }
  }
  // Literal spans: none is the plain encoding; the whole text is the encoding without specials
  // (these tokenizers have no added token inside a special one); spans from the bytes must not
  // crash.
  try {
    using Spans = std::vector<std::pair<size_t, size_t>>;
    const Spans none, whole{{0, text.size()}};
    if (tok.encode(text, true, none) != tok.encode(text, true, true)) std::abort();
    if (tok.encode(text, true, whole) != tok.encode(text, true, false) && built_in) std::abort();
    Spans some;
    size_t at = 0;
    for (size_t i = 0; i + 1 < size && at < text.size(); i += 2) {
      const size_t b = std::min(text.size(), at + data[i] % 8), e = std::min(text.size(), b + data[i + 1] % 8);
      some.emplace_back(b, e);
      at = e;
    }
    tok.encode(text, false, some);
  } catch (const kestrel::Error&) {
  }
  std::vector<int32_t> ids;
  for (size_t i = 0; i + 1 < size; i += 2) ids.push_back(static_cast<int32_t>((data[i] << 8 | data[i + 1]) % 300) - 10);
  for (bool skip : {true, false}) {
    kestrel::text::StreamDecoder sd(tok, skip);
    std::string all;
    for (int32_t id : ids) all += sd.push(id);
    all += sd.flush();
    if (all != tok.decode(ids, skip)) std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const Tokenizer bl = byte_level();
  static const Tokenizer sp = sentencepiece();
  if (size == 0) return 0;
  const std::string rest(reinterpret_cast<const char*>(data + 1), size - 1);
  if (data[0] % 2 == 0) {
    try {
      const Tokenizer t = Tokenizer::from_json_text(rest, "fuzz input");
      exercise(t, "Hello world 123 <s> héllo", data + 1, size - 1, false);
    } catch (const kestrel::Error&) {
    }
    return 0;
  }
  exercise(bl, rest, data + 1, size - 1, true);
  exercise(sp, rest, data + 1, size - 1, true);
  return 0;
}
