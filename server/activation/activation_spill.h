#pragma once

// Where the activation store puts slices that do not fit its arena: one file
// per slice in an InstanceDirectory (server/disk) under --spill_dir, written
// and read with io_uring.
//
// SpillIo runs asynchronous reads and writes on one io_uring ring: callers
// queue them (never waiting for the disk; the kernel's workers do), a thread
// it owns issues them to the kernel, and another reaps completions and runs
// the callers' callbacks. (The kernel cancels a thread's io_uring requests
// when the thread exits; callers' threads come and go, SpillIo's stay. The
// issuing thread never waits for a callback, however long one takes.)

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

struct io_uring;

namespace zeroshard {

class SpillIo {
 public:
  // Runs on SpillIo's completion thread, with no SpillIo lock held: OK when
  // all the bytes moved, otherwise the error (a read that hits the end of
  // the file early is DataLoss). Must not block for long: it delays every
  // other completion.
  using Done = std::function<void(absl::Status)>;

  // A ring of `queue_depth` entries and its completion thread. Unavailable
  // when the kernel refuses io_uring (too old, or blocked by a seccomp
  // policy).
  static absl::StatusOr<std::unique_ptr<SpillIo>> Create(unsigned queue_depth);
  // Waits (at most kDrainWait) for every operation in flight and its
  // callback, then stops the thread.
  ~SpillIo();
  static constexpr absl::Duration kDrainWait = absl::Seconds(60);

  // Writes `length` bytes of `buffer` to `fd` at file offset 0, or reads
  // them from it into `buffer`, asynchronously; `done` runs once when the
  // operation ends. `buffer` and `fd` belong to the operation until then.
  // Blocks while queue_depth operations are in flight, until `deadline`.
  // An error means nothing was queued and `done` is never called:
  // DeadlineExceeded, InvalidArgument (length 0), FailedPrecondition
  // (shutting down).
  absl::Status Write(int fd, const void* buffer, size_t length, absl::Time deadline, Done done);
  absl::Status Read(int fd, void* buffer, size_t length, absl::Time deadline, Done done);

  size_t in_flight() const;

 private:
  struct Op;
  explicit SpillIo(unsigned queue_depth);
  absl::Status Submit(std::unique_ptr<Op> op, absl::Time deadline);
  // Queues the op's next piece and submits the queue; on SpillIo's threads
  // only.
  void QueueLocked(Op* op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // io_uring_submit, retried briefly while the kernel lacks resources.
  void SubmitLocked(absl::string_view what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // issuer_: pending_ to the kernel, until stopped.
  void Issue() ABSL_LOCKS_EXCLUDED(mu_);
  // thread_: completions and callbacks, until the stop marker.
  void Run() ABSL_LOCKS_EXCLUDED(mu_);
  void Finish(Op* op, absl::Status status);

  const unsigned depth_;
  std::unique_ptr<struct io_uring> ring_;
  bool ring_ready_ = false;
  mutable absl::Mutex mu_;  // the submission queue and the counters
  size_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;      // pending_ and those issued
  std::vector<Op*> pending_ ABSL_GUARDED_BY(mu_);  // accepted, for issuer_
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_issuer_ ABSL_GUARDED_BY(mu_) = false;
  std::thread issuer_;
  std::thread thread_;
};

}  // namespace zeroshard
