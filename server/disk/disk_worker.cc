#include "server/disk/disk_worker.h"

#include <cstdio>
#include <deque>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace zeroshard {
namespace {

void Log(const std::string& line) { std::fprintf(stderr, "zeroshardd: %s\n", line.c_str()); }

std::string Seconds(absl::Duration d) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", absl::ToDoubleSeconds(d));
  return buf;
}

}  // namespace

std::string DiskTimeoutFlag(absl::Duration timeout) {
  return absl::StrCat("--disk_timeout_seconds=", absl::ToDoubleSeconds(timeout));
}

struct DiskWorker::State {
  struct Task {
    std::function<absl::Status()> fn;
    bool abandoned = false;  // its caller stopped waiting
    bool done = false;
    absl::Status result;
  };

  State(std::string w, std::string f, absl::Duration t)
      : what(std::move(w)), flag(std::move(f)), timeout(t) {}

  // A call in progress longer than the timeout: the disk is stuck.
  bool StuckLocked(absl::Time now) const ABSL_SHARED_LOCKS_REQUIRED(mu) {
    return running && now - running_since > timeout;
  }

  const std::string what;
  const std::string flag;
  const absl::Duration timeout;

  mutable absl::Mutex mu;
  std::deque<std::shared_ptr<Task>> queue ABSL_GUARDED_BY(mu);
  bool running ABSL_GUARDED_BY(mu) = false;
  absl::Time running_since ABSL_GUARDED_BY(mu);
  bool stuck_logged ABSL_GUARDED_BY(mu) = false;  // of the call in progress
  bool stopping ABSL_GUARDED_BY(mu) = false;
};

DiskWorker::DiskWorker(std::string what, std::string timeout_flag, absl::Duration timeout)
    : state_(std::make_shared<State>(std::move(what), std::move(timeout_flag), timeout)),
      thread_(&DiskWorker::Loop, state_) {}

DiskWorker::~DiskWorker() {
  bool idle = false;
  {
    absl::MutexLock lock(&state_->mu);
    state_->stopping = true;
    State* s = state_.get();
    auto not_running = [s]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) { return !s->running; };
    idle = state_->mu.AwaitWithTimeout(absl::Condition(&not_running), state_->timeout);
  }
  if (idle) {
    thread_.join();
    return;
  }
  // The call in progress ends when the disk answers; the thread holds the
  // state until then.
  Log(absl::StrCat(state_->what, ": a call on it is still in progress at shutdown; it is left to "
                                 "finish when the disk answers"));
  thread_.detach();
}

void DiskWorker::Loop(std::shared_ptr<State> state) {
  State& s = *state;
  absl::MutexLock lock(&s.mu);
  for (;;) {
    auto ready = [&s]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
      return s.stopping || !s.queue.empty();
    };
    s.mu.Await(absl::Condition(&ready));
    if (s.stopping) {
      for (const std::shared_ptr<State::Task>& t : s.queue) {
        t->result = absl::UnavailableError(absl::StrCat(s.what, ": the daemon is stopping"));
        t->done = true;
      }
      s.queue.clear();
      return;
    }
    std::shared_ptr<State::Task> task = std::move(s.queue.front());
    s.queue.pop_front();
    if (task->abandoned) continue;
    s.running = true;
    s.running_since = absl::Now();
    s.stuck_logged = false;
    s.mu.Unlock();
    absl::Status result = task->fn();
    task->fn = nullptr;  // what it owns goes now, not with the task
    s.mu.Lock();
    const absl::Duration took = absl::Now() - s.running_since;
    s.running = false;
    task->result = std::move(result);
    task->done = true;
    if (took > s.timeout) {
      Log(absl::StrCat(s.what, ": a call returned after ", Seconds(took),
                       " s (past ", s.flag, "): the disk answers again"));
    }
  }
}

absl::Status DiskWorker::Run(std::function<absl::Status()> fn) {
  auto task = std::make_shared<State::Task>();
  task->fn = std::move(fn);
  const std::shared_ptr<State> state = state_;
  State& s = *state;
  absl::MutexLock lock(&s.mu);
  const absl::Time now = absl::Now();
  if (s.StuckLocked(now)) {
    return absl::UnavailableError(absl::StrCat(
        s.what, ": a call on it has not returned for ", Seconds(now - s.running_since),
        " s (past ", s.flag, "): its disk is hung or far too slow; refused without touching it"));
  }
  if (s.stopping) return absl::UnavailableError(absl::StrCat(s.what, ": the daemon is stopping"));
  s.queue.push_back(task);
  if (s.mu.AwaitWithTimeout(absl::Condition(&task->done), s.timeout)) return task->result;
  task->abandoned = true;
  if (s.running && !s.stuck_logged) {
    s.stuck_logged = true;
    Log(absl::StrCat(s.what, ": a call on it has not returned for ",
                     Seconds(absl::Now() - s.running_since), " s (", s.flag,
                     "): its disk is hung or far too slow; calls on it are refused until it "
                     "answers"));
  }
  return absl::UnavailableError(absl::StrCat(
      s.what, " did not answer within ", s.flag,
      " (its disk is hung or far too slow): the call finishes if the disk answers, and calls on it "
      "are refused until then"));
}

absl::Duration DiskWorker::Busy() const {
  absl::MutexLock lock(&state_->mu);
  return state_->running ? absl::Now() - state_->running_since : absl::ZeroDuration();
}

}  // namespace zeroshard
