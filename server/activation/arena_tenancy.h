#pragma once

// Which job may use the activation arena while its bulk key is out. One
// remote key reaches the whole arena, so the key is lent to one job at a
// time: the first job whose rank exchanges endpoints while no other job has
// activations in the arena. While it holds the key, other jobs' activation
// requests are refused (their slices would be readable with it); when no
// job holds it, every job may keep activations there over the streaming
// RPCs. The key returns when its job is removed. Each tenancy has a key of
// its own (ActivationStore::IssueTenantKey when it starts, RevokeTenantKey
// when it ends): a key a former tenant kept reaches nothing. Thread-safe.

#include <functional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/activation/activation_store.h"

namespace zeroshard {

class Job;

class ArenaTenancy {
 public:
  // Lends the key to `job` unless another job holds it, or
  // `others_have_activations()` (called with this object's lock held; it
  // must not call back into it) says another job has slices in the arena.
  // A new tenancy gets a fresh key from `store` (registered under this
  // object's lock: activation requests wait for it, once per tenancy).
  // Returns whether `job` holds the key now; the store's error when the key
  // cannot be made (nothing lent).
  absl::StatusOr<bool> Lend(const Job* job, const std::string& job_id,
                            const std::function<bool()>& others_have_activations,
                            ActivationStore* store) {
    absl::MutexLock lock(&mu_);
    if (tenant_ == job) return true;
    if (tenant_ != nullptr || others_have_activations()) return false;
    if (absl::Status s = store->IssueTenantKey(); !s.ok()) return s;
    tenant_ = job;
    tenant_id_ = job_id;
    return true;
  }

  // OK when `job` may keep activations in the arena: no job holds the key,
  // or `job` does. FailedPrecondition naming the holder otherwise.
  absl::Status Check(const Job* job) const {
    absl::MutexLock lock(&mu_);
    if (tenant_ == nullptr || tenant_ == job) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        "this daemon's activation arena is lent to job ", tenant_id_,
        "'s bulk transport (its key reaches the whole arena); keep this job's activation "
        "checkpoints on the trainer, or on daemons of its own"));
  }

  // Called when `job` is removed: when it is the tenant, revokes its key.
  void Return(const Job* job, ActivationStore* store) {
    absl::MutexLock lock(&mu_);
    if (tenant_ != job) return;
    store->RevokeTenantKey();
    tenant_ = nullptr;
    tenant_id_.clear();
  }

 private:
  mutable absl::Mutex mu_;
  const Job* tenant_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::string tenant_id_ ABSL_GUARDED_BY(mu_);
};

}  // namespace zeroshard
