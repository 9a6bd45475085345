// The block ids of a KV pool that sequences share (the CPU's KvBlockPool, the GPU's
// KvBlockTables), with reference counts and the prefix cache: a block a sequence has filled with
// 16 positions is published under a hash of its tokens chained with the hash of every token
// before it, so a later sequence whose prompt starts with the same tokens takes the block
// instead of computing it again. Published blocks that no sequence holds stay cached until the
// pool needs room, and then go least recently used first (a chain's last blocks before its
// first). A block is found by its chained hash and its own tokens (compared), so two prompts
// meet only when they agree on every token before the block's end.
#pragma once
#include <cstddef>
#include <cstdint>
#include <list>
#include <span>
#include <unordered_map>
#include <vector>

namespace kestrel {

struct PrefixCacheStats {
  int64_t lookups = 0;        // match() calls
  int64_t hit_tokens = 0;     // positions taken from the cache
  int64_t lookup_tokens = 0;  // positions that match() could have taken
  int64_t evictions = 0;      // cached blocks given to other positions
  int64_t cached_blocks = 0;  // published blocks now (held or not)
};

class KvBlocks {
 public:
  static constexpr int kBlock = 16;  // positions per block (KvBlockPool::kBlock)

  // Ids 0 .. blocks - 1, all free; `prefix_cache` false: nothing is published or matched.
  KvBlocks(int64_t blocks, bool prefix_cache);

  int64_t blocks() const { return int64_t(refs_.size()); }
  bool prefix_cache() const { return prefix_cache_; }
  // Blocks take() can hand out: free ones and cached ones no sequence holds.
  int64_t available() const { return int64_t(free_.size() + idle_.size()); }
  int64_t held() const { return blocks() - available(); }  // by at least one sequence

  // A block for a sequence's own positions (one reference): a free one (the most recently freed
  // first), else the least recently used cached one nobody holds, which stops being cached.
  // Fails when every block is held.
  int32_t take();
  // A sequence gives a block back: free once nobody holds it, or cached if it was published.
  void release(int32_t block);

  // The chained hash of the first full blocks of a sequence: hash of block i from hash of block
  // i - 1 (kNoParent for the first) and the block's 16 tokens.
  static constexpr uint64_t kNoParent = 0x6b657374726c0001ull;
  static uint64_t chain(uint64_t parent, std::span<const int32_t> tokens);

  // The cached blocks holding the first full blocks of `tokens`, at most `max_blocks` of them
  // (the longest run found from the first), each with a reference for the caller. `hashes`
  // receives their chained hashes.
  std::vector<int32_t> match(std::span<const int32_t> tokens, int64_t max_blocks, std::vector<uint64_t>* hashes = nullptr);
  // Block `block`, held by the caller, now holds the 16 `tokens` after a prefix of chained hash
  // `parent`; returns the block's chained hash. The block becomes findable unless an equal one is
  // cached already (two sequences that computed the same prefix side by side: the first stays).
  uint64_t publish(uint64_t parent, std::span<const int32_t> tokens, int32_t block);

  const PrefixCacheStats& stats() const { return stats_; }

 private:
  struct Entry {
    uint64_t parent;
    int32_t tokens[kBlock];
    int32_t block;
  };
  void check(int32_t block) const;
  void drop_cached(int32_t block);  // forgets a cached block's entry

  bool prefix_cache_;
  std::vector<int32_t> refs_;                 // per block
  std::vector<int32_t> free_;                 // not cached, nobody holds them; taken from the back
  std::list<int32_t> idle_;                   // cached, nobody holds them: least recently used first
  std::vector<std::list<int32_t>::iterator> idle_at_;  // per block, valid while in idle_
  std::vector<uint64_t> hash_of_;             // per block: its chained hash while cached
  std::vector<bool> cached_;                  // per block
  std::unordered_multimap<uint64_t, Entry> entries_;  // chained hash -> cached block
  PrefixCacheStats stats_;
};

// A sequence's side of the prefix cache: the tokens at its written positions, and how many of
// its full blocks it has published, so that each block is published once it is full.
struct PrefixChain {
  std::vector<int32_t> tokens;
  uint64_t hash = KvBlocks::kNoParent;  // chained hash of the published blocks
  size_t published = 0;                 // blocks

  // A sequence that starts with the blocks match() gave for the first tokens of `prompt`.
  void start(std::span<const int32_t> prompt, const std::vector<uint64_t>& hashes) {
    tokens.assign(prompt.begin(), prompt.begin() + std::ptrdiff_t(hashes.size()) * KvBlocks::kBlock);
    hash = hashes.empty() ? KvBlocks::kNoParent : hashes.back();
    published = hashes.size();
  }
  // The sequence wrote `more` at its next positions; publishes the blocks full now (row[i]: the
  // id of its i-th block).
  // With `publish` false (a verification whose rejected tokens are rewound next) nothing is
  // published until publish() (after rewind()).
  template <class Id>
  void wrote(std::span<const int32_t> more, std::span<const Id> row, KvBlocks& ids, bool publish_now = true) {
    if (!ids.prefix_cache()) return;
    tokens.insert(tokens.end(), more.begin(), more.end());
    if (publish_now) publish(row, ids);
  }
  template <class Id>
  void publish(std::span<const Id> row, KvBlocks& ids) {
    if (!ids.prefix_cache()) return;
    for (; (published + 1) * KvBlocks::kBlock <= tokens.size() && published < row.size(); ++published)
      hash = ids.publish(hash, std::span<const int32_t>(tokens).subspan(published * KvBlocks::kBlock, KvBlocks::kBlock),
                         int32_t(row[published]));
  }
  // The sequence's positions from n on are gone (its blocks past them given back; a published
  // one stays cached as it was).
  void rewind(size_t n) {
    if (n >= tokens.size()) return;
    tokens.resize(n);
    if (published * KvBlocks::kBlock <= n) return;
    published = n / KvBlocks::kBlock;
    hash = KvBlocks::kNoParent;
    for (size_t b = 0; b < published; ++b)
      hash = KvBlocks::chain(hash, std::span<const int32_t>(tokens).subspan(b * KvBlocks::kBlock, KvBlocks::kBlock));
  }
};

}  // namespace kestrel
