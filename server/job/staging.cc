#include "server/job/staging.h"

#include <sys/random.h>

#include <algorithm>
#include <atomic>

#include "absl/strings/str_cat.h"

namespace zeroshard {

RankStaging::RankStaging(MemoryLedger* ledger, std::string job_id, uint32_t slots,
                         uint64_t slot_bytes)
    : ledger_(ledger),
      job_id_(std::move(job_id)),
      slots_(slots),
      slot_bytes_(slot_bytes),
      slot_state_(new Slot[slots]) {}

absl::StatusOr<std::unique_ptr<RankStaging>> RankStaging::Create(transport::Transport* transport,
                                                                 MemoryLedger* ledger,
                                                                 std::string job_id,
                                                                 uint32_t slots,
                                                                 uint64_t slot_bytes) {
  const uint64_t bytes = uint64_t{slots} * slot_bytes;
  if (absl::Status s = ledger->Reserve(job_id, MemoryCategory::kBuffer, bytes); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<transport::Region>> region =
      transport->AllocateRegion(bytes, transport::Access::kRemoteReadWrite);
  if (!region.ok()) {
    ledger->Release(job_id, MemoryCategory::kBuffer, bytes);
    return region.status();
  }
  std::unique_ptr<RankStaging> s(new RankStaging(ledger, std::move(job_id), slots, slot_bytes));
  s->region_ = *std::move(region);
  return s;
}

RankStaging::~RankStaging() {
  region_.reset();
  uint64_t mapped = 0;
  {
    absl::MutexLock lock(&memories_mu_);
    mapped = mapped_bytes_;
    memories_.clear();
  }
  ledger_->Release(job_id_, MemoryCategory::kBuffer, uint64_t{slots_} * slot_bytes_ + mapped);
}

absl::Status RankStaging::Apply(uint32_t slot, uint64_t generation, uint64_t length,
                                absl::FunctionRef<absl::Status(absl::string_view)> apply,
                                uint32_t push_memory, absl::Time deadline) {
  if (slot >= slots_) {
    return absl::InvalidArgumentError(
        absl::StrCat("staging_slot: must be < ", slots_, ", got ", slot));
  }
  std::shared_ptr<const transport::PeerMemory> memory;
  if (push_memory != 0) {
    absl::MutexLock lock(&memories_mu_);
    for (const Mapped& m : memories_) {
      if (m.id == push_memory) memory = m.memory;
    }
    if (memory == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "push_memory: ", push_memory, " is not one MapPushMemory answered for this rank "
          "process (it has mapped ", memories_.size(), ")"));
    }
  } else if (length > slot_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("staged chunks of ", length,
                                                   " bytes do not fit a staging slot of ",
                                                   slot_bytes_, " bytes"));
  }
  if (generation == 0) {
    return absl::InvalidArgumentError("staging_generation: must be >= 1");
  }
  Slot& s = slot_state_[slot];
  absl::MutexLock lock(&s.mu);
  if (generation <= s.applied || generation <= s.fenced) {
    return absl::FailedPreconditionError(absl::StrCat(
        "staging slot ", slot, " generation ", generation, " is ",
        generation <= s.fenced ? "fenced" : "already applied", " (applied up to ", s.applied,
        ", fenced up to ", s.fenced, "); write the slot again with a new generation"));
  }
  if (memory != nullptr && absl::Now() >= deadline) {
    return absl::DeadlineExceededError(absl::StrCat(
        "staging slot ", slot, " generation ", generation,
        ": the push's deadline passed before its turn; nothing of the trainer's memory read"));
  }
  const absl::string_view payload =
      memory != nullptr
          ? memory->bytes()
          : absl::string_view(static_cast<const char*>(region_->base()) + slot * slot_bytes_,
                              length);
  absl::Status status = apply(payload);
  if (status.ok()) {
    s.applied = generation;
    if (memory != nullptr) {
      absl::MutexLock lock(&memories_mu_);
      pulled_bytes_ += length;
    }
  }
  return status;
}

namespace {

// Push memory ids: unique within this process, from a random start, so that
// an id a trainer kept from a daemon that restarted names nothing here.
uint32_t NextPushMemoryId() {
  static std::atomic<uint32_t> next{[] {
    uint32_t r = 0;
    if (::getrandom(&r, sizeof(r), 0) != static_cast<ssize_t>(sizeof(r))) r = 1;
    return r;
  }()};
  uint32_t id = 0;
  while (id == 0) id = next.fetch_add(1, std::memory_order_relaxed);
  return id;
}

}  // namespace

absl::StatusOr<uint32_t> RankStaging::MapPushMemory(int64_t pid, int64_t fd,
                                                    absl::string_view name, uint64_t bytes,
                                                    uint64_t max_bytes) {
  // Refusals and the same memory again are answered without opening
  // anything; the checks are repeated once it is open.
  auto admit = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(memories_mu_) -> absl::StatusOr<uint32_t> {
    for (const Mapped& m : memories_) {
      if (m.name == name) return m.id;
    }
    if (memories_.size() >= kMaxPushMemories) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "this rank process has mapped ", kMaxPushMemories,
          " push memories already, the most a rank process may; push from one of those or "
          "through the staging slots"));
    }
    if (bytes > max_bytes || mapped_bytes_ > max_bytes - bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "push memory of ", bytes, " bytes: this rank process may have at most ", max_bytes,
          " bytes of push memory mapped (twice the job's fp32 gradient and 1 GiB), and has ",
          mapped_bytes_));
    }
    return 0u;
  };
  {
    absl::MutexLock lock(&memories_mu_);
    absl::StatusOr<uint32_t> admitted = admit();
    if (!admitted.ok() || *admitted != 0) return admitted;
    // Only calls that open something count.
    if (++map_calls_ > kMaxPushMemoryCalls) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "this rank process has asked to map a push memory ", kMaxPushMemoryCalls,
          " times already, the most a rank process may; push through the staging slots"));
    }
  }
  absl::StatusOr<std::unique_ptr<transport::PeerMemory>> opened =
      transport::PeerMemory::Open(pid, fd, name, bytes);
  if (!opened.ok()) return opened.status();
  absl::MutexLock lock(&memories_mu_);
  absl::StatusOr<uint32_t> admitted = admit();
  if (!admitted.ok() || *admitted != 0) return admitted;
  if (absl::Status s = ledger_->Reserve(job_id_, MemoryCategory::kBuffer, bytes); !s.ok()) {
    return s;
  }
  const uint32_t id = NextPushMemoryId();
  memories_.push_back({id, std::string(name), *std::move(opened)});
  mapped_bytes_ += bytes;
  return id;
}

uint32_t RankStaging::push_memories() const {
  absl::MutexLock lock(&memories_mu_);
  return static_cast<uint32_t>(memories_.size());
}

uint64_t RankStaging::pulled_bytes() const {
  absl::MutexLock lock(&memories_mu_);
  return pulled_bytes_;
}

absl::StatusOr<uint64_t> RankStaging::Fence(uint32_t slot, uint64_t generation,
                                            absl::Time deadline) {
  if (slot >= slots_) {
    return absl::InvalidArgumentError(
        absl::StrCat("slot: must be < ", slots_, ", got ", slot));
  }
  Slot& s = slot_state_[slot];
  // A push applying the slot holds its lock (at most its own deadline,
  // which the daemon caps): wait for it until this fence's deadline.
  absl::Duration pause = absl::Milliseconds(1);
  while (!s.mu.TryLock()) {
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "staging slot ", slot, ": a push was still being applied from it at the deadline; "
          "nothing was fenced, fence it again"));
    }
    absl::SleepFor(pause);
    pause = std::min(2 * pause, absl::Milliseconds(10));
  }
  s.fenced = std::max(s.fenced, generation);
  const uint64_t applied = s.applied;
  s.mu.Unlock();
  return applied;
}

}  // namespace zeroshard
