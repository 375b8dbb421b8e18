#pragma once

// The offset allocator behind a daemon's activation arena. Activation
// checkpoints are allocated during a step's forward pass, layer after layer,
// and freed after the same step's backward pass, in reverse order or all at
// once. First fit over the free blocks in address order fits that pattern:
// a forward pass fills the arena from the bottom up, the frees of backward
// coalesce back into one block, and holes left by spilled slices at the
// bottom are the first reused.
//
// Sizes and offsets are multiples of the alignment. The arena's unusable free
// space, `fragmentation()`, is the free bytes outside the largest free block:
// a request larger than the largest free block fails even when the free bytes
// would hold it.
//
// Not thread-safe: the ActivationStore guards it with its lock. Copyable (the
// store plans spills on a copy).

#include <cstdint>
#include <map>
#include <optional>
#include <set>

namespace zeroshard {

class ArenaAllocator {
 public:
  // Manages [begin, begin + capacity) with `alignment` (a power of two); the
  // range is shrunk inwards to alignment boundaries.
  ArenaAllocator(uint64_t begin, uint64_t capacity, uint64_t alignment);

  // The lowest-addressed free block that holds RoundUp(bytes) (bytes >= 1),
  // or nullopt when none does. Nothing changes on nullopt.
  std::optional<uint64_t> Allocate(uint64_t bytes);
  // Frees the block allocated at `offset`, merging it with free neighbours;
  // returns its size, or 0 (and changes nothing) when no block starts there.
  uint64_t Free(uint64_t offset);
  // The size of the block allocated at `offset`, or 0.
  uint64_t BlockSize(uint64_t offset) const;

  uint64_t RoundUp(uint64_t bytes) const { return (bytes + alignment_ - 1) & ~(alignment_ - 1); }
  // Whether Allocate(bytes) would succeed now.
  bool Fits(uint64_t bytes) const { return bytes >= 1 && RoundUp(bytes) <= largest_free(); }

  uint64_t alignment() const { return alignment_; }
  // First managed offset and managed bytes.
  uint64_t begin() const { return begin_; }
  uint64_t capacity() const { return capacity_; }
  uint64_t free_bytes() const { return free_bytes_; }
  uint64_t used_bytes() const { return capacity_ - free_bytes_; }
  uint64_t largest_free() const { return free_sizes_.empty() ? 0 : *free_sizes_.rbegin(); }
  uint64_t fragmentation() const { return free_bytes_ - largest_free(); }
  size_t free_blocks() const { return free_.size(); }
  size_t used_blocks() const { return used_.size(); }
  // The blocks allocated now: offset -> size, in address order.
  const std::map<uint64_t, uint64_t>& used() const { return used_; }

  // Folds the allocator's state into `h` (FNV-1a), for tests that check a
  // refused request changed nothing.
  void Hash(uint64_t& h) const;

 private:
  void InsertFree(uint64_t offset, uint64_t size);
  void EraseFree(std::map<uint64_t, uint64_t>::iterator it);

  uint64_t alignment_;
  uint64_t begin_;
  uint64_t capacity_;
  uint64_t free_bytes_;
  std::map<uint64_t, uint64_t> free_;  // offset -> size; never two adjacent
  std::multiset<uint64_t> free_sizes_;
  std::map<uint64_t, uint64_t> used_;  // offset -> size
};

}  // namespace zeroshard
