#include "client/executor.h"

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"

namespace zeroshard {

Executor::Executor(int threads) {
  if (threads < 1) threads = 1;
  workers_.reserve(threads);
  for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { Loop(); });
}

Executor::~Executor() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : workers_) t.join();
}

void Executor::Submit(std::function<void()> fn) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(fn));
}

void Executor::Loop() {
  for (;;) {
    std::function<void()> fn;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !queue_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping and drained
      fn = std::move(queue_.front());
      queue_.pop_front();
    }
    fn();
  }
}

void CountDown::Add(int64_t n) {
  absl::MutexLock lock(&mu_);
  pending_ += n;
}

void CountDown::Done(const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  if (!status.ok() && status_.ok()) status_ = status;
  --pending_;
}

absl::Status CountDown::Wait(absl::Time deadline, const std::string& what) {
  absl::MutexLock lock(&mu_);
  auto zero = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return pending_ <= 0; };
  if (!mu_.AwaitWithDeadline(absl::Condition(&zero), deadline)) {
    return absl::DeadlineExceededError(
        absl::StrCat(what, ": ", pending_, " operation(s) still in flight at the deadline"));
  }
  return status_;
}

bool CountDown::done() const {
  absl::MutexLock lock(&mu_);
  return pending_ <= 0;
}

absl::Status ParallelFor(Executor& executor, uint32_t n,
                         const std::function<absl::Status(uint32_t)>& fn) {
  auto group = std::make_shared<CountDown>(n);
  for (uint32_t i = 0; i < n; ++i) {
    executor.Submit([group, &fn, i] { group->Done(fn(i)); });
  }
  // `fn` refers to the caller's state, so this must not return before every
  // call has; each call bounds its own waits, so the wait ends.
  return group->Wait(absl::InfiniteFuture(), "parallel calls");
}

}  // namespace zeroshard
