#include "server/activation/activation_spill.h"

#include <liburing.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace zeroshard {
namespace {

void Log(const std::string& line) { std::fprintf(stderr, "zeroshardd: %s\n", line.c_str()); }

}  // namespace

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
