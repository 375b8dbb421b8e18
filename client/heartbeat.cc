#include "client/heartbeat.h"

#include <algorithm>

namespace zeroshard {

HeartbeatLoop::HeartbeatLoop(RankId id, std::vector<DaemonControl*> daemons,
                             absl::Duration interval, absl::Duration rpc_timeout)
    : id_(std::move(id)),
      daemons_(std::move(daemons)),
      interval_(interval),
      rpc_timeout_(rpc_timeout),
      thread_([this] { Run(); }) {}

HeartbeatLoop::~HeartbeatLoop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

void HeartbeatLoop::Run() {
  auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; };
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping), interval_)) return;
    }
    for (DaemonControl* d : daemons_) {
      const absl::Status s = d->Heartbeat(id_, absl::Now() + std::min(interval_, rpc_timeout_));
      ++sent_;
      if (!s.ok()) ++failures_;
    }
  }
}

}  // namespace zeroshard
