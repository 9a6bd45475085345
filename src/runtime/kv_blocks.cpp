#include "runtime/kv_blocks.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "common/error.h"

namespace kestrel {

KvBlocks::KvBlocks(int64_t blocks, bool prefix_cache) : prefix_cache_(prefix_cache) {
  if (blocks < 0 || blocks >= std::numeric_limits<int32_t>::max())
    fail("a KV pool of ", blocks, " blocks: expected 0 to ", std::numeric_limits<int32_t>::max() - 1);
  refs_.assign(size_t(blocks), 0);
  free_.resize(size_t(blocks));
  for (int64_t i = 0; i < blocks; ++i) free_[size_t(i)] = int32_t(blocks - 1 - i);  // block 0 first
  idle_at_.resize(size_t(blocks));
  hash_of_.assign(size_t(blocks), 0);
  cached_.assign(size_t(blocks), false);
}

void KvBlocks::check(int32_t block) const {
  if (block < 0 || block >= int32_t(refs_.size())) fail("internal: KV block ", block, " outside 0..", refs_.size() - 1);
}

int32_t KvBlocks::take() {
  int32_t b;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else if (!idle_.empty()) {
    b = idle_.front();
    idle_.pop_front();
    drop_cached(b);
    ++stats_.evictions;
  } else {
    fail("KV cache full: all ", refs_.size(), " blocks of ", kBlock, " positions are in use");
  }
  refs_[size_t(b)] = 1;
  return b;
}

void KvBlocks::release(int32_t block) {
  check(block);
  int32_t& r = refs_[size_t(block)];
  if (r <= 0) fail("internal: KV block ", block, " released more often than taken");
  if (--r > 0) return;
  if (cached_[size_t(block)]) {
    idle_.push_back(block);
    idle_at_[size_t(block)] = std::prev(idle_.end());
  } else {
    free_.push_back(block);
  }
}

void KvBlocks::drop_cached(int32_t block) {
  const uint64_t h = hash_of_[size_t(block)];
  auto [lo, hi] = entries_.equal_range(h);
  for (auto it = lo; it != hi; ++it)
    if (it->second.block == block) {
      entries_.erase(it);
      break;
    }
  cached_[size_t(block)] = false;
  --stats_.cached_blocks;
}

uint64_t KvBlocks::chain(uint64_t parent, std::span<const int32_t> tokens) {
  // FNV-1a over the parent's hash and the tokens' bytes, then a 64-bit finalizer (splitmix64's)
  // so that neighbouring inputs spread over the whole range.
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 0x100000001b3ull;
    }
  };
  mix(parent);
  for (int32_t t : tokens) mix(uint64_t(uint32_t(t)));
  h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
  h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
  return h ^ (h >> 31);
}

std::vector<int32_t> KvBlocks::match(std::span<const int32_t> tokens, int64_t max_blocks, std::vector<uint64_t>* hashes) {
  std::vector<int32_t> out;
  if (hashes) hashes->clear();
  if (!prefix_cache_) return out;
  const int64_t n = std::min<int64_t>(max_blocks, int64_t(tokens.size()) / kBlock);
  ++stats_.lookups;
  stats_.lookup_tokens += std::max<int64_t>(n, 0) * kBlock;
  uint64_t parent = kNoParent;
  for (int64_t i = 0; i < n; ++i) {
    const std::span<const int32_t> t = tokens.subspan(size_t(i * kBlock), kBlock);
    const uint64_t h = chain(parent, t);
    int32_t found = -1;
    auto [lo, hi] = entries_.equal_range(h);
    for (auto it = lo; it != hi && found < 0; ++it)
      if (it->second.parent == parent && std::equal(t.begin(), t.end(), it->second.tokens)) found = it->second.block;
    if (found < 0) break;
    if (refs_[size_t(found)]++ == 0) idle_.erase(idle_at_[size_t(found)]);
    out.push_back(found);
    if (hashes) hashes->push_back(h);
    parent = h;
  }
  stats_.hit_tokens += int64_t(out.size()) * kBlock;
  return out;
}

uint64_t KvBlocks::publish(uint64_t parent, std::span<const int32_t> tokens, int32_t block) {
  check(block);
  if (tokens.size() != size_t(kBlock)) fail("internal: a KV block holds ", kBlock, " tokens, not ", tokens.size());
  const uint64_t h = chain(parent, tokens);
  if (!prefix_cache_ || cached_[size_t(block)]) return h;
  if (refs_[size_t(block)] <= 0) fail("internal: KV block ", block, " published by nobody who holds it");
  auto [lo, hi] = entries_.equal_range(h);
  for (auto it = lo; it != hi; ++it)
    if (it->second.parent == parent && std::equal(tokens.begin(), tokens.end(), it->second.tokens)) return h;
  Entry e;
  e.parent = parent;
  std::memcpy(e.tokens, tokens.data(), sizeof e.tokens);
  e.block = block;
  entries_.emplace(h, e);
  hash_of_[size_t(block)] = h;
  cached_[size_t(block)] = true;
  ++stats_.cached_blocks;
  return h;
}

}  // namespace kestrel
