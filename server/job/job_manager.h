#pragma once

// The jobs a daemon serves, and their lifecycle: registration (idempotent,
// spec-checked), removal after the last rank leaves, and retirement: a
// removed job's memory (and so its transport regions) stays alive for the
// read lease after it last handed out remote access, because peers may
// still be reading it with one-sided Gets. A janitor thread reaps retired
// jobs and refreshes the rank-liveness gauges.
//
// Thread-safe. Jobs are shared_ptr: an RPC in flight keeps its job alive.

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/zeroshard/v1/control.pb.h"
#include "server/metrics/daemon_metrics.h"
#include "server/job/job.h"

namespace zeroshard {

class JobManager {
 public:
  struct Options {
    absl::Duration read_lease = absl::Seconds(30);
    absl::Duration rank_timeout = absl::Seconds(30);
    absl::Duration janitor_period = absl::Milliseconds(250);
    // Jobs registered at once, at most (ResourceExhausted past it).
    uint32_t max_jobs = 64;
    // Jobs one identity (Registrant::identity) may have registered at once
    // (ResourceExhausted past it); exempt registrants are not counted.
    uint32_t max_jobs_per_identity = 32;
    // A job registered here whose home copy (a primary) no rank joins within
    // this is removed with every copy, so that registrations nobody follows
    // up cannot hold --max_jobs or memory for good. Zero: never.
    absl::Duration join_timeout = absl::Minutes(2);
    // A job whose home copy (a primary) had ranks joined and has heard from
    // none of them (join, heartbeat, any rank request) for this long is
    // removed with every copy: a crashed run's state stays for the time a
    // restart needs, not for good (before_idle_removal may save it first).
    // Zero: never.
    absl::Duration job_idle_timeout = absl::Hours(1);
    // Called on the janitor thread, with no manager lock held, for each
    // primary copy of a job about to be removed as idle, before anything is
    // removed (the daemon saves the copy's checkpoint part there): whether
    // the copy may go now. While any answers false the job stays, and the
    // next passes ask again. It should not block. A job a rank was heard
    // from meanwhile stays.
    std::function<bool(const std::shared_ptr<Job>& job)> before_idle_removal;
    // Called by Remove, on its thread with no manager lock held, before the
    // job leaves the registry (so before a job of the same id can be
    // registered again), for what the daemon keeps for a job outside it: its
    // activation checkpoints.
    std::function<void(const std::shared_ptr<Job>& job)> on_remove;
  };

  // Who registers a job (the RPC layer decides, server/rpc/services.h):
  // whether the caller may create one, and the identity its quotas count
  // against (the jobs it has registered here, Options::
  // max_jobs_per_identity, and the bytes those hold, the ledger's owner
  // limit). `exempt` (the admin) counts against no quota.
  struct Registrant {
    bool may_create = true;
    std::string identity;
    bool exempt = false;
  };

  // Starts the janitor. Everything borrowed must outlive the manager.
  JobManager(Options options, JobResources resources, DaemonMetrics* metrics);
  // Stops the janitor (waits for a pass that runs); no pass runs after.
  // Call it before what the janitor's hooks use goes. Idempotent.
  void StopJanitor();
  // Stops the janitor; frees every job.
  ~JobManager();

  // The job's home copy: the replica group it was registered as
  // (RegisterJobRequest.daemon_index). NotFound naming the job when it is
  // not registered here.
  absl::StatusOr<std::shared_ptr<Job>> Find(const std::string& id) const;
  // The copy of replica group `group` (replicated jobs hold two groups per
  // daemon). NotFound naming the groups held here otherwise.
  absl::StatusOr<std::shared_ptr<Job>> Find(const std::string& id, uint32_t group) const;
  // Creates the job bound to `token` (with replicas = 2 two copies: the
  // group `daemon_index` as primary, or as backup with `as_backup`, and the
  // backup of the group before it), or checks the registered one was
  // bound to the same token: PermissionDenied otherwise, and that
  // `request.spec` equals its spec: FailedPrecondition naming the first
  // difference). *created tells which. Unavailable when `draining` and the
  // job is new; ResourceExhausted when max_jobs are registered, or
  // max_jobs_per_identity by the registrant's identity; PermissionDenied
  // when the job is new and the registrant may not create it (the caller
  // lacks the daemon's registration token). A new job's memory is booked
  // under the registrant's identity (MemoryLedger::SetOwner).
  absl::StatusOr<std::shared_ptr<Job>> Register(const v1::RegisterJobRequest& request,
                                                const TokenDigest& token, bool draining,
                                                const Registrant& registrant, bool* created);
  // Takes the copy `job` out of the registry and retires it, if it is still
  // the one registered for its id and group (otherwise does nothing: a copy
  // is retired once); before the job's last copy goes, calls
  // Options::on_remove.
  void Remove(const std::shared_ptr<Job>& job);
  // Every copy of every job.
  std::vector<std::shared_ptr<Job>> All() const;
  // Jobs (ids) registered.
  size_t size() const;
  // Jobs (ids) registered by `identity`, and being registered.
  size_t CountOf(const std::string& identity) const;
  // Who registered job `id` (its first registration); NotFound when it is
  // not registered here.
  absl::StatusOr<Registrant> RegisteredBy(const std::string& id) const;
  // Retired jobs still holding memory.
  size_t retired() const;
  // Jobs removed because no rank joined them within join_timeout.
  uint64_t unjoined_removed() const;
  // Jobs removed because no rank was heard from within job_idle_timeout.
  uint64_t idle_removed() const;

  const Options& options() const { return options_; }
  // What every job borrows from the daemon.
  const JobResources& resources() const { return resources_; }

  // One janitor pass (exposed for tests): removes jobs past join_timeout
  // with no rank joined and jobs idle past job_idle_timeout, reaps retired jobs whose lease ended and that no
  // caller holds any more (their memory, ledger entry and metric series go
  // together), and updates the ranks-connected gauges.
  void Tick();

 private:
  struct Retired {
    std::shared_ptr<Job> job;
    absl::Time until;
  };

  void RunJanitor();

  const Options options_;
  const JobResources resources_;
  DaemonMetrics* const metrics_;

  struct Entry {
    uint32_t home = 0;                                // the group registered as
    absl::Time registered;                            // when it entered the registry
    Registrant registrant;                            // who created it
    std::map<uint32_t, std::shared_ptr<Job>> copies;  // by replica group
  };

  mutable absl::Mutex mu_;
  std::map<std::string, Entry> jobs_ ABSL_GUARDED_BY(mu_);
  // Ids a registration is creating (booking and allocating, with no lock
  // held), with the registrant's identity: another registration of the
  // same id waits for it instead of booking the job's memory a second time.
  std::map<std::string, std::string> creating_ ABSL_GUARDED_BY(mu_);
  size_t CountOfLocked(const std::string& identity) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<Retired> retired_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t unjoined_removed_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t idle_removed_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread janitor_;
};

}  // namespace zeroshard
