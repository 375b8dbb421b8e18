#pragma once

// Which job may use the activation arena while its bulk key is out. One
// remote key reaches the whole arena, so the key is lent to one job at a
// time: the first job whose rank exchanges endpoints while no other job has
// slices in the arena or its spill files. While it holds the key, other
// jobs' activation requests are refused (their slices would be readable
// with it): here at once, and by the store's reservations under the
// store's own lock, so none slips in between; when no
// job holds it, every job may keep activations there over the streaming
// RPCs. The key returns when its job is removed. Each tenancy has a key of
// its own (ActivationStore::IssueTenantKey when it starts, RevokeTenantKey
// when it ends): a key a former tenant kept reaches nothing. Thread-safe.

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/activation/activation_store.h"

namespace zeroshard {

class Job;

class ArenaTenancy {
 public:
  // Lends the key to `job` (the instance `instance`, id `job_id`) unless
  // another job holds it, or another job has slices in the arena or its
  // spill files (ActivationStore::BeginTenancy, which also zeroes what
  // former jobs left in the arena). A new tenancy gets a fresh key from
  // `store` (registered under this object's lock: activation requests wait
  // for it, once per tenancy). Returns whether `job` holds the key now; the
  // store's error when the key cannot be made (nothing lent).
  absl::StatusOr<bool> Lend(const Job* job, const std::shared_ptr<const void>& instance,
                            const std::string& job_id, ActivationStore* store) {
    absl::MutexLock lock(&mu_);
    if (tenant_ == job) return true;
    if (tenant_ != nullptr || !store->BeginTenancy(instance, job_id)) return false;
    if (absl::Status s = store->IssueTenantKey(); !s.ok()) {
      store->EndTenancy();
      return s;
    }
    tenant_ = job;
    tenant_id_ = job_id;
    return true;
  }

  // OK when `job` may keep activations in the arena: no job holds the key,
  // or `job` does. FailedPrecondition naming the holder otherwise.
  absl::Status Check(const Job* job) const {
    absl::MutexLock lock(&mu_);
    if (tenant_ == nullptr || tenant_ == job) return absl::OkStatus();
    return absl::FailedPreconditionError(ArenaLentMessage(tenant_id_));
  }

  // Called when `job` is removed: when it is the tenant, revokes its key.
  void Return(const Job* job, ActivationStore* store) {
    absl::MutexLock lock(&mu_);
    if (tenant_ != job) return;
    store->RevokeTenantKey();
    store->EndTenancy();
    tenant_ = nullptr;
    tenant_id_.clear();
  }

 private:
  mutable absl::Mutex mu_;
  const Job* tenant_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::string tenant_id_ ABSL_GUARDED_BY(mu_);
};

}  // namespace zeroshard
