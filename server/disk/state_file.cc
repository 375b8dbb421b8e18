#include "server/disk/state_file.h"

#include <fcntl.h>
#include <liburing.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"

namespace zeroshard {
namespace {

// One submission moves at most this much; the rest follows when it ends.
constexpr size_t kMaxPiece = size_t{1} << 30;
// The ring's size is bounded (the kernel allows 32768 entries); deeper
// queues than this gain nothing on one file.
constexpr unsigned kMaxDepth = 4096;
// How often a submission the kernel refuses for lack of resources is tried
// again, and how many times, before the transfer runs synchronously.
constexpr absl::Duration kSubmitRetryPeriod = absl::Milliseconds(1);
constexpr int kSubmitAttempts = 100;
// The longest single wait for a completion (a deadline far away is reached
// by several).
constexpr absl::Duration kMaxWaitSlice = absl::Hours(1);

void Log(const std::string& line) { std::fprintf(stderr, "zeroshardd: %s\n", line.c_str()); }

// The status of a transfer or allocation that failed with errno `err`.
absl::Status TransferError(int err, absl::string_view path, absl::string_view what) {
  const std::string message =
      absl::StrCat("state file ", path, ": ", what, ": ", std::strerror(err));
  switch (err) {
    case ENOSPC:
    case EDQUOT:
    case EFBIG:
      return absl::ResourceExhaustedError(message);
    case EIO:
      return absl::DataLossError(message);
    default:
      return absl::InternalError(message);
  }
}

bool NoRoom(int err) { return err == ENOSPC || err == EDQUOT || err == EFBIG; }

}  // namespace

class StateFile::Impl {
 public:
  struct Op {
    uint64_t id = 0;
    uint64_t seq = 0;  // start order, for WaitAll's first error
    bool write = false;
    uint64_t offset = 0;
    char* data = nullptr;
    size_t length = 0;
    size_t done = 0;     // bytes moved so far
    bool ended = false;  // no longer in the kernel; `result` is final
    absl::Status result;
  };

  Impl(InstanceDirectory* dir, std::string path, uint64_t size, size_t buffer_bytes,
       unsigned depth)
      : dir_(dir), path_(std::move(path)), size_(size), buffer_bytes_(buffer_bytes),
        depth_(depth) {}
  ~Impl();

  absl::Status AllocateBuffers(size_t count);
  absl::Status CreateFile();
  void InitRing();

  absl::Status Start(bool write, uint64_t id, uint64_t offset, size_t buffer, size_t at,
                     size_t length, absl::Time deadline);
  absl::Status Wait(uint64_t id, absl::Time deadline);
  absl::Status WaitAll(absl::Time deadline);
  uint64_t UnusedId() const;

  InstanceDirectory* const dir_;
  const std::string path_;
  const uint64_t size_;
  const size_t buffer_bytes_;
  const unsigned depth_;
  int fd_ = -1;
  bool created_ = false;  // the file at path_ is ours to remove
  std::vector<char*> buffers_;
  struct io_uring ring_ {};
  bool ring_ready_ = false;
  size_t in_kernel_ = 0;  // ops submitted and not ended
  uint64_t next_seq_ = 0;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Op>> ops_;  // in flight, by id

 private:
  absl::Status FillWithZeros();
  // Submits the op's next piece; where the ring will not take it, moves the
  // rest synchronously.
  void Issue(Op* op);
  bool SubmitToRing(Op* op);
  void RunSynchronously(Op* op);
  void Finish(Op* op, absl::Status status);
  // Handles every completion the ring holds.
  void ReapAvailable();
  // Reaps completions until `done()` or the deadline.
  template <typename Done>
  absl::Status ReapUntil(absl::Time deadline, Done done, absl::string_view waiting_for);
  absl::Status PieceError(const Op& op, int err) const;
};

StateFile::Impl::~Impl() {
  if (ring_ready_) {
    const absl::Status drained =
        ReapUntil(absl::Now() + kDrainWait, [this] { return in_kernel_ == 0; }, "the drain");
    if (!drained.ok()) {
      // The kernel may still write into them: leaked, never reused.
      Log(absl::StrCat("state file ", path_, ": ", in_kernel_, " transfer(s) still running after ",
                       absl::FormatDuration(kDrainWait), "; its ", buffers_.size(),
                       " buffer(s) are leaked, not freed under them"));
      buffers_.clear();
    }
    io_uring_queue_exit(&ring_);
  }
  if (fd_ >= 0) ::close(fd_);
  if (created_) dir_->Remove(path_);
  for (char* b : buffers_) std::free(b);
}

absl::Status StateFile::Impl::AllocateBuffers(size_t count) {
  for (size_t i = 0; i < count; ++i) {
    void* b = std::aligned_alloc(kAlignment, buffer_bytes_);
    if (b == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat(
          dir_->naming().flag, ": cannot allocate ", count, " buffer(s) of ", buffer_bytes_,
          " bytes for a state file"));
    }
    std::memset(b, 0, buffer_bytes_);
    buffers_.push_back(static_cast<char*>(b));
  }
  return absl::OkStatus();
}

absl::Status StateFile::Impl::CreateFile() {
  absl::StatusOr<int> fd = dir_->OpenForReadWrite(path_);
  if (!fd.ok()) return fd.status();
  fd_ = *fd;
  created_ = true;
  int rc;
  do {
    rc = ::fallocate(fd_, 0, 0, static_cast<off_t>(size_));
  } while (rc != 0 && errno == EINTR);
  if (rc == 0) return absl::OkStatus();
  const int err = errno;
  if (err == EOPNOTSUPP) return FillWithZeros();
  if (NoRoom(err)) {
    return absl::ResourceExhaustedError(absl::StrCat(dir_->naming().flag, " ", dir_->dir(),
                                                     " has no room for a state file of ", size_,
                                                     " bytes (", std::strerror(err), ")"));
  }
  return TransferError(err, path_, absl::StrCat("allocating ", size_, " bytes"));
}

absl::Status StateFile::Impl::FillWithZeros() {
  // Buffer 0 is zeros still, and aligned for O_DIRECT.
  const char* zeros = buffers_[0];
  for (uint64_t off = 0; off < size_;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buffer_bytes_, size_ - off));
    const ssize_t w = ::pwrite(fd_, zeros, n, static_cast<off_t>(off));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const int err = w < 0 ? errno : ENOSPC;
      if (NoRoom(err)) {
        return absl::ResourceExhaustedError(absl::StrCat(
            dir_->naming().flag, " ", dir_->dir(), " has no room for a state file of ", size_,
            " bytes (", std::strerror(err), ")"));
      }
      return TransferError(err, path_, absl::StrCat("writing zeros at offset ", off));
    }
    off += static_cast<uint64_t>(w);
  }
  return absl::OkStatus();
}

void StateFile::Impl::InitRing() {
  // One entry more than transfers: a kernel without IORING_FEAT_EXT_ARG
  // takes an entry for each timed wait.
  const int rc = io_uring_queue_init(depth_ + 1, &ring_, 0);
  ring_ready_ = rc == 0;
}

absl::Status StateFile::Impl::PieceError(const Op& op, int err) const {
  return TransferError(err, path_,
                       absl::StrCat(op.write ? "write of " : "read of ", op.length,
                                    " bytes at offset ", op.offset, " (after ", op.done, ")"));
}

absl::Status StateFile::Impl::Start(bool write, uint64_t id, uint64_t offset, size_t buffer,
                                    size_t at, size_t length, absl::Time deadline) {
  auto invalid = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("state file ", path_, ": transfer ", id, " (",
                                                   write ? "write" : "read", " of ", length,
                                                   " bytes at offset ", offset, "): ", why));
  };
  if (length == 0) return invalid("length 0");
  if (buffer >= buffers_.size()) {
    return invalid(absl::StrCat("buffer ", buffer, " of ", buffers_.size()));
  }
  if (offset % kAlignment != 0 || length % kAlignment != 0 || at % kAlignment != 0) {
    return invalid(absl::StrCat("offset, length and buffer position (", at,
                                ") must be multiples of ", kAlignment));
  }
  if (at > buffer_bytes_ || length > buffer_bytes_ - at) {
    return invalid(absl::StrCat("buffer position ", at, " + length exceeds the buffer's ",
                                buffer_bytes_, " bytes"));
  }
  if (offset > size_ || length > size_ - offset) {
    return invalid(absl::StrCat("past the file's ", size_, " bytes"));
  }
  if (ops_.contains(id)) return invalid("an id already in flight");
  if (ring_ready_ && in_kernel_ >= depth_) {
    absl::Status room = ReapUntil(
        deadline, [this] { return in_kernel_ < depth_; },
        absl::StrCat("room (", depth_, " transfers running)"));
    if (!room.ok()) return room;
  }
  auto op = std::make_unique<Op>();
  op->id = id;
  op->seq = next_seq_++;
  op->write = write;
  op->offset = offset;
  op->data = buffers_[buffer] + at;
  op->length = length;
  Op* const p = op.get();
  ops_.emplace(id, std::move(op));
  if (ring_ready_) {
    ++in_kernel_;
    Issue(p);
  } else {
    RunSynchronously(p);
  }
  return absl::OkStatus();
}

void StateFile::Impl::Issue(Op* op) {
  if (SubmitToRing(op)) return;
  // Counted as running until now; the rest moves here, in this call.
  --in_kernel_;
  RunSynchronously(op);
}

bool StateFile::Impl::SubmitToRing(Op* op) {
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  if (sqe == nullptr) {
    // Entries left by an earlier refused submission: flush them first.
    io_uring_submit(&ring_);
    sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) return false;
  }
  const size_t n = std::min(op->length - op->done, kMaxPiece);
  const uint64_t offset = op->offset + op->done;
  if (op->write) {
    io_uring_prep_write(sqe, fd_, op->data + op->done, static_cast<unsigned>(n), offset);
  } else {
    io_uring_prep_read(sqe, fd_, op->data + op->done, static_cast<unsigned>(n), offset);
  }
  io_uring_sqe_set_data(sqe, op);
  // Through the page cache the kernel would copy inline, inside Start*; its
  // workers do it instead. Direct transfers are queued to the disk inline,
  // without waiting for it.
  if (!dir_->direct()) io_uring_sqe_set_flags(sqe, IOSQE_ASYNC);
  for (int attempt = 0; attempt < kSubmitAttempts; ++attempt) {
    const int rc = io_uring_submit(&ring_);
    if (rc >= 0) return true;
    if (rc != -EAGAIN && rc != -EBUSY && rc != -EINTR) {
      Log(absl::StrCat("state file ", path_, ": io_uring_submit: ", std::strerror(-rc),
                       "; the transfer runs synchronously"));
      break;
    }
    // (EBUSY would mean a full completion queue: it has room for twice
    // the transfers that can be running.)
    if (rc != -EINTR) absl::SleepFor(kSubmitRetryPeriod);
  }
  // The entry may go to the kernel with a later submission: a no-op now,
  // whose completion names no transfer.
  io_uring_prep_nop(sqe);
  io_uring_sqe_set_data(sqe, nullptr);
  return false;
}

void StateFile::Impl::RunSynchronously(Op* op) {
  while (op->done < op->length) {
    const size_t n = std::min(op->length - op->done, kMaxPiece);
    const off_t at = static_cast<off_t>(op->offset + op->done);
    const ssize_t r = op->write ? ::pwrite(fd_, op->data + op->done, n, at)
                                : ::pread(fd_, op->data + op->done, n, at);
    if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (r < 0) return Finish(op, PieceError(*op, errno));
    if (r == 0) {
      return Finish(op, op->write ? PieceError(*op, ENOSPC)
                                  : absl::DataLossError(absl::StrCat(
                                        "state file ", path_, ": read of ", op->length,
                                        " bytes at offset ", op->offset, " ends after ", op->done,
                                        " bytes: the file is shorter than it was made")));
    }
    op->done += static_cast<size_t>(r);
  }
  Finish(op, absl::OkStatus());
}

void StateFile::Impl::Finish(Op* op, absl::Status status) {
  op->ended = true;
  op->result = std::move(status);
}

void StateFile::Impl::ReapAvailable() {
  io_uring_cqe* cqe = nullptr;
  while (io_uring_peek_cqe(&ring_, &cqe) == 0) {
    Op* op = static_cast<Op*>(io_uring_cqe_get_data(cqe));
    const int res = cqe->res;
    io_uring_cqe_seen(&ring_, cqe);
    if (op == nullptr) continue;  // a no-op left by a refused submission
    if (res == -EINTR || res == -EAGAIN) {
      Issue(op);
    } else if (res < 0) {
      --in_kernel_;
      Finish(op, PieceError(*op, -res));
    } else if (res == 0) {
      --in_kernel_;
      // A write that takes no bytes: as a full disk (a write(2) of 0 bytes
      // would have said ENOSPC). A read of none: the file got shorter.
      Finish(op, op->write ? PieceError(*op, ENOSPC)
                           : absl::DataLossError(absl::StrCat(
                                 "state file ", path_, ": read of ", op->length,
                                 " bytes at offset ", op->offset, " ends after ", op->done,
                                 " bytes: the file is shorter than it was made")));
    } else {
      op->done += static_cast<size_t>(res);
      if (op->done < op->length) {
        Issue(op);  // a short transfer: the rest, at the advanced offset
      } else {
        --in_kernel_;
        Finish(op, absl::OkStatus());
      }
    }
  }
}

template <typename Done>
absl::Status StateFile::Impl::ReapUntil(absl::Time deadline, Done done,
                                        absl::string_view waiting_for) {
  for (;;) {
    if (ring_ready_) ReapAvailable();
    if (done()) return absl::OkStatus();
    if (!ring_ready_ || in_kernel_ == 0) {
      return absl::InternalError(absl::StrCat("state file ", path_, ": waiting for ",
                                              waiting_for, " with no transfer running"));
    }
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(
          absl::StrCat("state file ", path_, ": waiting for ", waiting_for, ": ", in_kernel_,
                       " transfer(s) still running at the deadline"));
    }
    const absl::Duration slice = std::min(left, kMaxWaitSlice);
    const int64_t nanos = absl::ToInt64Nanoseconds(slice);
    __kernel_timespec ts{};
    ts.tv_sec = nanos / 1000000000;
    ts.tv_nsec = nanos % 1000000000;
    io_uring_cqe* cqe = nullptr;
    const int rc = io_uring_wait_cqe_timeout(&ring_, &cqe, &ts);
    if (rc == 0 || rc == -ETIME || rc == -EINTR || rc == -EAGAIN) continue;
    return absl::InternalError(absl::StrCat("state file ", path_,
                                            ": io_uring_wait_cqe_timeout: ", std::strerror(-rc)));
  }
}

absl::Status StateFile::Impl::Wait(uint64_t id, absl::Time deadline) {
  auto it = ops_.find(id);
  if (it == ops_.end()) {
    return absl::NotFoundError(
        absl::StrCat("state file ", path_, ": no transfer ", id, " in flight"));
  }
  Op* const op = it->second.get();
  absl::Status ended =
      ReapUntil(deadline, [op] { return op->ended; }, absl::StrCat("transfer ", id));
  if (!ended.ok()) return ended;
  absl::Status result = std::move(op->result);
  ops_.erase(id);
  return result;
}

absl::Status StateFile::Impl::WaitAll(absl::Time deadline) {
  absl::Status ended = ReapUntil(
      deadline, [this] { return in_kernel_ == 0; }, "every transfer");
  if (!ended.ok()) return ended;
  const Op* first_error = nullptr;
  for (const auto& [id, op] : ops_) {
    if (!op->result.ok() && (first_error == nullptr || op->seq < first_error->seq)) {
      first_error = op.get();
    }
  }
  absl::Status result = first_error == nullptr ? absl::OkStatus() : first_error->result;
  ops_.clear();
  return result;
}

uint64_t StateFile::Impl::UnusedId() const {
  uint64_t id = std::numeric_limits<uint64_t>::max();
  while (ops_.contains(id)) --id;
  return id;
}

// ---- StateFile ----

absl::StatusOr<std::unique_ptr<StateFile>> StateFile::Create(InstanceDirectory* dir,
                                                             uint64_t bytes, size_t buffer_bytes,
                                                             size_t buffers, unsigned queue_depth,
                                                             Engine engine) {
  if (dir == nullptr) return absl::InvalidArgumentError("state file: no directory");
  const std::string& flag = dir->naming().flag;
  if (bytes == 0 || bytes % kAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, ": a state file of ", bytes, " bytes: the size must be a positive multiple of ",
        kAlignment));
  }
  if (buffer_bytes == 0 || buffer_bytes % kAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, ": state file buffers of ", buffer_bytes,
        " bytes: the size must be a positive multiple of ", kAlignment));
  }
  if (buffers == 0) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": a state file needs a buffer"));
  }
  const unsigned depth = std::clamp(queue_depth, 1u, kMaxDepth);
  auto impl = std::make_unique<Impl>(dir, dir->NewPath(), bytes, buffer_bytes, depth);
  // On any error below, the Impl's destructor closes and removes the file
  // and frees the buffers.
  if (absl::Status s = impl->AllocateBuffers(buffers); !s.ok()) return s;
  if (absl::Status s = impl->CreateFile(); !s.ok()) return s;
  if (engine == Engine::kIoUring) impl->InitRing();
  return std::unique_ptr<StateFile>(new StateFile(std::move(impl)));
}

StateFile::StateFile(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

StateFile::~StateFile() = default;

char* StateFile::buffer(size_t i) const {
  return i < impl_->buffers_.size() ? impl_->buffers_[i] : nullptr;
}
size_t StateFile::buffers() const { return impl_->buffers_.size(); }
size_t StateFile::buffer_bytes() const { return impl_->buffer_bytes_; }

absl::Status StateFile::StartRead(uint64_t id, uint64_t offset, size_t buffer, size_t at,
                                  size_t length, absl::Time deadline) {
  return impl_->Start(/*write=*/false, id, offset, buffer, at, length, deadline);
}

absl::Status StateFile::StartWrite(uint64_t id, uint64_t offset, size_t buffer, size_t at,
                                   size_t length, absl::Time deadline) {
  return impl_->Start(/*write=*/true, id, offset, buffer, at, length, deadline);
}

absl::Status StateFile::Wait(uint64_t id, absl::Time deadline) { return impl_->Wait(id, deadline); }

absl::Status StateFile::WaitAll(absl::Time deadline) { return impl_->WaitAll(deadline); }

absl::Status StateFile::Read(uint64_t offset, size_t buffer, size_t at, size_t length,
                             absl::Time deadline) {
  const uint64_t id = impl_->UnusedId();
  if (absl::Status s = StartRead(id, offset, buffer, at, length, deadline); !s.ok()) return s;
  return Wait(id, deadline);
}

absl::Status StateFile::Write(uint64_t offset, size_t buffer, size_t at, size_t length,
                              absl::Time deadline) {
  const uint64_t id = impl_->UnusedId();
  if (absl::Status s = StartWrite(id, offset, buffer, at, length, deadline); !s.ok()) return s;
  return Wait(id, deadline);
}

const std::string& StateFile::path() const { return impl_->path_; }
uint64_t StateFile::size() const { return impl_->size_; }
bool StateFile::direct() const { return impl_->dir_->direct(); }
bool StateFile::io_uring() const { return impl_->ring_ready_; }
size_t StateFile::in_flight() const { return impl_->ops_.size(); }

}  // namespace zeroshard
