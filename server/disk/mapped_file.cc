#include "server/disk/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace zeroshard {

absl::StatusOr<std::unique_ptr<MappedFile>> MappedFile::Create(InstanceDirectory* dir,
                                                               uint64_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("a mapped file of 0 bytes");
  const std::string path = dir->NewPath();
  absl::StatusOr<int> fd = dir->OpenForReadWrite(path);
  if (!fd.ok()) return fd.status();
  auto fail = [&](int err, absl::string_view what) {
    ::close(*fd);
    dir->Remove(path);
    if (err == ENOSPC || err == EDQUOT || err == EFBIG) {
      return absl::ResourceExhaustedError(absl::StrCat(dir->naming().flag, " ", dir->dir(),
                                                       " has no room for a mapped file of ",
                                                       bytes, " bytes (", std::strerror(err),
                                                       ")"));
    }
    return absl::InternalError(
        absl::StrCat("mapped file ", path, ": ", what, ": ", std::strerror(err)));
  };
  // Through the page cache (a mapping is), whatever the directory's files
  // otherwise use.
  if (const int flags = ::fcntl(*fd, F_GETFL); flags >= 0 && (flags & O_DIRECT) != 0) {
    ::fcntl(*fd, F_SETFL, flags & ~O_DIRECT);
  }
  int rc = 0;
  do {
    rc = ::fallocate(*fd, 0, 0, static_cast<off_t>(bytes));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0 && errno == EOPNOTSUPP) {
    // A file system without fallocate: zeros written, so that the kernel's
    // write-back never needs a block the disk may not have.
    static const char kZeros[1 << 16] = {};
    for (uint64_t off = 0; off < bytes;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(sizeof(kZeros), bytes - off));
      const ssize_t w = ::pwrite(*fd, kZeros, n, static_cast<off_t>(off));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) return fail(w < 0 ? errno : ENOSPC, "writing zeros");
      off += static_cast<uint64_t>(w);
    }
    rc = 0;
  }
  if (rc != 0) return fail(errno, "allocating");
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0);
  if (data == MAP_FAILED) return fail(errno, "mapping");
  // The mapping keeps the file open.
  ::close(*fd);
  return std::unique_ptr<MappedFile>(new MappedFile(dir, path, data, bytes));
}

MappedFile::~MappedFile() {
  ::munmap(data_, size_);
  dir_->Remove(path_);
}

}  // namespace zeroshard
