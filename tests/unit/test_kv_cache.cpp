// The paged KV cache: positions in blocks of 16 from a pool, taken as positions are reserved and
// given back on truncate or destruction; sequences sharing a pool never see each other's rows.
#include <gtest/gtest.h>

#include "common/error.h"
#include "runtime/kv_cache.h"

namespace kestrel {
namespace {

const KvLayout kLayout{6, 6, 3, {true, false}};  // 2 layers: k and v rows of 6, index rows in layer 0

TEST(KvCache, BlocksAreTakenAsPositionsAreReservedAndGivenBack) {
  auto pool = std::make_shared<KvBlockPool>(2, kLayout, 4);
  EXPECT_EQ(pool->block_bytes(), size_t(16 * (6 + 6 + 3 + 6 + 6)) * 4);
  {
    KvCache a(pool, 40);
    a.reserve(1);
    EXPECT_EQ(pool->in_use(), 1);
    a.commit(1);
    a.reserve(16);  // positions 1..16: a second block
    EXPECT_EQ(pool->in_use(), 2);
    a.commit(16);
    a.truncate(5);
    EXPECT_EQ(pool->in_use(), 1);
    EXPECT_THROW(a.reserve(36), Error);  // past its capacity of 40
  }
  EXPECT_EQ(pool->in_use(), 0);
}

TEST(KvCache, SequencesSharingAPoolKeepTheirOwnRows) {
  auto pool = std::make_shared<KvBlockPool>(2, kLayout, 8);
  KvCache a(pool, 64), b(pool, 64);
  for (int step = 0; step < 40; ++step) {  // interleaved, so their blocks alternate in the pool
    for (KvCache* c : {&a, &b}) {
      c->reserve(1);
      const float tag = (c == &a ? 1000.0f : 2000.0f) + float(step);
      for (int l = 0; l < 2; ++l) {
        for (int i = 0; i < 6; ++i) c->k(l, step)[i] = tag + 0.1f * float(l);
        for (int i = 0; i < 6; ++i) c->v(l, step)[i] = -tag - 0.1f * float(l);
      }
      for (int i = 0; i < 3; ++i) c->index_key(0, step)[i] = tag + 0.5f;
      c->commit(1);
    }
  }
  EXPECT_EQ(pool->in_use(), 6);  // 40 positions: 3 blocks each
  for (int step = 0; step < 40; ++step)
    for (KvCache* c : {&a, &b}) {
      const float tag = (c == &a ? 1000.0f : 2000.0f) + float(step);
      for (int l = 0; l < 2; ++l) {
        EXPECT_EQ(c->k(l, step)[5], tag + 0.1f * float(l));
        EXPECT_EQ(c->v(l, step)[0], -tag - 0.1f * float(l));
      }
      EXPECT_EQ(c->index_key(0, step)[2], tag + 0.5f);
    }
}

TEST(KvCache, AnEmptyPoolSaysSo) {
  auto pool = std::make_shared<KvBlockPool>(2, kLayout, 2);
  KvCache a(pool, 64);
  a.reserve(32);
  KvCache b(pool, 64);
  try {
    b.reserve(1);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "KV cache full: all 2 blocks of 16 positions are in use");
  }
}

}  // namespace
}  // namespace kestrel
