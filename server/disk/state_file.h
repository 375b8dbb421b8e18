#pragma once

// A file of fixed size holding one job's model states on a daemon's
// --state_dir (fp32 masters and optimizer moments that do not stay in RAM),
// moved in aligned pieces between the disk and the file's own buffers with
// io_uring, several transfers in flight.
//
// Ownership and threads: the StateFile owns the file (mode 0600, an
// unpredictable name of its InstanceDirectory, removed by the destructor)
// and `buffers` buffers of `buffer_bytes` each, aligned for direct I/O and
// allocated once by Create. Not thread-safe: one caller at a time (the job's
// step, checkpoint or state read, under the job's parameter lock); it starts
// no threads of its own. A transfer's buffer belongs to the kernel from
// Start* until Wait has returned its result; the caller does not touch it
// meanwhile. The kernel cancels a thread's io_uring transfers when the
// thread exits: the thread that starts a transfer must not end before the
// transfer has (Wait or WaitAll on it, or the destructor).
//
// Blocking: Create blocks on the file system (it allocates the file's
// blocks: a disk without room is found at registration, not in a step).
// Start* never waits for the disk, except while `queue_depth` transfers are
// running in the kernel (then until one ends, or the deadline); a transfer
// that has ended stays in flight, holding its id, until Wait returns it. Wait and WaitAll block
// until the transfers end or the deadline passes. After a DeadlineExceeded
// the transfer may still be running: the caller must treat the file's
// contents as unknown (the job's model states are damaged); the destructor
// waits for it (bounded by kDrainWait) before freeing the buffers.
//
// Without io_uring (kernel too old, or refused by a seccomp policy) every
// transfer runs synchronously inside Start* with pread/pwrite; io_uring()
// says which. (So does a transfer the kernel's ring refuses to take.)
// Without O_DIRECT (a file system that refuses it, e.g. tmpfs before Linux
// 6.6) transfers go through the page cache; direct() says which.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/disk/instance_directory.h"

namespace zeroshard {

class StateFile {
 public:
  // Offsets, lengths and buffer positions of every transfer are multiples of
  // this (direct I/O's alignment).
  static constexpr uint64_t kAlignment = InstanceDirectory::kDirectAlignment;
  static constexpr absl::Duration kDrainWait = absl::Seconds(60);

  // How transfers run: kIoUring where the kernel allows it (else as
  // kSynchronous); kSynchronous always with pread/pwrite inside Start*.
  enum class Engine { kIoUring, kSynchronous };

  // Creates a new file of `bytes` (a multiple of kAlignment, > 0) in `dir`
  // with every block allocated (fallocate; where the file system cannot,
  // zeros are written), and the buffers. Errors, with nothing left behind:
  // ResourceExhausted naming the directory and the size when the disk (or
  // a quota, or RLIMIT_FSIZE) has no room; ResourceExhausted when the
  // buffers cannot be allocated; InvalidArgument for a size or buffer size
  // that is not a positive multiple of kAlignment, or buffers == 0; the
  // errno text naming the path otherwise. `dir` must outlive the file.
  // RLIMIT_FSIZE is found as EFBIG only when the process ignores SIGXFSZ
  // (the daemon does); otherwise the signal kills it. queue_depth 0 counts
  // as 1.
  static absl::StatusOr<std::unique_ptr<StateFile>> Create(InstanceDirectory* dir,
                                                           uint64_t bytes, size_t buffer_bytes,
                                                           size_t buffers, unsigned queue_depth,
                                                           Engine engine = Engine::kIoUring);
  ~StateFile();

  StateFile(const StateFile&) = delete;
  StateFile& operator=(const StateFile&) = delete;

  // Buffer i (< buffers()), buffer_bytes() bytes aligned to kAlignment.
  char* buffer(size_t i) const;
  size_t buffers() const;
  size_t buffer_bytes() const;

  // Queues a transfer of `length` bytes between buffer(buffer) + at and the
  // file at `offset`; `id` names it for Wait and must differ from every
  // transfer in flight. InvalidArgument (nothing queued) for a misaligned or
  // out-of-bounds transfer, length 0, or an id in flight; DeadlineExceeded
  // when queue_depth transfers stay in flight until `deadline`. A transfer
  // whose queueing failed needs no Wait.
  absl::Status StartRead(uint64_t id, uint64_t offset, size_t buffer, size_t at, size_t length,
                         absl::Time deadline);
  absl::Status StartWrite(uint64_t id, uint64_t offset, size_t buffer, size_t at, size_t length,
                          absl::Time deadline);
  // Waits for transfer `id` and returns its result: OK when every byte
  // moved (short transfers are continued), else the errno text naming the
  // file (ResourceExhausted for ENOSPC/EDQUOT/EFBIG, DataLoss for EIO or
  // a read past the end, Internal otherwise); DeadlineExceeded when it has
  // not ended by `deadline`; NotFound for an id not in flight.
  absl::Status Wait(uint64_t id, absl::Time deadline);
  // Waits for every transfer in flight; the first error among them (in
  // the order they were started). DeadlineExceeded leaves them all in
  // flight.
  absl::Status WaitAll(absl::Time deadline);

  // Synchronous helpers: StartRead/StartWrite then Wait (id: any unused).
  absl::Status Read(uint64_t offset, size_t buffer, size_t at, size_t length,
                    absl::Time deadline);
  absl::Status Write(uint64_t offset, size_t buffer, size_t at, size_t length,
                     absl::Time deadline);

  const std::string& path() const;
  uint64_t size() const;
  bool direct() const;
  bool io_uring() const;
  // Transfers in flight: started, and not yet returned by Wait or WaitAll.
  size_t in_flight() const;

 private:
  class Impl;
  explicit StateFile(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zeroshard
