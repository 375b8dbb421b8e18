#pragma once

// Gradient memory a shard daemon on the same host reads in place.
//
// A trainer allocates a PushMemory: anonymous shared memory (memfd) whose
// size is sealed (it can neither shrink nor grow) and whose name carries a
// 128-bit random secret. The trainer keeps its gradients there and tells the
// daemon, over the authenticated control plane, its process id, the memory's
// file descriptor number, the name and the size. The daemon takes that
// descriptor (PeerMemory::Open) and maps the memory read-only; it sums a
// pushed gradient straight from there instead of from a staging slot the
// trainer copied it into (one pass over the bytes instead of two).
//
// How the daemon gets it: it reads the descriptor's mount in
// /proc/<pid>/fdinfo/<fd> and takes only one on the kernel's shared-memory
// mount, duplicating it (pidfd_open + pidfd_getfd) and checking the copy's
// mount again, so no file is opened by path and no other filesystem (FUSE)
// is asked anything, a close included. What the checks give the daemon: the file
// must be sealed against shrinking (only shared-memory files carry seals)
// and live on tmpfs (not hugetlbfs), so no later truncation or hole can turn
// the daemon's reads into SIGBUS; its name must be exactly the one given,
// whose random part a process learns only from the trainer or by reading
// its /proc files (rights that already let it read the trainer's memory);
// it must be at least `bytes` long, at most kMaxPushMemoryBytes. A trainer
// can still write its memory while the daemon reads it: that changes only
// its own contribution, as sending other bytes would. The duplication needs
// the daemon to see the trainer's process (same host and pid namespace) and
// the right to ptrace it (same user without a stricter ptrace policy, or
// CAP_SYS_PTRACE); otherwise Open fails and the trainer sends through the
// bulk transport as before. Under Yama's ptrace_scope 1 (Ubuntu's default)
// only a daemon that is the trainer's ancestor, or holds CAP_SYS_PTRACE
// (root), may take it.

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace zeroshard::transport {

// The owner's side. Not copyable; destroying it unmaps and closes the memory
// (a daemon that mapped it keeps its own mapping until it lets go).
class PushMemory {
 public:
  // `bytes` (> 0, rounded up to whole pages) of zeroed, sealed shared memory.
  // ResourceExhausted when the system refuses; InvalidArgument for 0.
  static absl::StatusOr<std::unique_ptr<PushMemory>> Create(size_t bytes);
  ~PushMemory();
  PushMemory(const PushMemory&) = delete;
  PushMemory& operator=(const PushMemory&) = delete;

  void* data() const { return data_; }
  size_t size() const { return size_; }
  // What a daemon needs to open it (PeerMemory::Open).
  pid_t pid() const { return pid_; }
  int fd() const { return fd_; }
  const std::string& name() const { return name_; }
  // Whether [p, p + n) lies inside this memory; sets *offset to p's.
  bool Contains(const void* p, size_t n, uint64_t* offset) const;

 private:
  PushMemory(void* data, size_t size, int fd, std::string name);

  void* const data_;
  const size_t size_;
  const int fd_;
  const pid_t pid_;
  const std::string name_;
};

// The reader's side: a trainer's PushMemory mapped read-only. Not copyable;
// destroying it unmaps.
class PeerMemory {
 public:
  // Takes descriptor `fd` of process `pid` and maps its first `bytes`
  // (1..kMaxPushMemoryBytes) read-only, at another page offset within 2
  // MiB than this process's previous mappings (memories summed together are
  // read faster so: push_memory.cc). FailedPrecondition when the
  // descriptor cannot be taken (another host, another pid namespace, no
  // right to ptrace the process, no such descriptor: the message says which
  // errno) or is not a tmpfs memfd named `name` sealed against shrinking and
  // at least `bytes` long; InvalidArgument for a malformed argument. Reads
  // nothing of the memory; never blocks on a filesystem.
  static absl::StatusOr<std::unique_ptr<PeerMemory>> Open(int64_t pid, int64_t fd,
                                                          absl::string_view name,
                                                          uint64_t bytes);
  ~PeerMemory();
  PeerMemory(const PeerMemory&) = delete;
  PeerMemory& operator=(const PeerMemory&) = delete;

  // The mapped bytes.
  absl::string_view bytes() const {
    return absl::string_view(static_cast<const char*>(data_), size_);
  }

 private:
  PeerMemory(const void* data, size_t size) : data_(data), size_(size) {}

  const void* const data_;
  const size_t size_;
};

// The longest name PushMemory gives and PeerMemory::Open accepts.
inline constexpr size_t kMaxPushMemoryName = 64;
// The most bytes PeerMemory::Open maps (callers bound it further).
inline constexpr uint64_t kMaxPushMemoryBytes = uint64_t{1} << 40;

}  // namespace zeroshard::transport
