#include "client/staging_slots.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace zeroshard {
namespace {

// Outcomes learned by fencing a quarantined slot for another push, kept for
// a later push of the same contribution.
constexpr size_t kMaxResolvedKeys = 1024;

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
  slots_[i].state = State::kFencing;
  mu_.Unlock();
  const absl::StatusOr<uint64_t> applied = fence(i, generation);
  mu_.Lock();
  if (!applied.ok()) {
    slots_[i].state = State::kQuarantined;
    return applied.status();
  }
  slots_[i].state = State::kFree;
  std::vector<PushKey> keys = std::move(slots_[i].keys);
  slots_[i].keys.clear();
  if (*applied != generation) return false;
  for (PushKey& key : keys) {
    if (resolved_.size() == kMaxResolvedKeys) resolved_.erase(resolved_.begin());
    resolved_.push_back(std::move(key));
  }
  return true;
}

void StagingSlots::ResolveEarlierAttempts(absl::Span<const PushKey> keys, FenceFn fence,
                                          std::vector<bool>* applied, std::vector<bool>* failed,
                                          absl::Status* last_error) {
  for (;;) {
    // What earlier fences found applied.
    for (size_t k = 0; k < keys.size(); ++k) {
      if ((*applied)[k]) continue;
      auto it = std::find(resolved_.begin(), resolved_.end(), keys[k]);
      if (it != resolved_.end()) {
        resolved_.erase(it);
        (*applied)[k] = true;
      }
    }
    // A quarantined slot holding one of the others.
    std::optional<uint32_t> holding;
    for (uint32_t i = 0; i < count_ && !holding; ++i) {
      const Slot& s = slots_[i];
      if (s.state != State::kQuarantined || Marked(*failed, i)) continue;
      for (size_t k = 0; k < keys.size() && !holding; ++k) {
        if (!(*applied)[k] && std::find(s.keys.begin(), s.keys.end(), keys[k]) != s.keys.end()) {
          holding = i;
        }
      }
    }
    if (!holding) return;
    if (absl::StatusOr<bool> fenced = FenceLocked(*holding, fence); !fenced.ok()) {
      Mark(failed, *holding);
      *last_error = fenced.status();
    }
  }
}

absl::StatusOr<StagingSlots::Acquired> StagingSlots::Acquire(absl::Span<const PushKey> keys,
                                                             absl::Time deadline, FenceFn fence) {
  absl::MutexLock lock(&mu_);
  std::vector<bool> failed;  // quarantined slots whose fence failed in this call
  absl::Status last_error;
  Acquired acquired;
  acquired.applied.assign(keys.size(), false);
  auto usable = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return Find(State::kFree, {}).has_value() || Find(State::kQuarantined, failed).has_value();
  };
  for (;;) {
    // Earlier attempts of these contributions that nobody answered (and the
    // fences of other pushes' slots while the lock was released): their
    // outcomes decide what is left to send.
    ResolveEarlierAttempts(keys, fence, &acquired.applied, &failed, &last_error);
    if (std::find(acquired.applied.begin(), acquired.applied.end(), false) ==
        acquired.applied.end()) {
      acquired.delivered = true;
      return acquired;
    }
    if (std::optional<uint32_t> i = Find(State::kFree, {})) {
      Slot& s = slots_[*i];
      s.state = State::kBusy;
      acquired.lease = {*i, ++s.generation};
      return acquired;
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

absl::StatusOr<bool> StagingSlots::Resolve(const Lease& lease, absl::Span<const PushKey> keys,
                                           FenceFn fence) {
  // The slot stays kBusy (this push's) while the fence runs.
  const absl::StatusOr<uint64_t> applied = fence(lease.slot, lease.generation);
  absl::MutexLock lock(&mu_);
  Slot& s = slots_[lease.slot];
  if (!applied.ok()) {
    s.state = State::kQuarantined;
    s.keys.assign(keys.begin(), keys.end());
    return applied.status();
  }
  s.state = State::kFree;
  return *applied == lease.generation;
}

}  // namespace zeroshard
