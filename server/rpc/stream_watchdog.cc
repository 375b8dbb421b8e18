#include "server/rpc/stream_watchdog.h"

#include <algorithm>
#include <utility>

#include "absl/time/clock.h"

namespace zeroshard {

StreamWatch::~StreamWatch() {
  if (watchdog_ != nullptr) watchdog_->Forget(this);
}

StreamWatchdog::StreamWatchdog(absl::Duration idle)
    : idle_(idle), thread_([this] { Run(); }) {}

StreamWatchdog::~StreamWatchdog() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

std::unique_ptr<StreamWatch> StreamWatchdog::Watch(absl::AnyInvocable<void()> cancel) {
  auto watch = std::make_unique<StreamWatch>();
  watch->watchdog_ = this;
  watch->cancel_ = std::move(cancel);
  absl::MutexLock lock(&mu_);
  watches_.insert(watch.get());
  return watch;
}

void StreamWatchdog::Forget(StreamWatch* watch) {
  absl::MutexLock lock(&mu_);
  watches_.erase(watch);
}

void StreamWatchdog::Run() {
  const absl::Duration tick = std::min(idle_ / 4, absl::Seconds(1));
  const int64_t idle_ns = absl::ToInt64Nanoseconds(idle_);
  absl::MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(&stopping_), tick)) {
    const int64_t now = absl::GetCurrentTimeNanos();
    for (StreamWatch* w : watches_) {
      const int64_t since = w->waiting_since_ns_.load(std::memory_order_relaxed);
      if (since == 0 || now - since <= idle_ns || w->expired()) continue;
      w->expired_.store(true, std::memory_order_release);
      // Counted before the cancel: whoever the cancel wakes sees the count.
      cancelled_.fetch_add(1, std::memory_order_relaxed);
      w->cancel_();
    }
  }
}

}  // namespace zeroshard
