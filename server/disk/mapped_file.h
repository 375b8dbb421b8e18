#pragma once

// A file of fixed size under an InstanceDirectory, mapped into memory
// (MAP_SHARED): memory the kernel writes back to the disk and evicts under
// memory pressure, and reads back on the next touch. Holds a job's gradient
// accumulator when it may leave RAM (--state_gradients).
//
// Ownership: the MappedFile owns the file (mode 0600, an unpredictable name
// of its directory) and the mapping; the destructor unmaps and removes the
// file. Thread-safe as memory is: callers order their accesses themselves.
//
// Blocking: Create blocks on the file system (the file's blocks are
// allocated there, so a disk without room is found at creation and the
// kernel's write-back never needs a new block). A touch of an evicted page
// blocks on the disk; the kernel's write-back of dirty pages is throttled
// by vm.dirty_ratio. Errors after Create are the kernel's: a page that
// cannot be read back raises SIGBUS in the process (the file's blocks were
// allocated, so only a failing disk does that).

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/disk/instance_directory.h"

namespace zeroshard {

class MappedFile {
 public:
  // Creates a new file of `bytes` (> 0) in `dir`, allocates its blocks and
  // maps it read-write, zero-filled. ResourceExhausted naming the directory
  // when the disk has no room; the errno text naming the path otherwise;
  // nothing is left behind on error. `dir` must outlive the file.
  static absl::StatusOr<std::unique_ptr<MappedFile>> Create(InstanceDirectory* dir,
                                                            uint64_t bytes);
  ~MappedFile();

  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  void* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile(InstanceDirectory* dir, std::string path, void* data, uint64_t size)
      : dir_(dir), path_(std::move(path)), data_(data), size_(size) {}

  InstanceDirectory* const dir_;
  const std::string path_;
  void* const data_;
  const uint64_t size_;
};

}  // namespace zeroshard
