#pragma once

// A daemon's files in a directory it may share with other daemons (the
// activation store's --spill_dir, the model states' --state_dir).
//
// Each daemon takes an instance lock (flock on `<prefix><instance>.lock`)
// for its lifetime and names its files `<prefix><instance>.<n>`, where
// <instance> is 16 random hex digits. At start a daemon removes the files of
// instances whose lock nobody holds any more (daemons that were killed);
// nothing else in the directory is touched, and a directory shared by two
// kinds of file (two prefixes) keeps each kind to its own InstanceDirectory.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace zeroshard {

class InstanceDirectory {
 public:
  // The alignment direct I/O gets here: buffers, lengths and offsets of
  // O_DIRECT reads and writes are multiples of it.
  static constexpr uint64_t kDirectAlignment = 4096;

  // What the files are called and how errors and log lines name them.
  struct Naming {
    std::string flag;    // the flag that names the directory; starts every error message
    std::string prefix;  // every file and lock name starts with it
    std::string what;    // the kind of file in log lines ("removed 3 spill file(s) ...")
  };
  // {"--spill_dir", "zeroshard-spill.", "spill"}: the activation store's.
  static Naming SpillNaming();
  // {"--state_dir", "zeroshard-state.", "state"}: the model states' files.
  static Naming StateNaming();

  enum class DirectIo { kIfSupported, kNever };
  // Creates `dir` if missing, removes the files of dead instances, takes a
  // new instance lock, and probes whether O_DIRECT works there (a file
  // system that refuses it with EINVAL, like tmpfs before Linux 6.6, gets
  // buffered I/O through the page cache; so does kNever). Blocks on the
  // file system. InvalidArgument for an empty path or a naming without a
  // flag or a prefix; the errno text naming the path when the directory
  // cannot be used; FailedPrecondition (as MakeDirectories) for a directory
  // owned by neither this user nor root, or writable by group or others
  // without the sticky bit. Directories it makes are mode 0700, files 0600.
  // Every message starts with `naming.flag`.
  static absl::StatusOr<std::unique_ptr<InstanceDirectory>> Open(
      const std::string& dir, Naming naming, DirectIo direct_io = DirectIo::kIfSupported);
  // Removes this instance's remaining files and its lock. Blocks on the
  // file system.
  ~InstanceDirectory();

  InstanceDirectory(const InstanceDirectory&) = delete;
  InstanceDirectory& operator=(const InstanceDirectory&) = delete;

  const std::string& dir() const { return dir_; }
  const Naming& naming() const { return naming_; }
  // Whether files are opened with O_DIRECT.
  bool direct() const { return direct_; }
  // Files of dead instances (and their locks) removed by Open.
  size_t removed_at_open() const { return removed_at_open_; }

  // A path for a new file of this instance (never the same twice). Safe
  // from any thread.
  std::string NewPath();
  // Opens `path` for writing, or for reading and writing (a new file:
  // anything already there, a link included, is an error), or for reading
  // (not through a link); O_DIRECT when direct(). Blocks on the file
  // system; returns the descriptor, which the caller closes, or the errno
  // text naming the path (ResourceExhausted for ENOSPC, EDQUOT, ENOMEM;
  // FailedPrecondition for a missing file, a link, or no permission;
  // Internal otherwise). Safe from any thread.
  absl::StatusOr<int> OpenForWrite(const std::string& path) const;
  absl::StatusOr<int> OpenForReadWrite(const std::string& path) const;
  absl::StatusOr<int> OpenForRead(const std::string& path) const;
  // Removes a file of this instance; a missing file is not an error, any
  // other failure is logged to stderr. Blocks on the file system.
  void Remove(const std::string& path) const;

  // Whether `name` is a file or lock of some instance with names starting
  // with `prefix` (the names Open may remove).
  static bool IsInstanceFileName(absl::string_view name, absl::string_view prefix);

 private:
  InstanceDirectory(std::string dir, Naming naming)
      : dir_(std::move(dir)), naming_(std::move(naming)) {}
  absl::Status TakeLock();
  void RemoveDeadInstances();
  absl::Status ProbeDirect(DirectIo direct_io);
  std::string LockPath(absl::string_view instance) const;

  const std::string dir_;
  const Naming naming_;
  std::string instance_;
  int lock_fd_ = -1;
  bool direct_ = false;
  size_t removed_at_open_ = 0;
  std::atomic<uint64_t> next_file_{1};
};

}  // namespace zeroshard
