#pragma once

// Ends streaming calls whose peer stopped: a stream handler runs each
// blocking read or write of its call through a StreamWatch, and a call that
// has waited on its peer for longer than the watchdog's idle limit is
// cancelled (grpc::ServerContext::TryCancel), which makes that read or write
// return false. Time the handler spends on its own work (applying a push,
// waiting for a commit) is not idle time; only waits on the peer count.
//
// Threads: one of its own, woken every idle/4 (at most every second). Watches
// are created and used by handler threads; a watch must not outlive its
// watchdog.

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace zeroshard {

class StreamWatchdog;

// One call's watch. Without a watchdog (StreamWatch()) it only runs the I/O.
class StreamWatch {
 public:
  StreamWatch() = default;
  StreamWatch(const StreamWatch&) = delete;
  StreamWatch& operator=(const StreamWatch&) = delete;
  ~StreamWatch();

  // Runs `io` (one blocking Read or Write of the call) as a wait on the
  // peer, and returns what it returned.
  template <typename IO>
  bool Wait(IO&& io) {
    waiting_since_ns_.store(absl::GetCurrentTimeNanos(), std::memory_order_relaxed);
    const bool ok = io();
    waiting_since_ns_.store(0, std::memory_order_relaxed);
    return ok;
  }
  // Whether the watchdog cancelled the call for idleness.
  bool expired() const { return expired_.load(std::memory_order_acquire); }

 private:
  friend class StreamWatchdog;
  StreamWatchdog* watchdog_ = nullptr;
  absl::AnyInvocable<void()> cancel_;
  std::atomic<int64_t> waiting_since_ns_{0};  // 0: not waiting on the peer
  std::atomic<bool> expired_{false};
};

class StreamWatchdog {
 public:
  // `idle` > 0: the longest one read or write may wait on the peer.
  explicit StreamWatchdog(absl::Duration idle);
  // Stops and joins the thread. No watch of this watchdog may be alive.
  ~StreamWatchdog();
  StreamWatchdog(const StreamWatchdog&) = delete;
  StreamWatchdog& operator=(const StreamWatchdog&) = delete;

  // Watches a call until the returned watch is destroyed; `cancel` (called
  // at most once, on the watchdog's thread, with its lock held: it must not
  // block) ends the call.
  std::unique_ptr<StreamWatch> Watch(absl::AnyInvocable<void()> cancel);

  absl::Duration idle() const { return idle_; }
  // Calls cancelled so far.
  uint64_t cancelled() const { return cancelled_.load(std::memory_order_relaxed); }

 private:
  friend class StreamWatch;
  void Forget(StreamWatch* watch);
  void Run();

  const absl::Duration idle_;
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_set<StreamWatch*> watches_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> cancelled_{0};
  std::thread thread_;  // last: started once the rest is built
};

}  // namespace zeroshard
