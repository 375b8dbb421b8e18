#pragma once

// A thread that tells every daemon of a job, every `interval`, that this
// rank is alive (Control.Heartbeat), so that the daemons count it as
// connected (StepState.ranks_connected, zeroshard_ranks_connected). Runs from
// construction until destruction; a failed heartbeat is not retried sooner
// and is counted in failures().

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/daemon_control.h"

namespace zeroshard {

class HeartbeatLoop {
 public:
  // `daemons` must outlive the loop. Each Heartbeat RPC's deadline is
  // min(interval, rpc_timeout) from its start. `interval` > 0.
  HeartbeatLoop(RankId id, std::vector<DaemonControl*> daemons, absl::Duration interval,
                absl::Duration rpc_timeout);
  // Stops the thread: at most one RPC's deadline.
  ~HeartbeatLoop();

  HeartbeatLoop(const HeartbeatLoop&) = delete;
  HeartbeatLoop& operator=(const HeartbeatLoop&) = delete;

  uint64_t sent() const { return sent_.load(); }
  uint64_t failures() const { return failures_.load(); }

 private:
  void Run();

  const RankId id_;
  const std::vector<DaemonControl*> daemons_;
  const absl::Duration interval_;
  const absl::Duration rpc_timeout_;
  std::atomic<uint64_t> sent_{0};
  std::atomic<uint64_t> failures_{0};
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: started once the members above exist
};

}  // namespace zeroshard
