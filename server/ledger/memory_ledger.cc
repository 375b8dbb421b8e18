#include "server/ledger/memory_ledger.h"

#include <algorithm>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "common/format.h"
#include "metrics/metric_names.h"

namespace zeroshard {

static_assert(static_cast<int>(std::size(metrics::kMemoryCategories)) == kNumMemoryCategories,
              "one exported category name per MemoryCategory");

const char* MemoryCategoryName(MemoryCategory c) {
  // The names are string literals, so data() is NUL-terminated.
  return metrics::kMemoryCategories[static_cast<int>(c)].data();
}

void MemoryLedger::SetListener(Listener listener) { listener_ = std::move(listener); }

absl::Status MemoryLedger::CheckLocked(const std::string& job, uint64_t bytes,
                                       absl::FunctionRef<std::string()> what) const {
  if (limit_ != 0 && (bytes > limit_ || total_ > limit_ - bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "job ", job, ": ", what(), " would exceed the daemon's --memory_limit of ",
        FormatBytes(limit_), " (", FormatBytes(total_), " in use)"));
  }
  if (owner_limit_ == 0) return absl::OkStatus();
  auto owner = owner_of_.find(job);
  if (owner == owner_of_.end()) return absl::OkStatus();
  auto held = owner_bytes_.find(owner->second);
  const uint64_t in_use = held == owner_bytes_.end() ? 0 : held->second;
  if (bytes > owner_limit_ || in_use > owner_limit_ - bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "job ", job, ": ", what(), " would exceed the --max_memory_per_identity of ",
        FormatBytes(owner_limit_), " for ", owner->second, ", who registered it (",
        FormatBytes(in_use), " in use by that identity's jobs)"));
  }
  return absl::OkStatus();
}

void MemoryLedger::AddOwnerBytesLocked(const std::string& job, int64_t bytes) {
  if (bytes == 0) return;
  auto owner = owner_of_.find(job);
  if (owner == owner_of_.end()) return;
  uint64_t& held = owner_bytes_[owner->second];
  if (bytes > 0) {
    held += static_cast<uint64_t>(bytes);
  } else {
    held -= std::min(held, static_cast<uint64_t>(-bytes));
    if (held == 0) owner_bytes_.erase(owner->second);
  }
}

absl::Status MemoryLedger::CheckFits(const std::string& job, uint64_t bytes) const {
  absl::MutexLock lock(&mu_);
  return CheckLocked(job, bytes, [&] {
    return absl::StrCat(FormatBytes(bytes), " (", bytes, " B) more");
  });
}

absl::Status MemoryLedger::Reserve(const std::string& job, MemoryCategory category,
                                   uint64_t bytes) {
  uint64_t now;
  {
    absl::MutexLock lock(&mu_);
    absl::Status fits = CheckLocked(job, bytes, [&] {
      return absl::StrCat(FormatBytes(bytes), " more for ", MemoryCategoryName(category));
    });
    if (!fits.ok()) return fits;
    total_ += bytes;
    now = (jobs_[job][static_cast<int>(category)] += bytes);
    AddOwnerBytesLocked(job, static_cast<int64_t>(bytes));
  }
  Notify(job, category, now);
  return absl::OkStatus();
}

absl::Status MemoryLedger::ReserveAll(const std::string& job, const CategoryBytes& bytes) {
  uint64_t sum = 0;
  for (uint64_t b : bytes) {
    if (b > ~uint64_t{0} - sum) {
      return absl::ResourceExhaustedError(
          absl::StrCat("job ", job, ": the memory asked for exceeds 2^64 bytes"));
    }
    sum += b;
  }
  CategoryBytes now{};
  {
    absl::MutexLock lock(&mu_);
    absl::Status fits = CheckLocked(job, sum, [&] {
      std::string parts;
      for (int c = 0; c < kNumMemoryCategories; ++c) {
        if (bytes[c] == 0) continue;
        absl::StrAppend(&parts, parts.empty() ? "" : ", ",
                        MemoryCategoryName(static_cast<MemoryCategory>(c)), " ",
                        FormatBytes(bytes[c]));
      }
      return absl::StrCat(FormatBytes(sum), " (", sum, " B: ", parts, ")");
    });
    if (!fits.ok()) return fits;
    if (sum == 0) return absl::OkStatus();
    total_ += sum;
    AddOwnerBytesLocked(job, static_cast<int64_t>(sum));
    CategoryBytes& entry = jobs_[job];
    for (int c = 0; c < kNumMemoryCategories; ++c) now[c] = (entry[c] += bytes[c]);
  }
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    if (bytes[c] != 0) Notify(job, static_cast<MemoryCategory>(c), now[c]);
  }
  return absl::OkStatus();
}

void MemoryLedger::Release(const std::string& job, MemoryCategory category, uint64_t bytes) {
  uint64_t now;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job);
    if (it == jobs_.end()) return;
    uint64_t& slot = it->second[static_cast<int>(category)];
    const uint64_t b = std::min(bytes, slot);
    slot -= b;
    total_ -= b;
    AddOwnerBytesLocked(job, -static_cast<int64_t>(b));
    now = slot;
  }
  Notify(job, category, now);
}

void MemoryLedger::Move(const std::string& from_job, MemoryCategory from,
                        const std::string& to_job, MemoryCategory to, uint64_t bytes) {
  uint64_t from_now;
  uint64_t to_now;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(from_job);
    if (it == jobs_.end()) return;
    uint64_t& source = it->second[static_cast<int>(from)];
    const uint64_t b = std::min(bytes, source);
    source -= b;
    from_now = source;
    // Looked up again: the emplace below may be the first entry of to_job.
    to_now = (jobs_[to_job][static_cast<int>(to)] += b);
    if (from_job != to_job) {
      AddOwnerBytesLocked(from_job, -static_cast<int64_t>(b));
      AddOwnerBytesLocked(to_job, static_cast<int64_t>(b));
    }
  }
  Notify(from_job, from, from_now);
  Notify(to_job, to, to_now);
}

bool MemoryLedger::RemoveJobIfEmpty(const std::string& job) {
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job);
    if (it == jobs_.end()) {
      owner_of_.erase(job);
      return true;
    }
    for (uint64_t b : it->second) {
      if (b != 0) return false;
    }
    jobs_.erase(it);
    owner_of_.erase(job);
  }
  if (remove_listener_) remove_listener_(job);
  return true;
}

void MemoryLedger::SetRemoveListener(std::function<void(const std::string&)> listener) {
  remove_listener_ = std::move(listener);
}

void MemoryLedger::SetOwner(const std::string& job, const std::string& owner) {
  absl::MutexLock lock(&mu_);
  uint64_t held = 0;
  if (auto it = jobs_.find(job); it != jobs_.end()) {
    for (uint64_t b : it->second) held += b;
  }
  AddOwnerBytesLocked(job, -static_cast<int64_t>(held));
  owner_of_[job] = owner;
  AddOwnerBytesLocked(job, static_cast<int64_t>(held));
}

uint64_t MemoryLedger::OwnerBytes(const std::string& owner) const {
  absl::MutexLock lock(&mu_);
  auto it = owner_bytes_.find(owner);
  return it == owner_bytes_.end() ? 0 : it->second;
}

uint64_t MemoryLedger::total() const {
  absl::MutexLock lock(&mu_);
  return total_;
}

std::map<std::string, CategoryBytes> MemoryLedger::Snapshot() const {
  absl::MutexLock lock(&mu_);
  return jobs_;
}

CategoryBytes MemoryLedger::JobBytes(const std::string& job) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job);
  return it == jobs_.end() ? CategoryBytes{} : it->second;
}

absl::StatusOr<LedgerReservation> LedgerReservation::Create(MemoryLedger* ledger, std::string job,
                                                            const CategoryBytes& bytes) {
  if (absl::Status s = ledger->ReserveAll(job, bytes); !s.ok()) return s;
  LedgerReservation r;
  r.ledger_ = ledger;
  r.job_ = std::move(job);
  r.held_ = bytes;
  return r;
}

LedgerReservation& LedgerReservation::operator=(LedgerReservation&& o) noexcept {
  if (this == &o) return *this;
  ReleaseHeld();
  ledger_ = o.ledger_;
  job_ = std::move(o.job_);
  held_ = o.held_;
  o.ledger_ = nullptr;
  o.held_ = {};
  return *this;
}

bool LedgerReservation::Take(MemoryCategory category, uint64_t bytes) {
  uint64_t& held = held_[static_cast<int>(category)];
  if (held < bytes) return false;
  held -= bytes;
  return true;
}

void LedgerReservation::ReleaseHeld() {
  if (ledger_ == nullptr) return;
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    if (held_[c] != 0) ledger_->Release(job_, static_cast<MemoryCategory>(c), held_[c]);
  }
  held_ = {};
}

void MemoryLedger::Notify(const std::string& job, MemoryCategory c, uint64_t bytes) {
  if (listener_) listener_(job, c, bytes);
}

}  // namespace zeroshard
