#include "server/job/rank_table.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/fnv.h"

namespace zeroshard {

RankTable::RankTable(Options options) : options_(std::move(options)) {
  absl::MutexLock lock(&mu_);
  ranks_.resize(options_.world_size);
}

absl::StatusOr<uint64_t> RankTable::Join(uint32_t rank, uint64_t incarnation) {
  absl::MutexLock lock(&mu_);
  if (removed_) {
    return absl::NotFoundError(
        absl::StrCat("job ", options_.job_id, " was removed; register it again"));
  }
  Entry& e = ranks_[rank];
  if (incarnation < e.incarnation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "incarnation: rank ", rank, " of job ", options_.job_id, " has joined as incarnation ",
        e.incarnation, " since; incarnation ", incarnation, " is fenced"));
  }
  // An incarnation far ahead would fence every later process of the rank
  // for good: the step is bounded past this daemon's clock.
  const uint64_t now_us = static_cast<uint64_t>(std::max<int64_t>(0, absl::ToUnixMicros(absl::Now())));
  const uint64_t bound = std::max(now_us, e.incarnation) + kMaxIncarnationAheadMicros;
  if (incarnation > bound) {
    return absl::InvalidArgumentError(absl::StrCat(
        "incarnation: at most ", bound, " (this daemon's clock in microseconds since the Unix ",
        "epoch, or the rank's current incarnation, plus one day), got ", incarnation,
        "; a trainer's incarnation is its start time in microseconds"));
  }
  if (incarnation == e.incarnation && e.left) {
    // Its pushes may still be in flight against the region its Leave
    // dropped: only a newer incarnation, which fences them, joins again.
    return absl::FailedPreconditionError(absl::StrCat(
        "incarnation: rank ", rank, " of job ", options_.job_id, " left as incarnation ",
        incarnation, "; a process that left joins again as a newer incarnation (a new client)"));
  }
  uint64_t replaced = 0;
  if (incarnation > e.incarnation) {
    // A newer process for this rank: the old one's staging goes with it.
    replaced = e.incarnation;
    e.incarnation = incarnation;
    e.left = false;
    e.staging.reset();
  }
  if (!e.joined) joined_.fetch_add(1, std::memory_order_acq_rel);
  e.joined = true;
  e.last_seen = absl::Now();
  ever_joined_ = true;
  return replaced;
}

bool RankTable::ever_joined() const {
  absl::MutexLock lock(&mu_);
  return ever_joined_;
}

absl::Status RankTable::CheckLocked(uint32_t rank, uint64_t incarnation,
                                    absl::string_view field) {
  if (rank >= options_.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, "rank: must be < world_size (", options_.world_size, "), got ", rank));
  }
  if (incarnation == 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, "incarnation: must be >= 1"));
  }
  Entry& e = ranks_[rank];
  if (e.left && incarnation == e.incarnation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, " incarnation ", incarnation, " left job ", options_.job_id,
        "; a process that left joins again as a newer incarnation (a new client)"));
  }
  if (!e.joined || incarnation > e.incarnation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, " of job ", options_.job_id, " has not joined as incarnation ",
        incarnation, "; call JoinJob first"));
  }
  if (incarnation < e.incarnation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, " incarnation ", incarnation, " is fenced: incarnation ", e.incarnation,
        " of the same rank joined job ", options_.job_id, " since"));
  }
  e.last_seen = absl::Now();
  return absl::OkStatus();
}

absl::Status RankTable::Check(uint32_t rank, uint64_t incarnation, absl::string_view field) {
  absl::MutexLock lock(&mu_);
  return CheckLocked(rank, incarnation, field);
}

absl::StatusOr<bool> RankTable::Leave(uint32_t rank, uint64_t incarnation) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckLocked(rank, incarnation, ""); !s.ok()) return s;
  Entry& e = ranks_[rank];
  e.joined = false;
  e.left = true;
  e.staging.reset();
  const uint32_t left = joined_.fetch_sub(1, std::memory_order_acq_rel) - 1;
  if (left == 0) removed_ = true;
  return left == 0;
}

absl::StatusOr<std::shared_ptr<RankStaging>> RankTable::Staging(uint32_t rank,
                                                                uint64_t incarnation,
                                                                bool create) {
  if (options_.transport == nullptr) {
    return absl::FailedPreconditionError("this daemon serves no bulk transport");
  }
  auto check = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
    if (removed_) {
      return absl::NotFoundError(absl::StrCat("job ", options_.job_id, " was removed"));
    }
    return CheckLocked(rank, incarnation, "");
  };
  {
    absl::MutexLock lock(&mu_);
    if (absl::Status s = check(); !s.ok()) return s;
    if (ranks_[rank].staging != nullptr) return ranks_[rank].staging;
    if (!create) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", rank, " of job ", options_.job_id,
          " has no staging region here; call ExchangeEndpoint first"));
    }
  }
  // Registers memory with the transport and books it, with no lock held:
  // heartbeats and joins of every rank take mu_.
  absl::StatusOr<std::unique_ptr<RankStaging>> created =
      RankStaging::Create(options_.transport, options_.ledger, options_.job_id,
                          options_.staging_slots, options_.staging_slot_bytes);
  if (!created.ok()) return created.status();
  std::shared_ptr<RankStaging> fresh = *std::move(created);
  absl::MutexLock lock(&mu_);
  // The rank may have been fenced, or the job removed, meanwhile; a region
  // another call installed first wins (ours is freed when `fresh` goes).
  if (absl::Status s = check(); !s.ok()) return s;
  if (ranks_[rank].staging == nullptr) ranks_[rank].staging = std::move(fresh);
  return ranks_[rank].staging;
}

void RankTable::NotePushed(uint32_t rank, uint64_t step) {
  absl::MutexLock lock(&mu_);
  if (rank < ranks_.size()) ranks_[rank].last_step_pushed = step;
}

uint32_t RankTable::Connected(absl::Duration timeout) const {
  const absl::Time cutoff = absl::Now() - timeout;
  absl::MutexLock lock(&mu_);
  uint32_t n = 0;
  for (const Entry& e : ranks_) n += e.joined && e.last_seen >= cutoff ? 1 : 0;
  return n;
}

absl::Time RankTable::LastHeard() const {
  absl::MutexLock lock(&mu_);
  absl::Time last = absl::InfinitePast();
  for (const Entry& e : ranks_) last = std::max(last, e.last_seen);
  return last;
}

std::vector<RankStatus> RankTable::Ranks(absl::Duration timeout) const {
  std::vector<RankStatus> out;
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  out.reserve(ranks_.size());
  for (uint32_t r = 0; r < ranks_.size(); ++r) {
    const Entry& e = ranks_[r];
    RankStatus& o = out.emplace_back();
    o.rank = r;
    o.joined = e.joined;
    o.connected = e.joined && e.last_seen >= now - timeout;
    o.incarnation = e.incarnation;
    o.seconds_since_heard =
        e.last_seen == absl::InfinitePast() ? -1.0 : absl::ToDoubleSeconds(now - e.last_seen);
    o.last_step_pushed = e.last_step_pushed;
  }
  return out;
}

void RankTable::Hash(uint64_t& h) const {
  absl::MutexLock lock(&mu_);
  for (const Entry& e : ranks_) {
    Fnv1aMix(h, &e.incarnation, sizeof(e.incarnation));
    Fnv1aMix(h, &e.joined, sizeof(e.joined));
    Fnv1aMix(h, &e.left, sizeof(e.left));
  }
}

}  // namespace zeroshard
