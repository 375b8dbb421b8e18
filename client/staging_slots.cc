#include "client/staging_slots.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace zeroshard {
namespace {

// Outcomes learned by fencing a quarantined slot for another push, kept for
// a later push of the same contribution.
constexpr size_t kMaxResolvedKeys = 64;

bool Marked(const std::vector<bool>& marks, uint32_t i) { return i < marks.size() && marks[i]; }

void Mark(std::vector<bool>* marks, uint32_t i) {
  if (marks->size() <= i) marks->resize(i + 1, false);
  (*marks)[i] = true;
}

}  // namespace

void StagingSlots::SetCount(uint32_t count) {
  absl::MutexLock lock(&mu_);
  if (slots_.size() < count) slots_.resize(count);
  count_ = count;
}

int StagingSlots::quarantined() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(std::count_if(slots_.begin(), slots_.end(), [](const Slot& s) {
    return s.state == State::kQuarantined || s.state == State::kFencing;
  }));
}

std::optional<uint32_t> StagingSlots::Find(State state, const std::vector<bool>& skip) const {
  for (uint32_t i = 0; i < count_; ++i) {
    if (slots_[i].state == state && !Marked(skip, i)) return i;
  }
  return std::nullopt;
}

absl::StatusOr<bool> StagingSlots::FenceLocked(uint32_t i, FenceFn fence) {
  const uint64_t generation = slots_[i].generation;
  const PushKey key = slots_[i].key;
  slots_[i].state = State::kFencing;
  mu_.Unlock();
  const absl::StatusOr<uint64_t> applied = fence(i, generation);
  mu_.Lock();
  if (!applied.ok()) {
    slots_[i].state = State::kQuarantined;
    return applied.status();
  }
  slots_[i].state = State::kFree;
  if (*applied != generation) return false;
  if (resolved_.size() == kMaxResolvedKeys) resolved_.erase(resolved_.begin());
  resolved_.push_back(key);
  return true;
}

bool StagingSlots::ResolveEarlierAttempt(const PushKey& key, FenceFn fence,
                                         std::vector<bool>* failed, absl::Status* last_error) {
  for (;;) {
    auto it = std::find(resolved_.begin(), resolved_.end(), key);
    if (it != resolved_.end()) {
      resolved_.erase(it);
      return true;
    }
    std::optional<uint32_t> same;
    for (uint32_t i = 0; i < count_ && !same; ++i) {
      const Slot& s = slots_[i];
      if (s.state == State::kQuarantined && s.key == key && !Marked(*failed, i)) same = i;
    }
    if (!same) return false;
    absl::StatusOr<bool> applied = FenceLocked(*same, fence);
    if (!applied.ok()) {
      Mark(failed, *same);
      *last_error = applied.status();
    } else if (*applied) {
      resolved_.pop_back();  // FenceLocked recorded it for us
      return true;
    }
  }
}

absl::StatusOr<StagingSlots::Acquired> StagingSlots::Acquire(const PushKey& key,
                                                             absl::Time deadline,
                                                             FenceFn fence) {
  absl::MutexLock lock(&mu_);
  std::vector<bool> failed;  // quarantined slots whose fence failed in this call
  absl::Status last_error;
  // An earlier attempt of this contribution that nobody answered: its
  // outcome decides whether anything is left to send.
  if (ResolveEarlierAttempt(key, fence, &failed, &last_error)) return Acquired{true, {}};
  auto usable = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return Find(State::kFree, {}).has_value() || Find(State::kQuarantined, failed).has_value();
  };
  for (;;) {
    if (std::optional<uint32_t> i = Find(State::kFree, {})) {
      Slot& s = slots_[*i];
      s.state = State::kBusy;
      return Acquired{false, {*i, ++s.generation}};
    }
    if (std::optional<uint32_t> q = Find(State::kQuarantined, failed)) {
      if (absl::StatusOr<bool> applied = FenceLocked(*q, fence); !applied.ok()) {
        Mark(&failed, *q);
        last_error = applied.status();
      }
      continue;
    }
    bool others = false;  // another push holds a slot, or fences one
    for (uint32_t i = 0; i < count_; ++i) {
      others = others || slots_[i].state == State::kBusy || slots_[i].state == State::kFencing;
    }
    if (!others) {
      return absl::UnavailableError(absl::StrCat(
          "daemon ", daemon_, ": none of its ", count_, " staging slots is usable: each holds a ",
          "push whose outcome is unknown and could not be fenced",
          last_error.ok() ? "" : absl::StrCat(" (", last_error.message(), ")")));
    }
    if (!mu_.AwaitWithDeadline(absl::Condition(&usable), deadline)) {
      return absl::DeadlineExceededError(
          absl::StrCat("daemon ", daemon_, ": no staging slot became free in time"));
    }
  }
}

void StagingSlots::Release(const Lease& lease) {
  absl::MutexLock lock(&mu_);
  slots_[lease.slot].state = State::kFree;
}

absl::StatusOr<bool> StagingSlots::Resolve(const Lease& lease, const PushKey& key,
                                           FenceFn fence) {
  // The slot stays kBusy (this push's) while the fence runs.
  const absl::StatusOr<uint64_t> applied = fence(lease.slot, lease.generation);
  absl::MutexLock lock(&mu_);
  Slot& s = slots_[lease.slot];
  if (!applied.ok()) {
    s.state = State::kQuarantined;
    s.key = key;
    return applied.status();
  }
  s.state = State::kFree;
  return *applied == lease.generation;
}

}  // namespace zeroshard
