#include "server/activation/activation_spill.h"

#include <dirent.h>
#include <fcntl.h>
#include <liburing.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/checkpoint_files.h"

namespace zeroshard {
namespace {

constexpr absl::string_view kPrefix = "zeroshard-spill.";
constexpr absl::string_view kLockSuffix = ".lock";
constexpr size_t kInstanceChars = 16;
// A dead daemon's half-made lock (`.lock.new`) is removed only once it is
// this old: a live daemon renames its own within microseconds.
constexpr absl::Duration kNewLockAge = absl::Minutes(1);

void Log(const std::string& line) { std::fprintf(stderr, "zeroshardd: %s\n", line.c_str()); }

absl::Status Errno(int err, absl::string_view what, absl::string_view path) {
  const std::string message = absl::StrCat("--spill_dir: ", what, " ", path, ": ", std::strerror(err));
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

// A parsed spill name: the instance and what the file is.
struct SpillName {
  enum Kind { kData, kLock, kNewLock } kind;
  std::string instance;
};

std::optional<SpillName> ParseName(absl::string_view name) {
  if (!absl::ConsumePrefix(&name, kPrefix) || name.size() < kInstanceChars + 2) return std::nullopt;
  const absl::string_view instance = name.substr(0, kInstanceChars);
  for (char c : instance) {
    if (!absl::ascii_isdigit(c) && !(c >= 'a' && c <= 'f')) return std::nullopt;
  }
  absl::string_view rest = name.substr(kInstanceChars);
  if (rest == kLockSuffix) return SpillName{SpillName::kLock, std::string(instance)};
  if (rest == ".lock.new") return SpillName{SpillName::kNewLock, std::string(instance)};
  if (!absl::ConsumePrefix(&rest, ".") || rest.empty() || rest.size() > 20) return std::nullopt;
  for (char c : rest) {
    if (!absl::ascii_isdigit(c)) return std::nullopt;
  }
  return SpillName{SpillName::kData, std::string(instance)};
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

bool SpillDirectory::IsSpillName(absl::string_view name) { return ParseName(name).has_value(); }

absl::StatusOr<std::unique_ptr<SpillDirectory>> SpillDirectory::Open(const std::string& dir,
                                                                    DirectIo direct_io) {
  if (dir.empty()) return absl::InvalidArgumentError("--spill_dir: empty path");
  if (absl::Status s = MakeDirectories(dir); !s.ok()) {
    const absl::string_view why = absl::StripPrefix(s.message(), "checkpoint: ");
    return absl::Status(s.code(), absl::StrCat("--spill_dir: ", why));
  }
  std::unique_ptr<SpillDirectory> d(new SpillDirectory(dir));
  // The lock first: another daemon starting now then sees this one as alive.
  if (absl::Status s = d->TakeLock(); !s.ok()) return s;
  d->RemoveDeadInstances();
  if (absl::Status s = d->ProbeDirect(direct_io); !s.ok()) return s;
  return d;
}

absl::Status SpillDirectory::TakeLock() {
  for (int attempt = 0;; ++attempt) {
    instance_ = NewInstance();
    const std::string lock = absl::StrCat(dir_, "/", kPrefix, instance_, kLockSuffix);
    const std::string fresh = lock + ".new";
    const int fd = ::open(fresh.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
      if (errno == EEXIST && attempt < 3) continue;
      return Errno(errno, "cannot create", fresh);
    }
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0 || ::rename(fresh.c_str(), lock.c_str()) != 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(fresh.c_str());
      if (attempt < 3) continue;
      return Errno(err, "cannot take the lock", lock);
    }
    lock_fd_ = fd;
    return absl::OkStatus();
  }
}

void SpillDirectory::RemoveDeadInstances() {
  DIR* d = ::opendir(dir_.c_str());
  if (d == nullptr) return;
  std::map<std::string, std::vector<std::string>> data;  // instance -> files
  std::set<std::string> locks;
  std::vector<std::string> new_locks;
  while (const dirent* e = ::readdir(d)) {
    std::optional<SpillName> n = ParseName(e->d_name);
    if (!n.has_value() || n->instance == instance_) continue;
    switch (n->kind) {
      case SpillName::kData: data[n->instance].push_back(e->d_name); break;
      case SpillName::kLock: locks.insert(n->instance); break;
      case SpillName::kNewLock: new_locks.push_back(e->d_name); break;
    }
  }
  ::closedir(d);
  auto path = [&](absl::string_view name) { return absl::StrCat(dir_, "/", name); };
  auto lock_path = [&](const std::string& instance) {
    return absl::StrCat(dir_, "/", kPrefix, instance, kLockSuffix);
  };
  auto remove = [&](const std::string& p) {
    if (::unlink(p.c_str()) == 0) ++removed_at_open_;
  };
  std::set<std::string> dead;
  for (const std::string& instance : locks) {
    if (LockIsDead(lock_path(instance))) dead.insert(instance);
  }
  for (const auto& [instance, files] : data) {
    // A lock made while the directory was being listed may be missing from
    // the listing: look for it by name before calling its files orphans.
    const bool has_lock = locks.count(instance) != 0 || ::access(lock_path(instance).c_str(), F_OK) == 0;
    if (has_lock && !dead.count(instance) && !LockIsDead(lock_path(instance))) continue;
    for (const std::string& f : files) remove(path(f));
  }
  // Locks go after their files: a file whose lock is gone is an orphan.
  for (const std::string& instance : dead) remove(lock_path(instance));
  for (const std::string& name : new_locks) {
    struct stat st;
    const std::string p = path(name);
    if (::stat(p.c_str(), &st) != 0) continue;
    if (absl::Now() - absl::FromTimeT(st.st_mtime) < kNewLockAge) continue;
    if (LockIsDead(p)) remove(p);
  }
  if (removed_at_open_ > 0) {
    Log(absl::StrCat("removed ", removed_at_open_, " spill file(s) of stopped daemons from ", dir_));
  }
}

absl::Status SpillDirectory::ProbeDirect(DirectIo direct_io) {
  const std::string probe = NewPath();
  if (direct_io == DirectIo::kIfSupported) {
    const int fd = ::open(probe.c_str(),
                          O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC | O_DIRECT, 0600);
    if (fd < 0 && errno != EINVAL) return Errno(errno, "cannot create", probe);
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
      if (n >= 0) return Errno(EIO, "short write to", probe);
      if (err != EINVAL) return Errno(err, "cannot write", probe);
    }
    // EINVAL: the file system refuses O_DIRECT (or this alignment). The
    // refused open may have made the file: the next probe takes a new name.
    Remove(probe);
  }
  const std::string buffered = NewPath();
  const int fd =
      ::open(buffered.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return Errno(errno, "cannot create", buffered);
  ::close(fd);
  Remove(buffered);
  direct_ = false;
  return absl::OkStatus();
}

SpillDirectory::~SpillDirectory() {
  if (DIR* d = ::opendir(dir_.c_str()); d != nullptr) {
    std::vector<std::string> mine;
    while (const dirent* e = ::readdir(d)) {
      std::optional<SpillName> n = ParseName(e->d_name);
      if (n.has_value() && n->kind == SpillName::kData && n->instance == instance_) {
        mine.push_back(absl::StrCat(dir_, "/", e->d_name));
      }
    }
    ::closedir(d);
    for (const std::string& p : mine) Remove(p);
  }
  if (lock_fd_ >= 0) {
    ::unlink(absl::StrCat(dir_, "/", kPrefix, instance_, kLockSuffix).c_str());
    ::close(lock_fd_);
  }
}

std::string SpillDirectory::NewPath() {
  return absl::StrCat(dir_, "/", kPrefix, instance_, ".", next_file_.fetch_add(1));
}

absl::StatusOr<int> SpillDirectory::OpenForWrite(const std::string& path) const {
  // Always a new file: whatever is at `path` already (a planted link
  // included) is refused, not followed or truncated.
  const int flags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC | (direct_ ? O_DIRECT : 0);
  const int fd = ::open(path.c_str(), flags, 0600);
  if (fd < 0) return Errno(errno, "cannot create", path);
  return fd;
}

absl::StatusOr<int> SpillDirectory::OpenForRead(const std::string& path) const {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | (direct_ ? O_DIRECT : 0));
  if (fd < 0) return Errno(errno, "cannot open", path);
  return fd;
}

void SpillDirectory::Remove(const std::string& path) {
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    Log(absl::StrCat("cannot remove spill file ", path, ": ", std::strerror(errno)));
  }
}

// ---- SpillIo ----

struct SpillIo::Op {
  bool write = false;
  int fd = -1;
  char* buffer = nullptr;
  size_t length = 0;
  size_t done = 0;  // bytes moved so far
  Done callback;
};

namespace {
// One submission moves at most this much; the rest follows when it completes.
constexpr size_t kMaxPiece = size_t{1} << 30;
// How often the issuer submits again what a refused submission left queued.
constexpr absl::Duration kResubmitPeriod = absl::Milliseconds(10);
}  // namespace

SpillIo::SpillIo(unsigned queue_depth)
    : depth_(queue_depth == 0 ? 1 : queue_depth), ring_(std::make_unique<struct io_uring>()) {}

absl::StatusOr<std::unique_ptr<SpillIo>> SpillIo::Create(unsigned queue_depth) {
  std::unique_ptr<SpillIo> io(new SpillIo(queue_depth));
  // One more entry than operations: the stop marker always finds room.
  const int rc = io_uring_queue_init(io->depth_ + 1, io->ring_.get(), 0);
  if (rc < 0) {
    return absl::UnavailableError(absl::StrCat("--spill_dir: io_uring is not available here (",
                                               std::strerror(-rc), ")"));
  }
  io->ring_ready_ = true;
  io->thread_ = std::thread([p = io.get()] { p->Run(); });
  io->issuer_ = std::thread([p = io.get()] { p->Issue(); });
  return io;
}

SpillIo::~SpillIo() {
  if (!ring_ready_) return;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
    if (!mu_.AwaitWithTimeout(absl::Condition(&drained), kDrainWait)) {
      Log(absl::StrCat(in_flight_, " spill I/O operation(s) still in flight after ",
                       absl::FormatDuration(kDrainWait), "; the ring is torn down under them"));
    }
    stop_issuer_ = true;
  }
  if (issuer_.joinable()) issuer_.join();
  {
    absl::MutexLock lock(&mu_);
    // The stop marker: a no-op without user data.
    io_uring_sqe* sqe = io_uring_get_sqe(ring_.get());
    if (sqe != nullptr) {
      io_uring_prep_nop(sqe);
      io_uring_sqe_set_data(sqe, nullptr);
      SubmitLocked("stop marker");
    }
  }
  thread_.join();
  io_uring_queue_exit(ring_.get());
}

size_t SpillIo::in_flight() const {
  absl::MutexLock lock(&mu_);
  return in_flight_;
}

absl::Status SpillIo::Write(int fd, const void* buffer, size_t length, absl::Time deadline,
                            Done done) {
  auto op = std::make_unique<Op>();
  op->write = true;
  op->fd = fd;
  op->buffer = static_cast<char*>(const_cast<void*>(buffer));
  op->length = length;
  op->callback = std::move(done);
  return Submit(std::move(op), deadline);
}

absl::Status SpillIo::Read(int fd, void* buffer, size_t length, absl::Time deadline, Done done) {
  auto op = std::make_unique<Op>();
  op->fd = fd;
  op->buffer = static_cast<char*>(buffer);
  op->length = length;
  op->callback = std::move(done);
  return Submit(std::move(op), deadline);
}

absl::Status SpillIo::Submit(std::unique_ptr<Op> op, absl::Time deadline) {
  if (op->length == 0) return absl::InvalidArgumentError("spill I/O of 0 bytes");
  absl::MutexLock lock(&mu_);
  auto room = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || in_flight_ < depth_;
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&room), deadline)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "waiting for room in the spill I/O queue (", depth_, " operations in flight)"));
  }
  if (stopping_) return absl::FailedPreconditionError("spill I/O is shutting down");
  ++in_flight_;
  pending_.push_back(op.release());
  return absl::OkStatus();
}

void SpillIo::Issue() {
  absl::MutexLock lock(&mu_);
  for (;;) {
    auto work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !pending_.empty() || stop_issuer_;
    };
    // Entries a refused submission left queued go again every
    // kResubmitPeriod until the kernel takes them.
    if (io_uring_sq_ready(ring_.get()) > 0) {
      mu_.AwaitWithTimeout(absl::Condition(&work), kResubmitPeriod);
      SubmitLocked("operation");
    } else {
      mu_.Await(absl::Condition(&work));
    }
    if (pending_.empty()) {
      if (stop_issuer_) return;  // stopped, with nothing left to issue
      continue;
    }
    for (Op* op : pending_) QueueLocked(op);
    pending_.clear();
  }
}

void SpillIo::SubmitLocked(absl::string_view what) {
  // A submission refused for lack of kernel resources stays queued; it is
  // retried briefly here, then by the issuer every kResubmitPeriod.
  for (int attempt = 0; attempt < 100; ++attempt) {
    const int rc = io_uring_submit(ring_.get());
    if (rc >= 0 || (rc != -EAGAIN && rc != -EBUSY && rc != -EINTR)) {
      if (rc < 0) Log(absl::StrCat("io_uring_submit: ", std::strerror(-rc)));
      return;
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  Log(absl::StrCat("io_uring_submit kept failing; the spill ", what, " stays queued"));
}

void SpillIo::QueueLocked(Op* op) {
  // At most depth_ operations are in flight, each with one entry queued, in
  // a ring of depth_ + 1: there is always an entry free.
  io_uring_sqe* sqe = io_uring_get_sqe(ring_.get());
  const size_t n = std::min(op->length - op->done, kMaxPiece);
  if (op->write) {
    io_uring_prep_write(sqe, op->fd, op->buffer + op->done, static_cast<unsigned>(n), op->done);
  } else {
    io_uring_prep_read(sqe, op->fd, op->buffer + op->done, static_cast<unsigned>(n), op->done);
  }
  io_uring_sqe_set_data(sqe, op);
  // Always to the kernel's workers: submitting then never copies or waits
  // inline, under this lock.
  io_uring_sqe_set_flags(sqe, IOSQE_ASYNC);
  SubmitLocked("operation");
}

void SpillIo::Finish(Op* op, absl::Status status) {
  std::unique_ptr<Op> owned(op);
  {
    // Room for the next operation now; the destructor still waits for this
    // callback, which runs on the thread it joins.
    absl::MutexLock lock(&mu_);
    --in_flight_;
  }
  owned->callback(std::move(status));
}

void SpillIo::Run() {
  for (;;) {
    io_uring_cqe* cqe = nullptr;
    const int rc = io_uring_wait_cqe(ring_.get(), &cqe);
    if (rc == -EINTR || rc == -EAGAIN) continue;
    if (rc < 0) {
      Log(absl::StrCat("io_uring_wait_cqe: ", std::strerror(-rc)));
      absl::SleepFor(absl::Milliseconds(10));
      continue;
    }
    Op* op = static_cast<Op*>(io_uring_cqe_get_data(cqe));
    const int res = cqe->res;
    io_uring_cqe_seen(ring_.get(), cqe);
    if (op == nullptr) return;  // the stop marker
    if (res == -EINTR || res == -EAGAIN) {
      absl::MutexLock lock(&mu_);
      QueueLocked(op);
      continue;
    }
    if (res < 0) {
      Finish(op, absl::Status(absl::ErrnoToStatusCode(-res),
                              absl::StrCat(op->write ? "spill write: " : "spill read: ",
                                           std::strerror(-res))));
      continue;
    }
    if (res == 0) {
      Finish(op, op->write ? absl::InternalError("spill write: the file took no bytes")
                           : absl::DataLossError(absl::StrCat(
                                 "spill read: the file ends after ", op->done, " of ",
                                 op->length, " bytes")));
      continue;
    }
    op->done += static_cast<size_t>(res);
    if (op->done < op->length) {
      absl::MutexLock lock(&mu_);
      QueueLocked(op);
      continue;
    }
    Finish(op, absl::OkStatus());
  }
}

}  // namespace zeroshard
