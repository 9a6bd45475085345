// The BPE model of tokenizer.json: vocabulary, ranked merges, byte fallback (<0x41> tokens),
// unknown-token fusing and ignore_merges. Words are merged lowest rank first (leftmost on ties)
// with a priority queue, and the result for short words is cached.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace kestrel::text {

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using TokenMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

class BpeModel {
 public:
  // `j` is the "model" object; `where` names the file and path for errors.
  static std::unique_ptr<BpeModel> from_json(const nlohmann::json& j, const std::string& where);

  // Appends the ids of one pre-token. Throws kestrel::Error if a character needs the unknown
  // token and the vocabulary has none of that name.
  void tokenize(std::string_view word, std::vector<int32_t>& out) const;

  int32_t token_id(std::string_view token) const;  // -1 if absent
  const std::string* token(int32_t id) const;      // nullptr if absent
  size_t size() const { return vocab_.size(); }    // number of entries
  int32_t max_id() const { return static_cast<int32_t>(id_to_token_.size()) - 1; }
  bool byte_fallback() const { return byte_fallback_; }

 private:
  struct Merge {
    int32_t rank;
    int32_t new_id;
  };
  static uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }
  void merge_word(std::string_view word, std::vector<int32_t>& out) const;

  TokenMap vocab_;
  std::vector<const std::string*> id_to_token_;
  std::unordered_map<uint64_t, Merge> merges_;
  std::string unk_token_;
  bool has_unk_ = false;
  std::string prefix_, suffix_;  // continuing_subword_prefix, end_of_word_suffix
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  std::array<int32_t, 256> byte_ids_{};  // <0xHH> token ids, -1 where absent

  mutable std::shared_mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> cache_;
};

}  // namespace kestrel::text
