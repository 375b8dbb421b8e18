#include "client/push_memories.h"

#include <algorithm>

namespace zeroshard {

absl::StatusOr<std::shared_ptr<transport::PushMemory>> PushMemories::Allocate(size_t bytes) {
  absl::StatusOr<std::unique_ptr<transport::PushMemory>> made =
      transport::PushMemory::Create(bytes);
  if (!made.ok()) return made.status();
  std::shared_ptr<transport::PushMemory> memory = *std::move(made);
  absl::MutexLock lock(&mu_);
  // Memories their owners let go of are forgotten here.
  entries_.erase(std::remove_if(entries_.begin(), entries_.end(),
                                [](const Entry& e) { return e.memory.expired(); }),
                 entries_.end());
  entries_.push_back({memory, next_serial_++});
  return memory;
}

std::optional<PushMemories::Found> PushMemories::Find(const void* p, size_t n) const {
  if (n == 0) return std::nullopt;
  absl::MutexLock lock(&mu_);
  for (const Entry& e : entries_) {
    std::shared_ptr<transport::PushMemory> memory = e.memory.lock();
    uint64_t offset = 0;
    if (memory != nullptr && memory->Contains(p, n, &offset)) {
      return Found{std::move(memory), e.serial, offset};
    }
  }
  return std::nullopt;
}

}  // namespace zeroshard
