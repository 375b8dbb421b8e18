#include "server/disk/instance_directory.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/checkpoint_files.h"

namespace zeroshard {
namespace {

constexpr absl::string_view kLockSuffix = ".lock";
constexpr size_t kInstanceChars = 16;
// A dead daemon's half-made lock (`.lock.new`) is removed only once it is
// this old: a live daemon renames its own within microseconds.
constexpr absl::Duration kNewLockAge = absl::Minutes(1);

void Log(const std::string& line) { std::fprintf(stderr, "zeroshardd: %s\n", line.c_str()); }

absl::Status Errno(absl::string_view flag, int err, absl::string_view what,
                   absl::string_view path) {
  const std::string message = absl::StrCat(flag, ": ", what, " ", path, ": ", std::strerror(err));
  switch (err) {
    case ENOSPC:
    case EDQUOT:
    case ENOMEM:
      return absl::ResourceExhaustedError(message);
    case ENOENT:
    case EACCES:
    case EPERM:
    case EROFS:
    case ENOTDIR:
    case ELOOP:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

// A parsed instance file name: the instance and what the file is.
struct InstanceName {
  enum Kind { kData, kLock, kNewLock } kind;
  std::string instance;
};

std::optional<InstanceName> ParseName(absl::string_view name, absl::string_view prefix) {
  if (prefix.empty() || !absl::ConsumePrefix(&name, prefix) || name.size() < kInstanceChars + 2) {
    return std::nullopt;
  }
  const absl::string_view instance = name.substr(0, kInstanceChars);
  for (char c : instance) {
    if (!absl::ascii_isdigit(c) && !(c >= 'a' && c <= 'f')) return std::nullopt;
  }
  absl::string_view rest = name.substr(kInstanceChars);
  if (rest == kLockSuffix) return InstanceName{InstanceName::kLock, std::string(instance)};
  if (rest == ".lock.new") return InstanceName{InstanceName::kNewLock, std::string(instance)};
  if (!absl::ConsumePrefix(&rest, ".") || rest.empty() || rest.size() > 20) return std::nullopt;
  for (char c : rest) {
    if (!absl::ascii_isdigit(c)) return std::nullopt;
  }
  return InstanceName{InstanceName::kData, std::string(instance)};
}

// From the kernel's random source: names nobody can guess in advance.
std::string NewInstance() {
  uint64_t r = 0;
  if (::getrandom(&r, sizeof(r), 0) != static_cast<ssize_t>(sizeof(r))) {
    std::random_device device;
    r = (uint64_t{device()} << 32) ^ device();
  }
  return absl::StrFormat("%016x", r);
}

// True iff nobody holds the lock at `path` (its daemon is gone). A lock that
// cannot be opened (removed meanwhile) counts as held: its files are left.
bool LockIsDead(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return false;
  const bool dead = ::flock(fd, LOCK_EX | LOCK_NB) == 0;
  ::close(fd);  // releases the lock taken just now, if any
  return dead;
}

}  // namespace

InstanceDirectory::Naming InstanceDirectory::SpillNaming() {
  return Naming{"--spill_dir", "zeroshard-spill.", "spill"};
}

InstanceDirectory::Naming InstanceDirectory::StateNaming() {
  return Naming{"--state_dir", "zeroshard-state.", "state"};
}

bool InstanceDirectory::IsInstanceFileName(absl::string_view name, absl::string_view prefix) {
  return ParseName(name, prefix).has_value();
}

absl::StatusOr<std::unique_ptr<InstanceDirectory>> InstanceDirectory::Open(
    const std::string& dir, Naming naming, DirectIo direct_io) {
  if (naming.flag.empty() || naming.prefix.empty() ||
      absl::StrContains(naming.prefix, '/')) {
    return absl::InvalidArgumentError(absl::StrCat(
        "instance directory: a naming needs a flag and a prefix without '/' (flag \"",
        naming.flag, "\", prefix \"", naming.prefix, "\")"));
  }
  if (dir.empty()) return absl::InvalidArgumentError(absl::StrCat(naming.flag, ": empty path"));
  if (absl::Status s = MakeDirectories(dir); !s.ok()) {
    const absl::string_view why = absl::StripPrefix(s.message(), "checkpoint: ");
    return absl::Status(s.code(), absl::StrCat(naming.flag, ": ", why));
  }
  std::unique_ptr<InstanceDirectory> d(new InstanceDirectory(dir, std::move(naming)));
  // The lock first: another daemon starting now then sees this one as alive.
  if (absl::Status s = d->TakeLock(); !s.ok()) return s;
  d->RemoveDeadInstances();
  if (absl::Status s = d->ProbeDirect(direct_io); !s.ok()) return s;
  return d;
}

std::string InstanceDirectory::LockPath(absl::string_view instance) const {
  return absl::StrCat(dir_, "/", naming_.prefix, instance, kLockSuffix);
}

absl::Status InstanceDirectory::TakeLock() {
  for (int attempt = 0;; ++attempt) {
    instance_ = NewInstance();
    const std::string lock = LockPath(instance_);
    const std::string fresh = lock + ".new";
    const int fd = ::open(fresh.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
      if (errno == EEXIST && attempt < 3) continue;
      return Errno(naming_.flag, errno, "cannot create", fresh);
    }
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0 || ::rename(fresh.c_str(), lock.c_str()) != 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(fresh.c_str());
      if (attempt < 3) continue;
      return Errno(naming_.flag, err, "cannot take the lock", lock);
    }
    lock_fd_ = fd;
    return absl::OkStatus();
  }
}

void InstanceDirectory::RemoveDeadInstances() {
  DIR* d = ::opendir(dir_.c_str());
  if (d == nullptr) return;
  std::map<std::string, std::vector<std::string>> data;  // instance -> files
  std::set<std::string> locks;
  std::vector<std::string> new_locks;
  while (const dirent* e = ::readdir(d)) {
    std::optional<InstanceName> n = ParseName(e->d_name, naming_.prefix);
    if (!n.has_value() || n->instance == instance_) continue;
    switch (n->kind) {
      case InstanceName::kData: data[n->instance].push_back(e->d_name); break;
      case InstanceName::kLock: locks.insert(n->instance); break;
      case InstanceName::kNewLock: new_locks.push_back(e->d_name); break;
    }
  }
  ::closedir(d);
  auto path = [&](absl::string_view name) { return absl::StrCat(dir_, "/", name); };
  auto remove = [&](const std::string& p) {
    if (::unlink(p.c_str()) == 0) ++removed_at_open_;
  };
  std::set<std::string> dead;
  for (const std::string& instance : locks) {
    if (LockIsDead(LockPath(instance))) dead.insert(instance);
  }
  for (const auto& [instance, files] : data) {
    // A lock made while the directory was being listed may be missing from
    // the listing: look for it by name before calling its files orphans.
    const bool has_lock =
        locks.count(instance) != 0 || ::access(LockPath(instance).c_str(), F_OK) == 0;
    if (has_lock && !dead.count(instance) && !LockIsDead(LockPath(instance))) continue;
    for (const std::string& f : files) remove(path(f));
  }
  // Locks go after their files: a file whose lock is gone is an orphan.
  for (const std::string& instance : dead) remove(LockPath(instance));
  for (const std::string& name : new_locks) {
    struct stat st;
    const std::string p = path(name);
    if (::stat(p.c_str(), &st) != 0) continue;
    if (absl::Now() - absl::FromTimeT(st.st_mtime) < kNewLockAge) continue;
    if (LockIsDead(p)) remove(p);
  }
  if (removed_at_open_ > 0) {
    Log(absl::StrCat("removed ", removed_at_open_, " ", naming_.what,
                     " file(s) of stopped daemons from ", dir_));
  }
}

absl::Status InstanceDirectory::ProbeDirect(DirectIo direct_io) {
  const std::string probe = NewPath();
  if (direct_io == DirectIo::kIfSupported) {
    const int fd = ::open(probe.c_str(),
                          O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC | O_DIRECT, 0600);
    if (fd < 0 && errno != EINVAL) return Errno(naming_.flag, errno, "cannot create", probe);
    if (fd >= 0) {
      void* block = std::aligned_alloc(kDirectAlignment, kDirectAlignment);
      ssize_t n = -1;
      int err = ENOMEM;
      if (block != nullptr) {
        std::memset(block, 0, kDirectAlignment);
        n = ::pwrite(fd, block, kDirectAlignment, 0);
        err = errno;
        std::free(block);
      }
      ::close(fd);
      Remove(probe);
      if (n == static_cast<ssize_t>(kDirectAlignment)) {
        direct_ = true;
        return absl::OkStatus();
      }
      if (n >= 0) return Errno(naming_.flag, EIO, "short write to", probe);
      if (err != EINVAL) return Errno(naming_.flag, err, "cannot write", probe);
    }
    // EINVAL: the file system refuses O_DIRECT (or this alignment). The
    // refused open may have made the file: the next probe takes a new name.
    Remove(probe);
  }
  const std::string buffered = NewPath();
  const int fd =
      ::open(buffered.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return Errno(naming_.flag, errno, "cannot create", buffered);
  ::close(fd);
  Remove(buffered);
  direct_ = false;
  return absl::OkStatus();
}

InstanceDirectory::~InstanceDirectory() {
  if (DIR* d = ::opendir(dir_.c_str()); d != nullptr) {
    std::vector<std::string> mine;
    while (const dirent* e = ::readdir(d)) {
      std::optional<InstanceName> n = ParseName(e->d_name, naming_.prefix);
      if (n.has_value() && n->kind == InstanceName::kData && n->instance == instance_) {
        mine.push_back(absl::StrCat(dir_, "/", e->d_name));
      }
    }
    ::closedir(d);
    for (const std::string& p : mine) Remove(p);
  }
  if (lock_fd_ >= 0) {
    ::unlink(LockPath(instance_).c_str());
    ::close(lock_fd_);
  }
}

std::string InstanceDirectory::NewPath() {
  return absl::StrCat(dir_, "/", naming_.prefix, instance_, ".", next_file_.fetch_add(1));
}

absl::StatusOr<int> InstanceDirectory::OpenForWrite(const std::string& path) const {
  // Always a new file: whatever is at `path` already (a planted link
  // included) is refused, not followed or truncated.
  const int flags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC | (direct_ ? O_DIRECT : 0);
  const int fd = ::open(path.c_str(), flags, 0600);
  if (fd < 0) return Errno(naming_.flag, errno, "cannot create", path);
  return fd;
}

absl::StatusOr<int> InstanceDirectory::OpenForReadWrite(const std::string& path) const {
  // A new file, as OpenForWrite.
  const int flags = O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC | (direct_ ? O_DIRECT : 0);
  const int fd = ::open(path.c_str(), flags, 0600);
  if (fd < 0) return Errno(naming_.flag, errno, "cannot create", path);
  return fd;
}

absl::StatusOr<int> InstanceDirectory::OpenForRead(const std::string& path) const {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | (direct_ ? O_DIRECT : 0));
  if (fd < 0) return Errno(naming_.flag, errno, "cannot open", path);
  return fd;
}

void InstanceDirectory::Remove(const std::string& path) const {
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    Log(absl::StrCat("cannot remove ", naming_.what, " file ", path, ": ", std::strerror(errno)));
  }
}

}  // namespace zeroshard
