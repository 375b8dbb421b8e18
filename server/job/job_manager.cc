#include "server/job/job_manager.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/auth.h"

namespace zeroshard {
namespace {

// The longest a registration waits for another registration of the same id.
constexpr absl::Duration kCreateWait = absl::Seconds(60);

absl::Status TooManyJobs(uint32_t max_jobs) {
  return absl::ResourceExhaustedError(absl::StrCat(
      "this daemon serves ", max_jobs, " jobs already (--max_jobs); retry when one has ended"));
}

}  // namespace

JobManager::JobManager(Options options, JobResources resources, DaemonMetrics* metrics)
    : options_(options), resources_(resources), metrics_(metrics) {
  janitor_ = std::thread([this] { RunJanitor(); });
}

void JobManager::StopJanitor() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (janitor_.joinable()) janitor_.join();
}

JobManager::~JobManager() {
  StopJanitor();
  std::vector<Retired> retired;
  std::map<std::string, Entry> jobs;
  {
    absl::MutexLock lock(&mu_);
    retired.swap(retired_);
    jobs.swap(jobs_);
  }
}

absl::StatusOr<std::shared_ptr<Job>> JobManager::Find(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(id);
  if (it == jobs_.end() || it->second.copies.count(it->second.home) == 0) {
    return absl::NotFoundError(
        absl::StrCat("job \"", id.substr(0, 140), "\" is not registered on this daemon"));
  }
  return it->second.copies.at(it->second.home);
}

absl::StatusOr<std::shared_ptr<Job>> JobManager::Find(const std::string& id, uint32_t group) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(id);
  if (it == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat("job \"", id.substr(0, 140),
                                            "\" is not registered on this daemon"));
  }
  auto copy = it->second.copies.find(group);
  if (copy == it->second.copies.end()) {
    std::string held;
    for (const auto& [g, job] : it->second.copies)
      absl::StrAppend(&held, held.empty() ? "" : ", ", g);
    return absl::NotFoundError(absl::StrCat("job ", id, ": this daemon holds replica groups [",
                                            held, "], not group ", group));
  }
  return copy->second;
}

absl::StatusOr<std::shared_ptr<Job>> JobManager::Register(const v1::RegisterJobRequest& request,
                                                          const TokenDigest& token, bool draining,
                                                          const Registrant& registrant,
                                                          bool* created) {
  *created = false;
  absl::StatusOr<JobConfig> config = ParseJobSpec(request.spec());
  if (!config.ok()) return config.status();
  if (request.daemon_index() >= config->daemons.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "daemon_index: must be < the number of daemons in spec.daemons (",
        config->daemons.size(), "), got ", request.daemon_index()));
  }
  auto same = [&](const Job& job) -> absl::Status {
    if (!job.token().Matches(token)) {
      return absl::PermissionDeniedError(absl::StrCat(
          "job ", config->job_id, " is registered here with another token; nothing was changed"));
    }
    const std::string diff = DescribeSpecDifference(job.spec(), request.spec());
    if (!diff.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", config->job_id, " is registered with a different spec: ", diff));
    }
    if (job.daemon_index() != request.daemon_index()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "daemon_index: job ", config->job_id, " is registered here as daemon ",
          job.daemon_index(), ", got ", request.daemon_index()));
    }
    return absl::OkStatus();
  };
  const std::string id = config->job_id;
  {
    absl::MutexLock lock(&mu_);
    auto not_creating = [this, &id]()
                            ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return creating_.count(id) == 0; };
    if (!mu_.AwaitWithTimeout(absl::Condition(&not_creating), kCreateWait)) {
      return absl::UnavailableError(absl::StrCat(
          "job ", id, ": another registration of it is still allocating its memory; retry"));
    }
    if (auto it = jobs_.find(id); it != jobs_.end()) {
      auto home = it->second.copies.find(it->second.home);
      if (home != it->second.copies.end()) {
        if (absl::Status s = same(*home->second); !s.ok()) return s;
        return home->second;
      }
      return absl::UnavailableError(absl::StrCat(
          "job ", id, " is being removed from this daemon; register it again shortly"));
    }
    if (draining) {
      return absl::UnavailableError("this daemon is draining and accepts no new jobs");
    }
    if (!registrant.may_create) {
      return absl::PermissionDeniedError(absl::StrCat(
          "job ", id, " is not registered here, and creating a job on this daemon needs the "
          "deployment's registration token (ZS_REGISTRATION_TOKEN or "
          "ClientConfig.registration_token, sent as metadata ",
          kRegistrationMetadataKey, ") or the admin token; nothing was created"));
    }
    // Jobs being created count: registrations in flight together do not
    // pass the bound together.
    if (jobs_.size() + creating_.size() >= options_.max_jobs) {
      return TooManyJobs(options_.max_jobs);
    }
    if (!registrant.exempt && options_.max_jobs_per_identity != 0 &&
        CountOfLocked(registrant.identity) >= options_.max_jobs_per_identity) {
      return absl::ResourceExhaustedError(absl::StrCat(
          registrant.identity, " has ", options_.max_jobs_per_identity,
          " jobs registered on this daemon already (--max_jobs_per_identity); job ", id,
          " was not created: retry when one of them has ended"));
    }
    creating_.emplace(id, registrant.identity);
  }
  // The job's bytes count toward its registrant's (booked by Create).
  if (!registrant.exempt) resources_.ledger->SetOwner(id, registrant.identity);
  // Books and allocates with no lock held.
  const uint32_t home = request.daemon_index();
  const bool replicated = config->replicas > 1;
  const uint32_t daemons = static_cast<uint32_t>(config->daemons.size());
  const ReplicaRole home_role =
      replicated && request.as_backup() ? ReplicaRole::kBackup : ReplicaRole::kPrimary;
  absl::StatusOr<std::unique_ptr<Job>> job =
      Job::Create(*config, request.spec(), home, resources_, home_role, home);
  absl::StatusOr<std::unique_ptr<Job>> backup = std::unique_ptr<Job>();
  absl::Status failed = job.status();
  if (job.ok() && replicated) {
    backup = Job::Create(*config, request.spec(), BackedUpGroup(home, daemons), resources_,
                         ReplicaRole::kBackup, home);
    if (!backup.ok()) {
      failed = backup.status();
      job->reset();  // frees the home copy and its booking first
      resources_.ledger->RemoveJobIfEmpty(id);
    }
  }
  if (!failed.ok()) resources_.ledger->RemoveJobIfEmpty(id);  // and its owner binding
  absl::MutexLock lock(&mu_);
  creating_.erase(id);
  if (!failed.ok()) return failed;
  Entry& entry = jobs_[id];
  entry.home = home;
  entry.registered = absl::Now();
  entry.registrant = registrant;
  std::shared_ptr<Job> shared = *std::move(job);
  shared->set_token(token);
  entry.copies.emplace(home, shared);
  if (*backup != nullptr) {
    (*backup)->set_token(token);
    const uint32_t group = (*backup)->daemon_index();
    entry.copies.emplace(group, std::shared_ptr<Job>(*std::move(backup)));
  }
  *created = true;
  return shared;
}

void JobManager::Remove(const std::shared_ptr<Job>& job) {
  const std::string& id = job->config().job_id;
  bool last = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(id);
    last = it != jobs_.end() && it->second.copies.size() == 1 &&
           it->second.copies.begin()->second == job;
  }
  // Before the id is free again: no newer job under the same id exists yet.
  if (last && options_.on_remove) options_.on_remove(job);
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return;  // removed before: retired once already
  auto copy = it->second.copies.find(job->daemon_index());
  if (copy == it->second.copies.end() || copy->second != job) return;  // a stale copy
  it->second.copies.erase(copy);
  if (it->second.copies.empty()) jobs_.erase(it);
  retired_.push_back({job, job->last_remote_access() + options_.read_lease});
}

std::vector<std::shared_ptr<Job>> JobManager::All() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Job>> out;
  for (const auto& [id, entry] : jobs_) {
    for (const auto& [group, job] : entry.copies) out.push_back(job);
  }
  return out;
}

size_t JobManager::CountOfLocked(const std::string& identity) const {
  size_t n = 0;
  for (const auto& [id, entry] : jobs_) {
    n += !entry.registrant.exempt && entry.registrant.identity == identity ? 1 : 0;
  }
  for (const auto& [id, who] : creating_) n += who == identity ? 1 : 0;
  return n;
}

size_t JobManager::CountOf(const std::string& identity) const {
  absl::MutexLock lock(&mu_);
  return CountOfLocked(identity);
}

absl::StatusOr<JobManager::Registrant> JobManager::RegisteredBy(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(id);
  if (it == jobs_.end()) {
    return absl::NotFoundError(
        absl::StrCat("job \"", id.substr(0, 140), "\" is not registered on this daemon"));
  }
  return it->second.registrant;
}

size_t JobManager::size() const {
  absl::MutexLock lock(&mu_);
  return jobs_.size();
}

size_t JobManager::retired() const {
  absl::MutexLock lock(&mu_);
  return retired_.size();
}

uint64_t JobManager::unjoined_removed() const {
  absl::MutexLock lock(&mu_);
  return unjoined_removed_;
}

uint64_t JobManager::idle_removed() const {
  absl::MutexLock lock(&mu_);
  return idle_removed_;
}

// A janitor pass this late is a pause of the whole daemon.
constexpr absl::Duration kPauseReported = absl::Seconds(5);

void JobManager::Tick() {
  const absl::Time now = absl::Now();
  std::vector<std::shared_ptr<Job>> unjoined;  // every copy of such jobs, and of idle ones
  // Idle jobs: the home copy, then every copy.
  std::vector<std::pair<std::shared_ptr<Job>, std::vector<std::shared_ptr<Job>>>> idle;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, entry] : jobs_) {
      auto home = entry.copies.find(entry.home);
      if (home == entry.copies.end() || home->second->role() != ReplicaRole::kPrimary) continue;
      const Job& job = *home->second;
      if (!job.ever_joined()) {
        if (options_.join_timeout == absl::ZeroDuration() ||
            entry.registered + options_.join_timeout > now) {
          continue;
        }
        ++unjoined_removed_;
        for (const auto& [group, copy] : entry.copies) unjoined.push_back(copy);
      } else {
        if (options_.job_idle_timeout == absl::ZeroDuration() ||
            job.LastHeard() + options_.job_idle_timeout > now) {
          continue;
        }
        idle.emplace_back(home->second, std::vector<std::shared_ptr<Job>>());
        for (const auto& [group, copy] : entry.copies) idle.back().second.push_back(copy);
      }
    }
  }
  for (const auto& [home, copies] : idle) {
    if (options_.before_idle_removal) {
      bool ready = true;
      for (const std::shared_ptr<Job>& copy : copies) {
        if (copy->role() == ReplicaRole::kPrimary) ready &= options_.before_idle_removal(copy);
      }
      if (!ready) continue;  // asked again at the next pass
    }
    // A rank heard from while the hook ran keeps the job.
    if (home->LastHeard() + options_.job_idle_timeout > absl::Now()) continue;
    {
      absl::MutexLock lock(&mu_);
      ++idle_removed_;
    }
    std::fprintf(stderr,
                 "zeroshardd: job %s removed: no rank heard from for %s "
                 "(--job_idle_timeout_seconds)\n",
                 home->config().job_id.c_str(),
                 absl::FormatDuration(options_.job_idle_timeout).c_str());
    unjoined.insert(unjoined.end(), copies.begin(), copies.end());
  }
  idle.clear();
  for (const std::shared_ptr<Job>& job : unjoined) Remove(job);
  unjoined.clear();  // the retired list holds them now: reapable below
  std::vector<std::shared_ptr<Job>> reap;
  std::vector<std::shared_ptr<Job>> live;
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < retired_.size();) {
      // Out of the registry, a retired job is reachable only from here and
      // from callers that found it before: use_count() == 1 means no RPC
      // holds it any more, and none can take it again. A job still held
      // waits for a later pass, so that its memory, its ledger entry and
      // its metric series go together.
      if (retired_[i].until <= now && retired_[i].job.use_count() == 1) {
        reap.push_back(std::move(retired_[i].job));
        retired_[i] = std::move(retired_.back());
        retired_.pop_back();
      } else {
        ++i;
      }
    }
    for (const auto& [id, entry] : jobs_) {
      for (const auto& [group, job] : entry.copies) {
        // A backup has no ranks joined: the ranks gauges follow primaries.
        if (job->role() == ReplicaRole::kPrimary) live.push_back(job);
      }
    }
  }
  for (std::shared_ptr<Job>& job : reap) {
    const std::string id = job->config().job_id;
    bool reregistered = false;
    {
      absl::MutexLock lock(&mu_);
      reregistered = jobs_.count(id) > 0;
    }
    job.reset();  // the last reference: frees its memory and its bookings
    if (!reregistered) {
      resources_.ledger->RemoveJobIfEmpty(id);
      metrics_->RemoveJob(id);
    }
  }
  for (const auto& job : live) {
    metrics_->SetRanks(job->config().job_id, job->RanksConnected(options_.rank_timeout),
                       job->config().world_size);
  }
}

void JobManager::RunJanitor() {
  absl::Time last = absl::Now();
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping), options_.janitor_period)) return;
    }
    // A janitor that wakes far too late ran in a process that was stopped
    // (SIGSTOP), hung or starved: its peers and trainers may have fenced it
    // meanwhile. Said once per pause; the replicated copies find out from
    // the next state transfer or request (their epochs).
    const absl::Time now = absl::Now();
    if (now - last >= kPauseReported) {
      std::fprintf(stderr,
                   "zeroshardd: this daemon did not run for %.1f s (stopped, hung or starved): "
                   "its peers may have fenced it meanwhile; a replicated job's copy that was "
                   "replaced serves no request at its old epoch and becomes a backup at the "
                   "new primary's next state transfer\n",
                   absl::ToDoubleSeconds(now - last));
    }
    Tick();
    last = absl::Now();  // a long pass (freeing a large job) is no pause
  }
}

}  // namespace zeroshard
