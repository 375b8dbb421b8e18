#pragma once

// Every byte a daemon holds for a job, booked under a category. The ledger is
// the one source of truth for MemoryReport and zeroshard_memory_bytes.
// Thread-safe.

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "common/host_memory.h"

namespace zeroshard {

enum class MemoryCategory : int {
  kParamMaster = 0,  // fp32 master parameters
  kParamHalf,        // half-precision copy served to trainers
  kGrad,             // reduced gradient shard
  kOptimM,           // Adam first moment / SGD momentum
  kOptimV,           // Adam second moment
  kActivation,       // offloaded activation checkpoints
  kBuffer,           // staging and communication buffers
  kFragmentation,    // reserved but unusable
  kReplica,          // a backup's copy of another daemon's replica group
  kParamCache,       // the node cache: other daemons' parameters (server/cache)
};
inline constexpr int kNumMemoryCategories = 10;

// "param_master", "param_half", "grad", "optim_m", "optim_v", "activation",
// "buffer", "fragmentation", "replica", "param_cache".
const char* MemoryCategoryName(MemoryCategory c);

using CategoryBytes = std::array<uint64_t, kNumMemoryCategories>;

// The ledger entry for memory the daemon holds for no job: the activation
// arena's free space (server/activation/activation_store.h). No job id can take this
// name (common/job_id.h allows no parentheses).
inline constexpr char kDaemonLedgerEntry[] = "(daemon)";

class MemoryLedger {
 public:
  // limit_bytes 0 = unlimited. owner_limit_bytes: what the jobs of one
  // owner (the identity that registered them, SetOwner) may hold together;
  // 0 = only the daemon's limit.
  explicit MemoryLedger(uint64_t limit_bytes, uint64_t owner_limit_bytes = 0)
      : limit_(limit_bytes), owner_limit_(owner_limit_bytes) {}

  // Called after every change with the job, category and new byte count (on
  // the thread that made the change, with no ledger lock held).
  using Listener = std::function<void(const std::string& job, MemoryCategory, uint64_t bytes)>;
  void SetListener(Listener listener);

  // Books `bytes` under (job, category) if the total stays within the limit
  // (and the job's owner's total within the owner limit); ResourceExhausted
  // naming the job, the request and the limit otherwise (nothing booked).
  absl::Status Reserve(const std::string& job, MemoryCategory category, uint64_t bytes);
  // Books every category's bytes of `bytes` under `job` in one step, all or
  // nothing: ResourceExhausted naming the job, the request and the limit when
  // the sum does not fit (nothing booked). See LedgerReservation.
  absl::Status ReserveAll(const std::string& job, const CategoryBytes& bytes);
  // Checks whether `bytes` more would fit, without booking. Advisory only:
  // concurrent callers may all pass it, so memory is booked (Reserve,
  // LedgerReservation) before it is allocated.
  absl::Status CheckFits(const std::string& job, uint64_t bytes) const;
  void Release(const std::string& job, MemoryCategory category, uint64_t bytes);
  // Rebooks `bytes` already booked under (from_job, from) to (to_job, to),
  // creating the target entry if needed: the total, and so the limit, are
  // unaffected. Moves at most what (from_job, from) holds.
  void Move(const std::string& from_job, MemoryCategory from, const std::string& to_job,
            MemoryCategory to, uint64_t bytes);
  // Binds `job` to `owner` for the owner limit: its bytes booked so far and
  // from now on count toward the owner's total, until the entry is dropped
  // (RemoveJobIfEmpty). A job with no owner counts toward no owner.
  void SetOwner(const std::string& job, const std::string& owner);
  // Bytes the jobs bound to `owner` hold.
  uint64_t OwnerBytes(const std::string& owner) const;
  uint64_t owner_limit() const { return owner_limit_; }
  // Drops the job's entry (and its owner binding) when all its bytes are
  // released (returns false and keeps it otherwise), then calls the remove
  // listener.
  bool RemoveJobIfEmpty(const std::string& job);
  // Called after a job's entry is dropped (set once at start-up).
  void SetRemoveListener(std::function<void(const std::string& job)> listener);

  uint64_t limit() const { return limit_; }
  uint64_t total() const;
  std::map<std::string, CategoryBytes> Snapshot() const;
  CategoryBytes JobBytes(const std::string& job) const;

 private:
  void Notify(const std::string& job, MemoryCategory c, uint64_t bytes);
  // OK when `bytes` more for `job` keep the daemon's total within the limit
  // and the job's owner's within the owner limit; the error says which
  // limit, `what()` naming the request (built only then).
  absl::Status CheckLocked(const std::string& job, uint64_t bytes,
                           absl::FunctionRef<std::string()> what) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds (or, negative, takes) `bytes` to the total of `job`'s owner, if any.
  void AddOwnerBytesLocked(const std::string& job, int64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint64_t limit_;
  const uint64_t owner_limit_;
  mutable absl::Mutex mu_;
  uint64_t total_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, CategoryBytes> jobs_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> owner_of_ ABSL_GUARDED_BY(mu_);  // job -> owner
  std::map<std::string, uint64_t> owner_bytes_ ABSL_GUARDED_BY(mu_);   // owner -> bytes
  Listener listener_;  // set once at start-up, before concurrent use
  std::function<void(const std::string&)> remove_listener_;
};

// Bytes booked for one job, by category, ahead of the allocations they are
// for: a request whose memory comes in several pieces is refused as a whole
// before any piece is allocated, and concurrent requests cannot each pass
// the limit with part of theirs. Each piece Take()s its bytes once it is
// allocated and releases them itself from then on; whatever is not taken
// is released when the reservation goes. Move-only; not thread-safe.
class LedgerReservation {
 public:
  LedgerReservation() = default;
  // Books `bytes` (MemoryLedger::ReserveAll): ResourceExhausted, nothing
  // booked, when they do not fit.
  static absl::StatusOr<LedgerReservation> Create(MemoryLedger* ledger, std::string job,
                                                  const CategoryBytes& bytes);
  LedgerReservation(LedgerReservation&& o) noexcept { *this = std::move(o); }
  LedgerReservation& operator=(LedgerReservation&& o) noexcept;
  ~LedgerReservation() { ReleaseHeld(); }

  // Hands `bytes` of `category` over to the caller; false, and nothing handed
  // over, when the reservation holds fewer.
  bool Take(MemoryCategory category, uint64_t bytes);
  uint64_t held(MemoryCategory category) const { return held_[static_cast<int>(category)]; }
  MemoryLedger* ledger() const { return ledger_; }
  const std::string& job() const { return job_; }

 private:
  void ReleaseHeld();

  MemoryLedger* ledger_ = nullptr;
  std::string job_;
  CategoryBytes held_{};
};

// A 64-byte-aligned array of T booked in a ledger for its lifetime.
// Allocated once; never grows.
template <typename T>
class LedgerArray {
 public:
  using value_type = T;
  LedgerArray() = default;
  // Reserves n * sizeof(T) bytes in `ledger` (ResourceExhausted if over the
  // limit), then allocates zeroed memory.
  static absl::StatusOr<LedgerArray> Create(MemoryLedger* ledger, const std::string& job,
                                            MemoryCategory category, size_t n);
  // Like Create, but the elements live in `memory` (at least n * sizeof(T)
  // bytes, zeroed, suitably aligned), which stays the caller's: it must
  // outlive the array and is not freed by it. Used for memory a transport
  // allocated for remote access.
  static absl::StatusOr<LedgerArray> CreateIn(MemoryLedger* ledger, const std::string& job,
                                              MemoryCategory category, size_t n, void* memory);
  // Like Create, or CreateIn when `memory` is not null, with the bytes taken
  // from `booked` (for its job) instead of booked anew: Internal, before
  // anything is allocated, when `booked` holds fewer than n * sizeof(T)
  // under `category`; ResourceExhausted when the allocation fails (the bytes
  // then stay in `booked`).
  static absl::StatusOr<LedgerArray> Create(LedgerReservation* booked, MemoryCategory category,
                                            size_t n, void* memory = nullptr);
  LedgerArray(LedgerArray&& o) noexcept { *this = std::move(o); }
  LedgerArray& operator=(LedgerArray&& o) noexcept {
    Reset();
    data_ = std::move(o.data_);
    size_ = o.size_;
    ledger_ = o.ledger_;
    job_ = std::move(o.job_);
    category_ = o.category_;
    o.size_ = 0;
    o.ledger_ = nullptr;
    return *this;
  }
  ~LedgerArray() { Reset(); }

  T* data() { return data_.get(); }
  const T* data() const { return data_.get(); }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }
  MemoryCategory category() const { return category_; }
  // Moves the array's bytes to `category` in the ledger (MemoryLedger::Move).
  void Rebook(MemoryCategory category) {
    if (ledger_ != nullptr && size_ > 0 && category != category_) {
      ledger_->Move(job_, category_, job_, category, size_ * sizeof(T));
    }
    category_ = category;
  }

 private:
  struct Free {
    bool owned = true;
    void operator()(T* p) const {
      if (owned) std::free(p);
    }
  };
  void Reset() {
    if (ledger_ != nullptr && size_ > 0) ledger_->Release(job_, category_, size_ * sizeof(T));
    data_.reset();
    size_ = 0;
    ledger_ = nullptr;
  }
  std::unique_ptr<T[], Free> data_;
  size_t size_ = 0;
  MemoryLedger* ledger_ = nullptr;
  std::string job_;
  MemoryCategory category_ = MemoryCategory::kBuffer;
};

template <typename T>
absl::StatusOr<LedgerArray<T>> LedgerArray<T>::Create(MemoryLedger* ledger, const std::string& job,
                                                      MemoryCategory category, size_t n) {
  LedgerArray a;
  if (n == 0) return a;
  const size_t bytes = n * sizeof(T);
  if (absl::Status s = ledger->Reserve(job, category, bytes); !s.ok()) return s;
  void* p = AllocateHostArray(bytes);
  if (p == nullptr) {
    ledger->Release(job, category, bytes);
    return absl::ResourceExhaustedError("out of host memory");
  }
  a.data_.reset(static_cast<T*>(p));
  a.size_ = n;
  a.ledger_ = ledger;
  a.job_ = job;
  a.category_ = category;
  return a;
}

template <typename T>
absl::StatusOr<LedgerArray<T>> LedgerArray<T>::Create(LedgerReservation* booked,
                                                      MemoryCategory category, size_t n,
                                                      void* memory) {
  LedgerArray a;
  if (n == 0) return a;
  const size_t bytes = n * sizeof(T);
  if (booked->held(category) < bytes) {
    return absl::InternalError(
        "LedgerArray: the reservation does not hold the array's bytes under its category");
  }
  bool owned = false;
  if (memory == nullptr) {
    memory = AllocateHostArray(bytes);
    if (memory == nullptr) return absl::ResourceExhaustedError("out of host memory");
    owned = true;
  }
  booked->Take(category, bytes);
  a.data_ = std::unique_ptr<T[], Free>(static_cast<T*>(memory), Free{owned});
  a.size_ = n;
  a.ledger_ = booked->ledger();
  a.job_ = booked->job();
  a.category_ = category;
  return a;
}

template <typename T>
absl::StatusOr<LedgerArray<T>> LedgerArray<T>::CreateIn(MemoryLedger* ledger,
                                                        const std::string& job,
                                                        MemoryCategory category, size_t n,
                                                        void* memory) {
  LedgerArray a;
  if (n == 0) return a;
  if (absl::Status s = ledger->Reserve(job, category, n * sizeof(T)); !s.ok()) return s;
  a.data_ = std::unique_ptr<T[], Free>(static_cast<T*>(memory), Free{false});
  a.size_ = n;
  a.ledger_ = ledger;
  a.job_ = job;
  a.category_ = category;
  return a;
}

}  // namespace zeroshard
