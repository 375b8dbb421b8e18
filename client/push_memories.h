#pragma once

// The push memories of one Client (Client::AllocatePushMemory): gradient
// memory that a daemon on the same host sums in place
// (transport/shm/push_memory.h). The bulk data paths look up here whether a
// push's bytes lie in one of them; a memory stays findable while its owner
// (the caller of Allocate) holds it.
//
// Thread-safe; no call blocks on anything but the system calls of Allocate.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "transport/shm/push_memory.h"

namespace zeroshard {

class PushMemories {
 public:
  // A new push memory of `bytes` (rounded up to pages), registered here.
  // transport::PushMemory::Create's errors.
  absl::StatusOr<std::shared_ptr<transport::PushMemory>> Allocate(size_t bytes);

  struct Found {
    std::shared_ptr<const transport::PushMemory> memory;  // held while the push needs it
    uint64_t serial = 0;  // unique per allocation in this process, never reused
    uint64_t offset = 0;  // of the range's first byte in it
  };
  // The registered memory that holds [p, p + n) whole (n > 0), if its owner
  // still holds it.
  std::optional<Found> Find(const void* p, size_t n) const;

 private:
  struct Entry {
    std::weak_ptr<transport::PushMemory> memory;
    uint64_t serial = 0;
  };
  mutable absl::Mutex mu_;
  std::vector<Entry> entries_ ABSL_GUARDED_BY(mu_);
  uint64_t next_serial_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace zeroshard
