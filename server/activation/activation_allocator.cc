#include "server/activation/activation_allocator.h"

#include <iterator>

#include "common/fnv.h"

namespace zeroshard {

ArenaAllocator::ArenaAllocator(uint64_t begin, uint64_t capacity, uint64_t alignment)
    : alignment_(alignment == 0 ? 1 : alignment) {
  const uint64_t end = begin + capacity;
  begin_ = RoundUp(begin);
  const uint64_t aligned_end = end & ~(alignment_ - 1);
  capacity_ = aligned_end > begin_ ? aligned_end - begin_ : 0;
  free_bytes_ = 0;
  if (capacity_ > 0) InsertFree(begin_, capacity_);
}

void ArenaAllocator::InsertFree(uint64_t offset, uint64_t size) {
  free_.emplace(offset, size);
  free_sizes_.insert(size);
  free_bytes_ += size;
}

void ArenaAllocator::EraseFree(std::map<uint64_t, uint64_t>::iterator it) {
  free_sizes_.erase(free_sizes_.find(it->second));
  free_bytes_ -= it->second;
  free_.erase(it);
}

std::optional<uint64_t> ArenaAllocator::Allocate(uint64_t bytes) {
  if (bytes == 0) return std::nullopt;
  const uint64_t size = RoundUp(bytes);
  if (size < bytes || size > largest_free()) return std::nullopt;
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < size) continue;
    const uint64_t offset = it->first;
    const uint64_t rest = it->second - size;
    EraseFree(it);
    if (rest > 0) InsertFree(offset + size, rest);
    used_.emplace(offset, size);
    return offset;
  }
  return std::nullopt;  // unreachable: largest_free() said one fits
}

uint64_t ArenaAllocator::Free(uint64_t offset) {
  auto used = used_.find(offset);
  if (used == used_.end()) return 0;
  const uint64_t size = used->second;
  used_.erase(used);
  uint64_t begin = offset;
  uint64_t end = offset + size;
  auto next = free_.lower_bound(offset);
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == begin) {
      begin = prev->first;
      EraseFree(prev);
    }
  }
  if (next != free_.end() && next->first == end) {
    end += next->second;
    EraseFree(next);
  }
  InsertFree(begin, end - begin);
  return size;
}

uint64_t ArenaAllocator::BlockSize(uint64_t offset) const {
  auto it = used_.find(offset);
  return it == used_.end() ? 0 : it->second;
}

void ArenaAllocator::Hash(uint64_t& h) const {
  for (const auto& [offset, size] : free_) {
    Fnv1aMix(h, &offset, sizeof(offset));
    Fnv1aMix(h, &size, sizeof(size));
  }
  const uint64_t separator = ~uint64_t{0};
  Fnv1aMix(h, &separator, sizeof(separator));
  for (const auto& [offset, size] : used_) {
    Fnv1aMix(h, &offset, sizeof(offset));
    Fnv1aMix(h, &size, sizeof(size));
  }
}

}  // namespace zeroshard
