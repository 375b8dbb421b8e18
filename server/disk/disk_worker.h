#pragma once

// Runs a daemon's short file-system calls for one directory (the checkpoint
// directory's owner files, quota walk and manifests) on a thread of its
// own, so that a disk that stops answering (a failing drive, a lost NFS
// server, a frozen filesystem) holds that thread and no request handler:
// a caller waits for its call at most `timeout`, and while a call has been
// running for longer than that, every new call is refused at once.
//
// A call whose caller stopped waiting still runs to its end once the disk
// answers (a system call stuck in the kernel cannot be taken back); calls
// queued behind it that nobody waits for any more are dropped unrun. When
// the stuck call returns, the worker logs how long it took and serves
// again.
//
// Thread-safe. Blocking: Run waits up to the timeout. The destructor waits
// up to the timeout for the call in progress, then leaves it to finish on
// its own (its thread keeps what it needs alive).

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace zeroshard {

// How --disk_timeout_seconds names itself in messages ("...=10").
std::string DiskTimeoutFlag(absl::Duration timeout);

class DiskWorker {
 public:
  // `what` names the directory in errors and logs, e.g.
  // "--checkpoint_dir /var/lib/zeroshard"; `timeout_flag` the setting that
  // bounds a call, e.g. "--disk_timeout_seconds=10". `timeout` > 0.
  DiskWorker(std::string what, std::string timeout_flag, absl::Duration timeout);
  ~DiskWorker();
  DiskWorker(const DiskWorker&) = delete;
  DiskWorker& operator=(const DiskWorker&) = delete;

  // Runs `fn` on the worker's thread and returns its result.
  // Unavailable, naming the directory and the timeout, when `fn` did not
  // end within the timeout (it then ends when the disk answers, with nobody
  // waiting for it), or at once, unrun, while an earlier call has been
  // running for longer than the timeout. `fn` must own everything it uses
  // (values, shared_ptrs): it may outlive this call.
  absl::Status Run(std::function<absl::Status()> fn);

  template <typename T>
  absl::StatusOr<T> Call(std::function<absl::StatusOr<T>()> fn) {
    auto result = std::make_shared<absl::StatusOr<T>>(absl::UnknownError("not run"));
    absl::Status s = Run([result, fn = std::move(fn)] {
      *result = fn();
      return result->status();
    });
    if (!s.ok()) return s;
    return std::move(*result);
  }

  // How long the call in progress has been running; zero when none is.
  absl::Duration Busy() const;

 private:
  struct State;
  static void Loop(std::shared_ptr<State> state);

  std::shared_ptr<State> state_;
  std::thread thread_;
};

}  // namespace zeroshard
