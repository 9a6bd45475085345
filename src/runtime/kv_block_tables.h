// The block tables of a paged KV cache that sequence slots share (the GPU's, backend/cuda/
// gpu_slots.h), kept on the host: which blocks of the pool each open slot holds and which are
// free. Row `slot` lists the slot's blocks, positions [16 i, 16 i + 16) in block row[i].
// The pool has one block more than the tables hand out, the spare: every entry a slot does not
// own points there (all of a closed slot's row, the rest of an open one's), so a batched step's
// rows that hold no sequence, or that write past a sequence's reservation, write into the spare
// and never into another sequence's blocks. The ids come from KvBlocks (kv_blocks.h), which also
// keeps the prefix cache: a row may start with cached blocks other rows hold too.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "runtime/kv_blocks.h"

namespace kestrel {

class KvBlockTables {
 public:
  // `blocks` to hand out (ids 0 .. blocks - 1; the spare is id `blocks`), `slots` rows of
  // ceil(context / 16) entries.
  KvBlockTables(int64_t blocks, int slots, int64_t context, bool prefix_cache = false);

  int64_t blocks() const { return ids_.blocks(); }
  int64_t pool_blocks() const { return blocks() + 1; }  // with the spare
  int32_t spare() const { return int32_t(blocks()); }
  int slots() const { return int(held_.size()); }
  int64_t stride() const { return stride_; }  // entries per row
  int64_t free_blocks() const { return ids_.available(); }  // free or cached by nobody held
  KvBlocks& ids() { return ids_; }
  const KvBlocks& ids() const { return ids_; }

  // Gives `slot` the blocks of `positions` positions: first `cached` (blocks of the prefix cache
  // whose references the caller hands over, KvBlocks::match), then blocks of its own. Fails
  // naming the numbers when the slot is open, the positions pass the context, or not enough
  // blocks are free (the cached ones are then released).
  void open(int slot, int64_t positions, std::span<const int32_t> cached = {});
  // Gives the slot's blocks back, its last first (so that a chain's first blocks stay cached
  // longest); the most recently freed are taken first by the next open.
  void close(int slot);
  bool is_open(int slot) const { return held_[check(slot)] >= 0; }
  int64_t held(int slot) const { return is_open(slot) ? held_[size_t(slot)] : 0; }  // blocks
  std::span<const int32_t> row(int slot) const;

  // The slots whose rows changed (open, close) since clear_changed(), ascending; at first every
  // slot. Copies of the tables elsewhere follow them and then clear.
  std::vector<int> changed() const;
  void clear_changed() { changed_.assign(changed_.size(), false); }

 private:
  size_t check(int slot) const;  // the slot as an index, or fails

  KvBlocks ids_;
  int64_t stride_;
  std::vector<int32_t> table_;  // [slots][stride_]
  std::vector<int64_t> held_;   // blocks per slot, -1 when closed
  std::vector<bool> changed_;
};

}  // namespace kestrel
