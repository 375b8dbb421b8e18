#include "server/cache/param_cache.h"

#include <algorithm>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"

namespace zeroshard {

ParamCache::Copy::Copy(std::shared_ptr<const ParamCacheOptions> options, uint64_t bytes)
    : options_(std::move(options)), bytes_(bytes), data_(new uint8_t[bytes]) {}

ParamCache::Copy::~Copy() {
  options_->ledger->Release(options_->job_id, MemoryCategory::kParamCache, bytes_);
}

bool ParamCache::Copy::Contains(const FlatRange& range) const {
  return range.begin < range.end && range.end <= options_->total_elements &&
         range.Intersect(options_->owned).size() == 0;
}

const uint8_t* ParamCache::Copy::At(const FlatRange& range) const {
  // The non-owned elements lie back to back: those below the owned range,
  // then those above it.
  const uint64_t index =
      range.begin < options_->owned.begin ? range.begin : range.begin - options_->owned.size();
  return data_.get() + index * DTypeSize(options_->dtype);
}

ParamCache::ParamCache(ParamCacheOptions options)
    : options_(std::make_shared<const ParamCacheOptions>(std::move(options))),
      copy_bytes_((options_->total_elements - options_->owned.size()) *
                  DTypeSize(options_->dtype)) {}

ParamCache::Counts ParamCache::counts() const {
  absl::MutexLock lock(&mu_);
  return counts_;
}

absl::StatusOr<std::shared_ptr<ParamCache::Copy>> ParamCache::NewCopy() {
  if (absl::Status s =
          options_->ledger->Reserve(options_->job_id, MemoryCategory::kParamCache, copy_bytes_);
      !s.ok()) {
    return s;
  }
  // Booked: the copy releases it when it goes.
  return std::shared_ptr<Copy>(new Copy(options_, copy_bytes_));
}

absl::Status ParamCache::FetchInto(Copy& copy, uint64_t step, ParamFetcher& fetcher,
                                   absl::Time deadline, uint64_t* bytes_fetched) {
  // One fetch per owner, all in flight at once: owners_.size() - 1 threads
  // of this fetch, the calling thread taking the first owner. Each writes
  // only its own range of the copy and its own result slot; the joins
  // order those writes before the reads below. Every fetch ends by
  // `deadline` (ParamFetcher's contract), so the joins do too.
  const std::vector<std::pair<uint32_t, FlatRange>>& owners = options_->owners;
  std::vector<absl::StatusOr<uint64_t>> results(owners.size(), uint64_t{step});
  auto fetch_one = [&](size_t i) {
    const auto& [owner, range] = owners[i];
    if (range.size() == 0) return;
    results[i] = fetcher.Fetch(owner, range, options_->dtype, step, deadline,
                               copy.MutableAt(range));
  };
  {
    std::vector<std::thread> threads;
    threads.reserve(owners.size());
    for (size_t i = 1; i < owners.size(); ++i) threads.emplace_back(fetch_one, i);
    if (!owners.empty()) fetch_one(0);
    for (std::thread& t : threads) t.join();
  }
  // The first owner's error (in owner order), else the first later step.
  absl::Status error;
  for (size_t i = 0; i < owners.size(); ++i) {
    const auto& [owner, range] = owners[i];
    const absl::StatusOr<uint64_t>& at = results[i];
    if (!at.ok()) {
      if (error.ok() || absl::IsAborted(error)) error = at.status();
      continue;
    }
    *bytes_fetched += range.size() * DTypeSize(options_->dtype);
    if (*at != step && error.ok()) {
      error = absl::AbortedError(absl::StrCat(
          "job ", options_->job_id, ": daemon ", owner, " answered the parameters of step ", *at,
          " for step ", step, " (it committed a later step meanwhile); gather again"));
    }
  }
  if (!error.ok()) return error;
  copy.step_ = step;
  return absl::OkStatus();
}

void ParamCache::Drop() {
  std::shared_ptr<Copy> dropped;  // released after the lock
  absl::MutexLock lock(&mu_);
  ++drops_;
  dropped = std::move(copy_);
}

absl::StatusOr<std::shared_ptr<const ParamCache::Copy>> ParamCache::Get(uint64_t step,
                                                                        ParamFetcher& fetcher,
                                                                        absl::Time deadline,
                                                                        Counts* served) {
  Counts ignored;
  if (served == nullptr) served = &ignored;
  std::shared_ptr<Copy> reuse;
  uint64_t mine = 0;
  uint64_t drops = 0;
  {
    absl::MutexLock lock(&mu_);
    while (true) {
      if (copy_ != nullptr && copy_->step() == step) {
        ++counts_.hits;
        ++served->hits;
        return std::shared_ptr<const Copy>(copy_);
      }
      const uint64_t newest = std::max(copy_ != nullptr ? copy_->step() : 0,
                                       fetching_ ? fetching_step_ : 0);
      if ((copy_ != nullptr || fetching_) && newest > step) {
        return absl::FailedPreconditionError(absl::StrCat(
            "job ", options_->job_id, ": the node cache holds step ", newest, ", not step ", step));
      }
      if (!fetching_) break;
      // A fetch of this step (or an older one) is in flight: wait for it.
      const uint64_t awaited = fetches_started_;
      const bool same_step = fetching_step_ == step;
      auto ended = [this, awaited]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return fetches_ended_ >= awaited;
      };
      if (!mu_.AwaitWithDeadline(absl::Condition(&ended), deadline)) {
        return absl::DeadlineExceededError(absl::StrCat(
            "job ", options_->job_id, ": waiting for the node cache's fetch of step ",
            fetching_step_, " for step ", step));
      }
      if (same_step && fetches_ended_ == awaited && !last_fetch_.ok()) return last_fetch_;
    }
    fetching_ = true;
    fetching_step_ = step;
    mine = ++fetches_started_;
    drops = drops_;
    // Nobody reads the previous copy: its buffer (and booking) is reused.
    if (copy_ != nullptr && copy_.use_count() == 1) reuse = std::move(copy_);
    copy_ = nullptr;
  }
  absl::Status s;
  std::shared_ptr<Copy> copy = std::move(reuse);
  if (copy == nullptr) {
    absl::StatusOr<std::shared_ptr<Copy>> fresh = NewCopy();
    if (fresh.ok()) {
      copy = *std::move(fresh);
    } else {
      s = fresh.status();
    }
  }
  uint64_t bytes_fetched = 0;
  if (s.ok()) s = FetchInto(*copy, step, fetcher, deadline, &bytes_fetched);
  if (!s.ok()) copy = nullptr;  // nothing left: the booking goes with it
  served->bytes_fetched += bytes_fetched;
  absl::MutexLock lock(&mu_);
  counts_.bytes_fetched += bytes_fetched;
  if (s.ok() && drops != drops_) {
    copy = nullptr;
    s = absl::AbortedError(absl::StrCat("job ", options_->job_id,
                                        ": the parameters changed outside a step while the node "
                                        "cache fetched step ", step, "; gather again"));
  }
  fetching_ = false;
  fetches_ended_ = mine;
  last_fetch_ = s;
  if (!s.ok()) return s;
  ++counts_.fetches;
  ++served->fetches;
  copy_ = copy;
  return std::shared_ptr<const Copy>(std::move(copy));
}

}  // namespace zeroshard
