// The KV pool's block ids and the prefix cache (runtime/kv_blocks.h): references, publishing a
// chain and finding it again, a difference in any earlier block ending the match, eviction of
// blocks nobody holds (a chain's last blocks first), two sequences publishing the same prefix,
// the cache turned off; and random sequences sharing prefixes, checked against a model of what
// every block holds.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>

#include "common/error.h"
#include "runtime/kv_blocks.h"

namespace kestrel {
namespace {

constexpr int kB = KvBlocks::kBlock;

std::vector<int32_t> tokens(int n, int32_t start) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) t[size_t(i)] = start + i;
  return t;
}

// A sequence's blocks for `prompt`: the cached ones, then its own, the full ones published.
std::vector<int32_t> fill(KvBlocks& ids, const std::vector<int32_t>& prompt, size_t* cached = nullptr) {
  std::vector<uint64_t> hashes;
  std::vector<int32_t> row = ids.match(prompt, (int64_t(prompt.size()) - 1) / kB, &hashes);
  if (cached) *cached = row.size();
  PrefixChain chain;
  chain.start(prompt, hashes);
  while (int64_t(row.size()) * kB < int64_t(prompt.size())) row.push_back(ids.take());
  chain.wrote(std::span<const int32_t>(prompt).subspan(chain.tokens.size()), std::span<const int32_t>(row), ids);
  return row;
}

void release(KvBlocks& ids, const std::vector<int32_t>& row) {
  for (size_t i = row.size(); i-- > 0;) ids.release(row[i]);
}

TEST(KvBlocks, TakeAndReleaseCountReferences) {
  KvBlocks ids(3, true);
  EXPECT_EQ(ids.take(), 0);
  EXPECT_EQ(ids.take(), 1);
  EXPECT_EQ(ids.available(), 1);
  ids.release(0);
  EXPECT_EQ(ids.take(), 0);  // the most recently freed first
  EXPECT_EQ(ids.take(), 2);
  try {
    ids.take();
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("all 3 blocks of 16 positions are in use"), std::string::npos) << e.what();
  }
  ids.release(1);
  EXPECT_THROW(ids.release(1), Error);   // released more often than taken
  EXPECT_THROW(ids.release(7), Error);   // no such block
  EXPECT_THROW(KvBlocks(-1, true), Error);
}

TEST(KvBlocks, APublishedChainIsFoundUpToItsFirstDifference) {
  KvBlocks ids(16, true);
  const std::vector<int32_t> a = tokens(3 * kB + 5, 100);  // 3 full blocks and 5 tokens
  const std::vector<int32_t> row = fill(ids, a);
  ASSERT_EQ(row.size(), 4u);
  EXPECT_EQ(ids.stats().cached_blocks, 3);  // the partial block is not published
  // The same prompt again: its 3 full blocks, each now held twice.
  std::vector<uint64_t> hashes;
  EXPECT_EQ(ids.match(a, 10, &hashes), (std::vector<int32_t>{row[0], row[1], row[2]}));
  EXPECT_EQ(hashes.size(), 3u);
  EXPECT_EQ(hashes[0], KvBlocks::chain(KvBlocks::kNoParent, std::span<const int32_t>(a).first(kB)));
  // At most max_blocks.
  EXPECT_EQ(ids.match(a, 2), (std::vector<int32_t>{row[0], row[1]}));
  // A prompt that differs in its second block's last token: the first block only, even though
  // its third block is equal (a block is found only after the same tokens).
  std::vector<int32_t> b = a;
  b[2 * kB - 1] += 1;
  EXPECT_EQ(ids.match(b, 10), (std::vector<int32_t>{row[0]}));
  // Differing in the first token: nothing.
  std::vector<int32_t> c = a;
  c[0] = 7;
  EXPECT_TRUE(ids.match(c, 10).empty());
  // A shorter prompt: only its full blocks.
  EXPECT_EQ(ids.match(std::vector<int32_t>(a.begin(), a.begin() + kB + 3), 10), (std::vector<int32_t>{row[0]}));
  EXPECT_EQ(ids.stats().hit_tokens, (3 + 2 + 1 + 0 + 1) * kB);
}

TEST(KvBlocks, BlocksNobodyHoldsStayCachedUntilThePoolNeedsThemLastBlockFirst) {
  KvBlocks ids(4, true);
  const std::vector<int32_t> a = tokens(3 * kB, 0);
  const std::vector<int32_t> row = fill(ids, a);  // 3 blocks, all published
  release(ids, row);
  EXPECT_EQ(ids.available(), 4);
  EXPECT_EQ(ids.held(), 0);
  EXPECT_EQ(ids.stats().cached_blocks, 3);
  // A free block first, then the cached ones, least recently used first: the chain's last block
  // (released first) before its first.
  EXPECT_EQ(ids.take(), 3);
  EXPECT_EQ(ids.take(), row[2]);
  EXPECT_EQ(ids.stats().evictions, 1);
  EXPECT_EQ(ids.stats().cached_blocks, 2);
  // What is left is still found; the evicted block is not.
  EXPECT_EQ(ids.match(a, 3), (std::vector<int32_t>{row[0], row[1]}));
  // Held blocks are never handed out: nothing left.
  EXPECT_THROW(ids.take(), Error);
}

TEST(KvBlocks, TheFirstOfTwoEqualBlocksStaysCached) {
  KvBlocks ids(8, true);
  const std::vector<int32_t> a = tokens(kB + 1, 5);
  const std::vector<int32_t> r1 = fill(ids, a), r2 = fill(ids, std::vector<int32_t>(a));
  // r2 found r1's block (published before it started).
  EXPECT_EQ(r2[0], r1[0]);
  // Side by side: both take blocks of their own before either publishes.
  const int32_t x = ids.take(), y = ids.take();
  PrefixChain cx, cy;
  const std::vector<int32_t> b = tokens(kB, 900);
  const std::vector<int32_t> rx{x}, ry{y};
  cx.wrote(b, std::span<const int32_t>(rx), ids);
  cy.wrote(b, std::span<const int32_t>(ry), ids);
  EXPECT_EQ(cx.hash, cy.hash);
  EXPECT_EQ(ids.match(b, 1), (std::vector<int32_t>{x}));
  ids.release(y);  // not cached: free at once
  EXPECT_EQ(ids.take(), y);
}

TEST(KvBlocks, WithoutThePrefixCacheNothingIsFound) {
  KvBlocks ids(8, false);
  const std::vector<int32_t> a = tokens(2 * kB + 1, 0);
  size_t cached = 9;
  const std::vector<int32_t> row = fill(ids, a, &cached);
  EXPECT_EQ(cached, 0u);
  fill(ids, a, &cached);
  EXPECT_EQ(cached, 0u);
  release(ids, row);
  EXPECT_EQ(ids.stats().cached_blocks, 0);
  EXPECT_EQ(ids.available(), 8 - 3);
}

// Sequences of random prompts that share beginnings open, grow and close at random. A model
// records the whole prefix each published block was computed for; every block a match gives must
// hold exactly the prompt's tokens up to its end, no block is ever held by a sequence that
// writes it while another holds it, and the counts add up.
TEST(KvBlocks, RandomSequencesOnlyShareBlocksOfEqualPrefixes) {
  const int64_t blocks = 40;
  KvBlocks ids(blocks, true);
  std::mt19937 rng(11);
  struct Seq {
    std::vector<int32_t> prompt, row;
  };
  std::vector<Seq> open;
  std::map<int32_t, std::vector<int32_t>> content;  // block -> the prefix whose last 16 it holds
  std::vector<std::vector<int32_t>> stems;
  for (int i = 0; i < 4; ++i) {
    std::vector<int32_t> s(size_t(kB * (1 + rng() % 4)));
    for (auto& t : s) t = int32_t(rng() % 3);  // few tokens: many equal blocks in different places
    stems.push_back(s);
  }
  int64_t hits = 0;
  for (int step = 0; step < 3000; ++step) {
    if (!open.empty() && (rng() % 2 || open.size() > 6)) {
      const size_t k = rng() % open.size();
      release(ids, open[k].row);
      open.erase(open.begin() + std::ptrdiff_t(k));
      continue;
    }
    Seq s;
    s.prompt = stems[rng() % stems.size()];
    for (int n = int(rng() % 40); n > 0; --n) s.prompt.push_back(int32_t(rng() % 3));
    if (s.prompt.empty()) s.prompt.push_back(1);
    const int64_t need = (int64_t(s.prompt.size()) + kB - 1) / kB;
    std::vector<uint64_t> hashes;
    s.row = ids.match(s.prompt, (int64_t(s.prompt.size()) - 1) / kB, &hashes);
    hits += int64_t(s.row.size());
    for (size_t i = 0; i < s.row.size(); ++i) {
      const std::vector<int32_t> want(s.prompt.begin(), s.prompt.begin() + std::ptrdiff_t((i + 1) * kB));
      ASSERT_EQ(content.at(s.row[i]), want) << "block " << s.row[i] << " at " << i;
    }
    if (need - int64_t(s.row.size()) > ids.available()) {
      release(ids, s.row);
      continue;
    }
    PrefixChain chain;
    chain.start(s.prompt, hashes);
    while (int64_t(s.row.size()) < need) {
      const int32_t b = ids.take();
      content.erase(b);  // evicted or free: whatever it held is gone
      s.row.push_back(b);
    }
    const size_t before = chain.published;
    chain.wrote(std::span<const int32_t>(s.prompt).subspan(chain.tokens.size()), std::span<const int32_t>(s.row), ids);
    for (size_t i = before; i < chain.published; ++i)
      if (!content.count(s.row[i]))
        content[s.row[i]] = std::vector<int32_t>(s.prompt.begin(), s.prompt.begin() + std::ptrdiff_t((i + 1) * kB));
    // Blocks held: the union of the open rows; no own (unpublished) block in two rows.
    std::set<int32_t> held;
    std::map<int32_t, int> uses;
    for (const Seq& o : open)
      for (int32_t b : o.row) held.insert(b), ++uses[b];
    for (int32_t b : s.row) held.insert(b), ++uses[b];
    for (auto [b, n] : uses) {
      if (n > 1) {
        ASSERT_TRUE(content.count(b)) << "block " << b << " shared but never published";
      }
    }
    ASSERT_EQ(ids.held(), int64_t(held.size()));
    open.push_back(std::move(s));
  }
  EXPECT_GT(hits, 500);  // the prompts did share blocks
  EXPECT_GT(ids.stats().evictions, 0);
}

}  // namespace
}  // namespace kestrel
