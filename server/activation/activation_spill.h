#pragma once

// Where the activation store puts slices that do not fit its arena: one file
// per slice under --spill_dir, written and read with io_uring.
//
// SpillDirectory owns a daemon's files in the directory. Several daemons may
// share one directory: each takes an instance lock (flock on
// `zeroshard-spill.<instance>.lock`) for its lifetime and names its files
// `zeroshard-spill.<instance>.<n>`. At start a daemon removes the files of
// instances whose lock nobody holds any more (daemons that were killed);
// nothing else in the directory is touched.
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

class SpillDirectory {
 public:
  // The alignment direct I/O gets here: buffers, lengths and offsets of
  // O_DIRECT reads and writes are multiples of it.
  static constexpr uint64_t kDirectAlignment = 4096;

  enum class DirectIo { kIfSupported, kNever };
  // Creates `dir` if missing, removes the files of dead instances, takes a
  // new instance lock, and probes whether O_DIRECT works there (a file
  // system that refuses it with EINVAL, like tmpfs before Linux 6.6, gets
  // buffered I/O through the page cache; so does kNever). Blocks on the
  // file system. InvalidArgument for an empty path; the errno text naming
  // the path when the directory cannot be used; FailedPrecondition (as
  // MakeDirectories) for a directory owned by neither this user nor root,
  // or writable by group or others without the sticky bit. Directories it
  // makes are mode 0700, files 0600.
  static absl::StatusOr<std::unique_ptr<SpillDirectory>> Open(
      const std::string& dir, DirectIo direct_io = DirectIo::kIfSupported);
  // Removes this instance's remaining files and its lock.
  ~SpillDirectory();

  const std::string& dir() const { return dir_; }
  // Whether files are opened with O_DIRECT.
  bool direct() const { return direct_; }
  // Files of dead instances (and their locks) removed by Open.
  size_t removed_at_open() const { return removed_at_open_; }

  // A path for a new file of this instance (never the same twice).
  std::string NewPath();
  // Opens `path` for writing (a new file: anything already there, a link
  // included, is an error) or reading (not through a link); O_DIRECT when
  // direct(). Blocks on the file system; returns the descriptor, which the
  // caller closes, or the errno text naming the path.
  absl::StatusOr<int> OpenForWrite(const std::string& path) const;
  absl::StatusOr<int> OpenForRead(const std::string& path) const;
  // Removes a file of this instance; a missing file is not an error.
  static void Remove(const std::string& path);

  // Whether `name` is a spill file or lock of some instance (the names Open
  // may remove).
  static bool IsSpillName(absl::string_view name);

 private:
  explicit SpillDirectory(std::string dir) : dir_(std::move(dir)) {}
  absl::Status TakeLock();
  void RemoveDeadInstances();
  absl::Status ProbeDirect(DirectIo direct_io);

  const std::string dir_;
  std::string instance_;
  int lock_fd_ = -1;
  bool direct_ = false;
  size_t removed_at_open_ = 0;
  std::atomic<uint64_t> next_file_{1};
};

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
