// The host side of the GPU's paged KV cache: slots take the blocks of the positions they reserve
// from a shared pool and give them back; every entry a slot does not own points at the spare
// block, so no slot's row ever reaches another slot's blocks.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>

#include "common/error.h"
#include "runtime/kv_block_tables.h"

namespace kestrel {
namespace {

std::vector<int32_t> row_of(const KvBlockTables& t, int slot) {
  const auto r = t.row(slot);
  return {r.begin(), r.end()};
}

TEST(KvBlockTables, StartWithEveryRowOnTheSpareAndEveryRowChanged) {
  KvBlockTables t(10, 3, 40);  // rows of ceil(40 / 16) = 3 entries
  EXPECT_EQ(t.stride(), 3);
  EXPECT_EQ(t.pool_blocks(), 11);
  EXPECT_EQ(t.spare(), 10);
  EXPECT_EQ(t.free_blocks(), 10);
  for (int s = 0; s < 3; ++s) {
    EXPECT_FALSE(t.is_open(s));
    EXPECT_EQ(row_of(t, s), (std::vector<int32_t>{10, 10, 10}));
  }
  EXPECT_EQ(t.changed(), (std::vector<int>{0, 1, 2}));
  t.clear_changed();
  EXPECT_TRUE(t.changed().empty());
}

TEST(KvBlockTables, OpenTakesWholeBlocksAndCloseGivesThemBackMostRecentFirst) {
  KvBlockTables t(6, 3, 64);
  t.clear_changed();
  t.open(1, 17);  // two blocks
  EXPECT_EQ(row_of(t, 1), (std::vector<int32_t>{0, 1, 6, 6}));
  EXPECT_EQ(t.held(1), 2);
  EXPECT_EQ(t.free_blocks(), 4);
  EXPECT_EQ(t.changed(), (std::vector<int>{1}));
  t.open(0, 48);  // exactly three
  EXPECT_EQ(row_of(t, 0), (std::vector<int32_t>{2, 3, 4, 6}));
  t.clear_changed();
  t.close(0);
  EXPECT_EQ(row_of(t, 0), (std::vector<int32_t>{6, 6, 6, 6}));
  EXPECT_FALSE(t.is_open(0));
  EXPECT_EQ(t.held(0), 0);
  EXPECT_EQ(t.changed(), (std::vector<int>{0}));
  t.open(2, 64);  // the freed blocks (given back last block first), last freed first, then the never used one
  EXPECT_EQ(row_of(t, 2), (std::vector<int32_t>{2, 3, 4, 5}));
  EXPECT_EQ(t.free_blocks(), 0);
  t.close(1);
  t.close(1);  // closing a closed slot does nothing
  EXPECT_EQ(t.free_blocks(), 2);
}

TEST(KvBlockTables, ASequenceThePoolCannotHoldNowIsRefusedNamingTheNumbers) {
  KvBlockTables t(4, 2, 128);
  t.open(0, 40);  // three blocks
  try {
    t.open(1, 20);
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("1 of its 4 blocks"), std::string::npos) << m;
    EXPECT_NE(m.find("20 positions needs 2"), std::string::npos) << m;
  }
  EXPECT_FALSE(t.is_open(1));
  EXPECT_EQ(t.free_blocks(), 1);
  EXPECT_THROW(t.open(0, 1), Error);    // already open
  EXPECT_THROW(t.open(1, 129), Error);  // past the context
  EXPECT_THROW(t.open(2, 1), Error);    // no such slot
  EXPECT_THROW(KvBlockTables(0, 2, 16), Error);
  t.open(1, 16);
  EXPECT_EQ(row_of(t, 1), (std::vector<int32_t>{3, 4, 4, 4, 4, 4, 4, 4}));
}

TEST(KvBlockTables, SlotsOpeningAndClosingAtRandomNeverShareABlock) {
  const int slots = 8, blocks = 40, context = 100;
  KvBlockTables t(blocks, slots, context);
  std::mt19937 rng(5);
  std::vector<int64_t> want(slots, -1);  // positions of each open slot
  for (int step = 0; step < 2000; ++step) {
    const int s = int(rng() % slots);
    if (t.is_open(s)) {
      t.close(s);
      want[size_t(s)] = -1;
    } else {
      const int64_t positions = int64_t(rng() % (context + 1));
      const int64_t need = (positions + 15) / 16;
      if (need > t.free_blocks()) {
        EXPECT_THROW(t.open(s, positions), Error);
      } else {
        t.open(s, positions);
        want[size_t(s)] = positions;
      }
    }
    std::set<int32_t> seen;
    int64_t held = 0;
    for (int i = 0; i < slots; ++i) {
      const auto r = row_of(t, i);
      const int64_t n = want[size_t(i)] < 0 ? 0 : (want[size_t(i)] + 15) / 16;
      ASSERT_EQ(t.held(i), n);
      for (int64_t k = 0; k < t.stride(); ++k) {
        if (k < n) {
          ASSERT_GE(r[size_t(k)], 0);
          ASSERT_LT(r[size_t(k)], blocks);
          ASSERT_TRUE(seen.insert(r[size_t(k)]).second) << "block " << r[size_t(k)] << " held twice";
        } else {
          ASSERT_EQ(r[size_t(k)], t.spare());
        }
      }
      held += n;
    }
    ASSERT_EQ(held + t.free_blocks(), blocks);
  }
}

}  // namespace
}  // namespace kestrel
