#pragma once

// A fixed set of worker threads running submitted closures in FIFO order,
// and a countdown that collects the first error of a group of tasks.

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace zeroshard {

class Executor {
 public:
  // Starts `threads` (>= 1) workers; they live until the destructor.
  explicit Executor(int threads);
  // Runs every closure already submitted, then joins the workers. Closures
  // must not wait for anything without a deadline, or destruction can hang.
  ~Executor();

  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Queues `fn`; never blocks. `fn` runs on one of the workers.
  void Submit(std::function<void()> fn);

 private:
  void Loop();

  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

// Counts outstanding tasks of one group; each Done() may carry an error, the
// first one is kept. Thread-safe.
class CountDown {
 public:
  explicit CountDown(int64_t count = 0) : pending_(count) {}

  void Add(int64_t n);
  void Done(const absl::Status& status = absl::OkStatus());
  // Blocks until the count reaches zero (returns the first error, or OK) or
  // until `deadline` (DeadlineExceeded naming `what`; the tasks keep running).
  absl::Status Wait(absl::Time deadline, const std::string& what);
  bool done() const;

 private:
  mutable absl::Mutex mu_;
  int64_t pending_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

// Runs fn(i) for every i in [0, n) on `executor`, in parallel, and returns
// once every call has returned (the first error, or OK). Blocks without a
// deadline of its own: each fn must bound its waits (its RPCs' deadlines).
// Must not be called from one of `executor`'s own threads.
absl::Status ParallelFor(Executor& executor, uint32_t n,
                         const std::function<absl::Status(uint32_t)>& fn);

}  // namespace zeroshard
